# A/B round prepared in the twelfth session, run in the thirteenth (results: BENCHMARKS.md), with
# TORCH_SM90_SDPA_HEAD_DIMS=96,128,256 (bf16). Trees (tools/ab_rounds/deferrals_call.sh):
#   a = main;
#   b = patches/defer-dv.patch: the d96 / d128 dense kernels issue an m-block's dV in the next
#       step, behind that step's S and dP wgmmas (the tensor cores run it while dS is computed);
#   c = patches/masked-defer.patch: the same with three dO stages at d96 / d128, and bwd_step
#       forced inline so that the masked kernels defer too (dV at d96 / d128, and d256's last
#       dQ slice, which only the dense d256 kernel deferred).
# bench_bwd (dense kernels; --check compares our gradients with cuDNN's), then the main-kernel
# ms of is_causal (dense) and of the causal mask as a bias (masked kernel) at d128 and d256.
python3 benchmarks/bench_bwd.py --dims 96,128 --seqs 2048,8192 --no-gqa --reps 10 --check
python3 benchmarks/profile_bwd.py --b 8 --h 16 --kv-heads 4 --s 2048 --d 128 --reps 10
python3 benchmarks/profile_bwd.py --b 8 --h 8 --kv-heads 2 --s 2048 --d 256 --reps 10
