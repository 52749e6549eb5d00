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
    echo "warp stall samples by reason (ncu raw page, smsp__pcsamp_warps_issue_stalled_*):"
    python3 - "/tmp/ncu_${i}_raw.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5]
head, vals = rows[0], rows[-1]  # one kernel: the header row, (units row,) its values
got = []
for name, val in zip(head, vals):
    if name.startswith("smsp__pcsamp_warps_issue_stalled_") and not name.endswith("_not_issued"):
        try:
            got.append((float(val.replace(",", "")), name[len("smsp__pcsamp_warps_issue_stalled_"):]))
        except ValueError:
            pass
total = sum(v for v, _ in got) or 1.0
for v, name in sorted(got, reverse=True)[:15]:
    print(f"  {name:32s} {v:14.0f}  {100 * v / total:5.1f}%")
PY
  } > "$OUTD/ncu_${i}_top.txt" 2>&1
  # the headline metrics: name, value, unit (a details row starts with the kernel's long name)
  python3 - "$OUTD/ncu_${i}_details.csv" "$i" <<'PY' | tee -a "$OUTD/summary.txt"
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head = rows[0]
name, unit, value = (head.index(c) for c in ("Metric Name", "Metric Unit", "Metric Value"))
want = ("Duration", "Compute (SM) Throughput", "L1/TEX Cache Throughput", "L2 Cache Throughput",
        "DRAM Throughput", "Issue Slots Busy", "Registers Per Thread", "Achieved Occupancy")
for r in rows[1:]:
    if len(r) > value and r[name] in want:
        print(f"  [{sys.argv[2]}] {r[name]:26s} {r[value]:>10s} {r[unit]}")
PY
done
cat "$OUTD/summary.txt"
