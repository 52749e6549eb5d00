#!/usr/bin/env bash
# On the machine a landing call left warm (its build in place): the A/B of the pre- and
# postprocess's row order (TORCH_SM90_SDPA_PREPOST_ORDER; side A = unset = the default,
# reversed; side B = forward) with tools/env_ab_probe.py, three interleaved rounds, every kernel
# of the call and the synchronized call's wall (--walls), on the rows where the pre- and
# postprocess weigh most (s = 512 at d64 / d128 / d256) and a few longer ones; then the
# back-to-back bench_bwd and the compiled GPT demo of the landing (issue 8).
#   GIT_COMMIT=<landed commit> bash tools/ab_rounds/prepost_order_warm_call.sh "$OUT"
set -uo pipefail
source "$(dirname "$0")/../call_header.sh" "$@"
use_deps
rows=64:32:32:512:c,64:32:32:512,128:32:16:512:c,128:32:16:512,256:32:8:512:c,256:32:8:512
rows=$rows,128:16:16:1024:c,128:8:16:2048:c,128:8:16:2048,128:2:16:8192
timeout "${PROBE_S:-200}" python3 tools/env_ab_probe.py --env TORCH_SM90_SDPA_PREPOST_ORDER \
  --b-value forward --rounds 3 --walls --rows "$rows" > "$OUTD/probe.txt" 2>&1
stamp "env_ab_probe PREPOST_ORDER (A reversed, B forward): exit $?"
bench_one bench_b2b "${BENCH_S:-200}" --batched 5 --reps 6
gpt_demo demo.txt "${DEMO_S:-150}"
cat "$OUTD/probe.txt" | grep -v Warning
cat "$OUTD/summary.txt"
