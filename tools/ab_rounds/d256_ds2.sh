# A/B round prepared in the fourteenth session (the fifteenth ran d256_ds2_quick.sh instead), with
# TORCH_SM90_SDPA_HEAD_DIMS=256 (bf16). Trees (tools/ab_rounds/ab_call.sh):
#   a = main;
#   b = patches/d256-ds2.patch: d256 with two P / dS buffers (TILES stages_ds 1 -> 2), so a
#       step no longer waits for every warpgroup to be done with the previous P / dS before it
#       stores its own (ptxas: the dense and masked kernels without spill; the smem fits).
# bench_bwd at d256 (--check compares our gradients with cuDNN's), then the main-kernel ms of
# is_causal (dense) and of the causal mask as a bias (masked) at 2k keys, and of full at 8k.
#   TORCH_SM90_SDPA_HEAD_DIMS=256 bash tools/ab_rounds/ab_call.sh "$OUT" \
#     tools/ab_rounds/patches/d256-ds2.patch tools/ab_rounds/d256_ds2.sh "256"
python3 benchmarks/bench_bwd.py --dims 256 --seqs 2048,8192 --no-gqa --reps 10 --check
python3 benchmarks/profile_bwd.py --b 8 --h 8 --kv-heads 2 --s 2048 --d 256 --reps 10
python3 benchmarks/profile_bwd.py --b 2 --h 8 --s 8192 --d 256 --mask zeros --reps 10
