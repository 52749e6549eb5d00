# A/B round (prepared in the ninth session for the next one), with
# TORCH_SM90_SDPA_HEAD_DIMS=64,96,128 and the trees main, dq-sw32-d96, dq-perm-all:
# - dq-sw32-d96: the 32-byte dQ staging swizzle at d96 as well (d64 / d128 gained 1.5-2.4% with
#   it, d192 lost);
# - dq-perm-all: d64 / d128 stage dQ with the segment permutation and the 128-byte swizzle in
#   place of the 32-byte swizzle (half the TMA reduce-adds), as dq-perm at d192 / d256.
python3 benchmarks/profile_bwd.py --b 8 --h 16 --kv-heads 4 --s 2048 --d 128 --reps 10
python3 benchmarks/profile_bwd.py --b 8 --h 32 --kv-heads 8 --s 2048 --d 64 --reps 10
python3 benchmarks/bench_bwd.py --dims 64,96,128 --seqs 2048,8192 --no-gqa --reps 20
