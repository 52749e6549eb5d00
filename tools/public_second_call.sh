#!/usr/bin/env bash
# One device call on a prebuilt extension (build/carry: a call's prebuilt/, the .so gunzipped):
# the GPU suite with compute-sanitizer memcheck beside it, bench_bwd's grid with --extra
# --dropin synchronized and --batched (the public paths' columns), public_path_probe.py
# --nodes, and, when
# build/ncu_d256.ncu-rep is carried, its SASS source page reduced to the top instructions
# (tools/ncu_top_instructions.py).
#   GIT_COMMIT=$(git rev-parse --short HEAD) bash tools/public_second_call.sh "$OUT"
#   (carry .whl, build/carry and optionally build/ncu_d256.ncu-rep). About 7-8 minutes.
set -uo pipefail
source "$(dirname "$0")/call_header.sh" "$@"
use_prebuilt
if [ -f build/ncu_d256.ncu-rep ]; then
  ncu --import build/ncu_d256.ncu-rep --page source --csv --print-source sass > /tmp/ncu_src.csv 2>&1
  python3 tools/ncu_top_instructions.py /tmp/ncu_src.csv > "$OUTD/ncu_d256_top.txt" 2>&1
  stamp "ncu source page: exit $?"
fi
timeout 60 python3 tools/public_path_probe.py --nodes 2>&1 | grep -v -i warn > "$OUTD/nodes.txt"
stamp "public_path_probe --nodes: exit $?"
suite_with_memcheck 260 ${SUITE_TIMEOUT_S:-270} /tmp
tail -n 30 /tmp/suite.txt > "$OUTD/suite_tail.txt"
bench_pair bench_bwd_dropin bench_bwd_batched 120 150
head -c 6000 "$OUTD/ncu_d256_top.txt" 2>/dev/null
cat "$OUTD/summary.txt"
