"""Plot a bench_bwd.py --json file: backward TFLOP/s against sequence length, as a PNG.

One panel per head dim (full and causal lines per backend), from the JSON that
benchmarks/bench_bwd.py --json writes:

    python tools/plot_bwd.py benchmarks/results/bench_bwd_h200_c4cc88a_sync.json -o docs/bench_bwd.png

Only the grid's rows are plotted (bf16, as many kv heads as q heads); the title names the run
(device, commit, date from the JSON's meta). Needs matplotlib (a tool-only dependency: the
package does not use it).
"""
import argparse
import json
import sys


# The columns drawn: the kernels (ours, the stock backends, FA4, ours with --ab-env's switch);
# the public paths' columns (--dropin) measure host time as much as kernels and are left out.
PLOTTED = ("ours", "ours_env", "fa4", "cudnn", "flash", "efficient")


def series(rows, backends=None):
    """{head_dim: {(backend, case): [(seqlen, TFLOP/s), ...] sorted by seqlen}} of the grid's
    rows: bf16 (rows without a dtype are bf16), MHA, unmasked, every backend or those named."""
    out = {}
    for r in rows:
        if r.get("dtype", "bf16") != "bf16" or r["heads"] != r["kv_heads"] or r.get("masked"):
            continue
        case = "causal" if r["causal"] else "full"
        for backend, tf in r["tflops"].items():
            if backends is not None and backend not in backends:
                continue
            out.setdefault(r["head_dim"], {}).setdefault((backend, case), []).append((r["seqlen"], tf))
    for per_dim in out.values():
        for points in per_dim.values():
            points.sort()
    return out


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"ours": "tab:red", "cudnn": "tab:blue", "flash": "tab:green", "efficient": "tab:gray",
              "fa4": "tab:orange", "ours_env": "tab:purple", "dropin": "tab:pink",
              "cudnn_sdpa": "tab:cyan"}
    data = series(result["rows"], PLOTTED)
    if not data:
        raise SystemExit("no grid rows (bf16, MHA) in the results")
    dims = sorted(data)
    fig, axes = plt.subplots(1, len(dims), figsize=(5 * len(dims), 4), squeeze=False)
    for ax, d in zip(axes[0], dims):
        for (backend, case), points in sorted(data[d].items()):
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", linestyle="-" if case == "full" else "--",
                    color=colors.get(backend), label=f"{backend} {case}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("backward TFLOP/s")
        ax.set_title(f"head dim {d}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    m = result.get("meta", {})
    fig.suptitle(f"{m.get('device', '?')}, commit {m.get('commit', '?')}, {m.get('date', '?')}: "
                 f"{m.get('command', '')}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", help="a bench_bwd --json file")
    ap.add_argument("-o", "--output", required=True, help="the PNG to write")
    a = ap.parse_args()
    with open(a.result) as f:
        result = json.load(f)
    if result.get("meta", {}).get("bench") != "bench_bwd":
        raise SystemExit(f"{a.result} is not bench_bwd output")
    try:
        plot(result, a.output)
    except ImportError:
        raise SystemExit("tools/plot_bwd.py needs matplotlib (pip install matplotlib)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
