#!/usr/bin/env bash
# A short A/B of tools/ab_rounds/patches/defer-dq-d128.patch for a device call with little time
# left: tree a = this tree on the carried build (build/carry_gz, matching these C++ sources),
# tree b = a copy with the patch, only d128 bf16 built; then two alternating rounds of
# tools/env_ab_probe.py on d128 b32 h16 s512 (`is_causal` and full: the 64-row tile the patch
# changes) in each tree (compare side A, the persistent default, of probe_a with probe_b), then
# tree b's d128 GPU tests of the 64-row tile in what time is left.
#   bash tools/ab_rounds/defer_dq_quick_call.sh "$OUT"   (carry .whl and build/carry_gz)
# The full A/B (both trees built, every d128 test, memcheck) is
# tools/ab_rounds/d256_patch_ab_call.sh with AB_DIMS=128 (docs/KERNEL.md).
set -uo pipefail
source "$(dirname "$0")/../call_header.sh" "$@"
unpack_carry_gz || exit 2
use_prebuilt
B=/tmp/tree_b
rm -rf "$B" && mkdir -p "$B"
tar --exclude=./build --exclude=./.git --exclude='./torch_sm90_sdpa/_C*.so' \
  --exclude=./torch_sm90_sdpa/_build_config.py --exclude=./torch_sm90_sdpa/prebuilt_sources.sha1 -cf - . \
  | (cd "$B" && tar xf -)
(cd "$B" && patch -p1 < tools/ab_rounds/patches/defer-dq-d128.patch) > "$OUTD/patch.txt" 2>&1
stamp "tree b patched: exit $?"
(cd "$B" && TORCH_SM90_SDPA_HEAD_DIMS=128 TORCH_SM90_SDPA_DTYPES=bf16 tools/gpu_check.sh /tmp/b_chk \
  tests/test_build.py -k build_info) > "$OUTD/b_build.txt" 2>&1
stamp "tree b build: exit $?, $(grep -m1 '^result' /tmp/b_chk/summary.txt 2>/dev/null)"
rows=128:32:16:512:c,128:32:16:512
for r in 1 2; do
  for side in a b; do
    tree=$ROOT; [ "$side" = b ] && tree=$B
    (cd "$tree" && PYTHONPATH="$ROOT/build/gpu_deps:$tree" timeout 60 python3 tools/env_ab_probe.py \
      --env TORCH_SM90_SDPA_PERSISTENT --b-value 0 --rounds 1 --rows "$rows") >> "$OUTD/probe_$side.txt" 2>&1
  done
  stamp "probe round $r done"
done
grep -h "main A" "$OUTD"/probe_a.txt "$OUTD"/probe_b.txt
(cd "$B" && PYTHONPATH="$ROOT/build/gpu_deps:$B" timeout "${TEST_S:-100}" python3 -m pytest -q -n 8 \
  tests/test_cuda_backward.py -k "128 and (mha or full_tile or persistent or gqa)" -x) > "$OUTD/b_tests.txt" 2>&1
stamp "tree b d128 tests: exit $?, $(tail -n 1 "$OUTD/b_tests.txt")"
cat "$OUTD/summary.txt"
