#!/usr/bin/env bash
# Four rounds of long_seq_focus.sh in trees a = main, b = patches/dq-per-wg.patch,
# c = patches/no-evict-last.patch (d64 and d128 bf16); tests and memcheck in b, a few only
# (its full tests/test_cuda_backward.py selection passed in session 18's first call). About 8 min.
#   bash tools/ab_rounds/long_seq_focus_call.sh "$OUT"   (from main; carry .whl)
set -euo pipefail
OUTD=${1:?usage: $0 OUTDIR}
cd "$(dirname "$0")/../.."
p=tools/ab_rounds/patches
AB_ROUNDS=4 AB_TEST_FILES=tests/test_cuda_backward.py TORCH_SM90_SDPA_HEAD_DIMS=64,128 \
  bash tools/ab_rounds/ab_call.sh "$OUTD" "$p/dq-per-wg.patch,$p/no-evict-last.patch" \
  tools/ab_rounds/long_seq_focus.sh "bf16 and 128 and (causal or mask)"
