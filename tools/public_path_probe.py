"""Where the drop-in's backward loses time against the op called directly (issue 8, item 2).

For each shape and mode (default, deterministic): the backward through the op
(torch.ops.torch_sm90_sdpa.sdpa_backward) and through the drop-in (torch.autograd.grad of
torch_sm90_sdpa.scaled_dot_product_attention), interleaved: CUDA-event time per call, and from
one profiled call of each the CUDA kernels it ran with their summed duration. Equal kernel time
with unequal event time means host gaps; extra or slower kernels show in the lists.

    python tools/public_path_probe.py [--host | --batched | --latency]

--host: instead, the host timeline of one call of each path (CPU events of 5 us or more, with
their start relative to the call's start, and the CUDA kernels' start on the same clock).
--batched: instead, per shape and path, the mean time of 20 calls issued back to back between
one pair of events (the host runs ahead as in training), next to the synchronized per-call median.
--latency: instead, per shape (LATENCY_SHAPES), four paths side by side: our op, our drop-in,
stock cuDNN's aten backward op and stock cuDNN through its public path (autograd.grad of
F.scaled_dot_product_attention under sdpa_kernel(CUDNN_ATTENTION)); per path the synchronized
event time, its kernels' summed time and the difference (host latency and gaps). With --host,
the host timelines include the stock public path too.
--nodes: instead, where a public path's extra time comes from (LATENCY_SHAPES, synchronized
event time minus the op's): our drop-in (ops.EagerSdpa since c886836; before it the custom op's generated autograd node), a plain
torch.autograd.Function calling the same forward and backward ops, cuDNN's public path (its C++
autograd node), and a plain autograd.Function whose backward calls cuDNN's aten backward (a
Python node around stock's kernels).
"""
import math
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import torch_sm90_sdpa  # noqa: E402
from bench_bwd import backend_cudnn, backend_cudnn_sdpa, make, time_interleaved  # noqa: E402

SHAPES = [(8, 32, 2048, 64, True), (2, 16, 8192, 128, False),
          (2, 16, 8192, 128, True)]  # (b, h, s, d, causal)
LATENCY_SHAPES = [(32, 16, 512, 128, True), (8, 8, 2048, 256, True)] + SHAPES[:2]


def four_paths(b, h, s, d, causal):
    """{path: backward fn} on one set of inputs: our op, our drop-in, cuDNN's aten op, cuDNN's
    public path (each forward run once, outside)."""
    q, k, v, dout = make(b, h, h, s, d, torch.bfloat16)
    scale = 1 / math.sqrt(d)
    o, lse = torch.ops.torch_sm90_sdpa.sdpa(q, k, v, causal, scale, False)
    qs, ks, vs = (t.detach().requires_grad_(True) for t in (q, k, v))
    od = torch_sm90_sdpa.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale)
    return {"op": lambda: torch.ops.torch_sm90_sdpa.sdpa_backward(
                dout, q, k, v, o, lse, causal, scale, False),
            "drop-in": lambda: torch.autograd.grad(od, (qs, ks, vs), dout, retain_graph=True),
            "cudnn op": backend_cudnn(q, k, v, dout, causal, scale),
            "cudnn public": backend_cudnn_sdpa(q, k, v, dout, causal, scale)}


def kernels(fn):
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    ev = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    return sorted(((e.key[:90], e.count, e.device_time_total / 1e3) for e in ev), key=lambda x: -x[2])


def host_timeline(name, fn):
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    t0 = events[0].time_range.start
    print(f"  {name}: host and device events (start us from the first event, duration us)")
    for e in events:
        dur = e.time_range.end - e.time_range.start
        if dur >= 5 or e.device_type.name == "CUDA":
            where = "GPU" if e.device_type.name == "CUDA" else f"CPU thread {e.thread}"
            print(f"    {e.time_range.start - t0:9.1f} {dur:9.1f}  {where:16s} {e.name[:80]}")


def batched(fns, calls=20):
    """Mean ms per call of `calls` back-to-back calls of each fn, interleaved over 5 rounds."""
    out = {n: [] for n in fns}
    for _ in range(5):
        for n, fn in fns.items():
            torch.cuda.synchronize()
            st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            st.record()
            for _ in range(calls):
                fn()
            en.record()
            torch.cuda.synchronize()
            out[n].append(st.elapsed_time(en) / calls)
    return {n: sorted(v)[len(v) // 2] for n, v in out.items()}


class _OursFunction(torch.autograd.Function):
    """Our forward and backward ops in a plain autograd.Function (no custom-op wrapper)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        o, lse = torch.ops.torch_sm90_sdpa.sdpa(q, k, v, causal, scale, False)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, dout):
        q, k, v, o, lse = ctx.saved_tensors
        return (*torch.ops.torch_sm90_sdpa.sdpa_backward(dout, q, k, v, o, lse, ctx.causal,
                                                         ctx.scale, False), None, None)


class _CudnnFunction(torch.autograd.Function):
    """cuDNN's aten forward and backward in a plain autograd.Function (a Python node)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        aten = torch.ops.aten
        res = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                       scale=scale)
        ctx.save_for_backward(q, k, v, *res[:2])
        ctx.rest, ctx.causal, ctx.scale = res[2:8], causal, scale
        return res[0]

    @staticmethod
    def backward(ctx, dout):
        q, k, v, o, lse = ctx.saved_tensors
        cq, ck, mq, mk, seed, off = ctx.rest
        grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, o, lse, seed, off, None, cq, ck, mq, mk, 0.0, ctx.causal,
            scale=ctx.scale)
        return (*grads, None, None)


