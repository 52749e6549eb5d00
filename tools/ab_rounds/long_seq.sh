# A/B round prepared in the seventeenth session (run in the eighteenth: BENCHMARKS.md), with
# TORCH_SM90_SDPA_HEAD_DIMS=64,128 (bf16): where FlashAttention-4 leads us (d64 / d128 from 8k
# keys, most in full attention: BENCHMARKS.md, seventeenth session). Trees (one patch per side):
#   a = main;
#   b = patches/dq-per-wg.patch (branch dq-per-wg): d128's 64-row tile (is_causal, masked,
#       deterministic) stages dQ per MMA warpgroup with barriers of its own, the writer warp
#       reduce-adding each half as it comes (FA3 / FA4 decouple the warpgroups so);
#   c = patches/m-rotate.patch: full attention without a mask, not deterministic, each CTA
#       starts its m-block walk at an offset spread over the n-blocks and wraps around (the
#       CTAs of a head otherwise reduce-add into the same dQ tile together);
#   d = patches/no-evict-last.patch: Q / dO loaded without the EVICT_LAST hint (FA4 gives none).
# Not in this call (a fifth tree would pass the call's 10 minutes):
#   patches/d64-dq-permuted.patch: d64 stages dQ under the 128-byte swizzle with permuted
#   segments (32-column TMA boxes, like d192 / d256) instead of the 32-byte swizzle's 8-column
#   boxes (level at 2k keys in the tenth session; long sequences not measured then; landed as
#   71bbd29, its patch file removed).
# Main-kernel ms of full d64 / d128 at 16k keys (no mask, then a zero bias: the masked kernel,
# which c leaves alone), d128 is_causal at 16k (b's kernel), then bench_bwd's d64 / d128 rows at 8k and 16k
# with --check. Each line under a timeout: a hang in one tree (b changes barriers) must not
# take the whole call.
#   bash tools/ab_rounds/long_seq_call.sh "$OUT"   (run from main; carry .whl)
timeout 90 python3 benchmarks/profile_bwd.py --b 1 --h 32 --s 16384 --d 64 --mask zeros --reps 5
timeout 90 python3 benchmarks/profile_bwd.py --b 1 --h 16 --s 16384 --d 128 --mask zeros --reps 5
timeout 90 python3 benchmarks/profile_bwd.py --b 1 --h 16 --s 16384 --d 128 --reps 5
timeout 150 python3 benchmarks/bench_bwd.py --dims 64,128 --seqs 8192,16384 --no-gqa --reps 5 --check
