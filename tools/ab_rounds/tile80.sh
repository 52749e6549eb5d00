# A/B round of the fourteenth session (results: BENCHMARKS.md), with
# TORCH_SM90_SDPA_HEAD_DIMS=128 (bf16). Trees (tools/ab_rounds/ab_call.sh):
#   a = main;
#   b = patches/tile80.patch: d128 calls neither causal nor deterministic run an 80 x 128 tile
#       (FlashAttention-3's and -4's for d128 without causal) with dQ^T = K^T dS^T.
# bench_bwd (dense kernels; --check compares our gradients with cuDNN's), then the main-kernel
# ms of full attention at d128 (no mask, and a zero bias: the masked kernel, unchanged).
python3 benchmarks/bench_bwd.py --dims 128 --seqs 2048,4096,8192,16384 --no-gqa --reps 10 --check
python3 benchmarks/profile_bwd.py --b 8 --h 16 --s 2048 --d 128 --mask zeros --reps 10
python3 benchmarks/profile_bwd.py --b 2 --h 16 --s 8192 --d 128 --mask zeros --reps 10
