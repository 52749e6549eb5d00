#!/usr/bin/env bash
# One device call, prepared in the twelfth session (not run yet): the A/B of defer_dv.sh, then
# each tree's backward tests (the float64 criterion; the programmatic-launch tests, which set
# TORCH_SM90_SDPA_PDL themselves), then tools/pdl_probe.py in this tree. At most 8 files come
# back from a device call, so only these go to OUTDIR: ab_summary.txt, a.txt / b.txt / c.txt
# (the rounds), tests_a.txt / tests_b.txt / tests_c.txt, pdl_probe.txt.
#   bash tools/ab_rounds/defer_dv_call.sh "$OUT"     (carry .whl; estimated 9-10 minutes: builds about 200 s, rounds 150 s,
#   tests 150 s, probe 60 s)
set -u
OUTD=${1:?usage: $0 OUTDIR}
export PYTHONUNBUFFERED=1 TORCH_SM90_SDPA_HEAD_DIMS=${TORCH_SM90_SDPA_HEAD_DIMS:-96,128}
AB=/tmp/ab
P=tools/ab_rounds/patches
TESTS="tests/test_build.py -k build_info" tools/ab_session.sh "$AB" \
  "$P/defer-dv.patch,$P/defer-dv-do3.patch" 2 -- bash tools/ab_rounds/defer_dv.sh \
  > "$OUTD/ab_summary.txt" 2>&1
for s in a b c; do
  tail -n 25 "$AB/${s}_check.log" >> "$OUTD/ab_summary.txt"
  cp "$AB/$s.txt" "$OUTD/" 2>/dev/null
done
for s in a b c; do
  if [ "$s" = a ]; then tree=$(pwd); else tree=${AB_TREE_PREFIX:-/tmp/torch_sm90_sdpa_ab_}$s; fi
  (cd "$tree" && PYTHONPATH="$tree/build/gpu_deps:$tree" timeout 240 \
     python3 -m pytest -n 5 -q tests/test_cuda_backward.py > "$OUTD/tests_$s.txt" 2>&1) &
done
wait
PYTHONPATH="$(pwd)/build/gpu_deps:$(pwd)" timeout 90 python3 tools/pdl_probe.py --rounds 7 \
  > "$OUTD/pdl_probe.txt" 2>&1
for s in a b c; do echo "tests $s: $(tail -n 1 "$OUTD/tests_$s.txt")"; done
