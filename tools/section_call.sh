#!/usr/bin/env bash
# One device call (twenty-fourth session) for a candidate that changes the main kernel's
# schedule: all ten variants built (the landing build: its prebuilt/ comes back for later
# calls), tools/section_probe.py (the causal sections' power-of-two rule against the count
# before it, interleaved), the GQA walk of groups of 8 forced on against the default
# (profile_bwd.py, TORCH_SM90_SDPA_GQA_WALK=1 / unset, d128 s8192 b2 is_causal: 32/4, and
# 32/8 with the walk as a check), then the GPU suite with compute-sanitizer memcheck beside it.
#   GIT_COMMIT=$(git rev-parse --short HEAD) SUITE_TIMEOUT_S=250 bash tools/section_call.sh "$OUT"
#   (carry .whl; about 9 minutes)
set -uo pipefail
source "$(dirname "$0")/call_header.sh" "$@"
build_all /tmp/section_logs

python3 tools/section_probe.py ${SECTION_ARGS:-} > "$LOGS/section_probe.txt" 2>&1
stamp "section_probe: exit $?"

for kv in 4 8; do
  for walk in 1 default; do
    if [ "$walk" = default ]; then unset TORCH_SM90_SDPA_GQA_WALK; else export TORCH_SM90_SDPA_GQA_WALK=$walk; fi
    python3 benchmarks/profile_bwd.py --b 2 --h 32 --kv-heads $kv --s 8192 --d 128 --reps 10 \
      > "$LOGS/walk_32_${kv}_$walk.txt" 2>&1
    stamp "GQA 32/$kv walk=$walk: $(grep -A1 -- '-- is_causal' "$LOGS/walk_32_${kv}_$walk.txt" | grep bwd_main | awk '{print $1}') ms main kernel"
  done
done
unset TORCH_SM90_SDPA_GQA_WALK

suite_with_memcheck 200 ${SUITE_TIMEOUT_S:-250}

tar czf "$OUTD/logs.tgz" -C "$LOGS" .
cat "$LOGS/section_probe.txt"
grep -E "FAILED|ERROR" "$LOGS/suite.txt" | head -n 20
cat "$OUTD/summary.txt"
