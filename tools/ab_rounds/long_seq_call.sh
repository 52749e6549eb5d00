#!/usr/bin/env bash
# The long-sequence A/B in one device call (seventeenth session, not run): trees a = main,
# b = patches/m-rotate.patch, c = patches/no-evict-last.patch, d = patches/d64-dq-permuted.patch
# (d64 and d128 bf16 built in each), one round of long_seq.sh; the tests of
# tests/test_cuda_backward.py and memcheck in tree b (the rotation). About 9 minutes.
#   bash tools/ab_rounds/long_seq_call.sh "$OUT"   (from main; carry .whl)
set -euo pipefail
OUTD=${1:?usage: $0 OUTDIR}
cd "$(dirname "$0")/../.."
p=tools/ab_rounds/patches
AB_ROUNDS=1 AB_TEST_FILES=tests/test_cuda_backward.py TORCH_SM90_SDPA_HEAD_DIMS=64,128 \
  bash tools/ab_rounds/ab_call.sh "$OUTD" "$p/m-rotate.patch,$p/no-evict-last.patch,$p/d64-dq-permuted.patch" \
  tools/ab_rounds/long_seq.sh "(full and bf16) or full_tile or walk"
