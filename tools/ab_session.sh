#!/usr/bin/env bash
# A / B on the GPU machine: this tree (A) against a copy of it with a patch applied (B), both
# built at the same time with only the variants a comparison needs, then one command run in
# each tree in turn, ROUNDS times (A, B, A, B, ...: separate processes, since both builds are
# the same module), so that clock drift between the rounds falls on both sides.
#
#   tools/ab_session.sh OUTDIR PATCH ROUNDS -- COMMAND [ARGS...]
#
# PATCH: a `git diff` of B against this tree, made on the development machine and carried as
# a file that git does not ignore (e.g. `git diff main my-branch > ab/my-branch.patch`).
# COMMAND runs in the tree's root with that tree's build first on PYTHONPATH, e.g.
#   tools/ab_session.sh /tmp/ab ab/x.patch 3 -- python3 benchmarks/bench_masks.py --kinds causal --seqs 2048 --reps 30
# Variants: TORCH_SM90_SDPA_HEAD_DIMS (default 128) and TORCH_SM90_SDPA_DTYPES (default bf16);
# each build gets half the cores. TESTS (optional): pytest arguments run in both trees after
# the builds (e.g. "-n 4 tests/test_cuda_masks.py"); by default only the build smoke test.
# Writes OUTDIR/a and OUTDIR/b (gpu_check logs), a.txt and b.txt (the command's output per
# round, headed by the round) and prints a summary. Carry .whl.
set -uo pipefail
if [ $# -lt 5 ] || [ "$4" != "--" ]; then
  echo "usage: $0 OUTDIR PATCH ROUNDS -- COMMAND [ARGS...]" >&2
  exit 2
fi
OUT=$1
PATCH=$2
ROUNDS=$3
shift 4
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PATCH=$(cd "$ROOT" && realpath "$PATCH")
B=${AB_TREE_B:-/tmp/torch_sm90_sdpa_ab_b}

# ---- the B tree: a copy without build outputs, the patch applied ----------------------------
rm -rf "$B"
mkdir -p "$B"
(cd "$ROOT" && tar --exclude=./build --exclude=./.git --exclude='./torch_sm90_sdpa/_C*.so' \
   --exclude=./torch_sm90_sdpa/_build_config.py --exclude=./torch_sm90_sdpa/prebuilt_sources.sha1 \
   -cf - .) | (cd "$B" && tar -xf -)
if ! (cd "$B" && patch -p1 --forward < "$PATCH" > "$OUT/patch.log" 2>&1); then
  cat "$OUT/patch.log"
  echo "[ab_session] the patch does not apply to this tree" >&2
  exit 1
fi

# ---- both builds at once ------------------------------------------------------------------
export TORCH_SM90_SDPA_HEAD_DIMS=${TORCH_SM90_SDPA_HEAD_DIMS:-128}
export TORCH_SM90_SDPA_DTYPES=${TORCH_SM90_SDPA_DTYPES:-bf16}
half=$(( $(nproc) / 2 ))
[ "$half" -ge 1 ] || half=1
read -r -a TEST_ARGS <<< "${TESTS:-tests/test_build.py -k build_info}"
t0=$(date +%s)
(cd "$ROOT" && MAX_JOBS=$half tools/gpu_check.sh "$OUT/a" "${TEST_ARGS[@]}" > "$OUT/a_check.log" 2>&1)
echo $? > "$OUT/a_check.rc" &
(cd "$B" && MAX_JOBS=$half tools/gpu_check.sh "$OUT/b" "${TEST_ARGS[@]}" > "$OUT/b_check.log" 2>&1)
echo $? > "$OUT/b_check.rc" &
wait
build_s=$(( $(date +%s) - t0 ))

# ---- the command, alternating -------------------------------------------------------------
: > "$OUT/a.txt"
: > "$OUT/b.txt"
for ((r = 1; r <= ROUNDS; r++)); do
  for side in a b; do
    tree=$ROOT
    [ "$side" = b ] && tree=$B
    echo "==== round $r" >> "$OUT/$side.txt"
    (cd "$tree" && PYTHONPATH="$tree/build/gpu_deps:$tree" "$@" >> "$OUT/$side.txt" 2>&1)
    echo "exit $?" >> "$OUT/$side.txt"
  done
done

echo "==== ab_session summary"
echo "builds + tests: ${build_s} s; A exit $(cat "$OUT/a_check.rc" 2>/dev/null), B exit $(cat "$OUT/b_check.rc" 2>/dev/null)" \
     "(variants: ${TORCH_SM90_SDPA_HEAD_DIMS} / ${TORCH_SM90_SDPA_DTYPES})"
for side in a b; do
  echo "---- $side: $(grep -E '[0-9]+ passed' "$OUT/$side/summary.txt" 2>/dev/null | head -n 1)"
  tail -n 20 "$OUT/$side.txt"
done
