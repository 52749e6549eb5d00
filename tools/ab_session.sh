#!/usr/bin/env bash
# A / B on the GPU machine: this tree (A) against copies of it with a patch applied (B, C, ...),
# all built at the same time with only the variants a comparison needs, then one command run
# in each tree in turn, ROUNDS times (A, B, A, B, ...: separate processes, since every build is
# the same module), so that clock drift between the rounds falls on every side.
#
#   tools/ab_session.sh OUTDIR PATCH[,PATCH...] ROUNDS -- COMMAND [ARGS...]
#
# PATCH: a `git diff` of B against this tree, made on the development machine and carried as
# a file that git does not ignore (e.g. `git diff main my-branch > ab/my-branch.patch`); a
# comma-separated list makes one tree per patch (sides b, c, ...).
# COMMAND runs in the tree's root with that tree's build first on PYTHONPATH, e.g.
#   tools/ab_session.sh /tmp/ab ab/x.patch 3 -- python3 benchmarks/bench_masks.py --kinds causal --seqs 2048 --reps 30
# Variants: TORCH_SM90_SDPA_HEAD_DIMS (default 128) and TORCH_SM90_SDPA_DTYPES (default bf16);
# the builds share the cores. TESTS (optional): pytest arguments run in every tree after
# the builds (e.g. "-n 4 tests/test_cuda_masks.py"), split on spaces; TESTS_K (optional): a -k
# expression added as one argument; by default only the build smoke test.
# Writes OUTDIR/a, OUTDIR/b, ... (gpu_check logs), a.txt, b.txt, ... (the command's output per
# round, headed by the round) and prints a summary. Carry .whl.
set -uo pipefail
if [ $# -lt 5 ] || [ "$4" != "--" ]; then
  echo "usage: $0 OUTDIR PATCH[,PATCH...] ROUNDS -- COMMAND [ARGS...]" >&2
  exit 2
fi
OUT=$1
IFS=, read -r -a PATCHES <<< "$2"
ROUNDS=$3
shift 4
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SIDES=(a)
declare -A TREE=([a]=$ROOT)
letters=(b c d e f g)
[ ${#PATCHES[@]} -le ${#letters[@]} ] || { echo "at most ${#letters[@]} patches" >&2; exit 2; }

# ---- the patched trees: copies without build outputs, one patch each ----------------------
for i in "${!PATCHES[@]}"; do
  side=${letters[$i]}
  patch_file=$(cd "$ROOT" && realpath "${PATCHES[$i]}")
  tree=${AB_TREE_PREFIX:-/tmp/torch_sm90_sdpa_ab_}$side
  rm -rf "$tree"
  mkdir -p "$tree"
  (cd "$ROOT" && tar --exclude=./build --exclude=./.git --exclude='./torch_sm90_sdpa/_C*.so' \
     --exclude=./torch_sm90_sdpa/_build_config.py --exclude=./torch_sm90_sdpa/prebuilt_sources.sha1 \
     -cf - .) | (cd "$tree" && tar -xf -)
  if ! (cd "$tree" && patch -p1 --forward < "$patch_file" > "$OUT/patch_$side.log" 2>&1); then
    cat "$OUT/patch_$side.log"
    echo "[ab_session] ${PATCHES[$i]} does not apply to this tree" >&2
    exit 1
  fi
  echo "$side: ${PATCHES[$i]}" >> "$OUT/sides.txt"
  SIDES+=("$side")
  TREE[$side]=$tree
done

# ---- every build at once ------------------------------------------------------------------
export TORCH_SM90_SDPA_HEAD_DIMS=${TORCH_SM90_SDPA_HEAD_DIMS:-128}
export TORCH_SM90_SDPA_DTYPES=${TORCH_SM90_SDPA_DTYPES:-bf16}
share=$(( $(nproc) / ${#SIDES[@]} ))
[ "$share" -ge 1 ] || share=1
read -r -a TEST_ARGS <<< "${TESTS:-tests/test_build.py -k build_info}"
# TESTS is split on spaces; TESTS_K is one pytest -k expression (e.g. "192 or 256")
[ -n "${TESTS_K:-}" ] && TEST_ARGS+=(-k "$TESTS_K")
t0=$(date +%s)
for side in "${SIDES[@]}"; do
  { (cd "${TREE[$side]}" && MAX_JOBS=$share tools/gpu_check.sh "$OUT/$side" "${TEST_ARGS[@]}" \
       > "$OUT/${side}_check.log" 2>&1)
    echo $? > "$OUT/${side}_check.rc"; } &
done
wait
build_s=$(( $(date +%s) - t0 ))

# ---- the command, alternating -------------------------------------------------------------
for side in "${SIDES[@]}"; do : > "$OUT/$side.txt"; done
for ((r = 1; r <= ROUNDS; r++)); do
  for side in "${SIDES[@]}"; do
    tree=${TREE[$side]}
    echo "==== round $r" >> "$OUT/$side.txt"
    (cd "$tree" && PYTHONPATH="$tree/build/gpu_deps:$tree" "$@" >> "$OUT/$side.txt" 2>&1)
    echo "exit $?" >> "$OUT/$side.txt"
  done
done

echo "==== ab_session summary"
echo "builds + tests: ${build_s} s (variants: ${TORCH_SM90_SDPA_HEAD_DIMS} / ${TORCH_SM90_SDPA_DTYPES})"
cat "$OUT/sides.txt" 2>/dev/null
for side in "${SIDES[@]}"; do
  echo "---- $side: check exit $(cat "$OUT/${side}_check.rc" 2>/dev/null);" \
       "$(grep -E '[0-9]+ passed' "$OUT/$side/summary.txt" 2>/dev/null | head -n 1)"
  tail -n 20 "$OUT/$side.txt"
done
