#!/usr/bin/env bash
# One device call (twenty-fifth session) for the split tail (tile_scheduler.h): all ten
# variants built (its prebuilt/ comes back for later calls); the split-tail and persistent GPU
# tests with compute-sanitizer memcheck on tools/sanitize_case.py beside them (split cases
# included); then tools/env_ab_probe.py (split against whole tiles, interleaved, the FA grid's
# d64 / d128 full rows).
#   GIT_COMMIT=$(git rev-parse --short HEAD) bash tools/split_call.sh "$OUT"   (carry .whl)
set -uo pipefail
source "$(dirname "$0")/call_header.sh" "$@"
build_all /tmp/split_logs

timeout 200 compute-sanitizer --tool memcheck python3 tools/sanitize_case.py > "$LOGS/memcheck.txt" 2>&1 &
memcheck_pid=$!
timeout 220 python3 -m pytest -n 4 -q -p no:cacheprovider tests/test_cuda_backward.py -k "split_tail or persistent" \
  > "$LOGS/split_tests.txt" 2>&1
stamp "split / persistent tests: exit $?, $(tail -n 1 "$LOGS/split_tests.txt")"
wait "$memcheck_pid"
stamp "memcheck: exit $?, $(grep 'ERROR SUMMARY' "$LOGS/memcheck.txt" | tail -n 1), $(tail -n 1 "$LOGS/memcheck.txt" | head -c 120)"

timeout 150 python3 tools/env_ab_probe.py ${SPLIT_ARGS:-} > "$LOGS/split_probe.txt" 2>&1
stamp "env_ab_probe (split tail): exit $?"

cp "$LOGS/split_tests.txt" "$LOGS/split_probe.txt" "$LOGS/memcheck.txt" "$OUTD/" 2>/dev/null
cat "$LOGS/split_probe.txt"
grep -E "FAILED|ERROR|Error" "$LOGS/split_tests.txt" | head -n 20
cat "$OUTD/summary.txt"
