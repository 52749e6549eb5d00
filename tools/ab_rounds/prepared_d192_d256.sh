# A/B round (prepared in the ninth session for the next one), with
# TORCH_SM90_SDPA_HEAD_DIMS=192,256 and the trees main, dq-defer-masked, dq-perm:
# - dq-defer-masked: the masked d256 kernel hands its last dQ slice over in the next step, in
#   its unmasked step variant (main's masked d256 main kernel: 1.16 ms at b8 h8/2 s2k with a
#   causal bias; the dense kernel's deferral took it from 1.15 to 1.02 ms);
# - dq-perm: d192 / d256 stage dQ without bank conflicts (segments permuted by the row, also in
#   dq_accum) and keep 32-column TMA boxes.
python3 benchmarks/bench_masks.py --fill cudnn --classes --head-dim 256 --kv-heads 2 --seqs 2048,8192 --reps 10
python3 benchmarks/profile_bwd.py --b 8 --h 8 --kv-heads 2 --s 2048 --d 256 --reps 10
python3 benchmarks/bench_bwd.py --dims 192,256 --seqs 2048,8192 --no-gqa --reps 20
