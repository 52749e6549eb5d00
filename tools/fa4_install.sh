#!/usr/bin/env bash
# Install FlashAttention-4 offline on the GPU machine for bench_bwd.py --fa4 (tools/fetch_fa4.sh).
# The last of fetch_fa4.sh's three carries: join build/fa4/part1 and part1b (left by the
# commands before, on this same machine) and part2, check the archive, and install its wheels
# offline into build/fa4_deps (put the two folders it prints on PYTHONPATH).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! ls build/fa4/part1/wheels.tar.part00 > /dev/null 2>&1; then
  echo "tools/fa4_install.sh: build/fa4/part1 is not here (a fresh machine: carry it again, then part1b at once)" >&2
  exit 3
fi
tmp=$(mktemp -d)
# the parts in their order: part1/, part1b/ (tools/fetch_fa4.sh's three carries; absent in the
# two of an older download), part2/ (named one by one: a glob's order follows the locale, which
# on the GPU machine puts part1b/ before part1/)
parts=(build/fa4/part1/wheels.tar.part00)
if [ -d build/fa4/part1b ]; then parts+=(build/fa4/part1b/wheels.tar.part*); fi
parts+=(build/fa4/part2/wheels.tar.part*)
cat "${parts[@]}" > "$tmp/wheels.tar"
echo "$(cat build/fa4/part2/wheels.tar.sha256)  $tmp/wheels.tar" | sha256sum -c --quiet
tar xf "$tmp/wheels.tar" -C "$tmp"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target build/fa4_deps "$tmp"/*.whl
rm -rf "$tmp"
# nvidia-cutlass-dsl's `cutlass` package sits in nvidia_cutlass_dsl/dsl_packages, added to
# sys.path by a .pth file that pip --target does not process: put both folders on PYTHONPATH
fa4_path=$PWD/build/fa4_deps/nvidia_cutlass_dsl/dsl_packages:$PWD/build/fa4_deps
PYTHONPATH=$fa4_path${PYTHONPATH:+:$PYTHONPATH} python3 -c \
  "import flash_attn.cute.interface as i; print('flash_attn.cute imports:', i.__file__)"
echo "for bench_bwd.py --fa4: export PYTHONPATH=$fa4_path:\$PYTHONPATH"
