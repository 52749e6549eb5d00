# A/B round (seventh session, call 1): the causal bias against is_causal at 2k and 8k keys
# (16 q / 16 kv heads), per-kernel times at b8 h16/4 s2048, dense d128 rows against cuDNN.
# tools/ab_session.sh runs it in each tree in turn.
python3 benchmarks/bench_masks.py --fill cudnn --kinds causal --seqs 2048,8192 --reps 30
python3 benchmarks/profile_bwd.py --b 8 --h 16 --kv-heads 4 --s 2048 --d 128 --reps 10
python3 benchmarks/bench_bwd.py --dims 128 --seqs 2048,8192 --no-gqa --reps 20
