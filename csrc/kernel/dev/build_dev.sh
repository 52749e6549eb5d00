#!/usr/bin/env bash
# Build the dev shim (csrc/kernel/dev/dev_shim.cu) into build/dev/libsm90dev.so.
# Usage: csrc/kernel/dev/build_dev.sh "-DDEV_D128" [extra nvcc flags]
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
CUTLASS_INC=${CUTLASS_INCLUDE_DIR:-$(python3 -c "import cutlass_library,os;print(os.path.join(os.path.dirname(cutlass_library.__file__),'source','include'))")}
mkdir -p build/dev
defs=${1:-"-DDEV_D128"}
shift || true
nvcc -gencode=arch=compute_90a,code=sm_90a -std=c++17 --expt-relaxed-constexpr --expt-extended-lambda -O3 -lineinfo \
  -I csrc -I "$CUTLASS_INC" -I "$CUTLASS_INC/../tools/util/include" -DNDEBUG \
  -Xcompiler -fPIC -shared -Xptxas -v $defs "$@" \
  csrc/kernel/dev/dev_shim.cu -o ${DEV_OUT:-build/dev/libsm90dev.so}
