# The common start of the device-call scripts (tools/*_call.sh), sourced after their
# `set -uo pipefail`:   source "$(dirname "$0")/call_header.sh" "$@"
# Sets OUTD (the call's output folder, the script's first argument) and ROOT (the repository
# root, made the working directory), exports PYTHONUNBUFFERED and GIT_COMMIT (unknown unless
# set), and defines:
#   stamp MSG...    one line "N s: MSG" (seconds since the call started), to stdout and to
#                   OUTD/summary.txt
#   use_prebuilt    the carried build (build/carry: a call's prebuilt/, the .so gunzipped; when
#                   present) into torch_sm90_sdpa/, gpu_check.sh's smoke test with PREBUILT=1
#                   (it builds only when the sources' hash differs; TORCH_SM90_SDPA_HEAD_DIMS /
#                   _DTYPES pick what it would build), its result stamped, then PYTHONPATH set
#   use_deps        PYTHONPATH to build/gpu_deps (the carried wheels) and ROOT
#   unpack_carry_gz build/carry_gz (a call's prebuilt/ as it came back: the .so gzipped, carried
#                   where 64 MiB leave no room for it unzipped) into build/carry; returns 2
#                   when none was carried
#   install_fa4     tools/fa4_install.sh (FlashAttention-4 from build/fa4, tools/fetch_fa4.sh's
#                   two carries) into OUTD/fa4_install.txt, stamped; sets FA4_PATH, the folders
#                   to put on PYTHONPATH for flash_attn.cute
#   suite_with_memcheck MEMCHECK_S SUITE_S [DIR]
#                   the GPU suite (pytest -n 8, DIR/suite.txt) with compute-sanitizer memcheck
#                   on tools/sanitize_case.py beside it (DIR/memcheck.txt), each under its
#                   timeout in seconds and stamped; DIR defaults to LOGS
#   bench_pair SYNC BATCHED SYNC_S BATCHED_S
#                   bench_bwd.py --extra --dropin synchronized (OUTD/SYNC.json, .txt), then back
#                   to back (--batched 5 --reps 6: OUTD/BATCHED.json, .txt), each under its
#                   timeout in seconds and stamped with its geometric means
#   gpt_demo FILE LIMIT_S [demo arguments]
#                   the compiled 8-block GPT of issue 8 (d128, 16 q / 8 kv heads, b2 s8192) with
#                   the default enable() (`demo --only-faster`) into OUTD/FILE, stamped with its
#                   step and attention-backward ratios
#   build_all DIR   LOGS=DIR (emptied), every variant built by tools/device_session.sh (smoke
#                   test only), its result stamped, the build's prebuilt/ copied to OUTD (for
#                   PREBUILT=1 in a later call), then PYTHONPATH set
OUTD=${1:?usage: $0 OUTDIR}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)  # (this file is in tools/)
cd "$ROOT"
export PYTHONUNBUFFERED=1 GIT_COMMIT=${GIT_COMMIT:-unknown}
t0=$(date +%s)
stamp() { echo "$(( $(date +%s) - t0 )) s: $*" | tee -a "$OUTD/summary.txt"; }
use_deps() { export PYTHONPATH="$ROOT/build/gpu_deps:$ROOT"; }
use_prebuilt() {
  if ls build/carry/_C*.so > /dev/null 2>&1; then cp build/carry/* torch_sm90_sdpa/; fi
  PREBUILT=1 tools/gpu_check.sh /tmp/chk tests/test_build.py -k build_info > "$OUTD/check.txt" 2>&1
  stamp "check (PREBUILT=1): exit $?, $(grep -m1 '^result' /tmp/chk/summary.txt 2>/dev/null); $(grep -m1 'PREBUILT\|building' "$OUTD/check.txt")"
  use_deps
}
unpack_carry_gz() {
  local gz
  gz=$(ls build/carry_gz/_C*.so.gz 2> /dev/null | head -n 1)
  [ -n "$gz" ] || { stamp "no build/carry_gz/_C*.so.gz carried"; return 2; }
  mkdir -p build/carry
  gunzip -c "$gz" > "build/carry/$(basename "$gz" .gz)"
  cp build/carry_gz/_build_config.py build/carry_gz/prebuilt_sources.sha1 build/carry/
}
install_fa4() {
  bash tools/fa4_install.sh > "$OUTD/fa4_install.txt" 2>&1
  stamp "fa4_install: exit $?"
  FA4_PATH=$ROOT/build/fa4_deps/nvidia_cutlass_dsl/dsl_packages:$ROOT/build/fa4_deps
}
build_all() {
  LOGS=$1
  rm -rf "$LOGS" && mkdir -p "$LOGS"
  bash tools/device_session.sh "$LOGS/session" none > "$LOGS/device_session.txt" 2>&1
  stamp "build + smoke test: exit $?, $(grep -m1 '^result' "$LOGS/session/check/summary.txt" 2>/dev/null)"
  cp -r "$LOGS/session/prebuilt" "$OUTD/" 2>/dev/null
  use_deps
}
bench_one() {  # NAME LIMIT_S [bench_bwd arguments added to --extra --dropin]
  local name=$1 limit=$2
  shift 2
  timeout "$limit" python3 benchmarks/bench_bwd.py --extra --dropin "$@" --json "$OUTD/$name.json" \
    > "$OUTD/$name.txt" 2>&1
  stamp "bench_bwd --extra --dropin $*: exit $?, $(grep -E 'ours / cudnn:|public paths|paths agree' "$OUTD/$name.txt" | tr '\n' ';')"
}
bench_pair() { bench_one "$1" "$3"; bench_one "$2" "$4" --batched 5 --reps 6; }
gpt_demo() {
  local file=$1 limit=$2
  shift 2
  timeout "$limit" python3 -m torch_sm90_sdpa demo --layers 8 --dim 2048 --heads 16 --seq-len 8192 \
    --batch 2 --steps 2 --timing-iters 10 --timing-rounds 3 --only-faster "$@" > "$OUTD/$file" 2>&1
  stamp "demo --only-faster $* (timeout $limit s): exit $?, $(grep 'step speedup\|no attention backward' "$OUTD/$file")"
}
suite_with_memcheck() {
  local dir=${3:-$LOGS}
  timeout "$1" compute-sanitizer --tool memcheck python3 tools/sanitize_case.py > "$dir/memcheck.txt" 2>&1 &
  local memcheck_pid=$!
  timeout "$2" python3 -m pytest -n 8 -q -p no:cacheprovider tests > "$dir/suite.txt" 2>&1
  stamp "GPU suite: exit $?, $(tail -n 1 "$dir/suite.txt")"
  wait "$memcheck_pid"
  stamp "memcheck: exit $?, $(grep 'ERROR SUMMARY' "$dir/memcheck.txt" | tail -n 1)"
}
