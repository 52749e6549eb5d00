"""Which CUDA kernels a compiled training step runs, stock against routed (issue 8, item 2).

The demo's model (torch_sm90_sdpa.testing.TinyTransformer; default: 8 blocks, dim 2048, 16 heads
of 128, 8 kv heads, causal, b2 s8192, bf16 autocast) compiled twice: stock, and with
``enable(only_faster=...)``. Profiled forward + backward steps of each (after three warm-up
steps, benchmarks/profile_bwd.py's kernel_ms), then per model the kernels by summed GPU time,
and the kernels whose time differs most between the two. Attention's share shows where the compiled path loses against bench_bwd's op-level figure.
Then (--wall-rounds, default 3) both models' steps timed with CUDA events, interleaved, as the
demo times them: the step ratio beside the kernel sums; --idle: then where each model's GPU
idles in a step (gaps between GPU activities) and the host's CUDA runtime calls.
--isolated: then the same shapes' attention backward alone, back to back (ours through the op,
cuDNN's through F.scaled_dot_product_attention's autograd), with the same kernel table: whether
a kernel is slower inside the model than on its own. --clocks: the median SM clock and power
(nvidia-smi, sampled every 20 ms) during each of those phases.

    python tools/compiled_step_kernels.py [--layers 8] [--seq-len 8192] [--all-calls]
        [--isolated] [--clocks] [--wall-rounds 3] [--wall-iters 10] [--idle]
"""
import argparse
import collections
import contextlib
import copy
import os
import statistics
import subprocess
import sys

import torch

from torch_sm90_sdpa import routing
from torch_sm90_sdpa.demo import _time_cuda as time_cuda  # the demo's step timing
from torch_sm90_sdpa.testing import TinyTransformer, compile_own_graphs, lm_loss

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from profile_bwd import kernel_ms  # noqa: E402


def step(model, tokens):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = lm_loss(model(tokens), tokens)
    loss.backward()


@contextlib.contextmanager
def clocks(name, enabled):
    """With `enabled`: print the median SM clock (MHz) and power (W) while the block ran."""
    if not enabled:
        yield
        return
    cmd = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
           "-lms", "20"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        yield
    finally:
        proc.terminate()
        rows = [line.split(",") for line in proc.communicate()[0].splitlines() if "," in line]
        try:
            mhz = statistics.median(float(r[0]) for r in rows)
            watts = statistics.median(float(r[1]) for r in rows)
            print(f"clocks during {name}: SM {mhz:.0f} MHz, {watts:.0f} W (median of {len(rows)} samples)")
        except (ValueError, statistics.StatisticsError):
            print(f"clocks during {name}: no samples")


