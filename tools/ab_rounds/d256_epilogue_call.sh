#!/usr/bin/env bash
# One device call (twenty-sixth session), run at bda6d2b (the patch applies to that commit
# only: 1bbebcf landed its rule): d256's epilogue with persistent CTAs. Tree a = bda6d2b
# (persistent only where a split tail is planned; one tile per CTA stores dK / dV from the
# union), tree b = patches/d256-always-persistent.patch (persistent wherever allowed, dK / dV in
# turn through the dQ staging tile). d256 bf16 built in both; tests/test_cuda_backward.py -k 256
# in both; then two alternating rounds of tools/env_ab_probe.py --env TORCH_SM90_SDPA_PERSISTENT
# over the FA grid's d256 rows (side B, =0: one tile per CTA, union epilogue, in both trees);
# memcheck on tools/sanitize_case.py (its d256 cases) in tree a.
#   GIT_COMMIT=$(git rev-parse --short HEAD) bash tools/ab_rounds/d256_epilogue_call.sh "$OUT"   (carry .whl)
set -uo pipefail
source "$(dirname "$0")/../call_header.sh" "$@"
rows=""
for s in 512 1024 2048 4096 8192 16384; do rows="$rows,256:$((16384 / s)):8:$s:c,256:$((16384 / s)):8:$s"; done
TORCH_SM90_SDPA_HEAD_DIMS=256 TESTS="-n 6 -q -p no:cacheprovider tests/test_cuda_backward.py -k 256" \
  bash tools/ab_session.sh /tmp/ab256 tools/ab_rounds/patches/d256-always-persistent.patch 2 -- \
  python3 tools/env_ab_probe.py --env TORCH_SM90_SDPA_PERSISTENT --b-value 0 --rounds 2 --rows "${rows#,}" \
  > "$OUTD/ab_session.txt" 2>&1
stamp "ab_session: exit $?"
for side in a b; do
  stamp "tests $side: $(grep -E '[0-9]+ (passed|failed)' /tmp/ab256/$side/tests.log | tail -n 1)"
  cp /tmp/ab256/$side.txt "$OUTD/probe_$side.txt"
done
PYTHONPATH="$ROOT/build/gpu_deps:$ROOT" timeout 150 compute-sanitizer --tool memcheck python3 tools/sanitize_case.py \
  > /tmp/ab256/memcheck.txt 2>&1
stamp "memcheck (tree a): exit $?, $(grep 'ERROR SUMMARY' /tmp/ab256/memcheck.txt | tail -n 1), $(grep sanitize_case /tmp/ab256/memcheck.txt | tail -n 1)"
grep -E "FAILED|Error" /tmp/ab256/a/tests.log /tmp/ab256/b/tests.log | head -n 20
cat "$OUTD/summary.txt"
