# A/B round (seventh session, call 2): the causal bias against is_causal at 2k keys with MHA and
# GQA (16 / 4), per-kernel times, dense d128 rows (GQA row included) against cuDNN.
python3 benchmarks/bench_masks.py --fill cudnn --kinds causal --seqs 2048 --reps 30
python3 benchmarks/bench_masks.py --fill cudnn --kinds causal --seqs 2048 --reps 30 --kv-heads 4
python3 benchmarks/profile_bwd.py --b 8 --h 16 --kv-heads 4 --s 2048 --d 128 --reps 10
python3 benchmarks/bench_bwd.py --dims 128 --seqs 512,2048,8192 --reps 20
