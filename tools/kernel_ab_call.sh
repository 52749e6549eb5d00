#!/usr/bin/env bash
# One device call for a kernel change (twenty-sixth session): the head dims in
# TORCH_SM90_SDPA_HEAD_DIMS (default 128,256; bf16) built, the GPU tests matching TESTS_K
# (pytest -k; default "split_tail or persistent") with compute-sanitizer memcheck on
# tools/sanitize_case.py beside them, then tools/env_ab_probe.py with PROBE_ARGS (an A/B of a
# per-call switch, interleaved; PROBE2_ARGS: a second one). Logs and a summary in OUTDIR.
#   GIT_COMMIT=$(git rev-parse --short HEAD) PROBE_ARGS="--env ... --rows ..." \
#     bash tools/kernel_ab_call.sh "$OUT"   (carry .whl)
set -uo pipefail
source "$(dirname "$0")/call_header.sh" "$@"
LOGS=/tmp/kernel_ab_logs
rm -rf "$LOGS" && mkdir -p "$LOGS"
export TORCH_SM90_SDPA_HEAD_DIMS=${TORCH_SM90_SDPA_HEAD_DIMS:-128,256}
export TORCH_SM90_SDPA_DTYPES=${TORCH_SM90_SDPA_DTYPES:-bf16}
tools/gpu_check.sh "$LOGS/check" tests/test_build.py -k build_info > "$LOGS/check.txt" 2>&1
stamp "build ($TORCH_SM90_SDPA_HEAD_DIMS, $TORCH_SM90_SDPA_DTYPES) + smoke test: exit $?, $(grep -m1 '^result' "$LOGS/check/summary.txt" 2>/dev/null)"
use_deps

timeout "${MEMCHECK_S:-200}" compute-sanitizer --tool memcheck python3 tools/sanitize_case.py > "$LOGS/memcheck.txt" 2>&1 &
memcheck_pid=$!
timeout "${TESTS_S:-240}" python3 -m pytest -n 6 -q -p no:cacheprovider tests/test_cuda_backward.py \
  -k "${TESTS_K:-split_tail or persistent}" > "$LOGS/tests.txt" 2>&1
stamp "tests (-k ${TESTS_K:-split_tail or persistent}): exit $?, $(tail -n 1 "$LOGS/tests.txt")"
wait "$memcheck_pid"
stamp "memcheck: exit $?, $(grep 'ERROR SUMMARY' "$LOGS/memcheck.txt" | tail -n 1), $(tail -n 1 "$LOGS/memcheck.txt" | head -c 120)"

timeout "${PROBE_S:-200}" python3 tools/env_ab_probe.py ${PROBE_ARGS:-} > "$LOGS/probe.txt" 2>&1
stamp "env_ab_probe: exit $?"
if [ -n "${PROBE2_ARGS:-}" ]; then  # a second A/B (another switch or other rows)
  timeout "${PROBE_S:-200}" python3 tools/env_ab_probe.py $PROBE2_ARGS >> "$LOGS/probe.txt" 2>&1
  stamp "env_ab_probe (second): exit $?"
fi

cp "$LOGS/tests.txt" "$LOGS/probe.txt" "$LOGS/memcheck.txt" "$LOGS/check/build.log" "$OUTD/" 2>/dev/null
cat "$LOGS/probe.txt"
grep -E "FAILED|ERROR|Error" "$LOGS/tests.txt" | head -n 20
cat "$OUTD/summary.txt"
