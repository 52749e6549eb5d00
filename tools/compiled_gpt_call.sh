#!/usr/bin/env bash
# One device call for the compiled 8-block GPT of issue 8 (d128, 16 q / 8 kv heads, causal, b2
# s8192) with the default enable(), stock against routed, now that both are compiled apart
# (testing.compile_own_graphs; until the seventeenth session the demo's stock model ran our
# backward): the demo with --only-faster (step and attention-backward ratios, interleaved), then
# tools/compiled_step_kernels.py (kernel tables, step wall time interleaved, and where each
# model's GPU idles).
#   GIT_COMMIT=$(git rev-parse --short HEAD) bash tools/compiled_gpt_call.sh "$OUT"
# Carry .whl, and build/carry with a prebuilt extension of these C++ sources (a landing call's
# prebuilt/, the .so gunzipped) to skip the build; without it, d128 bf16 alone is built (about
# 100 s). About 4-5 minutes in all. OUTDIR gets summary.txt, check.txt, demo.txt, kernels.txt.
set -uo pipefail
source "$(dirname "$0")/call_header.sh" "$@"

TORCH_SM90_SDPA_HEAD_DIMS=${TORCH_SM90_SDPA_HEAD_DIMS:-128} \
  TORCH_SM90_SDPA_DTYPES=${TORCH_SM90_SDPA_DTYPES:-bf16} use_prebuilt

gpt_demo demo.txt 300

timeout 240 python3 tools/compiled_step_kernels.py --wall-rounds 3 --wall-iters 10 --idle \
  > "$OUTD/kernels.txt" 2>&1
stamp "compiled_step_kernels: exit $?, $(grep 'step wall' "$OUTD/kernels.txt")"
grep -E "replaced|kept stock|speed|step |routing_stats" "$OUTD/demo.txt"
grep -E "GPU busy|of kernels per step|step wall|routing_stats" "$OUTD/kernels.txt"
cat "$OUTD/summary.txt"
