#!/usr/bin/env bash
# Four rounds of d64_long.sh in trees a = main, b = patches/d64-dq-permuted.patch,
# c = patches/no-evict-last.patch (d64 bf16 only); d64 tests and memcheck in b. About 5 min.
# (Ran in the eighteenth session. Side b landed as 71bbd29 and its patch file, a copy of that
# code, was removed: the branch d64-dq-permuted keeps it.)
#   bash tools/ab_rounds/d64_long_call.sh "$OUT"   (from main; carry .whl)
set -euo pipefail
OUTD=${1:?usage: $0 OUTDIR}
cd "$(dirname "$0")/../.."
p=tools/ab_rounds/patches
AB_ROUNDS=4 AB_TEST_FILES=tests/test_cuda_backward.py TORCH_SM90_SDPA_HEAD_DIMS=64 \
  bash tools/ab_rounds/ab_call.sh "$OUTD" "$p/d64-dq-permuted.patch,$p/no-evict-last.patch" \
  tools/ab_rounds/d64_long.sh "bf16 and 64"
