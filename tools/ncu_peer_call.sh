#!/usr/bin/env bash
# Nsight Compute (--set full) of one backward call of ours and of FlashAttention-4's SM90
# backward on the same inputs (tools/ncu_peer_case.py: every kernel of the call, pre / main /
# post), per case of NCU_PEER_CASES (';'-separated; default d64 b2 h32 and d128 b2 h16, s8192,
# no mask), so the two main kernels can be set side by side: headline metrics, instruction mix
# by opcode, top instructions by stall samples, stall reasons, pipe utilization. The last of
# three device calls on one warm machine, as tools/fa4_side_call.sh (carry build/fa4/part2, .whl
# and build/carry_gz; the first two calls carry build/fa4/part1 and part1b and run `true`):
#   GIT_COMMIT=$(git rev-parse --short HEAD) bash tools/ncu_peer_call.sh "$OUT"
# (In the thirty-first session call 1's build was still on the machine: the call gzipped it into
# build/carry_gz there first.) NCU_PEER_IMPLS (default "ours fa4") picks the sides.
# OUTDIR gets summary.txt (every kernel's headline figures) and per case i and implementation
# ncu_<i>_<impl>_top.txt (instruction mix, top instructions, stalls, pipes); the details pages
# stay in /tmp/ncu_<i>_<impl>_details.csv (a call brings back at most 8 files).
set -uo pipefail
source "$(dirname "$0")/call_header.sh" "$@"
unpack_carry_gz || exit 2
use_prebuilt
install_fa4

IFS=';' read -r -a cases <<< "${NCU_PEER_CASES:---d 64 --b 2 --h 32 --s 8192;--d 128 --b 2 --h 16 --s 8192}"
i=0
for args in "${cases[@]}"; do
  i=$((i + 1))
  for impl in ${NCU_PEER_IMPLS:-ours fa4}; do
    tag=${i}_$impl
    rep=/tmp/ncu_$tag
    # shellcheck disable=SC2086
    PYTHONPATH="$FA4_PATH:$PYTHONPATH" timeout 240 ncu --clock-control none --set full --import-source yes \
      --profile-from-start off -f -o "$rep" python3 tools/ncu_peer_case.py --impl "$impl" $args \
      > "/tmp/ncu_$tag.log" 2>&1
    stamp "ncu $impl [$args]: exit $?, $(grep -m1 -E 'ncu_peer_case:|Error|error' "/tmp/ncu_$tag.log")"
    ncu --import "$rep.ncu-rep" --page details --csv > "/tmp/ncu_${tag}_details.csv" 2>&1
    ncu --import "$rep.ncu-rep" --page source --csv --print-source sass > "/tmp/ncu_${tag}_source.csv" 2>&1
    ncu --import "$rep.ncu-rep" --page raw --csv > "/tmp/ncu_${tag}_raw.csv" 2>&1
    { echo "case: $impl $args"; python3 tools/ncu_top_instructions.py "/tmp/ncu_${tag}_source.csv" --top 30 --opcodes
      python3 tools/ncu_summary.py raw "/tmp/ncu_${tag}_raw.csv"
    } > "$OUTD/ncu_${tag}_top.txt" 2>&1
    python3 tools/ncu_summary.py details "/tmp/ncu_${tag}_details.csv" "$tag" | tee -a "$OUTD/summary.txt"
  done
done
