#!/usr/bin/env bash
# One device call (twenty-seventh session): the landed commit as one build, and the d256
# question of the twenty-sixth. All ten variants built (prebuilt/ comes back for later calls);
# the GPU suite with compute-sanitizer memcheck beside it; then, on this one machine,
# bench_bwd.py over the FA grid's d256 rows with --ab-env TORCH_SM90_SDPA_PERSISTENT=0 (ours
# persistent against one CTA per tile, interleaved with cuDNN, synchronized calls) and
# tools/env_ab_probe.py --walls on the same switch (profiler device ms beside each side's
# synchronized wall, GPU span and kernel sum).
#   GIT_COMMIT=$(git rev-parse --short HEAD) bash tools/head_check_call.sh "$OUT"   (carry .whl)
set -uo pipefail
source "$(dirname "$0")/call_header.sh" "$@"
build_all /tmp/head_logs
suite_with_memcheck 240 300

timeout 120 python3 benchmarks/bench_bwd.py --dims 256 --no-gqa --ab-env TORCH_SM90_SDPA_PERSISTENT=0 \
  > "$LOGS/bench_d256_ab.txt" 2>&1
stamp "bench d256 --ab-env PERSISTENT=0: exit $?, $(grep -E 'ours / cudnn|ours / ours_env' "$LOGS/bench_d256_ab.txt" | tr '\n' ';')"

rows=""
for s in 512 1024 2048 4096 8192 16384; do rows="$rows,256:$((16384 / s)):8:$s:c,256:$((16384 / s)):8:$s"; done
timeout 110 python3 tools/env_ab_probe.py --env TORCH_SM90_SDPA_PERSISTENT --b-value 0 --rounds 2 --walls \
  --rows "${rows#,}" > "$LOGS/probe_d256_walls.txt" 2>&1
stamp "env_ab_probe --walls d256: exit $?"

cp "$LOGS/bench_d256_ab.txt" "$LOGS/probe_d256_walls.txt" "$OUTD/" 2>/dev/null
tail -n 3 "$LOGS/suite.txt" > "$OUTD/suite_tail.txt"; tail -n 3 "$LOGS/memcheck.txt" > "$OUTD/memcheck_tail.txt"
grep -E "FAILED|ERROR" "$LOGS/suite.txt" | head -n 20
grep -E "^d=|geometric" "$LOGS/bench_d256_ab.txt"
cat "$LOGS/probe_d256_walls.txt"
cat "$OUTD/summary.txt"
