"""The SASS instructions that matter most in an Nsight Compute source page (CSV).

Reads `ncu --import REP --page source --csv --print-source sass` output and prints the top
instructions by each of: excess shared-memory wavefronts (bank conflicts), all shared
wavefronts, and warp stall samples, with their address and SASS text, so that a bank conflict
or a stall can be pinned to an instruction without the Nsight GUI. With --opcodes, first the
executed warp instructions summed by opcode (the instruction mix, to set two kernels side by
side). A page of several kernels is read for the one that executed the most instructions.

    python tools/ncu_top_instructions.py SOURCE.csv [--top 25] [--opcodes]
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
    ap.add_argument("--opcodes", action="store_true", help="the instruction mix by opcode first")
    a = ap.parse_args()
    with open(a.csv, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"') or "," in ln]
    rows = list(csv.reader(lines))
    heads = [i for i, r in enumerate(rows) if any("Source" == c.strip() for c in r)]
    if not heads:
        print("no source page in", a.csv)
        return 1
    blocks = []  # one (header, body) per kernel on the page
    for n, head_i in enumerate(heads):
        head = [c.strip() for c in rows[head_i]]
        end = heads[n + 1] if n + 1 < len(heads) else len(rows)
        blocks.append((head, [r for r in rows[head_i + 1:end] if len(r) == len(head)]))

    def executed(block):
        head, body = block
        col = head.index("Instructions Executed") if "Instructions Executed" in head else None
        return sum(number(r[col]) for r in body) if col is not None else 0.0

    head, body = max(blocks, key=executed)
    print(f"{len(body)} instructions ({len(blocks)} kernel(s) on the page, the one that executed the most);"
          f" columns: {head}")
    src = head.index("Source")
    if a.opcodes and "Instructions Executed" in head:
        col = head.index("Instructions Executed")
        by_op, total = {}, 0.0
        for r in body:
            words = r[src].strip().split()
            words = words[1:] if words and words[0].startswith("@") else words  # a predicate
            op = words[0].rstrip(";") if words else "?"
            by_op[op] = by_op.get(op, 0.0) + number(r[col])
            total += number(r[col])
        print(f"\n== warp instructions executed by opcode (total {total:,.0f})")
        for op, n in sorted(by_op.items(), key=lambda kv: -kv[1])[:40]:
            print(f"  {n:16,.0f} {n / max(total, 1.0):6.1%}  {op}")
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
