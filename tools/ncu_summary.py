"""Headline figures from Nsight Compute CSV pages (tools/gpu.sh ncu prints them):
    python tools/ncu_summary.py details DETAILS.csv TAG   the headline metrics of each kernel
    python tools/ncu_summary.py raw RAW.csv               the longest kernel's warp stall samples
                                                          by reason and its pipes' utilization
(DETAILS.csv: `ncu --import R --page details --csv`; RAW.csv: `--page raw --csv`.)
"""
import csv
import sys

HEADLINE = ("Duration", "Compute (SM) Throughput", "L1/TEX Cache Throughput", "L2 Cache Throughput",
            "DRAM Throughput", "Issue Slots Busy", "Executed Instructions", "Registers Per Thread",
            "Grid Size", "Block Size", "Dynamic Shared Memory Per Block", "Achieved Occupancy",
            "Local Memory Spilling Requests")
STALL = "smsp__pcsamp_warps_issue_stalled_"


def number(text):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return None


def details(path, tag):
    rows = list(csv.reader(open(path)))
    head = rows[0]
    kernel, name, unit, value = (head.index(c) for c in ("Kernel Name", "Metric Name", "Metric Unit",
                                                        "Metric Value"))
    seen = []
    for r in rows[1:]:
        if len(r) <= value or r[name] not in HEADLINE:
            continue
        if r[kernel] not in seen:
            seen.append(r[kernel])
            print(f"  [{tag}] kernel {len(seen)}: {r[kernel][:110]}")
        print(f"  [{tag}.{len(seen)}] {r[name]:32s} {r[value]:>14s} {r[unit]}")


def raw(path):
    rows = [r for r in csv.reader(open(path)) if len(r) > 5]
    head = rows[0]
    kernels = [r for r in rows[1:] if r and number(r[0]) is not None]  # skip the units row
    if not kernels:
        print("no kernel rows in", path)
        return
    dur = head.index("gpu__time_duration.sum") if "gpu__time_duration.sum" in head else None
    vals = max(kernels, key=lambda r: number(r[dur]) or 0.0) if dur is not None else kernels[-1]
    got = []
    for col, val in zip(head, vals):
        v = number(val)
        if col.startswith(STALL) and not col.endswith("_not_issued") and v is not None:
            got.append((v, col[len(STALL):]))
    total = sum(v for v, _ in got) or 1.0
    print("warp stall samples by reason (the longest kernel; smsp__pcsamp_warps_issue_stalled_*):")
    for v, col in sorted(got, reverse=True)[:15]:
        print(f"  {col:32s} {v:14.0f}  {100 * v / total:5.1f}%")
    print("pipe utilization (sm__*pipe*pct_of_peak_sustained_active):")
    for col, val in zip(head, vals):
        if "pipe" in col and col.endswith("pct_of_peak_sustained_active") and col.startswith("sm__"):
            v = number(val)
            if v is not None and v >= 0.5:
                print(f"  {col:72s} {v:6.1f}%")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "details":
        details(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 3 and sys.argv[1] == "raw":
        raw(sys.argv[2])
    else:
        sys.exit(__doc__)
