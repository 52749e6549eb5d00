#!/usr/bin/env bash
# One device call for the persistent main kernel (BwdParams::persistent, switched per call by
# TORCH_SM90_SDPA_PERSISTENT): every variant built; its GPU tests (tests -k persistent: against
# one CTA per tile and the fp64 criterion, every head dim) with compute-sanitizer memcheck beside
# them, persistent CTAs forced on; then bench_bwd's grid with --extra and the other side of the
# switch as a column of its own (--ab-env $AB_ENV, default TORCH_SM90_SDPA_PERSISTENT=0: one CTA
# per tile, now that persistent CTAs are the default; the twenty-second session ran it with =1
# while they were not), interleaved with cuDNN in one process, each call synchronized, then
# --batched 5. An environment switch's column reads a few percent low on short synchronized
# calls: compare with d256, whose kernels the switch does not change (BENCHMARKS.md).
#   GIT_COMMIT=$(git rev-parse --short HEAD) bash tools/ab_rounds/persistent_call.sh "$OUT"
#   (carry .whl). About 6 minutes: build 200-270 s, tests 30 s, bench 50 s, batched 70 s.
set -uo pipefail
source "$(dirname "$0")/../call_header.sh" "$@"
build_all /tmp/persistent_logs
TORCH_SM90_SDPA_PERSISTENT=1 timeout 200 compute-sanitizer --tool memcheck python3 tools/sanitize_case.py \
  > "$LOGS/memcheck.txt" 2>&1 &
memcheck_pid=$!
timeout 150 python3 -m pytest -n 8 -q -p no:cacheprovider tests/test_cuda_backward.py -k persistent \
  > "$LOGS/tests.txt" 2>&1
stamp "persistent tests: exit $?, $(tail -n 1 "$LOGS/tests.txt")"
wait "$memcheck_pid"
stamp "memcheck (persistent forced): exit $?, $(grep 'ERROR SUMMARY' "$LOGS/memcheck.txt" | tail -n 1)"
timeout 150 python3 benchmarks/bench_bwd.py --extra --ab-env "${AB_ENV:-TORCH_SM90_SDPA_PERSISTENT=0}" \
  --json "$OUTD/bench_bwd_persistent.json" > "$LOGS/bench_bwd.txt" 2>&1
stamp "bench_bwd --extra --ab-env: exit $?, $(grep -E 'ours / (cudnn|ours_env):' "$LOGS/bench_bwd.txt" | tr '\n' ';')"
timeout 130 python3 benchmarks/bench_bwd.py --extra --ab-env "${AB_ENV:-TORCH_SM90_SDPA_PERSISTENT=0}" --batched 5 \
  --reps 6 --json "$OUTD/bench_bwd_persistent_batched.json" > "$LOGS/bench_bwd_batched.txt" 2>&1
stamp "bench_bwd --batched 5 --ab-env: exit $?, $(grep -E 'ours / (cudnn|ours_env):' "$LOGS/bench_bwd_batched.txt" | tr '\n' ';')"
grep -E "FAILED|Error|error" "$LOGS/tests.txt" | head -n 30 > "$OUTD/test_failures.txt"
tar czf "$OUTD/logs.tgz" -C "$LOGS" .
grep -E "^(d=|GQA|bf16|fp16)|geometric" "$LOGS/bench_bwd.txt" | cut -c1-150 | tail -n 62
cat "$OUTD/summary.txt"
