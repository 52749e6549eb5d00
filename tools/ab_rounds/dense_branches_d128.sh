# A/B round (eighth session, call 1): the three dense-step branches (ftz-exp2, early-dv,
# uniform-desc; cumulative) against main: dense d128 rows against cuDNN, per-kernel times at
# b8 h16/4 s2048, and the causal bias against is_causal (the masked loop shares the step).
python3 benchmarks/bench_bwd.py --dims 128 --seqs 512,2048,8192 --reps 20
python3 benchmarks/profile_bwd.py --b 8 --h 16 --kv-heads 4 --s 2048 --d 128 --reps 10
python3 benchmarks/bench_masks.py --fill cudnn --kinds causal --seqs 2048 --reps 30 --kv-heads 4
