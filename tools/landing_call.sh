#!/usr/bin/env bash
# One device call that checks the commit that lands: all ten variants built
# (tools/device_session.sh, smoke test only), `bench_bwd.py --extra --json` (BENCH_ARGS replaces
# --extra, e.g. BENCH_ARGS="--extra --dropin" for the drop-in's column too; the side-by-side
# table of BENCHMARKS.md), the main-kernel ms of PROFILE_ARGS (default: d256 b8 h8/2 s2048,
# is_causal against a causal bias), then the GPU suite (`pytest -n 8 tests`) with
# compute-sanitizer memcheck on tools/sanitize_case.py beside it.
#
#   GIT_COMMIT=$(git rev-parse --short HEAD) bash tools/landing_call.sh "$OUT"   (carry .whl)
#   GIT_COMMIT=... BENCH_ARGS="--extra --dropin" bash tools/landing_call.sh "$OUT"
# PROFILE_ARGS=none skips profile_bwd; BENCH2_ARGS (e.g. "--extra --dropin --batched 5 --reps 6")
# runs a second bench after the suite, cut off at 590 s from the start (bench_bwd_full_2.json).
#
# A device call brings back at most 8 files, so OUTDIR gets: summary.txt, bench_bwd_full.json
# (and bench_bwd_full_2.json with BENCH2_ARGS), logs.tgz (every log), prebuilt/ (3 files: the
# build, for PREBUILT=1 in a later call).
# Estimated 8-9 minutes: build about 190-245 s, bench about 60-120 s, suite and memcheck about
# 200 s (twenty-seventh session, with PROFILE_ARGS=none and BENCH2_ARGS: 588 s in all).
set -uo pipefail
source "$(dirname "$0")/call_header.sh" "$@"
build_all /tmp/landing_logs

python3 benchmarks/bench_bwd.py ${BENCH_ARGS:---extra} --json "$OUTD/bench_bwd_full.json" > "$LOGS/bench_bwd.txt" 2>&1
stamp "bench_bwd ${BENCH_ARGS:---extra}: exit $?, $(grep 'ours / cudnn' "$LOGS/bench_bwd.txt" | tail -n 1)$(grep -E 'ours / (dropin|ours_env)|public paths|paths agree' "$LOGS/bench_bwd.txt" | sed 's/^/; /' | tr -d '\n')"

if [ "${PROFILE_ARGS:-}" != none ]; then
  python3 benchmarks/profile_bwd.py ${PROFILE_ARGS:---b 8 --h 8 --kv-heads 2 --s 2048 --d 256 --reps 10} \
    > "$LOGS/profile_bwd.txt" 2>&1
  stamp "profile_bwd: exit $?"
fi

suite_with_memcheck 260 ${SUITE_TIMEOUT_S:-300}

left=$(( 590 - ($(date +%s) - t0) ))
if [ -n "${BENCH2_ARGS:-}" ] && [ "$left" -gt 30 ]; then  # a second bench (e.g. --batched), in what is left of 590 s
  timeout "$left" python3 benchmarks/bench_bwd.py $BENCH2_ARGS --json "$OUTD/bench_bwd_full_2.json" \
    > "$LOGS/bench_bwd_2.txt" 2>&1
  stamp "bench_bwd $BENCH2_ARGS (timeout ${left} s): exit $?, $(grep 'ours / cudnn' "$LOGS/bench_bwd_2.txt" | tail -n 1)$(grep -E 'public paths|paths agree' "$LOGS/bench_bwd_2.txt" | sed 's/^/; /' | tr -d '\n')"
fi

tar czf "$OUTD/logs.tgz" -C "$LOGS" .
grep -E "^d=|geometric" "$LOGS/bench_bwd.txt" | tail -n 70
grep -E "geometric" "$LOGS/bench_bwd_2.txt" 2>/dev/null
grep -E "^-- |bwd_main" "$LOGS/profile_bwd.txt" 2>/dev/null | cut -c1-60
cat "$OUTD/summary.txt"
