#!/usr/bin/env bash
# One device call, prepared in the twelfth session and run in the thirteenth (401 s): the A/B of deferrals.sh
# (three trees, d96 / d128 / d256 bf16 built side by side, two alternating rounds), then the
# masked kernels' float64 tests in tree c (its masked kernels changed), then
# tools/pdl_probe.py in this tree (programmatic launch on / off). The full GPU suite is for the
# landing call, on the code that lands. At most 8 files come back from a device call; these
# go to OUTDIR: ab_summary.txt, a.txt / b.txt / c.txt (the rounds), masks_c.txt, pdl_probe.txt.
#   bash tools/ab_rounds/deferrals_call.sh "$OUT"     (carry .whl; estimated 8-9 minutes:
#   builds about 200 s, rounds about 270 s, tests 40 s, probe 40 s)
set -u
OUTD=${1:?usage: $0 OUTDIR}
export PYTHONUNBUFFERED=1 TORCH_SM90_SDPA_HEAD_DIMS=${TORCH_SM90_SDPA_HEAD_DIMS:-96,128,256}
AB=/tmp/ab
P=tools/ab_rounds/patches
TESTS="tests/test_build.py -k build_info" tools/ab_session.sh "$AB" \
  "$P/defer-dv.patch,$P/masked-defer.patch" 2 -- bash tools/ab_rounds/deferrals.sh \
  > "$OUTD/ab_summary.txt" 2>&1
for s in a b c; do
  tail -n 25 "$AB/${s}_check.log" >> "$OUTD/ab_summary.txt"
  cp "$AB/$s.txt" "$OUTD/" 2>/dev/null
done
tree=${AB_TREE_PREFIX:-/tmp/torch_sm90_sdpa_ab_}c
(cd "$tree" && PYTHONPATH="$tree/build/gpu_deps:$tree" timeout 150 python3 -m pytest -n 8 -q \
   tests/test_cuda_masks.py -k "test_masks_against_fp64 and bf16" > "$OUTD/masks_c.txt" 2>&1)
PYTHONPATH="$(pwd)/build/gpu_deps:$(pwd)" timeout 90 python3 tools/pdl_probe.py --rounds 7 \
  > "$OUTD/pdl_probe.txt" 2>&1
echo "masks in c: $(tail -n 1 "$OUTD/masks_c.txt")"
