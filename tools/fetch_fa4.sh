#!/usr/bin/env bash
# FlashAttention-4 for `benchmarks/bench_bwd.py --fa4` on the GPU machine, which has no internet
# and takes at most 64 MiB of carried files per call. On this machine: download the wheels of
# flash-attn-4 and its dependencies for the GPU machine's Python (3.12, x86_64, CUDA 13) and split
# them into three carries (the CUDA 13 CuTe-DSL libraries alone are a 92 MB wheel; the working
# tree, about 9 MiB, travels with every call):
#   build/fa4/part1/   the wheels' first 48 MiB
#   build/fa4/part1b/  the next 48 MiB
#   build/fa4/part2/   the rest and the archive's checksum
#     bash tools/fetch_fa4.sh [flash-attn-4 version, default 4.0.0b36]
# On the GPU machine, three commands back to back while the machine stays warm (ignored files a
# command leaves stay for the next one on the same machine):
#   carry build/fa4/part1: nothing to run (`true`)
#   carry build/fa4/part1b: nothing to run (`true`)
#   carry build/fa4/part2, .whl (and build/carry_gz, a build to reuse):
#      tools/gpu.sh build "$OUT" && bash tools/fa4_install.sh && D=$PWD/build/fa4_deps &&
#        PYTHONPATH=$D/nvidia_cutlass_dsl/dsl_packages:$D:$PWD/build/gpu_deps:$PWD \
#        python3 benchmarks/bench_bwd.py --fa4 --dims 64,128 --seqs 2048,8192,16384 --no-gqa
# tools/fa4_install.sh stops with a message when the first part is gone (a fresh machine).
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-4.0.0b36}
dl=build/fa4/download
rm -rf build/fa4 && mkdir -p "$dl" build/fa4/part1 build/fa4/part1b build/fa4/part2
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform any -d "$dl" "flash-attn-4==$version" "nvidia-cutlass-dsl==4.8.1" \
  "nvidia-cutlass-dsl-libs-core==4.8.1" "nvidia-cutlass-dsl-libs-base==4.8.1" \
  "nvidia-cutlass-dsl-libs-cu13==4.8.1" "apache-tvm-ffi>=0.1.11,<0.2" torch-c-dlpack-ext \
  "quack-kernels>=0.5.3"
# (einops, cuda-bindings, protobuf and typing-extensions are on the GPU machine: KINDS.md)
# one archive of every wheel, cut at 48 MiB (with the tree, under a call's 64 MiB)
(cd "$dl" && tar cf ../wheels.tar *.whl)
sha256sum build/fa4/wheels.tar | cut -d' ' -f1 > build/fa4/part2/wheels.tar.sha256
split -b 48M -d build/fa4/wheels.tar build/fa4/wheels.tar.part
mv build/fa4/wheels.tar.part00 build/fa4/part1/
mv build/fa4/wheels.tar.part01 build/fa4/part1b/
mv build/fa4/wheels.tar.part0[2-9] build/fa4/part2/
rm -rf "$dl" build/fa4/wheels.tar
du -sh build/fa4/part1 build/fa4/part1b build/fa4/part2
