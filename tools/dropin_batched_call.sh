#!/usr/bin/env bash
# One device call on a prebuilt extension (a landing call's prebuilt/, the .so gunzipped into
# build/carry): bench_bwd's whole grid with the drop-in's column, every sample BATCHED (default
# 5) calls back to back (the host running ahead, as in training), then tools/cta_cost_probe.py
# at d256, d128 and d64 (the main kernel's per-CTA fixed cost).
#   GIT_COMMIT=$(git rev-parse --short HEAD) bash tools/dropin_batched_call.sh "$OUT"
#   (carry .whl and build/carry). About 4-5 minutes (estimated).
set -uo pipefail
source "$(dirname "$0")/call_header.sh" "$@"
use_prebuilt
timeout 330 python3 benchmarks/bench_bwd.py --extra --dropin --batched "${BATCHED:-5}" --reps "${REPS:-6}" \
  --json "$OUTD/bench_bwd_batched.json" > "$OUTD/bench_bwd_batched.txt" 2>&1
stamp "bench_bwd --batched: exit $?, $(grep -E 'ours / (cudnn|dropin)|public paths|paths agree' "$OUTD/bench_bwd_batched.txt" | tr '\n' ';')"
for args in "--d 256 --b 8 --h 8 --sk 2048" "--d 128 --b 4 --h 16 --sk 4096" "--d 64 --b 4 --h 32 --sk 4096"; do
  timeout 60 python3 tools/cta_cost_probe.py $args >> "$OUTD/cta_cost_probe.txt" 2>&1
  stamp "cta_cost_probe $args: exit $?, $(grep '^fit' "$OUTD/cta_cost_probe.txt" | tail -n 1)"
done
cat "$OUTD/summary.txt"
