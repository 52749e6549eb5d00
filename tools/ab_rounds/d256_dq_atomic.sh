# A/B round prepared in the sixteenth session, run in the seventeenth (BENCHMARKS.md: "d256 dQ by
# atomics": every atomics side 21-23% slower; not merged), with TORCH_SM90_SDPA_HEAD_DIMS=256
# (bf16). Trees (tools/ab_session.sh, one patch per side):
#   a = main (d256: dQ through the staging tile and the dQ-writer warp's TMA reduce-add);
#   b = patches/d256-dq-atomic.patch: calls without mask that are not deterministic run a third
#       kernel whose MMA threads add dQ by float2 atomics (no staging), with a second dO stage;
#   c = the same with one dO stage (what the atomics alone do);
#   d = atomics, one dO stage, FA3's 64 x 80 tile (N = 80 key rows per CTA; ptxas: 404 B of
#       spill); c and d are b's patch with its TILES_FULL[256] line changed
#       (d256_dq_atomic_call.sh makes them).
# The main-kernel ms of d256 is_causal (the new kernel in b / c) next to a causal bias (the
# masked kernel, unchanged: the round's control), and of full d256 without a mask; then
# bench_bwd's d256 rows with --check (gradients against cuDNN's).
# Four trees (builds about 4 minutes), one round:
#   bash tools/ab_rounds/d256_dq_atomic_call.sh "$OUT"   (run from main; carry .whl)
# (tests and memcheck run in tree b only: a side that pays must be tested before it lands)
python3 benchmarks/profile_bwd.py --b 8 --h 8 --kv-heads 2 --s 2048 --d 256 --reps 10
python3 benchmarks/profile_bwd.py --b 2 --h 8 --s 8192 --d 256 --mask zeros --reps 5
python3 benchmarks/bench_bwd.py --dims 256 --seqs 2048,8192 --no-gqa --reps 10 --check
