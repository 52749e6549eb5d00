"""Deterministic attention backward: ours (deterministic mode) next to ours (default mode) and the
stock deterministic backward (what SDPA runs under torch.use_deterministic_algorithms(True) on
Hopper: FlashAttention-2's deterministic kernel; the memory-efficient one where flash refuses).

Same grid and method as bench_bwd.py: bf16, b = 16384 / s, h = 2048 / d, interleaved, median of
the repeats, backward only (ours through torch.ops.torch_sm90_sdpa.sdpa_backward with
deterministic=True / False). Each row also checks that two deterministic runs of ours are
bitwise identical ("repeat: ok"). --orders also times both orders of the deterministic mode
(DeterministicOrder in csrc/bwd_params.h, forced through TORCH_SM90_SDPA_DETERMINISTIC_ORDER),
interleaved with the rest. --walk also times the deterministic mode with the GQA group walk
forced (TORCH_SM90_SDPA_GQA_WALK=1: a CTA sums its kv head's group in registers, instead of one
fp32 dK / dV tile per q head summed by the postprocess) and adds GQA rows (4 and 8 q heads per
kv head, causal and full, 2k to 16k keys). --det-env VAR=VALUE (repeatable) also times the
deterministic mode with a device-layer switch set (e.g. TORCH_SM90_SDPA_SECTION_HEADS=16),
interleaved with the rest: each one's det/own ratio is printed as "VALUE".

    python benchmarks/bench_deterministic.py [--quick] [--orders] [--walk] [--dims 64,128,256]
                                             [--seqs 2048,8192] [--det-env VAR=VALUE ...]
"""
import math
import sys

import torch

import torch_sm90_sdpa  # noqa: F401  (registers the ops)
from torch_sm90_sdpa import _extension
from bench_bwd import backend_efficient, backend_flash, grid, grid_parser, make, time_interleaved


ORDER_ENV = "TORCH_SM90_SDPA_DETERMINISTIC_ORDER"
WALK_ENV = "TORCH_SM90_SDPA_GQA_WALK"


def ours(q, k, v, dout, causal, scale, deterministic, order=None, env_var=None):
    """order: None (the device layer's choice), "ascending" or "descending" (forced); env_var:
    None, or (name, value) of a device-layer switch set around each call."""
    o, lse = torch.ops.torch_sm90_sdpa.sdpa(q, k, v, causal, scale, q.shape[1] != k.shape[1])
    op = torch.ops.torch_sm90_sdpa.sdpa_backward
    if order is not None:
        env_var = (ORDER_ENV, order)

    def run():
        if env_var is None:
            return op(dout, q, k, v, o, lse, causal, scale, deterministic)
        with _extension.switch_env(*env_var):
            return op(dout, q, k, v, o, lse, causal, scale, deterministic)
    return run


def under_deterministic(fn):
    """fn run with torch's deterministic algorithms on (the stock kernels read the flag)."""
    def run():
        torch.use_deterministic_algorithms(True)
        try:
            return fn()
        finally:
            torch.use_deterministic_algorithms(False)
    return run


