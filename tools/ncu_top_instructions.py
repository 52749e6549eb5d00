"""The SASS instructions that matter most in an Nsight Compute source page (CSV).

Reads `ncu --import REP --page source --csv --print-source sass` output and prints the top
instructions by each of: excess shared-memory wavefronts (bank conflicts), all shared
wavefronts, and warp stall samples, with their address and SASS text, so that a bank conflict
or a stall can be pinned to an instruction without the Nsight GUI.

    python tools/ncu_top_instructions.py SOURCE.csv [--top 25]
"""
import argparse
import csv
import sys


def number(text):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    with open(a.csv, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"') or "," in ln]
    rows = list(csv.reader(lines))
    head_i = next(i for i, r in enumerate(rows) if any("Source" == c.strip() for c in r))
    head = [c.strip() for c in rows[head_i]]
    body = [r for r in rows[head_i + 1:] if len(r) == len(head)]
    print(f"{len(body)} instructions; columns: {head}")
    src = head.index("Source")
    addr = head.index("Address") if "Address" in head else None
    wanted = [c for c in head if "Shared" in c and ("Excessive" in c or "Wavefronts" in c)]
    wanted += [c for c in head if c.startswith("Warp Stall Sampling")]
    for col in wanted:
        i = head.index(col)
        total = sum(number(r[i]) for r in body)
        if total <= 0:
            continue
        print(f"\n== top by {col} (total {total:,.0f})")
        for r in sorted(body, key=lambda r: -number(r[i]))[:a.top]:
            share = number(r[i]) / total
            where = r[addr] if addr is not None else ""
            print(f"  {number(r[i]):14,.0f} {share:6.1%}  {where:>8s}  {r[src].strip()[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
