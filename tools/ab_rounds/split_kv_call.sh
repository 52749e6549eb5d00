#!/usr/bin/env bash
# Three rounds of split_kv.sh in trees a = main, b = patches/split-kv-barrier.patch (d256 bf16
# only); d256 bf16 tests and memcheck in b. About 6 min.
#   bash tools/ab_rounds/split_kv_call.sh "$OUT"   (from main; carry .whl)
set -euo pipefail
OUTD=${1:?usage: $0 OUTDIR}
cd "$(dirname "$0")/../.."
AB_ROUNDS=3 AB_TEST_FILES=tests/test_cuda_backward.py TORCH_SM90_SDPA_HEAD_DIMS=256 \
  bash tools/ab_rounds/ab_call.sh "$OUTD" tools/ab_rounds/patches/split-kv-barrier.patch \
  tools/ab_rounds/split_kv.sh "bf16 and 256"