def run_row(label, b, hq, hkv, s, d, causal, reps, orders, walk=False, det_envs=()):
    q, k, v, dout = make(b, hq, hkv, s, d, torch.bfloat16)
    scale = 1.0 / math.sqrt(d)
    fns, notes = {}, []
    fns["ours-det"] = ours(q, k, v, dout, causal, scale, True)
    fns["ours"] = ours(q, k, v, dout, causal, scale, False)
    if orders:
        for order in ("ascending", "descending"):
            fns[f"det-{order[:3]}"] = ours(q, k, v, dout, causal, scale, True, order)
    walk = walk and hq != hkv
    if walk:
        fns["det-walk"] = ours(q, k, v, dout, causal, scale, True, env_var=(WALK_ENV, "1"))
    for env_var in det_envs:
        fns[f"det-env {env_var[1]}"] = ours(q, k, v, dout, causal, scale, True, env_var=env_var)
    for name, make_fn in (("flash-det", backend_flash), ("efficient-det", backend_efficient)):
        try:
            fn = under_deterministic(make_fn(q, k, v, dout, causal, scale))
            fn()
            fns[name] = fn
            break  # SDPA's order: flash first, memory-efficient where flash refuses
        except Exception as exc:
            notes.append(f"{name}: {type(exc).__name__}")
    first, second = fns["ours-det"](), fns["ours-det"]()
    same = all(torch.equal(x, y) for x, y in zip(first, second))
    for way in [n for n in fns if n == "det-walk" or n.startswith("det-env")]:
        # the mode's other ways: repeatable too
        third, fourth = fns[way](), fns[way]()
        same = same and all(torch.equal(x, y) for x, y in zip(third, fourth))
    fast = fns["ours"]()
    rel = max(((x.float() - y.float()).norm() / y.float().norm()).item() for x, y in zip(first, fast))
    notes.append(f"repeat: {'ok' if same else 'DIFFERS'}, vs default mode {rel:.1e}")
    ms = time_interleaved(fns, reps)
    flops = 2.5 * 4 * b * hq * s * s * d / (2 if causal else 1)
    tf = {n: flops / (t * 1e-3) / 1e12 for n, t in ms.items()}
    stock = next((tf[n] for n in ("flash-det", "efficient-det") if n in tf), float("nan"))
    own = tf["ours-det"] / tf["ours"]
    vs_stock = tf["ours-det"] / stock
    by_order = (f"  asc {tf['det-asc'] / tf['ours']:4.2f} desc {tf['det-des'] / tf['ours']:4.2f}"
                if orders else "")
    if walk:
        by_order += f"  walk {tf['det-walk'] / tf['ours']:4.2f}"
    for env_var in det_envs:
        by_order += f"  {env_var[1]} {tf[f'det-env {env_var[1]}'] / tf['ours']:4.2f}"
    print(f"{label:38s} {tf['ours-det']:8.0f} {tf['ours']:6.0f} {stock:9.0f}   {own:5.2f} {vs_stock:8.2f}"
          f"{by_order}   {'; '.join(notes)}", flush=True)
    del q, k, v, dout, fns
    torch.cuda.empty_cache()
    return own, vs_stock, same


def main():
    ap = grid_parser(__doc__)
    ap.add_argument("--orders", action="store_true",
                    help="also time both deterministic orders (det/own ratio of each)")
    ap.add_argument("--walk", action="store_true",
                    help="also time GQA rows with the group walk forced (TORCH_SM90_SDPA_GQA_WALK=1), "
                         "and add GQA rows of 4 and 8 q heads per kv head, 2k-16k keys")
    ap.add_argument("--det-env", metavar="VAR=VALUE", action="append", default=[],
                    help="also time the deterministic mode with this device-layer switch set "
                         "(repeatable)")
    a = ap.parse_args()
    det_envs = [tuple(e.split("=", 1)) for e in a.det_env]
    if any(len(e) != 2 for e in det_envs):
        ap.error("--det-env takes VAR=VALUE")
    g = grid(a)
    if g is None:
        return 1
    reps, grid_rows = g
    print(f"{'row':38s} {'ours-det':>8s} {'ours':>6s} {'stock-det':>9s}   {'det/own':>7s} {'det/stock':>8s}")
    rows = [run_row(label, b, h, h, s, d, causal, reps, a.orders, a.walk, det_envs)
            for label, b, h, s, d, causal in grid_rows]
    if not a.no_gqa:
        for label, hq, hkv in (("GQA d=128 causal s=8192 32q/8kv b=2", 32, 8),
                               ("GQA d=128 causal s=8192 8q/1kv b=2", 8, 1),
                               ("MHA d=128 causal s=8192 32q b=2", 32, 32)):
            rows.append(run_row(label, 2, hq, hkv, 8192, 128, True, reps, a.orders, a.walk,
                                det_envs))
    if a.walk:
        for s in (2048, 8192, 16384):
            for hq, hkv in ((16, 4), (32, 4)):
                for causal in (True, False):
                    b = max(1, 16384 // s)
                    label = (f"GQA d=128 {'causal' if causal else 'full'} s={s} {hq}q/{hkv}kv "
                             f"b={b}")
                    rows.append(run_row(label, b, hq, hkv, s, 128, causal, reps, a.orders, True,
                                        det_envs))
    own = [r[0] for r in rows]
    print(f"deterministic / own default mode: min {min(own):.2f}, geometric mean "
          f"{math.exp(sum(map(math.log, own)) / len(own)):.3f} over {len(own)} rows; "
          f"bitwise repeatable on {sum(r[2] for r in rows)} of {len(rows)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
