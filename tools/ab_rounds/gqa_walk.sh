# A/B round prepared in the fifteenth session (run in the sixteenth: BENCHMARKS.md), with
# TORCH_SM90_SDPA_HEAD_DIMS=128 (bf16). Trees (tools/ab_rounds/ab_call.sh):
#   a = main (GQA: one q head per CTA, dK / dV reduce-added into fp32 accumulators);
#   b = the gqa-walk branch (81b1026) as a patch, `git diff main gqa-walk` then: a CTA walks its
#       kv head's whole group of q heads (512 CTAs and more by default; BwdParams::heads_per_cta),
#       dK / dV stored directly. It landed as 9e68b21 (with 128-CTA sections when walking); the
#       patch file, a copy of that code, was removed then.
# bench_bwd at d128 8k (its GQA rows 32/8, 32/4, 32/1; --check compares with cuDNN), then
# the main-kernel and all-kernel ms of GQA 32/8 (is_causal and a causal bias: both walk in
# b), of GQA 16/8 full as in the compiled GPT, of MHA (the head loop's cost where nothing walks),
# and of GQA 32/8 with the walk switched off (b's head loop at one head per CTA).
#   AB_TEST_FILES="tests/test_cuda_backward.py tests/test_cuda_masks.py" bash \
#     tools/ab_rounds/ab_call.sh "$OUT" tools/ab_rounds/patches/gqa-walk.patch \
#     tools/ab_rounds/gqa_walk.sh "gqa or walk or mqa"   (run from 5ad5d56; carry .whl)
python3 benchmarks/bench_bwd.py --dims 128 --seqs 8192 --reps 10 --check
python3 benchmarks/profile_bwd.py --b 2 --h 32 --kv-heads 8 --s 8192 --d 128 --reps 5
python3 benchmarks/profile_bwd.py --b 2 --h 16 --kv-heads 8 --s 8192 --d 128 --mask zeros --reps 5
python3 benchmarks/profile_bwd.py --b 2 --h 16 --s 8192 --d 128 --reps 5
TORCH_SM90_SDPA_GQA_WALK=0 python3 benchmarks/profile_bwd.py --b 2 --h 32 --kv-heads 8 --s 8192 --d 128 --reps 5
