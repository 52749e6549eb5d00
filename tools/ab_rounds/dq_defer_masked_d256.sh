# A/B round (prepared in the ninth session for the next one): branch dq-defer-masked (the masked
# d256 kernel hands its last dQ slice over in the next step, in its unmasked step variant) against
# main: masked d256 rows against cuDNN's masked backward, then per-kernel times at 2k keys
# (main's masked d256 main kernel: 1.16 ms at b8 h8/2 with a causal bias, ninth session).
# Build with TORCH_SM90_SDPA_HEAD_DIMS=256.
python3 benchmarks/bench_masks.py --fill cudnn --classes --head-dim 256 --kv-heads 2 --seqs 2048,8192 --reps 10
python3 benchmarks/profile_bwd.py --b 8 --h 8 --kv-heads 2 --s 2048 --d 256 --reps 10
