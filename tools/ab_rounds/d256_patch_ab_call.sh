#!/usr/bin/env bash
# One device call: a d256 kernel change as a patch, A/B against this commit. Tree a = this
# commit, tree b = PATCH applied; d256 bf16 built in both; the d256 GPU tests of
# test_cuda_backward.py, test_cuda_masks.py and test_cuda_deterministic.py (-k 256, the
# gradient criterion against float64 among them) in both; two alternating rounds of
# tools/env_ab_probe.py --env TORCH_SM90_SDPA_PERSISTENT over the FA grid's d256 rows (side A of
# each tree: the default, persistent; compare tree a's side A with tree b's); memcheck in tree
# b; then bench_bwd.py --dims 256 in tree b, then tree a (ours / cuDNN of each, synchronized).
# AB_DIMS="192,256" builds and tests d192 too (tests -k "192 or 256"; probe and bench rows of
# d192 at 2k and 8k keys, as bench_bwd's --extra: h10). Any other head dim in AB_DIMS takes the
# FA grid's rows (AB_SEQS: the lengths, default 512 .. 16384). AB_TESTS_K / AB_TEST_FILES
# replace the tests' -k expression / files.
#   GIT_COMMIT=$(git rev-parse --short HEAD) PATCH=tools/ab_rounds/patches/X.patch \
#     bash tools/ab_rounds/d256_patch_ab_call.sh "$OUT"   (carry .whl)
# Runs: twenty-seventh session's call 2 at f2d0d4d with PATCH=.../d256-ndkv1.patch (atom_n_dkv
# 1, landed in b63d144: that patch applies to f2d0d4d only); twenty-eighth session's call 1 at
# c4bebea with PATCH=.../d256-sdp-by-wg.patch (S on warpgroup 0, dP on warpgroup 1; landed
# right after: it applies to c4bebea only; results in benchmarks/results/session28/call1);
# twenty-ninth session's call 4 at 0e0b908 with AB_DIMS=192,256 and
# PATCH=.../dkv-stsm.patch (the dK / dV epilogue by stmatrix; landed for d256 only in 9941635,
# as a tile flag; results in benchmarks/results/session29/call4).
set -uo pipefail
source "$(dirname "$0")/../call_header.sh" "$@"
dims=${AB_DIMS:-256}
rows=""
for d in ${dims//,/ }; do
  if [ "$d" = 192 ]; then
    rows="$rows,192:8:10:2048:c,192:8:10:2048,192:2:10:8192:c,192:2:10:8192"
    continue
  fi
  # the FA grid's rows of the head dim (b = 16384 / s, h = 2048 / d); AB_SEQS narrows them
  for s in ${AB_SEQS:-512 1024 2048 4096 8192 16384}; do
    rows="$rows,$d:$((16384 / s)):$((2048 / d)):$s:c,$d:$((16384 / s)):$((2048 / d)):$s"
  done
done
TORCH_SM90_SDPA_HEAD_DIMS=$dims TESTS_K="${AB_TESTS_K:-${dims//,/ or }}" \
  TESTS="-n 6 -q -p no:cacheprovider ${AB_TEST_FILES:-tests/test_cuda_backward.py tests/test_cuda_masks.py tests/test_cuda_deterministic.py}" \
  bash tools/ab_session.sh /tmp/abndkv "${PATCH:?PATCH=tools/ab_rounds/patches/X.patch}" 2 -- \
  python3 tools/env_ab_probe.py --env TORCH_SM90_SDPA_PERSISTENT --b-value 0 --rounds 2 --rows "${rows#,}" \
  > "$OUTD/ab_session.txt" 2>&1
stamp "ab_session: exit $?"
for side in a b; do
  stamp "tests $side: $(grep -E '[0-9]+ (passed|failed)' /tmp/abndkv/$side/tests.log | tail -n 1)"
  cp /tmp/abndkv/$side.txt "$OUTD/probe_$side.txt"
  grep -E "FAILED|Error" /tmp/abndkv/$side/tests.log | head -n 10
done
tree_b=/tmp/torch_sm90_sdpa_ab_b
(cd "$tree_b" && PYTHONPATH="$tree_b/build/gpu_deps:$tree_b" timeout 150 compute-sanitizer --tool memcheck \
  python3 tools/sanitize_case.py > /tmp/abndkv/memcheck_b.txt 2>&1)
stamp "memcheck (tree b): exit $?, $(grep 'ERROR SUMMARY' /tmp/abndkv/memcheck_b.txt | tail -n 1), $(grep sanitize_case /tmp/abndkv/memcheck_b.txt | tail -n 1)"
for side in b a; do
  tree=$ROOT; [ "$side" = b ] && tree=$tree_b
  (cd "$tree" && PYTHONPATH="$tree/build/gpu_deps:$tree" timeout 100 python3 benchmarks/bench_bwd.py --dims "$dims" --no-gqa \
    > "$OUTD/bench_$side.txt" 2>&1)
  stamp "bench d$dims tree $side: exit $?, $(grep 'ours / cudnn' "$OUTD/bench_$side.txt" | tail -n 1)"
done
grep -E "^d[0-9]" "$OUTD/probe_a.txt" "$OUTD/probe_b.txt"
grep -E "^d=" "$OUTD/bench_a.txt" "$OUTD/bench_b.txt"
cat "$OUTD/summary.txt"
