#!/usr/bin/env bash
# The d256 dQ-atomics A/B in one device call (sixteenth session; run in the seventeenth: the
# atomics sides were 21-23% slower, BENCHMARKS.md "d256 dQ by atomics"):
# tree a = main; b = patches/d256-dq-atomic.patch (atomics, two dO stages); c and d are made
# here from b's patch by changing its one TILES_FULL[256] line: c = one dO stage, d = FA3's
# 64 x 80 tile with one dO stage (ptxas, locally: b and c 0 spill, d 404 B). One round of
# d256_dq_atomic.sh; tests and memcheck in tree b.
#   bash tools/ab_rounds/d256_dq_atomic_call.sh "$OUT"   (from main; carry .whl)
set -euo pipefail
OUTD=${1:?usage: $0 OUTDIR}
cd "$(dirname "$0")/../.."
base=tools/ab_rounds/patches/d256-dq-atomic.patch
line='256: Tile(64, 64, 2, 2, 2, 1, False, True, 1, 2, 1, 2, False, True),'
grep -qF "+    $line" "$base" || { echo "$base lacks its TILES_FULL[256] line" >&2; exit 2; }
mkdir -p /tmp/d256_sides
sed "s/$line/256: Tile(64, 64, 2, 2, 1, 1, False, True, 1, 2, 1, 2, False, True),/" "$base" \
  > /tmp/d256_sides/one-do.patch
sed "s/$line/256: Tile(64, 80, 2, 2, 1, 1, False, True, 1, 2, 1, 2, False, True),/" "$base" \
  > /tmp/d256_sides/tile80.patch
AB_ROUNDS=1 AB_TEST_FILES=tests/test_cuda_backward.py TORCH_SM90_SDPA_HEAD_DIMS=256 \
  bash tools/ab_rounds/ab_call.sh "$OUTD" "$base,/tmp/d256_sides/one-do.patch,/tmp/d256_sides/tile80.patch" \
  tools/ab_rounds/d256_dq_atomic.sh "256 or full_tile"
