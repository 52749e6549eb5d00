"""Which CUDA kernels a compiled training step runs, stock against routed (issue 8, item 2).

The demo's model (torch_sm90_sdpa.testing.TinyTransformer; default: 8 blocks, dim 2048, 16 heads
of 128, 8 kv heads, causal, b2 s8192, bf16 autocast) compiled twice: stock, and with
``enable(only_faster=...)``. One profiled forward + backward of each (after a warm-up step), then
per model the kernels by summed GPU time, and the kernels whose time differs most between the
two. Attention's share shows where the compiled path loses against bench_bwd's op-level figure.

    python tools/compiled_step_kernels.py [--layers 8] [--seq-len 8192] [--all-calls]
"""
import argparse
import collections
import copy

import torch
from torch.profiler import ProfilerActivity, profile

from torch_sm90_sdpa import routing
from torch_sm90_sdpa.testing import TinyTransformer, lm_loss


def step(model, tokens):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = lm_loss(model(tokens), tokens)
    loss.backward()


def kernel_times(model, tokens, reps):
    """{kernel name: (summed ms per step, launches per step)} over `reps` profiled steps."""
    step(model, tokens)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step(model, tokens)
        torch.cuda.synchronize()
    out = collections.defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            out[ev.name][0] += ev.device_time / 1000.0 / reps
            out[ev.name][1] += 1
    return {k: (ms, n // reps) for k, (ms, n) in out.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--all-calls", action="store_true",
                    help="route every eligible call (only_faster=False), not only the faster ones")
    a = ap.parse_args()
    torch.manual_seed(0)
    base = TinyTransformer(vocab=256, dim=a.dim, heads=a.heads, kv_heads=a.kv_heads,
                           layers=a.layers).cuda()
    tokens = torch.randint(0, 256, (a.batch, a.seq_len), device="cuda")
    # no FX graph cache: the second compile would reuse the first one's graphs, pass or not
    torch._inductor.config.fx_graph_cache = False
    times = {}
    routed = torch.compile(copy.deepcopy(base))
    with routing.enable(only_faster=not a.all_calls):
        routing.routing_stats(reset=True)
        times["routed"] = kernel_times(routed, tokens, a.reps)
        print("routing_stats:", {k: v for k, v in routing.routing_stats().items()
                                 if k in ("routed_nodes", "not_routed", "routed_calls")})
    torch._dynamo.reset()
    stock = torch.compile(copy.deepcopy(base))
    times["stock"] = kernel_times(stock, tokens, a.reps)
    times = {"stock": times["stock"], "routed": times["routed"]}
    for name, t in times.items():
        total = sum(ms for ms, _ in t.values())
        print(f"\n{name}: {total:.3f} ms of kernels per step; top {a.top}:")
        for k, (ms, n) in sorted(t.items(), key=lambda kv: -kv[1][0])[:a.top]:
            print(f"  {ms:8.3f} ms  {n:4d} x  {k[:110]}")
    keys = set(times["stock"]) | set(times["routed"])
    diff = {k: times["routed"].get(k, (0.0, 0))[0] - times["stock"].get(k, (0.0, 0))[0]
            for k in keys}
    print(f"\nlargest differences (routed - stock, ms per step):")
    for k, d in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:a.top]:
        print(f"  {d:+8.3f} ms  {k[:110]}")


if __name__ == "__main__":
    main()
