"""Host-side cost of one torch.ops.torch_sm90_sdpa.sdpa_backward call, and its alternatives.

A tiny problem (its kernels take a few microseconds) called back to back: the wall time per
call is then the host path (the GPU keeps up). Rows:

  * the op as users and compiled graphs call it: its CUDA kernel is C++ (registered through
    torch's stable ABI), so the call runs no Python below the dispatcher;
  * the same op with the causal mask as a 0 / -65504 bias (the masked path's extra launches);
  * the same op body in Python (_cuda_backend.sdpa_backward_python) registered as the CUDA
    kernel of a benchmark-only op with the same schema: the "lean Python path" alternative;
  * that Python body called directly (no dispatcher);
  * _C.run alone with prefilled params (TMA descriptors + 3 launches);
  * the stock cuDNN aten backward, for reference;
  * forward + backward through the public paths (the drop-in, then torch.autograd.grad; stock
    F.scaled_dot_product_attention on cuDNN likewise) and through the ops called directly
    (sdpa, then sdpa_backward): what the entry points cost the host over the ops;
  * backward only, torch.autograd.grad of an output made once (retain_graph): the drop-in's,
    a bare autograd.Function's whose backward calls the op and nothing else (the least any
    Python autograd path can cost), and stock cuDNN's: the part of issue 49's host gap that
    is the autograd engine's and the part that is ours.

    python benchmarks/host_overhead.py [--json OUT.json] [--profile CALLS]

Interleaved rounds; the median of the rounds' per-call means is printed. --profile CALLS then
runs each forward + backward row CALLS more times under torch.profiler and cProfile and prints
where its host time goes: the ops by self CPU time, and the Python functions by their own time.
"""
import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import torch

import torch_sm90_sdpa  # noqa: F401
from torch_sm90_sdpa import _cuda_backend, ops

SCHEMA = ("sdpa_backward_py(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
          "Tensor lse, bool is_causal, float scale, bool deterministic) -> "
          "(Tensor, Tensor, Tensor)")


def _python_path_op():
    """A benchmark-only op whose CUDA kernel is the Python op body (Autograd fallthrough, as
    sdpa_backward): what registering the Python path instead of the C++ kernel would cost."""
    lib = torch.library.Library("torch_sm90_sdpa_bench", "FRAGMENT")  # noqa: TOR901
    lib.define(SCHEMA)
    lib.impl("sdpa_backward_py", _cuda_backend.sdpa_backward_python, "CUDA")
    lib.impl("sdpa_backward_py", torch.library.fallthrough_kernel, "Autograd")
    return lib, torch.ops.torch_sm90_sdpa_bench.sdpa_backward_py.default


def per_call_us(fn, n):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def profile_rows(rows, calls, sync, cuda=True, top=20):
    """Per row (name -> fn): `calls` calls under torch.profiler (the ops by self CPU time, and
    their CUDA time where `cuda`) and under cProfile (the Python functions by their own time),
    printed; sync() ends each run (torch.cuda.synchronize on the GPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for name, fn in rows.items():
        sync()
        with profile(activities=activities) as prof:
            for _ in range(calls):
                fn()
            sync()
        print(f"\n== {name}: {calls} calls under torch.profiler, ops by self CPU time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
        py = cProfile.Profile()
        sync()
        py.enable()
        for _ in range(calls):
            fn()
        sync()
        py.disable()
        text = io.StringIO()
        pstats.Stats(py, stream=text).sort_stats("tottime").print_stats(top)
        print(f"== {name}: {calls} calls under cProfile, functions by own time")
        print(text.getvalue())


def _public_path_rows(q, k, v, do, scale):
    """Forward + backward rows: the ops called directly, the drop-in and stock cuDNN's public
    path, each a forward and the backward of its output (q, k, v [B, H, S, D], causal)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = tuple(t.detach().requires_grad_(True) for t in (q, k, v))

    def ops_direct():
        out, lse = torch.ops.torch_sm90_sdpa.sdpa(q, k, v, True, scale, False)
        return torch.ops.torch_sm90_sdpa.sdpa_backward.default(do, q, k, v, out, lse, True,
                                                               scale, False)

    def dropin():
        out = torch_sm90_sdpa.scaled_dot_product_attention(*leaves, is_causal=True, scale=scale)
        return torch.autograd.grad(out, leaves, do)

    def stock_cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True,
                                                                   scale=scale)
        return torch.autograd.grad(out, leaves, do)

    return {"forward + backward: the ops called directly (sdpa, sdpa_backward)": ops_direct,
            "forward + backward: the drop-in, then torch.autograd.grad": dropin,
            "forward + backward: stock F.scaled_dot_product_attention (cuDNN), autograd.grad":
                stock_cudnn}


