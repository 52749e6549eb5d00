#!/usr/bin/env bash
# One device call on a prebuilt extension (build/carry: a call's prebuilt/, the .so gunzipped):
# the GPU suite verbose (each test's outcome printed as it ends, so a cut run still names its
# failures), then the compiled 8-block GPT demo with the default enable() (issue 8's step
# ratio); with DEMO2_ARGS (e.g. "--no-causal": the same stack bidirectional), a second demo
# with those arguments added (demo2.txt).
#   GIT_COMMIT=$(git rev-parse --short HEAD) bash tools/suite_demo_call.sh "$OUT"
#   (carry .whl and build/carry). About 7 minutes: suite 260 s, demo 100 s (each).
set -uo pipefail
source "$(dirname "$0")/call_header.sh" "$@"
use_prebuilt
timeout ${SUITE_TIMEOUT_S:-280} python3 -m pytest -n 8 -v -rfE -p no:cacheprovider tests > /tmp/suite.txt 2>&1
stamp "GPU suite: exit $?, $(tail -n 1 /tmp/suite.txt)"
grep -E "FAILED|ERROR|XPASS" /tmp/suite.txt | head -n 40 > "$OUTD/suite_failures.txt"
grep -c PASSED /tmp/suite.txt | sed 's/^/passed lines: /' >> "$OUTD/suite_failures.txt"
sed -n '/= FAILURES =/,$p' /tmp/suite.txt | head -c 60000 > "$OUTD/suite_failure_details.txt"
gpt_demo demo.txt 160
# shellcheck disable=SC2086
[ -n "${DEMO2_ARGS:-}" ] && gpt_demo demo2.txt 160 $DEMO2_ARGS
cat "$OUTD/suite_failures.txt"
grep -E "replaced|kept stock|speed|step |routing_stats" "$OUTD/demo.txt" "$OUTD/demo2.txt" 2>/dev/null
cat "$OUTD/summary.txt"
