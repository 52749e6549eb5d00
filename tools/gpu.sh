#!/usr/bin/env bash
# The GPU-machine driver: build, GPU tests, benchmarks, compute-sanitizer, Nsight Compute.
#
#   tools/gpu.sh COMMAND[,COMMAND...] OUTDIR
#
# Commands (run in the order given; every one but `build` builds first when no usable build is
# here):
#   build     the offline wheels, then torch_sm90_sdpa._C in place with every core
#             (MAX_JOBS=$(nproc) unless set; TORCH_SM90_SDPA_HEAD_DIMS / _DTYPES / _NVCC_FLAGS
#             honored), its SASS summary, and the build gzipped into OUTDIR/prebuilt/; the
#             default build has no Dv != D pair: TORCH_SM90_SDPA_HEAD_DIMS=...,192x128 adds the
#             one tests/test_cuda_head_dim_v.py runs (it skips without it)
#   test      the GPU suite: pytest (-n 8 with pytest-xdist when installed) on `tests`, or on
#             TESTS (e.g. TESTS="tests/test_cuda_deterministic.py -k gqa"); PYTEST_TIMEOUT_S
#             bounds it; transformers comes from .whl/transformers/ when missing
#   bench     benchmarks/bench_bwd.py --extra --dropin, synchronized, then back to back
#             (--batched 5 --reps 6): OUTDIR/bench_bwd_sync.json and bench_bwd_b2b.json, the
#             files benchmarks/results/ keeps (BENCH_ARGS replaces --extra --dropin)
#   masks     benchmarks/bench_masks.py --fill cudnn --classes at d64 / d128 / d256 (the speed
#             gate's masked rows): OUTDIR/bench_masks_d<D>.json
#   sanitize  compute-sanitizer memcheck and racecheck on tools/sanitize_case.py
#   ncu       Nsight Compute (--set full) of the first launch of NCU_KERNEL (a regex, default
#             bwd_main_kernel, matched against the name NCU_NAME_BASE gives: function (default),
#             demangled or mangled; e.g. the forward's masked overlap kernel is
#             NCU_NAME_BASE=mangled NCU_KERNEL='fwd_main_kernel.*Lb1ELb1E') in NCU_SCRIPT
#             (default benchmarks/profile_bwd.py) --once, per case
#             of NCU_CASES (';'-separated arguments of the script): headline metrics
#             (tools/ncu_summary.py) and the top SASS instructions by stalls and shared
#             wavefronts (tools/ncu_top_instructions.py); the forward: NCU_SCRIPT=
#             benchmarks/profile_fwd.py NCU_KERNEL=fwd_main_kernel NCU_CASES="--modes causal;
#             --modes bool"; build with TORCH_SM90_SDPA_NVCC_FLAGS=-lineinfo to map SASS to
#             source lines
#   wheel     the wheel (pip wheel, every core) into OUTDIR/wheel/, installed with pip into
#             build/wheel_site; the later steps of the call then run on the installed package
#             (this copy's torch_sm90_sdpa/ is moved aside until the script exits), e.g.
#             `wheel,test` with TESTS naming the GPU test files
#   steps     benchmarks/bench_transformers.py --interface ${STEPS_ARGS} (STEPS_INTERFACE=0 leaves
#             --interface out: one compiled and two eager models fewer), unpadded and (unless
#             STEPS_PADDED=0) padded: compiled transformers Llama training steps, stock against
#             enable(forward=False) and attn_implementation="sm90_sdpa" (eager and compiled;
#             STEPS_ARGS=--forward adds enable(), forward nodes routed too; --ones an all-ones
#             attention_mask); transformers and its dependencies come from .whl/transformers/
#             when missing
#   fwd       benchmarks/bench_fwd.py ${FWD_ARGS}: the forward kernels against cuDNN and
#             FlashAttention-2 (OUTDIR/bench_fwd.json)
#   all       build, test, sanitize, bench
#
# Environment:
#   GIT_COMMIT  the commit of the tree sent, recorded in the benchmarks' JSON meta and the
#               summary. The GPU machine's copy of .git may lag the tree sent: take the hash
#               where the commit was made and write it into the command
#               (GIT_COMMIT=<hash> tools/gpu.sh ...); $(git rev-parse --short HEAD) is right
#               only in the checkout that made the commit
#   .whl/       wheels the GPU machine lacks (nvidia-cutlass, expecttest, ...; it has no
#               internet): carry the folder; they are installed with pip --no-index --target
#               build/gpu_deps, which goes on PYTHONPATH. .whl/transformers/ (for `steps`):
#               ../shared/tools/fetch_wheels.sh's command with transformers and its
#               dependencies, -d .whl/transformers
#   build/carry_gz/  a previous call's OUTDIR/prebuilt/ (the .so gzipped, _build_config.py,
#               prebuilt_sources.sha1), carried to skip the build; it is used only when its
#               hash matches these C++ sources and the build selection (TORCH_SM90_SDPA_HEAD_DIMS,
#               _DTYPES, _NVCC_FLAGS). A build left on a warm machine is reused alike;
#               FORCE_BUILD=1 builds anyway.
#   PACK=1      also OUTDIR.tar.gz beside OUTDIR when the script exits: every log and result
#               in one file (prebuilt/ left out), for machines that copy few files back
# Logs go to OUTDIR (build.log, tests.log, junit.xml, bench_*.txt, sanitize_*.txt, ncu_*); the
# last lines printed, and OUTDIR/summary.txt, are one line per step.
set -uo pipefail
if [ $# -ne 2 ]; then
  sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  exit 2
fi
COMMANDS=$1
mkdir -p "$2"
OUT=$(cd "$2" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
DEPS="$ROOT/build/gpu_deps"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-$(nproc)}
export PYTHONPATH="$DEPS:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "${GIT_COMMIT:-}" ]; then
  GIT_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  git diff --quiet HEAD 2>/dev/null || GIT_COMMIT="$GIT_COMMIT-dirty"
  echo "[gpu.sh] GIT_COMMIT not set: $GIT_COMMIT from this copy's git (may be stale)"
fi
export GIT_COMMIT
t0=$(date +%s)
status=0
built=0
stamp() { echo "$(( $(date +%s) - t0 )) s: $*" | tee -a "$OUT/summary.txt"; }
fail() { status=1; stamp "$@"; }
pack() {
  [ "${PACK:-0}" = 1 ] || return 0
  tar -czf "$OUT.tar.gz" -C "$(dirname "$OUT")" --exclude=prebuilt "$(basename "$OUT")"
}
trap pack EXIT

# ---- the offline wheels -------------------------------------------------------------------
install_wheels() {
  "$PY" -c "import cutlass_library, expecttest" > /dev/null 2>&1 && return 0
  shopt -s nullglob
  local wheels=(.whl/*.whl)
  shopt -u nullglob
  if [ ${#wheels[@]} -eq 0 ]; then
    fail "wheels: cutlass_library / expecttest missing and no .whl/*.whl here (carry .whl)"
    return 1
  fi
  mkdir -p "$DEPS"
  if "$PY" -m pip install -q --no-index --no-deps --upgrade --target "$DEPS" "${wheels[@]}" \
      > "$OUT/pip.log" 2>&1; then
    stamp "wheels: ${#wheels[@]} installed into build/gpu_deps"
  else
    fail "wheels: pip install failed (pip.log)"
    return 1
  fi
}

# ---- the build ----------------------------------------------------------------------------
# The C++ sources' content hash, with the build's selection (head dims, dtypes, nvcc flags): a
# build is reused only when it was made from these sources for the variants asked for.
sources_sha1() {
  { find csrc registration setup.py -type f ! -path 'csrc/instantiations/*' -print0 | sort -z \
      | xargs -0 cat
    echo "HEAD_DIMS=${TORCH_SM90_SDPA_HEAD_DIMS:-} DTYPES=${TORCH_SM90_SDPA_DTYPES:-}" \
         "NVCC_FLAGS=${TORCH_SM90_SDPA_NVCC_FLAGS:-}"
  } | sha1sum | cut -c1-40
}
so_here() {
  ls torch_sm90_sdpa/_C.cpython-"$("$PY" -c 'import sys; print("%d%d" % sys.version_info[:2])')"*.so \
    2> /dev/null | head -n 1
}
unpack_carry() {
  local gz
  gz=$(ls build/carry_gz/_C*.so.gz 2> /dev/null | head -n 1)
  [ -n "$gz" ] || return 0
  gunzip -c "$gz" > "torch_sm90_sdpa/$(basename "$gz" .gz)"
  cp build/carry_gz/_build_config.py build/carry_gz/prebuilt_sources.sha1 torch_sm90_sdpa/
  stamp "build: unpacked the carried build/carry_gz"
}
usable_build() {
  [ "${FORCE_BUILD:-0}" != 1 ] && [ -n "$(so_here)" ] && [ -f torch_sm90_sdpa/_build_config.py ] \
    && [ "$(cat torch_sm90_sdpa/prebuilt_sources.sha1 2> /dev/null)" = "$(sources_sha1)" ]
}
do_build() {
  install_wheels || return 1
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
  unpack_carry
  if usable_build; then
    stamp "build: reused $(so_here) (built from these sources)"
  else
    local t
    t=$(date +%s)
    TORCH_SM90_SDPA_BUILD_CUDA=1 "$PY" setup.py build_ext --inplace > "$OUT/build.log" 2>&1
    local rc=$?
    if [ "$rc" -ne 0 ]; then
      fail "build: FAILED (exit $rc, build.log)"
      return 1
    fi
    sources_sha1 > torch_sm90_sdpa/prebuilt_sources.sha1
    stamp "build: ok in $(( $(date +%s) - t )) s (MAX_JOBS=$MAX_JOBS," \
          "HEAD_DIMS=${TORCH_SM90_SDPA_HEAD_DIMS:-default}, DTYPES=${TORCH_SM90_SDPA_DTYPES:-default}," \
          "$(grep -c -E 'warning' "$OUT/build.log") warning lines)"
  fi
  local so
  so=$(so_here)
  if command -v cuobjdump > /dev/null 2>&1; then  # wgmma present in every main kernel?
    cuobjdump -sass "$so" 2> /dev/null | "$PY" -c '
import re, sys
counts, name = {}, None
for line in sys.stdin:
    m = re.search(r"Function : (\S+)", line)
    if m:
        name = m.group(1); counts.setdefault(name, [0, 0]); continue
    if name is not None and "HGMMA" in line: counts[name][0] += 1
    if name is not None and re.search(r"/\*[0-9a-f]{4,}\*/", line): counts[name][1] += 1
print(f"{len(counts)} kernels; HGMMA instructions / SASS instructions per kernel:")
for n, (h, t) in sorted(counts.items()):
    print(f"  {h:6d} / {t:7d}  {n}")
' > "$OUT/sass_summary.txt" 2>&1
  fi
  mkdir -p "$OUT/prebuilt"  # (files come back at most 16 MiB each: the .so gzipped)
  gzip -c "$so" > "$OUT/prebuilt/$(basename "$so").gz"
  cp torch_sm90_sdpa/_build_config.py torch_sm90_sdpa/prebuilt_sources.sha1 "$OUT/prebuilt/"
  built=1
}
ensure_built() {  # (a failed build is not tried again by the later steps)
  [ "$built" = 1 ] && return 0
  [ "$built" = 2 ] && return 1
  do_build || { built=2; return 1; }
}

# ---- the wheel ----------------------------------------------------------------------------
SOURCE_ASIDE="$ROOT/build/source_package_aside"
restore_source() {
  [ -d "$SOURCE_ASIDE/torch_sm90_sdpa" ] && [ ! -e "$ROOT/torch_sm90_sdpa" ] \
    && mv "$SOURCE_ASIDE/torch_sm90_sdpa" "$ROOT/torch_sm90_sdpa"
  return 0
}
do_wheel() {
  install_wheels || return 1
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
  rm -rf "$OUT/wheel" build/wheel_site
  local t
  t=$(date +%s)
  TORCH_SM90_SDPA_BUILD_CUDA=1 "$PY" -m pip wheel -v --no-build-isolation --no-deps \
    -w "$OUT/wheel" . > "$OUT/wheel_build.log" 2>&1
  local rc=$?
  local whl
  whl=$(ls "$OUT"/wheel/torch_sm90_sdpa-*.whl 2> /dev/null | head -n 1)
  if [ "$rc" -ne 0 ] || [ -z "$whl" ]; then
    fail "wheel: FAILED (exit $rc, wheel_build.log)"
    return 1
  fi
  stamp "wheel: $(basename "$whl"), $(du -h "$whl" | cut -f1), built in $(( $(date +%s) - t )) s"
  if ! "$PY" -m pip install -q --no-index --no-deps --target build/wheel_site "$whl" \
      > "$OUT/wheel_install.log" 2>&1; then
    fail "wheel: pip install FAILED (wheel_install.log)"
    return 1
  fi
  mkdir -p "$SOURCE_ASIDE"
  rm -rf "$SOURCE_ASIDE/torch_sm90_sdpa"
  mv torch_sm90_sdpa "$SOURCE_ASIDE/" && trap restore_source EXIT
  export PYTHONPATH="$ROOT/build/wheel_site:$DEPS"
  "$PY" -c 'import torch_sm90_sdpa as t, torch_sm90_sdpa._C; info = t.build_info()
print(t.__file__); print(info)' > "$OUT/wheel_import.txt" 2>&1
  rc=$?
  [ "$rc" -eq 0 ] || status=1
  stamp "wheel: import exit $rc, from $(head -n 1 "$OUT/wheel_import.txt")"
  built=1  # (the later steps use the installed package, not an in-place build)
}
install_transformers() {  # STEP_NAME: from .whl/transformers/ where the machine lacks it
  "$PY" -c "import transformers" > /dev/null 2>&1 && return 0
  local wheels=() w
  shopt -s nullglob
  for w in .whl/transformers/*.whl; do  # (numpy only where the machine has none)
    case "$(basename "$w")" in numpy-*) "$PY" -c "import numpy" 2> /dev/null && continue ;; esac
    wheels+=("$w")
  done
  shopt -u nullglob
  if [ ${#wheels[@]} -eq 0 ]; then
    stamp "$1: transformers missing and no .whl/transformers/ here"
    return 1
  fi
  "$PY" -m pip install -q --no-index --no-deps --target "$DEPS" "${wheels[@]}" \
    >> "$OUT/pip.log" 2>&1 || { stamp "$1: transformers not installable (pip.log)"; return 1; }
}
do_steps() {
  ensure_built || return 1
  install_transformers steps || { status=1; return 1; }
  local padded rc variants=("") interface=--interface
  [ "${STEPS_INTERFACE:-1}" = 0 ] && interface=
  [ "${STEPS_PADDED:-1}" = 0 ] || variants+=(--padded)
  for padded in "${variants[@]}"; do
    # shellcheck disable=SC2086
    "$PY" benchmarks/bench_transformers.py $interface ${STEPS_ARGS:-} $padded \
      --json "$OUT/bench_transformers${padded:+_padded}.json" \
      > "$OUT/bench_transformers${padded:+_padded}.txt" 2>&1
    rc=$?
    [ "$rc" -eq 0 ] || status=1
    stamp "steps ${padded:-unpadded}: exit $rc; $(grep -E 'speedup|sm90_sdpa|forward nodes too' \
      "$OUT/bench_transformers${padded:+_padded}.txt" | tr '\n' ';')"
  done
}

do_fwd() {
  ensure_built || return 1
  # shellcheck disable=SC2086
  "$PY" benchmarks/bench_fwd.py ${FWD_ARGS:-} --json "$OUT/bench_fwd.json" > "$OUT/bench_fwd.txt" 2>&1
  local rc=$?
  [ "$rc" -eq 0 ] || status=1
  stamp "fwd: exit $rc; $(grep -E 'geometric mean' "$OUT/bench_fwd.txt" | tr '\n' ';')"
}

# ---- the steps ----------------------------------------------------------------------------
do_test() {
  ensure_built || return 1
  install_transformers test  # (the compiled-model tests skip without it)
  local args=()
  if [ -n "${TESTS:-}" ]; then read -r -a args <<< "$TESTS"; else args=(tests); fi
  if "$PY" -c "import xdist" > /dev/null 2>&1; then args=(-n "${TEST_WORKERS:-8}" "${args[@]}"); fi
  timeout "${PYTEST_TIMEOUT_S:-0}" "$PY" -m pytest -q -rfE -p no:cacheprovider \
    --junitxml="$OUT/junit.xml" "${args[@]}" > "$OUT/tests.log" 2>&1
  local rc=$?
  [ "$rc" -eq 0 ] || status=1
  stamp "test (${args[*]}): exit $rc, $(tail -n 1 "$OUT/tests.log")"
}
bench_one() {  # NAME [bench_bwd arguments]
  local name=$1
  shift
  # shellcheck disable=SC2086
  "$PY" benchmarks/bench_bwd.py ${BENCH_ARGS:---extra --dropin} "$@" --json "$OUT/$name.json" \
    > "$OUT/$name.txt" 2>&1
  local rc=$?
  [ "$rc" -eq 0 ] || status=1
  stamp "$name: exit $rc; $(grep -E 'ours / cudnn:|public paths|paths agree' "$OUT/$name.txt" | tr '\n' ';')"
}
do_bench() {
  ensure_built || return 1
  bench_one bench_bwd_sync
  bench_one bench_bwd_b2b --batched 5 --reps 6
}
do_masks() {
  ensure_built || return 1
  local spec d kv seqs
  for spec in "64 8 1024,2048,4096,8192,16384" "128 4 1024,2048,4096,8192,16384" \
              "256 2 1024,2048,4096,8192,16384"; do
    read -r d kv seqs <<< "$spec"
    "$PY" benchmarks/bench_masks.py --fill cudnn --classes --head-dim "$d" --kv-heads "$kv" \
      --seqs "$seqs" --json "$OUT/bench_masks_d$d.json" > "$OUT/bench_masks_d$d.txt" 2>&1
    local rc=$?
    [ "$rc" -eq 0 ] || status=1
    stamp "bench_masks d$d: exit $rc"
  done
}
do_sanitize() {
  ensure_built || return 1
  local tool
  for tool in memcheck racecheck; do
    timeout "${SANITIZE_TIMEOUT_S:-300}" compute-sanitizer --tool "$tool" \
      "$PY" tools/sanitize_case.py > "$OUT/sanitize_$tool.txt" 2>&1
    local rc=$?
    [ "$rc" -eq 0 ] || status=1
    stamp "sanitize $tool: exit $rc, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.txt" | tail -n 1)"
  done
}
do_ncu() {
  ensure_built || return 1
  local cases args i=0 rep
  IFS=';' read -r -a cases <<< "${NCU_CASES:---d 128 --b 2 --h 16 --s 8192 --mask zeros;--d 128 --b 2 --h 16 --s 8192 --mask causal}"
  for args in "${cases[@]}"; do
    i=$((i + 1))
    rep="$OUT/ncu_$i"
    # shellcheck disable=SC2086
    timeout 300 ncu --clock-control none --set full --import-source yes \
      --kernel-name-base "${NCU_NAME_BASE:-function}" -k "regex:${NCU_KERNEL:-bwd_main_kernel}" \
      -c 1 -f -o "$rep" \
      "$PY" "${NCU_SCRIPT:-benchmarks/profile_bwd.py}" --once $args > "$rep.log" 2>&1
    local rc=$?
    [ "$rc" -eq 0 ] || status=1
    ncu --import "$rep.ncu-rep" --page details --csv > "${rep}_details.csv" 2>&1
    ncu --import "$rep.ncu-rep" --page source --csv --print-source sass > "${rep}_source.csv" 2>&1
    ncu --import "$rep.ncu-rep" --page raw --csv > "${rep}_raw.csv" 2>&1
    { echo "case: $args"
      "$PY" tools/ncu_summary.py details "${rep}_details.csv" "$i"
      "$PY" tools/ncu_summary.py raw "${rep}_raw.csv"
      "$PY" tools/ncu_top_instructions.py "${rep}_source.csv" --top 25
    } > "${rep}_summary.txt" 2>&1
    gzip -f "${rep}_source.csv" "${rep}_raw.csv"  # (large pages: files come back at most 16 MiB)
    stamp "ncu [$args]: exit $rc (ncu_${i}_summary.txt)"
  done
}

: > "$OUT/summary.txt"
stamp "tools/gpu.sh $COMMANDS at $GIT_COMMIT on $(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)"
IFS=',' read -r -a steps <<< "$COMMANDS"
for step in "${steps[@]}"; do
  case "$step" in
    build) do_build ;;
    test) do_test ;;
    bench) do_bench ;;
    masks) do_masks ;;
    sanitize) do_sanitize ;;
    ncu) do_ncu ;;
    wheel) do_wheel ;;
    steps) do_steps ;;
    fwd) do_fwd ;;
    all) do_build && do_test; do_sanitize; do_bench ;;
    *) fail "unknown command '$step' (build, test, bench, masks, sanitize, ncu, wheel, steps, fwd, all)" ;;
  esac
done
stamp "result: $([ "$status" -eq 0 ] && echo PASS || echo FAIL), logs in $OUT"
exit "$status"
