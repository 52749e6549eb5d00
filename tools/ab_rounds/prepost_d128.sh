# A/B round (seventh session, call 5): per-kernel times at 2k and 512 keys, dense d128 rows.
python3 benchmarks/profile_bwd.py --b 8 --h 16 --kv-heads 4 --s 2048 --d 128 --reps 10
python3 benchmarks/profile_bwd.py --b 32 --h 16 --s 512 --d 128 --reps 10
python3 benchmarks/bench_bwd.py --dims 128 --seqs 512,2048 --no-gqa --reps 20
