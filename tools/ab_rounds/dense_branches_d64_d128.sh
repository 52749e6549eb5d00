# A/B round (eighth session, call 2): main against ftz-exp2 and ftz-exp2 + uniform-desc (no
# early-dv): dense d64 / d128 rows against cuDNN and per-kernel times at 2k keys.
python3 benchmarks/bench_bwd.py --dims 64,128 --seqs 512,2048,8192 --no-gqa --reps 20
python3 benchmarks/profile_bwd.py --b 8 --h 16 --kv-heads 4 --s 2048 --d 128 --reps 10
python3 benchmarks/profile_bwd.py --b 8 --h 32 --kv-heads 8 --s 2048 --d 64 --reps 10
