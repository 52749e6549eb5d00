#!/usr/bin/env bash
# The long-sequence A/B in one device call (seventeenth session; run in the eighteenth, 408 s): trees a = main,
# b = patches/dq-per-wg.patch, c = patches/m-rotate.patch, d = patches/no-evict-last.patch
# (d64 and d128 bf16 built in each), one round of long_seq.sh; the tests of
# tests/test_cuda_backward.py and memcheck in tree b (the per-warpgroup dQ) only: a side c or d that
# pays is tested before it lands. About 9 minutes.
#   bash tools/ab_rounds/long_seq_call.sh "$OUT"   (from main; carry .whl)
set -euo pipefail
OUTD=${1:?usage: $0 OUTDIR}
cd "$(dirname "$0")/../.."
p=tools/ab_rounds/patches
AB_ROUNDS=1 AB_TEST_FILES=tests/test_cuda_backward.py TORCH_SM90_SDPA_HEAD_DIMS=64,128 \
  bash tools/ab_rounds/ab_call.sh "$OUTD" "$p/dq-per-wg.patch,$p/m-rotate.patch,$p/no-evict-last.patch" \
  tools/ab_rounds/long_seq.sh "bf16 and (64 or 128) or full_tile or walk"
