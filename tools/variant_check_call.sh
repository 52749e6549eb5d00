#!/usr/bin/env bash
# One device call that checks the variants of some head dims in both dtypes, for a kernel
# change confined to them (the other variants' code unchanged): TORCH_SM90_SDPA_HEAD_DIMS
# (default 256) built for bf16 and fp16 (tools/gpu_check.sh, every core), the GPU tests of those
# head dims (`pytest -n 8 tests -k "<dims joined by or>"`: the gradient criterion against
# float64 among them), compute-sanitizer memcheck on tools/sanitize_case.py (head dims not built
# skip), then `bench_bwd.py --dims <dims> --no-gqa` in what is left of 290 s.
#   GIT_COMMIT=$(git rev-parse --short HEAD) bash tools/variant_check_call.sh "$OUT"   (carry .whl)
# About 4-5 minutes for one head dim. OUTDIR gets summary.txt, tests_tail.txt, bench.txt.
set -uo pipefail
source "$(dirname "$0")/call_header.sh" "$@"
dims=${TORCH_SM90_SDPA_HEAD_DIMS:-256}
export TORCH_SM90_SDPA_HEAD_DIMS=$dims TORCH_SM90_SDPA_DTYPES=${TORCH_SM90_SDPA_DTYPES:-bf16,fp16}
tools/gpu_check.sh /tmp/vcheck -n 8 -q -p no:cacheprovider -k "${dims//,/ or }" > /tmp/vcheck.txt 2>&1
stamp "build + tests (d$dims, $TORCH_SM90_SDPA_DTYPES): exit $?, $(grep -m1 '^result' /tmp/vcheck/summary.txt 2>/dev/null); $(grep -E '[0-9]+ (passed|failed)' /tmp/vcheck/tests.log | tail -n 1)"
grep -E "FAILED|ERROR|[0-9]+ (passed|failed)" /tmp/vcheck/tests.log | tail -n 20 > "$OUTD/tests_tail.txt"
use_deps
timeout 90 compute-sanitizer --tool memcheck python3 tools/sanitize_case.py > /tmp/vcheck_memcheck.txt 2>&1
stamp "memcheck: exit $?, $(grep 'ERROR SUMMARY' /tmp/vcheck_memcheck.txt | tail -n 1), $(grep sanitize_case /tmp/vcheck_memcheck.txt | tail -n 1)"
left=$(( 290 - ($(date +%s) - t0) ))
if [ "$left" -gt 30 ]; then
  timeout "$left" python3 benchmarks/bench_bwd.py --dims "$dims" --no-gqa > "$OUTD/bench.txt" 2>&1
  stamp "bench_bwd --dims $dims (timeout $left s): exit $?, $(grep 'ours / cudnn' "$OUTD/bench.txt" | tail -n 1)"
fi
cat "$OUTD/tests_tail.txt"
grep -E "^d=|geometric" "$OUTD/bench.txt" 2>/dev/null
cat "$OUTD/summary.txt"
