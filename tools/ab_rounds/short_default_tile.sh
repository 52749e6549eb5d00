# A/B round prepared in the twenty-first session, run in the twenty-third (b landed), with
# TORCH_SM90_SDPA_HEAD_DIMS=128 (bf16). Trees (tools/ab_rounds/ab_call.sh):
#   a = main (d128 calls neither masked nor deterministic run the 80 x 128 tile at every length);
#   b = patches/short-default-tile.patch: up to 768 queries they run the default 64 x 128 tile
#       (512 queries: 8 full m-blocks instead of 7 of 80 rows, the last 32 rows short).
# If b lands: tests/test_cuda_backward.py's FULL_TILE_SEQS with fewer than 769 queries (80, 81,
# 160) then run the default tile; give the full tile lengths past 768 of the same kinds (e.g.
# 800 = 10 x 80 rows, 881: a partial last block) so that its partial blocks stay covered.
# bench_bwd at the short lengths (--check compares our gradients with cuDNN's), then the main
# kernel's ms at 512 queries, causal and full.
#   bash tools/ab_rounds/ab_call.sh "$OUT" tools/ab_rounds/patches/short-default-tile.patch \
#     tools/ab_rounds/short_default_tile.sh "128 or full_tile"          (carry .whl; ~5 min)
python3 benchmarks/bench_bwd.py --dims 128 --seqs 512,1024 --no-gqa --reps 10 --check
python3 benchmarks/profile_bwd.py --b 32 --h 16 --s 512 --d 128 --reps 10
python3 benchmarks/profile_bwd.py --b 32 --h 16 --s 512 --d 128 --mask zeros --reps 10
