#!/usr/bin/env bash
# One device call for an A/B of one patch (fourteenth session): tools/ab_session.sh builds
# this tree (a) and the patched one (b) side by side (TORCH_SM90_SDPA_HEAD_DIMS, default 128,
# bf16), runs ROUND_SCRIPT in each, alternating, two rounds; then in tree b the tests of
# tests/test_cuda_backward.py selected by PYTEST_K, and compute-sanitizer memcheck on
# tools/sanitize_case.py beside them. At most 8 files come back; OUTDIR gets ab_summary.txt,
# a.txt / b.txt (the rounds; c.txt ... with PATCH a comma-separated list, one side each),
# tests_b.txt, memcheck_b.txt (tests and memcheck in tree b only).
#   bash tools/ab_rounds/ab_call.sh OUTDIR PATCH[,PATCH...] ROUND_SCRIPT PYTEST_K     (carry .whl)
# AB_ROUNDS: rounds (default 2).
# Runs: the d128 full tile (patch: `git diff 6e4f144 6787db2`, which landed; tile80.sh,
# "128 or full_tile"; 330 s) and causal d128 calls on that tile (patches/causal80.patch,
# causal80.sh; 242 s; landed as 7a189fa), and two P / dS buffers at d256
# (patches/d256-ds2.patch, d256_ds2_quick.sh, "256 and causal"; 331 s; no gain, not landed).
# Sixteenth session: the gqa-walk branch as a patch with gqa_walk.sh, "gqa or walk or mqa" (one
# CTA per kv head's key block walks the group; 340 s), then that branch plus a section-size
# switch with gqa_walk_sections.sh through tools/ab_session.sh directly, one round (266 s);
# landed as 9e68b21 with 128-CTA sections (the two patch files, copies of that code, were
# removed; the switch alone is patches/section-groups.patch, against main).
# Sixteenth session, run in the seventeenth (21-23% slower, not merged): d256 dQ by atomics, trees b / c / d
# (d256_dq_atomic_call.sh: patches/d256-dq-atomic.patch and two variants of it),
# d256_dq_atomic.sh, "256 or full_tile", TORCH_SM90_SDPA_HEAD_DIMS=256.
# Seventeenth session's, run in the eighteenth: long_seq_call.sh (per-warpgroup dQ at d128, m-block
# rotation for full attention, no EVICT_LAST on Q / dO; 408 s), then long_seq_focus_call.sh
# (four rounds of two of them; 525 s) and d64_long_call.sh (d64 dQ with permuted segments, 2.8%
# faster at 16k keys, branch d64-dq-permuted; 390 s; merged in the nineteenth session, 71bbd29).
# Nineteenth session: d64_no_evict_call.sh (no EVICT_LAST in d64's unmasked kernel; 274 s) and
# split_kv_call.sh (K / V barriers split, d256; 363 s). Neither merged.
# Twenty-first session, prepared; run in the twenty-third (260 s): patches/short-default-tile.patch
# with short_default_tile.sh, "128 or full_tile" (d128 calls of up to 768 queries on the default
# tile; main kernel at 512 queries 3-6% faster; landed, the patch file kept as the record).
set -u
OUTD=${1:?usage: $0 OUTDIR PATCH ROUND_SCRIPT PYTEST_K}
PATCH=${2:?patch}
ROUND=${3:?round script}
PYTEST_K=${4:?pytest -k expression}
export PYTHONUNBUFFERED=1 TORCH_SM90_SDPA_HEAD_DIMS=${TORCH_SM90_SDPA_HEAD_DIMS:-128}
AB=/tmp/ab
TESTS="tests/test_build.py -k build_info" tools/ab_session.sh "$AB" "$PATCH" "${AB_ROUNDS:-2}" -- bash "$ROUND" \
  > "$OUTD/ab_summary.txt" 2>&1
for f in "$AB"/[a-g].txt; do  # every side's rounds (a, b and, with several patches, c, ...)
  s=$(basename "$f" .txt)
  tail -n 25 "$AB/${s}_check.log" >> "$OUTD/ab_summary.txt"
  cp "$f" "$OUTD/" 2>/dev/null
done
tree=${AB_TREE_PREFIX:-/tmp/torch_sm90_sdpa_ab_}b
cd "$tree" || exit 1
export PYTHONPATH="$tree/build/gpu_deps:$tree"
timeout 100 compute-sanitizer --tool memcheck python3 tools/sanitize_case.py > "$OUTD/memcheck_b.txt" 2>&1 &
# AB_TEST_FILES: the test files PYTEST_K selects from (default tests/test_cuda_backward.py)
timeout 150 python3 -m pytest -n 6 -q -p no:cacheprovider ${AB_TEST_FILES:-tests/test_cuda_backward.py} \
  -k "$PYTEST_K" > "$OUTD/tests_b.txt" 2>&1
wait
echo "tests in b: $(tail -n 1 "$OUTD/tests_b.txt")"
echo "memcheck in b: $(grep 'ERROR SUMMARY' "$OUTD/memcheck_b.txt" | tail -n 1); $(grep '^sanitize_case:' "$OUTD/memcheck_b.txt")"
