# A/B round (tenth session), TORCH_SM90_SDPA_HEAD_DIMS=64,128,192,256, trees main and dq-perm-all:
# dQ staged with each row's 8-column segments permuted (column c ^ ((r & 3) << 3)) under the
# 128-byte swizzle, at every head dim where main uses the 128-byte (d192, d256) or the
# 32-byte (d64, d128) swizzle. Main-kernel ms per call, then the op against cuDNN.
python3 benchmarks/profile_bwd.py --b 8 --h 16 --kv-heads 4 --s 2048 --d 128 --reps 10
python3 benchmarks/profile_bwd.py --b 8 --h 32 --kv-heads 8 --s 2048 --d 64 --reps 10
python3 benchmarks/profile_bwd.py --b 8 --h 8 --kv-heads 2 --s 2048 --d 256 --reps 10
python3 benchmarks/profile_bwd.py --b 8 --h 8 --kv-heads 2 --s 2048 --d 192 --reps 10
python3 benchmarks/bench_bwd.py --dims 64,128,192,256 --seqs 2048,8192 --no-gqa --reps 20
