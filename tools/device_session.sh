#!/usr/bin/env bash
# One call on the GPU machine: build, GPU tests, benchmarks, compute-sanitizer, logs in OUTDIR.
#
#   tools/device_session.sh OUTDIR [STEPS]
#
# STEPS (default "tests,host,sanitize"), comma-separated, run in this order after the build:
#   tests      the GPU suite (pytest-xdist, 8 workers) through tools/gpu_check.sh
#   host       benchmarks/host_overhead.py (host cost per op call, and its alternatives)
#   bench      benchmarks/bench_bwd.py --quick (side-by-side backward TFLOP/s)
#   masks      benchmarks/bench_masks.py --fill cudnn at d64 / d128 / d256 (masked backward against
#              cuDNN's masked kernel, the speed gate's masked rows): OUTDIR/bench_masks_d*.json
#              are the files tools/speed_table.py reads (copy them to benchmarks/results/)
#   det        benchmarks/bench_deterministic.py --quick (deterministic mode against ours and stock)
#   detpaths   benchmarks/bench_deterministic_paths.py --quick ${DETPATH_ARGS} (public paths under
#              use_deterministic_algorithms(True))
#   sanitize   compute-sanitizer memcheck + racecheck on tools/sanitize_case.py
#   profile    benchmarks/profile_bwd.py (per-kernel ms: is_causal vs causal bias, no mask vs
#              zero bias) at ${PROFILE_ARGS:-d128 b2 h16/4 s16k}
#   ncu        Nsight Compute (--set full) on the main and classification kernels of
#              profile_bwd.py --once, mask kinds ${NCU_MASKS:-causal zeros}: OUTDIR/ncu_*.ncu-rep, details and
#              per-SASS-instruction source pages as CSV (build with
#              TORCH_SM90_SDPA_NVCC_FLAGS=-lineinfo to map SASS to source lines)
# The built extension (gzipped: files come back at most 16 MiB each), its config and the hash
# of the C++ sources it was built from are copied to OUTDIR/prebuilt: unpack them into
# torch_sm90_sdpa/ and set PREBUILT=1 to skip the build of a later call (gpu_check.sh builds
# anyway when the sources' hash differs).
# TESTS (environment, optional): the pytest arguments of the tests step instead of the whole
# suite, e.g. TESTS="-n 8 tests/test_cuda_deterministic.py".
# GIT_COMMIT (environment): the commit of the tree sent, recorded in the benchmarks' --json (the
# copy's git metadata on the GPU machine may name another commit).
# Carry .whl (nvidia-cutlass, expecttest). Prints a short summary last.
set -uo pipefail
OUT=${1:?usage: $0 OUTDIR [STEPS]}
STEPS=${2:-tests,host,sanitize}
mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
has() { [[ ",$STEPS," == *",$1,"* ]]; }
summary=()

read -r -a TEST_ARGS <<< "${TESTS:--n 8 tests}"
has tests || TEST_ARGS=(tests/test_build.py -k build_info)  # still builds, runs a smoke test
t0=$(date +%s)
tools/gpu_check.sh "$OUT/check" "${TEST_ARGS[@]}" > "$OUT/gpu_check.log" 2>&1
summary+=("gpu_check (build + tests): exit $? in $(( $(date +%s) - t0 )) s")
mkdir -p "$OUT/prebuilt"
for so in torch_sm90_sdpa/_C*.so; do
  [ -e "$so" ] || continue  # no build: nothing to save
  gzip -c "$so" > "$OUT/prebuilt/$(basename "$so").gz"
  cp torch_sm90_sdpa/_build_config.py torch_sm90_sdpa/prebuilt_sources.sha1 "$OUT/prebuilt/" \
    2>/dev/null  # (the hash: written by gpu_check.sh after its build)
done
export PYTHONPATH="$ROOT/build/gpu_deps:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if has host; then
  python3 benchmarks/host_overhead.py --json "$OUT/host_overhead.json" > "$OUT/host_overhead.txt" 2>&1
  summary+=("host_overhead: exit $?")
fi
if has bench; then
  python3 benchmarks/bench_bwd.py --quick > "$OUT/bench_bwd.txt" 2>&1
  summary+=("bench_bwd: exit $?")
fi
if has masks; then
  for spec in "64 8 1024,2048,4096" "128 4 1024,4096,16384" "256 2 1024,2048,8192"; do
    read -r d kv seqs <<< "$spec"
    python3 benchmarks/bench_masks.py --fill cudnn --classes --head-dim "$d" --kv-heads "$kv" \
      --seqs "$seqs" --json "$OUT/bench_masks_d$d.json" >> "$OUT/bench_masks.txt" 2>&1
    summary+=("bench_masks d$d: exit $?")
  done
fi
if has det; then
  timeout 400 python3 benchmarks/bench_deterministic.py --quick ${DET_ARGS:-} > "$OUT/bench_deterministic.txt" 2>&1
  summary+=("bench_deterministic: exit $?")
fi
if has detpaths; then
  timeout 420 python3 benchmarks/bench_deterministic_paths.py --quick ${DETPATH_ARGS:-} \
    > "$OUT/bench_deterministic_paths.txt" 2>&1
  summary+=("bench_deterministic_paths: exit $?")
fi
if has sanitize; then
  for tool in memcheck racecheck; do
    timeout 240 compute-sanitizer --tool "$tool" python3 tools/sanitize_case.py \
      > "$OUT/sanitize_$tool.txt" 2>&1
    summary+=("sanitize $tool: exit $?, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.txt" | tail -n 1)")
  done
fi

if has profile; then
  for m in causal zeros; do
    python3 benchmarks/profile_bwd.py --mask "$m" ${PROFILE_ARGS:-} >> "$OUT/profile_bwd.txt" 2>&1
    summary+=("profile_bwd --mask $m: exit $?")
  done
fi
if has ncu; then
  for m in ${NCU_MASKS:-causal zeros}; do
    timeout 300 ncu --clock-control none --set full --import-source yes \
      -k 'regex:bwd_main_kernel|mask_classify|block_bounds' -f -o "$OUT/ncu_$m" \
      python3 benchmarks/profile_bwd.py --once --mask "$m" ${PROFILE_ARGS:-} > "$OUT/ncu_$m.log" 2>&1
    summary+=("ncu --mask $m: exit $?")
    ncu --import "$OUT/ncu_$m.ncu-rep" --page details --csv > "$OUT/ncu_${m}_details.csv" 2>&1
    ncu --import "$OUT/ncu_$m.ncu-rep" --page source --csv --print-source sass \
      > "$OUT/ncu_${m}_source.csv" 2>&1
  done
fi

echo "==== summary ===="
cat "$OUT/check/summary.txt" 2>/dev/null | sed -n '1,40p'
printf '%s\n' "${summary[@]}"
for f in profile_bwd.txt host_overhead.txt bench_bwd.txt bench_masks.txt bench_deterministic.txt bench_deterministic_paths.txt; do
  [ -f "$OUT/$f" ] && { echo "---- $f"; tail -n 40 "$OUT/$f"; }
done
exit 0
