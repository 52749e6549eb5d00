#!/usr/bin/env bash
# One device call of the fourteenth session: the A/B of tile80.sh (two trees, d128 bf16 built
# side by side, two alternating rounds), then in tree b (the d128 full tile) the
# d128 tests of tests/test_cuda_backward.py with the full tile's own, and compute-sanitizer
# memcheck on tools/sanitize_case.py (which has a d128 full case with 80-row blocks past the
# rounded length). At most 8 files come back; OUTDIR gets ab_summary.txt, a.txt / b.txt
# (the rounds), tests_b.txt, memcheck_b.txt.
#   bash tools/ab_rounds/tile80_call.sh "$OUT"     (carry .whl; run at 6e4f144 with
#   patches/tile80.patch = `git diff 6e4f144 <the full-tile commit>`, which landed: 330 s)
set -u
OUTD=${1:?usage: $0 OUTDIR}
export PYTHONUNBUFFERED=1 TORCH_SM90_SDPA_HEAD_DIMS=${TORCH_SM90_SDPA_HEAD_DIMS:-128}
AB=/tmp/ab
P=tools/ab_rounds/patches
TESTS="tests/test_build.py -k build_info" tools/ab_session.sh "$AB" \
  "$P/tile80.patch" 2 -- bash tools/ab_rounds/tile80.sh \
  > "$OUTD/ab_summary.txt" 2>&1
for s in a b; do
  tail -n 25 "$AB/${s}_check.log" >> "$OUTD/ab_summary.txt"
  cp "$AB/$s.txt" "$OUTD/" 2>/dev/null
done
tree=${AB_TREE_PREFIX:-/tmp/torch_sm90_sdpa_ab_}b
cd "$tree" || exit 1
export PYTHONPATH="$tree/build/gpu_deps:$tree"
timeout 100 compute-sanitizer --tool memcheck python3 tools/sanitize_case.py > "$OUTD/memcheck_b.txt" 2>&1 &
timeout 150 python3 -m pytest -n 6 -q -p no:cacheprovider tests/test_cuda_backward.py \
  -k "128 or full_tile" > "$OUTD/tests_b.txt" 2>&1
wait
echo "tests in b: $(tail -n 1 "$OUTD/tests_b.txt")"
echo "memcheck in b: $(grep 'ERROR SUMMARY' "$OUTD/memcheck_b.txt" | tail -n 1)"
