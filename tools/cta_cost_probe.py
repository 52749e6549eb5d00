"""Per-CTA fixed cost of the main backward kernel (GPU machine), to judge a persistent
scheduler: with the key length (so the grid: one CTA per key block, head and batch) held
fixed, the query length sets the m-blocks each CTA walks, and the main kernel's time is about
    waves * (F + m_blocks * t)
(F: a CTA's cost outside its m-loop -- start, K / V load, pipeline fill, dK / dV epilogue;
t: one m-block). A least-squares line through the sweep gives F and t; F / t says how many
m-blocks a CTA's fixed cost is worth, which is what causal attention (half the m-blocks per
CTA on average) pays twice as often per FLOP as full attention. Full attention, no mask, bf16;
cuDNN's whole backward on the same shapes is printed beside it for scale.
    python tools/cta_cost_probe.py --d 256 [--b 8 --h 8 --sk 2048 --sq 512,1024,2048,4096]
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "csrc")]
from profile_bwd import kernel_ms  # noqa: E402
from generate_instantiations import TILES, TILES_FULL  # noqa: E402  (the tiles that are built)

import torch_sm90_sdpa  # noqa: E402,F401  (registers the ops)


def fit_line(xs, ys):
    """(intercept, slope) of the least-squares line through (xs, ys)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--b", type=int, default=8)
    ap.add_argument("--h", type=int, default=8)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--sk", type=int, default=2048)
    ap.add_argument("--sq", default="512,1024,2048,4096", help="query lengths, comma-separated")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    tile = TILES_FULL.get(a.d, TILES[a.d])  # the tile of a full-attention, non-deterministic call
    block_m, block_n = tile.block_m, tile.block_n
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    scale = a.d ** -0.5
    k, v = (torch.randn(a.b, a.h, a.sk, a.d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ops = torch.ops.torch_sm90_sdpa
    print(f"{torch.cuda.get_device_name()}, b{a.b} h{a.h} sk{a.sk} d{a.d}, full attention, "
          f"main-kernel ms (profiler, mean of {a.reps}); tile {block_m} x {block_n}, {sms} SMs")
    xs, ys = [], []
    for sq in (int(x) for x in a.sq.split(",")):
        q, do = (torch.randn(a.b, a.h, sq, a.d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        o, lse = ops.sdpa(q, k, v, False, scale, False)
        per_kernel = kernel_ms(lambda: ops.sdpa_backward(do, q, k, v, o, lse, False, scale, False), a.reps)
        main_ms = sum(ms for name, ms in per_kernel.items() if "bwd_main_kernel" in name)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

        def cudnn():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                out = F.scaled_dot_product_attention(*leaves, scale=scale)
            torch.autograd.grad(out, leaves, do)
        cudnn_ms = sum(kernel_ms(cudnn, a.reps).values())
        m_blocks = -(-sq // block_m)
        xs.append(m_blocks)
        ys.append(main_ms)
        print(f"  sq {sq:6d}: m-blocks per CTA {m_blocks:4d}  main kernel {main_ms:8.3f} ms   "
              f"cuDNN forward + backward kernels {cudnn_ms:8.3f} ms")
    intercept, slope = fit_line(xs, ys)
    ctas = -(-a.sk // block_n) * a.h * a.b
    waves = ctas / sms  # one CTA per SM: every variant takes 384 x 168 registers, the whole file
    print(f"fit: main ms = {intercept:.4f} + {slope:.5f} * m_blocks; {ctas} CTAs = {waves:.2f} waves: "
          f"F = {intercept / waves * 1e3:.2f} us, t = {slope / waves * 1e3:.3f} us per CTA, "
          f"F / t = {intercept / slope:.1f} m-blocks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
