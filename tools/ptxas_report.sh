#!/usr/bin/env bash
# Compile main-kernel instantiations here (no GPU needed) and print ptxas' resource report of
# each kernel: registers, spill stores / loads, stack frame, shared memory. For checking a kernel
# change before any device time is spent on it.
#
#   tools/ptxas_report.sh [HEAD_DIMS] [DTYPES] [FILTER]
#     HEAD_DIMS  as TORCH_SM90_SDPA_HEAD_DIMS (default 128); DTYPES default bf16
#     FILTER     a grep pattern over the generated file names (default: every file), e.g. full
# Needs nvcc and the nvidia-cutlass wheel (pip install nvidia-cutlass==4.2.0.0). Output under
# PTXAS_OUT (default /tmp/ptxas_report; one log per file). Uses every core here, a file per core.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
dims=${1:-128}; dtypes=${2:-bf16}; filter=${3:-.}
out=${PTXAS_OUT:-/tmp/ptxas_report}
rm -rf "$out" && mkdir -p "$out/inst"
python3 "$ROOT/csrc/generate_instantiations.py" --out-dir "$out/inst" --head-dims "$dims" --dtypes "$dtypes" > /dev/null
cutlass=$(python3 -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))")
files=$(ls "$out"/inst/bwd_main_*.cu | grep -E "$filter" || true)
[ -n "$files" ] || { echo "no instantiation matches '$filter'"; exit 1; }
# the instantiations include instantiations/tile_configs.h relative to csrc/
mkdir -p "$out/csrc_overlay/instantiations"
cp "$out"/inst/*.h "$out/csrc_overlay/instantiations/"
echo "$files" | xargs -P "$(nproc)" -I{} sh -c '
  f={}; b=$(basename "$f" .cu)
  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -DNDEBUG -std=c++17 --expt-relaxed-constexpr \
    --expt-extended-lambda -Xptxas -v -I"$0/csrc_overlay" -I"$1/csrc" -I"$2" -c "$f" -o "$0/$b.o" \
    > "$0/$b.log" 2>&1 || { echo "$b: compile FAILED (see $0/$b.log)"; exit 0; }
' "$out" "$ROOT" "$cutlass"
for log in "$out"/*.log; do
  b=$(basename "$log" .log)
  # ptxas prints "Compiling entry function ..." then "Used N registers ..." per kernel
  awk -v b="$b" '
    /Compiling entry function/ { k = ($0 ~ /bwd_main_kernel/) ? "main" : "other" }
    /bytes stack frame/ && k == "main" { frame = $0 }
    /Used [0-9]+ registers/ && k == "main" { sub(/^.*ptxas info *: */, ""); print b ": " $0 "; " frame; k = "" }
    /warning|error/ { print b ": " $0 }
  ' "$log" | sed 's/ptxas info *: *//'
done
