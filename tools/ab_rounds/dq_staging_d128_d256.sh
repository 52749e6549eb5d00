# A/B round (prepared in the eighth session for the next one's first call): the dQ staging
# branches (dq-sw32: 32-byte swizzle of the staging tile; dq-defer: d256's last dQ slice handed
# over in the next step) against main: dense d128 / d256 rows against cuDNN and per-kernel
# times at 2k keys (d256: the causal rows were 0.80-0.84x).
python3 benchmarks/bench_bwd.py --dims 128,256 --seqs 512,2048,8192 --no-gqa --reps 20
python3 benchmarks/profile_bwd.py --b 8 --h 16 --kv-heads 4 --s 2048 --d 128 --reps 10
python3 benchmarks/profile_bwd.py --b 8 --h 8 --kv-heads 2 --s 2048 --d 256 --reps 10
