# A/B round prepared in the twelfth session (not run yet: no device machine was lent), with
# TORCH_SM90_SDPA_HEAD_DIMS=96,128. Trees: a = main, b = patches/defer-dv.patch (the dense
# kernel issues dV of an m-block in the next step, behind that step's S and dP wgmmas, at d96 /
# d128), c = patches/defer-dv-do3.patch (the same with three dO stages at d96 / d128). Ours
# against cuDNN, flash and efficient, interleaved (TFLOP/s per row). Driven by
# defer_dv_call.sh.
python3 benchmarks/bench_bwd.py --dims 96,128 --seqs 2048,8192 --no-gqa --reps 10