def node_paths(b, h, s, d, causal):
    """{path: backward fn}: the op and four autograd paths (see --nodes)."""
    fns = four_paths(b, h, s, d, causal)
    q, k, v, dout = make(b, h, h, s, d, torch.bfloat16)
    scale = 1 / math.sqrt(d)
    qs, ks, vs = (t.detach().requires_grad_(True) for t in (q, k, v))
    o_ours = _OursFunction.apply(qs, ks, vs, causal, scale)
    o_cudnn = _CudnnFunction.apply(qs, ks, vs, causal, scale)
    return {"op": fns["op"], "drop-in": fns["drop-in"],
            "ours in autograd.Function": lambda: torch.autograd.grad(
                o_ours, (qs, ks, vs), dout, retain_graph=True),
            "cudnn op": fns["cudnn op"], "cudnn public": fns["cudnn public"],
            "cudnn in autograd.Function": lambda: torch.autograd.grad(
                o_cudnn, (qs, ks, vs), dout, retain_graph=True)}


def main():
    if "--nodes" in sys.argv:
        for shape in LATENCY_SHAPES + [(1, 16, 16384, 128, True)]:
            fns = node_paths(*shape)
            ms = time_interleaved(fns, 15)
            print("b={} h={} s={} d={} causal={}: ms per synchronized call (median of 15, "
                  "order rotated), and over the op's own (ours: our op; cudnn: cuDNN's op)"
                  .format(*shape), flush=True)
            for name, t in ms.items():
                base = ms["cudnn op"] if "cudnn" in name else ms["op"]
                print(f"  {name:28s} {t:8.3f}  +{t - base:6.3f}", flush=True)
            del fns
            torch.cuda.empty_cache()
        return
    if "--batched" in sys.argv:
        for b, h, s, d, causal in SHAPES:
            q, k, v, dout = make(b, h, h, s, d, torch.bfloat16)
            scale = 1 / math.sqrt(d)
            o, lse = torch.ops.torch_sm90_sdpa.sdpa(q, k, v, causal, scale, False)
            qs, ks, vs = (t.detach().requires_grad_(True) for t in (q, k, v))
            od = torch_sm90_sdpa.scaled_dot_product_attention(qs, ks, vs, is_causal=causal,
                                                              scale=scale)
            for det in (False, True):
                torch.use_deterministic_algorithms(det)
                fns = {"op": lambda: torch.ops.torch_sm90_sdpa.sdpa_backward(
                           dout, q, k, v, o, lse, causal, scale, det),
                       "drop-in": lambda: torch.autograd.grad(od, (qs, ks, vs), dout,
                                                              retain_graph=True)}
                sync, back = time_interleaved(fns, 10), batched(fns)
                print(f"b={b} h={h} s={s} d={d} causal={causal} det={det}: ms per call, "
                      f"synchronized / back to back: op {sync['op']:.3f} / {back['op']:.3f}, "
                      f"drop-in {sync['drop-in']:.3f} / {back['drop-in']:.3f}", flush=True)
                torch.use_deterministic_algorithms(False)
        return
    if "--latency" in sys.argv:
        for shape in LATENCY_SHAPES:
            fns = four_paths(*shape)
            ms = time_interleaved(fns, 10)
            print("b={} h={} s={} d={} causal={}: ms per synchronized call, event / kernels / "
                  "event - kernels".format(*shape), flush=True)
            for name, fn in fns.items():
                kern = sum(t for _, _, t in kernels(fn))
                print(f"  {name:13s} {ms[name]:7.3f} / {kern:7.3f} / {ms[name] - kern:6.3f}", flush=True)
            del fns
            torch.cuda.empty_cache()
        return
    if "--host" in sys.argv:
        fns = four_paths(*SHAPES[1])
        time_interleaved(fns, 3)
        for name, fn in fns.items():
            host_timeline(name, fn)
        return
    for b, h, s, d, causal in SHAPES:
        q, k, v, dout = make(b, h, h, s, d, torch.bfloat16)
        scale = 1 / math.sqrt(d)
        o, lse = torch.ops.torch_sm90_sdpa.sdpa(q, k, v, causal, scale, False)
        qs, ks, vs = (t.detach().requires_grad_(True) for t in (q, k, v))
        od = torch_sm90_sdpa.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale)
        print(f"b={b} h={h} s={s} d={d} causal={causal}: q strides {q.stride()}, op out strides "
              f"{o.stride()}, drop-in out strides {od.stride()}, dout strides {dout.stride()}")
        for det in (False, True):
            torch.use_deterministic_algorithms(det)
            fns = {
                "op": lambda: torch.ops.torch_sm90_sdpa.sdpa_backward(
                    dout, q, k, v, o, lse, causal, scale, det),
                "drop-in": lambda: torch.autograd.grad(od, (qs, ks, vs), dout, retain_graph=True),
                "drop-in, dout copied contiguous (copy timed)": lambda: torch.autograd.grad(
                    od, (qs, ks, vs), dout.contiguous(), retain_graph=True),
            }
            ms = time_interleaved(fns, 10)
            for name, fn in fns.items():
                ks_ = kernels(fn)
                total = sum(t for _, _, t in ks_)
                print(f"  det={det} {name:45s} event {ms[name]:7.3f} ms, kernels {total:7.3f} ms:")
                for key, count, t in ks_[:6]:
                    print(f"      {t:7.3f} ms x{count} {key}")
            torch.use_deterministic_algorithms(False)


if __name__ == "__main__":
    main()
