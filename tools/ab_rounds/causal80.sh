# A/B round of the fourteenth session (results: BENCHMARKS.md), with
# TORCH_SM90_SDPA_HEAD_DIMS=128 (bf16). Trees (tools/ab_rounds/ab_call.sh):
#   a = main (the 80 x 128 d128 tile for calls neither causal nor deterministic);
#   b = patches/causal80.patch: causal d128 calls on that tile too (FlashAttention-3 and -4
#       keep 64 x 128 for causal). Run at 33ccafc; the patch was then remade against 4a920c6
#       (the same one-line kernel selection; its test part follows 4a920c6's KnownOverBound).
# bench_bwd at d128 (with the GQA rows, which the speed gate reads; --check compares our
# gradients with cuDNN's), then the main-kernel ms of is_causal (and of the causal mask as a
# bias: the masked kernel, unchanged) at 8k keys.
python3 benchmarks/bench_bwd.py --dims 128 --seqs 2048,8192 --reps 10 --check
python3 benchmarks/profile_bwd.py --b 2 --h 16 --s 8192 --d 128 --reps 10