class _BareOpFunction(torch.autograd.Function):
    """out = the op's forward; backward = the sdpa_backward op alone (no checks, no modes)."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        out, lse = torch.ops.torch_sm90_sdpa.sdpa(q, k, v, True, scale, False)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.torch_sm90_sdpa.sdpa_backward.default(
            grad_out, q, k, v, out, lse, True, ctx.scale, False)
        return dq, dk, dv, None


def _backward_only_rows(q, k, v, do, scale):
    """Backward-only rows: torch.autograd.grad of an output made once (retain_graph=True), as
    bench_bwd.py's "dropin" column times it (q, k, v [B, H, S, D], causal)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def grad_of(make_out):
        leaves = tuple(t.detach().requires_grad_(True) for t in (q, k, v))
        out = make_out(*leaves)
        return lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)

    def stock(*leaves):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True,
                                                                    scale=scale)
    return {
        "backward only: the drop-in's output, torch.autograd.grad": grad_of(
            lambda *t: torch_sm90_sdpa.scaled_dot_product_attention(*t, is_causal=True,
                                                                   scale=scale)),
        "backward only: a bare autograd.Function around the op, torch.autograd.grad": grad_of(
            lambda *t: _BareOpFunction.apply(*t, scale)),
        "backward only: stock cuDNN's output, torch.autograd.grad": grad_of(stock),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--profile", type=int, default=0, metavar="CALLS",
                    help="then profile each forward + backward row over CALLS calls")
    args = ap.parse_args()

    shape = (1, 2, 128, 128)
    q, k, v, do = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = 128 ** -0.5
    out, lse = torch.ops.torch_sm90_sdpa.sdpa(q, k, v, True, scale, False)
    bwd_args = (do, q, k, v, out, lse, True, scale, False)
    lib, py_op = _python_path_op()
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    params, ws = _cuda_backend.make_params(do, q, k, v, out, lse, True, scale, False,
                                           dq=dq, dk=dk, dv=dv)
    C = _cuda_backend._module()
    stream = torch.cuda.current_stream().cuda_stream
    o = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True,
                                                           False, scale=scale)

    # the causal mask as torch hands it to cuDNN: a 0 / -65504 bf16 bias [1, 1, S, S]
    keep = torch.ones(128, 128, device="cuda", dtype=torch.bool).tril()
    bias = torch.zeros(1, 1, 128, 128, device="cuda", dtype=torch.bfloat16).masked_fill_(~keep, -65504.0)
    masked_args = (do, q, k, v, out, lse, False, scale, False, bias)
    rows = {
        f"torch.ops.torch_sm90_sdpa.sdpa_backward ({ops.cuda_kernel_kind()} CUDA kernel)":
            lambda: torch.ops.torch_sm90_sdpa.sdpa_backward.default(*bwd_args),
        "the same op with the causal mask as a bias instead of is_causal (+ bounds, classify, "
        "ranges)":
            lambda: torch.ops.torch_sm90_sdpa.sdpa_backward.default(*masked_args),
        "the Python op body registered as a CUDA kernel (alternative)":
            lambda: py_op(*bwd_args),
        "the Python op body called directly": lambda: _cuda_backend.sdpa_backward_python(*bwd_args),
        "_C.run alone (params prefilled: TMA descriptors + 3 launches)":
            lambda: C.run(params, stream),
        "stock aten._scaled_dot_product_cudnn_attention_backward":
            lambda: torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                do, q, k, v, o[0], o[1], o[6], o[7], None, o[2], o[3], o[4], o[5], 0.0, True,
                scale=scale),
    }
    public = _public_path_rows(q, k, v, do, scale)
    rows.update(public)
    rows.update(_backward_only_rows(q, k, v, do, scale))
    for fn in rows.values():  # warm up
        for _ in range(20):
            fn()
    samples = {name: [] for name in rows}
    for _ in range(args.rounds):
        for name, fn in rows.items():
            samples[name].append(per_call_us(fn, args.calls))
    result = {name: statistics.median(s) for name, s in samples.items()}
    print(f"host cost per call (B=1, H=2, S=128, D=128, bf16, causal; {args.rounds} rounds of "
          f"{args.calls} calls, median):")
    for name, us in result.items():
        print(f"  {us:8.1f} us  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"us_per_call": result, "samples": samples,
                       "device": torch.cuda.get_device_name(), "torch": torch.__version__}, f,
                      indent=1)
    if args.profile > 0:
        profile_rows(public, args.profile, torch.cuda.synchronize)
    del lib


if __name__ == "__main__":
    main()
