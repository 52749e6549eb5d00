#!/usr/bin/env bash
# Two rounds of p_convert.sh in trees a = main, b = patches/p-convert-early.patch (d128 and
# d256 bf16); their bf16 tests and memcheck in b. Prepared in the nineteenth session (compiled
# here only); about 7-9 minutes estimated (not measured).
#   bash tools/ab_rounds/p_convert_call.sh "$OUT"   (from main; carry .whl)
set -euo pipefail
OUTD=${1:?usage: $0 OUTDIR}
cd "$(dirname "$0")/../.."
AB_ROUNDS=2 AB_TEST_FILES=tests/test_cuda_backward.py TORCH_SM90_SDPA_HEAD_DIMS=128,256 \
  bash tools/ab_rounds/ab_call.sh "$OUTD" tools/ab_rounds/patches/p-convert-early.patch \
  tools/ab_rounds/p_convert.sh "bf16"
