#!/usr/bin/env bash
# Build torch_sm90_sdpa._C in place and run the test suite on the GPU machine, in one go.
#
#   tools/gpu_check.sh OUTDIR [pytest args...]
#
# The GPU machine has no internet: the wheels it lacks (nvidia-cutlass, expecttest) come from
# .whl/ (made on a development machine by ../shared/tools/fetch_wheels.sh; carry ".whl" to
# the machine). They are installed with --target into build/gpu_deps (put on PYTHONPATH).
# The build uses every core (MAX_JOBS=$(nproc) unless set) and honors
# TORCH_SM90_SDPA_HEAD_DIMS / TORCH_SM90_SDPA_DTYPES / TORCH_SM90_SDPA_NVCC_FLAGS.
# pytest runs `tests` plus the extra args (only the extra args when one of them is a path).
# Writes into OUTDIR: build.log, nvidia-smi.txt, tests.log, junit.xml, sass_summary.txt (when
# cuobjdump exists), summary.txt (printed last). Exits non-zero when the setup, the build or
# the tests fail; the summary is written in every case. PYTEST_TIMEOUT_S (optional) bounds the
# pytest run. PREBUILT=1 skips the build when torch_sm90_sdpa/_C*.so (for this Python),
# _build_config.py and prebuilt_sources.sha1 are present and that hash matches the C++ sources
# here (device_session.sh saves the three after its build).
set -uo pipefail

