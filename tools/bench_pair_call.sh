#!/usr/bin/env bash
# One device call that measures a landed commit through every path issue 8 asks for, in one
# run: bench_bwd's whole grid with the drop-in's column synchronized (`--extra --dropin`) and
# back to back (`--batched 5 --reps 6`), then the compiled 8-block GPT with the default
# enable() (`demo --only-faster`: step and attention-backward ratios against stock, interleaved).
# With build/carry (a landing call's prebuilt/, the .so gunzipped) it skips the build (about
# 200 s of kernels otherwise: every variant is built, tools/device_session.sh).
#   GIT_COMMIT=$(git rev-parse --short HEAD) bash tools/bench_pair_call.sh "$OUT"   (carry .whl,
#   and build/carry when there is one). About 7-8 minutes with the build, 3-4 without.
# OUTDIR gets summary.txt, bench_sync.json / .txt, bench_batched.json / .txt, demo.txt, and
# prebuilt/ when it built (for build/carry in a later call).
set -uo pipefail
source "$(dirname "$0")/call_header.sh" "$@"

if ls build/carry/_C*.so > /dev/null 2>&1; then
  use_prebuilt
else
  build_all /tmp/bench_pair_logs
fi

bench_pair bench_sync bench_batched 150 170

left=$(( 590 - ($(date +%s) - t0) ))
if [ "$left" -gt 40 ]; then
  gpt_demo demo.txt "$left"
else
  stamp "demo skipped: ${left} s left of 590"
fi
grep -E "^d=|^GQA|geometric" "$OUTD/bench_sync.txt" | tail -n 70
grep -E "geometric" "$OUTD/bench_batched.txt"
grep -E "replaced|kept stock|speed|step " "$OUTD/demo.txt"
cat "$OUTD/summary.txt"