def idle_report(name, fn, reps, top):
    """Where the GPU idles in `fn`'s steps: the gaps between consecutive GPU activities (kernels,
    copies, memsets: the profiler's CUDA events), their sum per step, the largest with the
    activities around them, and the CUDA runtime calls of the host by count and host time (a
    synchronizing call or a cudaFree shows there)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(reps):
            fn()
            torch.cuda.synchronize()  # gaps across the step boundary are not the step's
    gpu = sorted((e.time_range.start, e.time_range.end, e.name) for e in p.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    gaps = []
    for (s0, e0, n0), (s1, _, n1) in zip(gpu, gpu[1:]):
        if s1 - e0 < 200_000:  # us; the longer ones are the synchronize between steps
            gaps.append((max(0, s1 - e0), n0, n1))
    total = sum(g for g, _, _ in gaps) / 1e3 / reps
    busy = sum(e - s for s, e, _ in gpu) / 1e3 / reps
    ours = sum("sm90_sdpa" in n for _, _, n in gpu) // reps
    print(f"\n{name}: GPU busy {busy:.3f} ms, idle between activities {total:.3f} ms per step "
          f"({len(gaps) // reps} gaps; {ours} of our kernels per step); the largest:")
    for g, n0, n1 in sorted(gaps, reverse=True)[:top]:
        print(f"  {g / 1e3:7.3f} ms  after {n0[:60]}  before {n1[:60]}")
    api = collections.defaultdict(lambda: [0, 0.0])
    for e in p.events():
        if e.device_type != torch.autograd.DeviceType.CUDA and e.name.startswith("cuda"):
            api[e.name][0] += 1
            api[e.name][1] += (e.time_range.end - e.time_range.start) / 1e3
    print(f"  CUDA runtime calls per step (count, host ms):")
    for k, (n, ms) in sorted(api.items(), key=lambda kv: -kv[1][1]):
        print(f"    {n / reps:7.1f} x {ms / reps:7.3f} ms  {k}")


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
    ap.add_argument("--isolated", action="store_true",
                    help="also the attention backward of the same shapes alone, back to back")
    ap.add_argument("--clocks", action="store_true", help="SM clock and power per phase")
    ap.add_argument("--wall-rounds", type=int, default=3,
                    help="event-timed steps of both models, interleaved rounds (0: none)")
    ap.add_argument("--wall-iters", type=int, default=10, help="steps per round")
    ap.add_argument("--idle", action="store_true",
                    help="with --wall-rounds: where each model's GPU idles, and its CUDA runtime calls")
    a = ap.parse_args()
    torch.manual_seed(0)
    base = TinyTransformer(vocab=256, dim=a.dim, heads=a.heads, kv_heads=a.kv_heads,
                           layers=a.layers).cuda()
    tokens = torch.randint(0, 256, (a.batch, a.seq_len), device="cuda")
    # no FX graph cache: the second compile would reuse the first one's graphs, pass or not
    torch._inductor.config.fx_graph_cache = False
    times = {}
    # each with graphs of its own: two torch.compile(model) of one class share Dynamo's graphs
    # (in 2c032cf and 06c53c6, "routed"'s wall and --idle figures after a Dynamo reset were stock's)
    routed = compile_own_graphs(copy.deepcopy(base), "routed")
    with routing.enable(only_faster=not a.all_calls), clocks("the routed model's steps", a.clocks):
        routing.routing_stats(reset=True)
        times["routed"] = kernel_ms(lambda: step(routed, tokens), a.reps, launches=True)
        print("routing_stats:", {k: v for k, v in routing.routing_stats().items()
                                 if k in ("routed_nodes", "not_routed", "routed_calls")})
    stock = compile_own_graphs(copy.deepcopy(base), "stock")
    with clocks("the stock model's steps", a.clocks):
        times["stock"] = kernel_ms(lambda: step(stock, tokens), a.reps, launches=True)
    times = {"stock": times["stock"], "routed": times["routed"]}
    ran_ours = {k: any("sm90_sdpa" in n for n in t) for k, t in times.items()}
    if ran_ours != {"stock": False, "routed": True}:  # what hid the demo's mistake for sessions
        sys.exit(f"the models did not run what they should: our kernels ran {ran_ours}")
    if a.wall_rounds:  # the demo's measure: event-timed steps, the two models interleaved
        walls = {"stock": [], "routed": []}
        models = {"stock": stock, "routed": routed}
        # (a recompile, should one happen, sees the routing each model was compiled with)
        def routing_of(name):
            return (routing.enable(only_faster=not a.all_calls) if name == "routed"
                    else contextlib.nullcontext())

        for _ in range(a.wall_rounds):
            for name, m in models.items():
                with routing_of(name):
                    step(m, tokens)  # (a first step outside the timing)
                    torch.cuda.synchronize()
                    walls[name].append(time_cuda(lambda m=m: step(m, tokens), a.wall_iters))
        if a.idle:
            for name, m in models.items():
                with routing_of(name):
                    idle_report(name, lambda m=m: step(m, tokens), 2, a.top)
        med = {k: statistics.median(v) for k, v in walls.items()}
        print(f"\nstep wall, CUDA events, median of {a.wall_rounds} interleaved rounds of "
              f"{a.wall_iters}: stock {med['stock']:.3f} ms, routed {med['routed']:.3f} ms, "
              f"ratio {med['stock'] / med['routed']:.3f}x (rounds: stock "
              + " ".join(f"{x:.3f}" for x in walls["stock"]) + "; routed "
              + " ".join(f"{x:.3f}" for x in walls["routed"]) + ")")
    if a.isolated:  # the model's attention shapes: q [B, H, S, D] and k / v [B, Hkv, S, D], BSHD
        d = a.dim // a.heads
        q, dout = (torch.randn(a.batch, a.seq_len, a.heads, d, device="cuda",
                               dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
        k, v = (torch.randn(a.batch, a.seq_len, a.kv_heads, d, device="cuda",
                            dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
        gqa = a.heads != a.kv_heads
        out, lse = torch.ops.torch_sm90_sdpa.sdpa(q, k, v, True, d ** -0.5, gqa)

        def ours():
            for _ in range(a.layers):
                torch.ops.torch_sm90_sdpa.sdpa_backward(dout, q, k, v, out, lse, True, d ** -0.5, False)

        qs, ks, vs = (t.detach().requires_grad_(True) for t in (q, k, v))
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)

        def cudnn():
            for _ in range(a.layers):
                torch.autograd.grad(o, (qs, ks, vs), dout, retain_graph=True)

        with clocks("our attention backward alone", a.clocks):
            times["ours alone"] = kernel_ms(ours, a.reps, launches=True)
        with clocks("cuDNN's attention backward alone", a.clocks):
            times["cudnn alone"] = kernel_ms(cudnn, a.reps, launches=True)
        print(f"\n(the 'alone' tables: {a.layers} backward calls per profiled call, as in a step)")
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
