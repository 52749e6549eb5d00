#!/usr/bin/env bash
# One device call on a prebuilt extension (build/carry: a call's prebuilt/, the .so gunzipped):
# Nsight Compute (--set full) of the main kernel's first launch in `profile_bwd.py --once` for
# each case of NCU_CASES (';'-separated profile_bwd arguments; default: d128 b2 h16 s8192 full
# and is_causal, d256 b32 h8 s512 is_causal), then per case the kernel's headline metrics
# (ncu --page details) and its top SASS instructions by stall samples and shared wavefronts
# (tools/ncu_top_instructions.py). Without a -lineinfo build the SASS is not mapped to source.
#   GIT_COMMIT=$(git rev-parse --short HEAD) bash tools/ncu_main_call.sh "$OUT"
#   (carry .whl and build/carry). About 2-4 minutes.
# OUTDIR gets summary.txt, ncu_<i>_details.csv, ncu_<i>_top.txt (top instructions, stall reasons)
# per case (i = 1, 2, ...).
set -uo pipefail
source "$(dirname "$0")/call_header.sh" "$@"
use_prebuilt

IFS=';' read -r -a cases <<< "${NCU_CASES:---d 128 --b 2 --h 16 --s 8192 --mask zeros;--d 128 --b 2 --h 16 --s 8192 --mask causal;--d 256 --b 32 --h 8 --s 512 --mask causal}"
i=0
for args in "${cases[@]}"; do
  i=$((i + 1))
  rep=/tmp/ncu_$i
  # the first bwd_main launch of the call is the mode without a mask (profile_bwd runs it first)
  timeout 240 ncu --clock-control none --set full --import-source yes -k 'regex:bwd_main_kernel' \
    -c 1 -f -o "$rep" python3 benchmarks/profile_bwd.py --once $args > "/tmp/ncu_$i.log" 2>&1
  stamp "ncu [$args]: exit $?, $(grep -m1 -E 'PROF|Error|error' "/tmp/ncu_$i.log")"
  ncu --import "$rep.ncu-rep" --page details --csv > "$OUTD/ncu_${i}_details.csv" 2>&1
  ncu --import "$rep.ncu-rep" --page source --csv --print-source sass > "/tmp/ncu_${i}_source.csv" 2>&1
  ncu --import "$rep.ncu-rep" --page raw --csv > "/tmp/ncu_${i}_raw.csv" 2>&1
  { echo "case: $args"; python3 tools/ncu_top_instructions.py "/tmp/ncu_${i}_source.csv" --top 25
    python3 tools/ncu_summary.py raw "/tmp/ncu_${i}_raw.csv"
  } > "$OUTD/ncu_${i}_top.txt" 2>&1
  python3 tools/ncu_summary.py details "$OUTD/ncu_${i}_details.csv" "$i" | tee -a "$OUTD/summary.txt"
done
cat "$OUTD/summary.txt"
