#!/usr/bin/env bash
# Four rounds of d64_long.sh in trees a = main (d64's permuted dQ landed), b =
# patches/d64-no-evict-unmasked.patch (branch d64-no-evict-unmasked: Q / dO without EVICT_LAST
# in d64's unmasked kernel only); d64 bf16 tests and memcheck in b. About 5 min.
#   bash tools/ab_rounds/d64_no_evict_call.sh "$OUT"   (from main; carry .whl)
set -euo pipefail
OUTD=${1:?usage: $0 OUTDIR}
cd "$(dirname "$0")/../.."
AB_ROUNDS=4 AB_TEST_FILES=tests/test_cuda_backward.py TORCH_SM90_SDPA_HEAD_DIMS=64 \
  bash tools/ab_rounds/ab_call.sh "$OUTD" tools/ab_rounds/patches/d64-no-evict-unmasked.patch \
  tools/ab_rounds/d64_long.sh "bf16 and 64"