if [ $# -lt 1 ]; then
  echo "usage: $0 OUTDIR [pytest args...]" >&2
  exit 2
fi
OUT=$1
shift
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

PY=${PYTHON:-python3}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
DEPS="$ROOT/build/gpu_deps"
export PYTHONPATH="$DEPS:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

status=0
setup_status="ok"
build_status="not run"
tests_status="not run"
build_s="-"

note() { echo "[gpu_check] $*"; }

# ---- 1. offline wheels --------------------------------------------------------------------
if ! "$PY" -c "import cutlass_library, expecttest" >/dev/null 2>&1; then
  shopt -s nullglob
  wheels=(.whl/*.whl)
  shopt -u nullglob
  if [ ${#wheels[@]} -eq 0 ]; then
    note "cutlass_library / expecttest missing and no .whl/*.whl here: run" \
         "../shared/tools/fetch_wheels.sh on a development machine and carry .whl"
    setup_status="FAILED (no wheels)"
    status=1
  else
    note "installing ${#wheels[@]} wheels into $DEPS"
    mkdir -p "$DEPS"
    if ! "$PY" -m pip install -q --no-index --no-deps --upgrade --target "$DEPS" "${wheels[@]}" \
        > "$OUT/pip.log" 2>&1; then
      cat "$OUT/pip.log"
      setup_status="FAILED (pip install of .whl, see pip.log)"
      status=1
    fi
  fi
fi

# ---- 2. the GPU ---------------------------------------------------------------------------
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
gpu_name=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null \
           | head -n 1)
gpu_name=${gpu_name:-"no GPU visible (nvidia-smi failed)"}

# ---- 3. build -----------------------------------------------------------------------------
# The C++ sources' content hash: a carried build is used only when it was built from these.
sources_sha1() {
  find csrc registration setup.py -type f ! -path 'csrc/instantiations/*' -print0 | sort -z \
    | xargs -0 cat | sha1sum | cut -c1-40
}
prebuilt=$(ls torch_sm90_sdpa/_C.cpython-"$("$PY" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')"*.so 2>/dev/null | head -n 1)
prebuilt_ok=0
if [ "${PREBUILT:-0}" = 1 ]; then
  if [ -z "$prebuilt" ] || [ ! -f torch_sm90_sdpa/_build_config.py ]; then
    note "PREBUILT=1 but no carried _C*.so for this Python or no _build_config.py: building"
  elif [ "$(cat torch_sm90_sdpa/prebuilt_sources.sha1 2>/dev/null)" != "$(sources_sha1)" ]; then
    note "PREBUILT=1 but the carried build's prebuilt_sources.sha1 does not match these sources: building"
  else
    prebuilt_ok=1
  fi
fi
if [ "$status" -eq 0 ] && [ "$prebuilt_ok" = 1 ]; then
  note "PREBUILT=1: using the carried $prebuilt (built from these sources), no build"
  build_status="ok (prebuilt, carried)"
elif [ "$status" -eq 0 ]; then
  note "building (MAX_JOBS=$MAX_JOBS, HEAD_DIMS=${TORCH_SM90_SDPA_HEAD_DIMS:-default}," \
       "DTYPES=${TORCH_SM90_SDPA_DTYPES:-default})"
  t0=$(date +%s.%N)
  TORCH_SM90_SDPA_BUILD_CUDA=1 "$PY" setup.py build_ext --inplace 2>&1 | tee "$OUT/build.log"
  rc=${PIPESTATUS[0]}
  build_s=$("$PY" -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" \
            "$t0" "$(date +%s.%N)")
  if [ "$rc" -eq 0 ]; then
    build_status="ok"
    sources_sha1 > torch_sm90_sdpa/prebuilt_sources.sha1  # what this build is from (PREBUILT)
  else
    build_status="FAILED (exit $rc)"
    status=1
  fi
fi

# ---- 4. SASS check (wgmma present? ptxas serialization warnings?) -------------------------
so=$(ls torch_sm90_sdpa/_C*.so 2>/dev/null | head -n 1)
sass_line="-"
if [ "$build_status" = "ok" ] && [ -n "$so" ] && command -v cuobjdump >/dev/null 2>&1; then
  cuobjdump -sass "$so" 2>/dev/null | "$PY" -c '
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
  sass_line=$(head -n 1 "$OUT/sass_summary.txt")
fi

# ---- 5. tests -----------------------------------------------------------------------------
if [[ "$build_status" == ok* ]]; then
  targets=(tests)
  for a in "$@"; do
    if [ -e "${a%%::*}" ]; then targets=(); break; fi
  done
  note "pytest ${targets[*]} $*"
  # PYTEST_TIMEOUT_S: kill pytest after this many seconds (a hung kernel); 0 or unset: no limit
  timeout "${PYTEST_TIMEOUT_S:-0}" "$PY" -m pytest -v -rfEs --junitxml="$OUT/junit.xml" \
    "${targets[@]}" "$@" 2>&1 \
    | tee "$OUT/tests.log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 0 ]; then
    tests_status="ok"
  else
    tests_status="FAILED (pytest exit $rc)"
    status=1
  fi
fi

# ---- 6. summary ---------------------------------------------------------------------------
{
  echo "gpu_check summary ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
  # GIT_COMMIT: the commit as the caller knows it (a copied tree's .git may be stale)
  if [ -n "${GIT_COMMIT:-}" ]; then
    commit="$GIT_COMMIT (as given by the caller)"
  elif commit=$(git rev-parse --short HEAD 2>/dev/null); then
    git diff --quiet HEAD 2>/dev/null || commit="$commit (+ uncommitted changes)"
  else
    commit="? (not a git checkout)"
  fi
  echo "commit:      $commit"
  echo "gpu:         $gpu_name"
  echo "python:      $("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)' 2>/dev/null)"
  echo "setup:       $setup_status"
  echo "build:       $build_status, ${build_s} s (MAX_JOBS=$MAX_JOBS," \
       "HEAD_DIMS=${TORCH_SM90_SDPA_HEAD_DIMS:-default}, DTYPES=${TORCH_SM90_SDPA_DTYPES:-default})"
  if [ -f "$OUT/build.log" ]; then
    grep -E '^\[torch_sm90_sdpa\] (compile times|build of|note)' "$OUT/build.log" | sed 's/^/  /'
    nwarn=$(grep -c -E '(: warning|warning #|ptxas warning|[Ww]arning C[0-9]+)' "$OUT/build.log" || true)
    echo "  compiler warnings: $nwarn (C7510 wgmma serialization: $(grep -c C7510 "$OUT/build.log" || true))"
    grep -E '^\[torch_sm90_sdpa\] FAILED' "$OUT/build.log" | sed 's/^/  /'
  fi
  echo "sass:        $sass_line"
  echo "tests:       $tests_status"
  if [ -f "$OUT/junit.xml" ]; then
    "$PY" - "$OUT/junit.xml" <<'PYEOF'
import sys
import xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
tot = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
passed = tot["tests"] - tot["failures"] - tot["errors"] - tot["skipped"]
print(f"  {passed} passed, {tot['failures']} failed, {tot['errors']} errors, "
      f"{tot['skipped']} skipped (of {tot['tests']})")
per_file = {}
for case in root.iter("testcase"):
    parts = case.get("classname", "?").split(".")
    f = next((x for x in parts if x.startswith("test_")), parts[0])
    st = per_file.setdefault(f, [0, 0, 0])
    if case.find("failure") is not None or case.find("error") is not None:
        st[1] += 1
    elif case.find("skipped") is not None:
        st[2] += 1
    else:
        st[0] += 1
for f, (p, fl, sk) in sorted(per_file.items()):
    print(f"    {f}: {p} passed, {fl} failed, {sk} skipped")
bad = [c for c in root.iter("testcase")
       if c.find("failure") is not None or c.find("error") is not None]
for c in bad[:20]:
    print(f"    FAILED {c.get('classname')}::{c.get('name')}")
if len(bad) > 20:
    print(f"    ... and {len(bad) - 20} more")
PYEOF
  fi
  [ -f "$OUT/tests.log" ] && echo "  pytest: $(tail -n 1 "$OUT/tests.log")"
  echo "logs:        $OUT"
  echo "result:      $([ "$status" -eq 0 ] && echo PASS || echo FAIL)"
} > "$OUT/summary.txt" 2>&1

echo
cat "$OUT/summary.txt"
exit "$status"
