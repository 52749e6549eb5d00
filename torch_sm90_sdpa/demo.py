"""python -m torch_sm90_sdpa demo: train a small compiled transformer with the rewrite.

What it shows, in order:

1. where it runs: on an SM90 GPU with a compiled kernel for the model's head dim, the
   CUDA route (bf16 autocast); anywhere else the CPU route (enable(cpu=True): the op's
   CPU reference, fp32), and it says so;
2. the stock attention backward ops of the compiled backward graph that were replaced
   (recorded from the graph after the rewrite) and routing_stats(summary=True);
3. gradient agreement: each parameter's gradient of the first step against an uncompiled
   stock run (max relative error = max |g - g_stock| / max |g_stock|), next to the
   compiled-stock error (the noise of compilation alone) where a compiled stock model runs;
4. the training steps, one line each on stderr (loss, step time);
5. on Hopper: step time and attention-backward GPU time (torch.profiler) against the same
   model compiled without the rewrite, interleaved.

The model is torch_sm90_sdpa.testing.TinyTransformer, which the tests compile too.
"""
from __future__ import annotations

import argparse
import copy
import math
import sys
import time

import torch
import torch.nn as nn

from . import _extension, eligibility, policy, routing

# The help text (the docstring is plain text: argparse prints it as it is).
_desc = __doc__.split(": ", 1)[1].strip()
DESCRIPTION = _desc[0].upper() + _desc[1:]
SUMMARY = "train a small compiled transformer with the rewrite"


# ---------------------------------------------------------------------------------------
# the demo
# ---------------------------------------------------------------------------------------


def _say(msg: str = "") -> None:
    print(msg, flush=True)


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _pick_device(requested: str, head_dim: int, heads: int, kv_heads: int,
                 dtype: torch.dtype):
    """(device, why) -- cuda where the kernels' contract serves the model's attention."""
    if requested == "cpu":
        return "cpu", "--device cpu"
    if not torch.cuda.is_available():
        return "cpu", "no CUDA GPU"
    cap = eligibility.device_capability(torch.device("cuda"))
    why = policy.kernel_verdict(dtype, head_dim, head_dim, heads, kv_heads, cap,
                                torch.are_deterministic_algorithms_enabled())
    if why is None:
        return "cuda", "SM90 GPU whose kernels serve the model's attention"
    if requested == "cuda":
        return "cuda", f"--device cuda, but {why}: nothing will be routed"
    return "cpu", why


def grad_errors(model_a: nn.Module, model_b: nn.Module) -> dict:
    """name -> max |g_a - g_b| / max |g_b| of every parameter gradient."""
    errs = {}
    pb = dict(model_b.named_parameters())
    for name, p in model_a.named_parameters():
        ga, gb = p.grad, pb[name].grad
        if ga is None or gb is None:
            errs[name] = float("nan")
            continue
        denom = gb.detach().float().abs().max().item()
        diff = (ga.detach().float() - gb.detach().float()).abs().max().item()
        errs[name] = diff / max(denom, 1e-30)
    return errs


def _strip_compile_prefix(name: str) -> str:
    return name.replace("_orig_mod.", "")


def _step(model, tokens, opt, autocast_dtype, device):
    from .testing import lm_loss  # (testing and the run import Inductor: not the --help)

    with torch.autocast(device_type=device, dtype=autocast_dtype,
                        enabled=autocast_dtype is not None):
        loss = lm_loss(model(tokens), tokens)
    loss.backward()
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss


def _stock_step_runs_stock(stock_model, tokens, autocast_dtype, device) -> bool:
    """One step of `stock_model` (its compile, with routing off); False when it ran our
    backward: Dynamo hands a model the graphs compiled for another instance of its class
    unless each is compiled apart (testing.compile_own_graphs)."""
    before = routing.routing_stats()["routed_calls"]
    _step(stock_model, tokens, None, autocast_dtype, device)
    return routing.routing_stats()["routed_calls"] == before


def _time_cuda(fn, iters: int) -> float:
    """Median ms per call with CUDA events."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def _attention_backward_ms(fn, iters: int) -> float:
    """GPU time per call of the attention backward ops (stock or ours), torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    names = ("_scaled_dot_product_cudnn_attention_backward",
             "_scaled_dot_product_flash_attention_backward",
             "_scaled_dot_product_efficient_attention_backward",
             "torch_sm90_sdpa::sdpa_backward")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total_us = 0.0
    for ev in prof.key_averages():
        if any(n in ev.key for n in names):
            total_us += getattr(ev, "device_time_total", getattr(ev, "cuda_time_total", 0.0))
    return total_us / 1000.0 / iters


def run(args) -> int:
    import torch._inductor.config

    from .testing import AttentionOpRecorder, TinyTransformer, compile_own_graphs

    head_dim = args.dim // args.heads
    cuda_dtype = torch.bfloat16
    device, why = args.resolved_device, args.device_why
    cpu_route = device == "cpu"
    autocast_dtype = cuda_dtype if device == "cuda" else None

    _say(f"torch_sm90_sdpa demo: torch {torch.__version__}")
    if cpu_route:
        _say(f"device: CPU -- {why}.")
        _say("  Running the CPU route (enable(cpu=True)): the stock CPU attention backward is "
             "replaced by torch_sm90_sdpa's CPU reference kernel (fp32). This checks the "
             "rewrite end to end; it says nothing about speed.")
    else:
        _say(f"device: {torch.cuda.get_device_name()} -- {why}; bf16 autocast.")
    _say(f"model: {args.layers} blocks, dim {args.dim}, {args.heads} heads of {head_dim}, "
         f"{args.kv_heads or args.heads} kv heads, "
         f"{'bidirectional (is_causal=False)' if args.no_causal else 'causal'}; batch {args.batch}, "
         f"seq len {args.seq_len}; {args.steps} steps")

    torch.manual_seed(args.seed)
    base = TinyTransformer(vocab=args.vocab, dim=args.dim, heads=args.heads,
                           kv_heads=args.kv_heads, layers=args.layers,
                           causal=not args.no_causal).to(device)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len), device=device)

    # 1. uncompiled stock reference gradients of the first step
    stock = copy.deepcopy(base)
    _step(stock, tokens, None, autocast_dtype, device)

    # 2. compiled with the rewrite (a recorder pass, set first, sees the graph after it)
    recorder = AttentionOpRecorder()
    saved_pass = torch._inductor.config.post_grad_custom_post_pass
    torch._inductor.config.post_grad_custom_post_pass = recorder
    routing.routing_stats(reset=True)
    routed_model = copy.deepcopy(base)
    # graphs of its own: Dynamo would hand them to the stock model compiled below (same class)
    compiled = compile_own_graphs(routed_model, "routed")
    opt = torch.optim.AdamW(routed_model.parameters(), lr=args.lr)
    try:
        # By default only_faster=False: the demo compares our backward with stock on its shapes
        # even where stock is faster (enable() alone would keep stock there); forward nodes then
        # stay stock (enable's forward follows only_faster; the demo's calls are unmasked, where
        # cuDNN's forward is faster than ours). --only-faster routes as the default enable()
        # does (the speed gates decide, forward nodes included).
        with routing.enable(cpu=cpu_route, only_faster=args.only_faster):
            t0 = time.perf_counter()
            loss = _step(compiled, tokens, None, autocast_dtype, device)  # compiles fwd + bwd
            if device == "cuda":
                torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            summary = routing.routing_summary()  # while routing is on
    finally:
        torch._inductor.config.post_grad_custom_post_pass = saved_pass
    errs = grad_errors(routed_model, stock)
    stats = routing.routing_stats()

    # 3. what was replaced
    _say("")
    _say(f"compiled in {compile_s:.1f} s (first step: forward + backward)")
    bw = recorder.backward_ops()
    _say("attention backward in the compiled backward graph, after the rewrite:")
    if recorder.graphs:
        for op in sorted(set(bw)):
            _say(f"  {bw.count(op)} x {op}")
        internal = {key: name for name, key in routing.BACKEND_KEYS.items()}
        for backend, n in stats["routed_nodes"].items():
            op = policy.STOCK_BACKWARD_OPS[internal.get(backend, backend)]
            _say(f"  replaced: {n} x {op} "
                 "-> torch_sm90_sdpa.sdpa_backward")
        for reason, n in stats["not_routed"].items():
            _say(f"  kept stock: {n} x ({reason})")
    else:
        _say("  (the graphs came from Inductor's FX graph cache, compiled earlier with the same "
             "routing: the pass did not run, so there is no graph to show)")
    first_calls = stats["routed_calls"]
    _say(f"  torch_sm90_sdpa.sdpa_backward ran {first_calls} times in the first backward "
         f"({len(base.blocks)} attention layers)")
    _say("routing_stats(summary=True): " + summary)

    # 4. gradients
    _say("")
    _say("gradient agreement with uncompiled stock (max |g - g_stock| / max |g_stock|):")
    width = max(len(_strip_compile_prefix(n)) for n in errs)
    for name, e in errs.items():
        _say(f"  {_strip_compile_prefix(name):<{width}}  {e:.2e}")
    worst = max(errs.values())
    _say(f"  worst: {worst:.2e}")

    # 5. training
    _say("")
    opt.step()
    opt.zero_grad(set_to_none=True)
    _progress(f"step 1/{args.steps}  loss {loss.item():.4f}  (compile)")
    for i in range(1, args.steps):
        t0 = time.perf_counter()
        loss = _step(compiled, tokens, opt, autocast_dtype, device)
        lv = loss.item()
        _progress(f"step {i + 1}/{args.steps}  loss {lv:.4f}  "
                  f"{(time.perf_counter() - t0) * 1000:.1f} ms")
    calls = routing.routing_stats()["routed_calls"]
    _say(f"trained {args.steps} steps; final loss {loss.item():.4f}; "
         f"our backward ran {calls} times")

    # 6. speed against stock (Hopper only)
    if device == "cuda" and first_calls > 0 and args.timing_iters > 0:
        _say("")
        stock_c = compile_own_graphs(copy.deepcopy(base), "stock")
        routing.disable()
        if not _stock_step_runs_stock(stock_c, tokens, autocast_dtype, device):
            _say("the stock model ran torch_sm90_sdpa's backward: no speed comparison")
            return 1
        models = {"stock": stock_c, "torch_sm90_sdpa": compiled}
        step_ms = {k: [] for k in models}
        attn_ms = {k: [] for k in models}
        for _ in range(args.timing_rounds):  # interleaved: A, B, A, B, ...
            for name, m in models.items():
                fn = lambda m=m: _step(m, tokens, None, autocast_dtype, device)  # noqa: E731
                step_ms[name].append(_time_cuda(fn, args.timing_iters))
                attn_ms[name].append(_attention_backward_ms(fn, max(2, args.timing_iters // 4)))
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        _say("speed, compiled model, median of interleaved rounds (fwd + bwd, no optimizer):")
        for name in models:
            _say(f"  {name:<16} step {med(step_ms[name]):8.3f} ms   "
                 f"attention backward {med(attn_ms[name]):8.3f} ms")
        s, o = med(step_ms["stock"]), med(step_ms["torch_sm90_sdpa"])
        a, b = med(attn_ms["stock"]), med(attn_ms["torch_sm90_sdpa"])
        _say(f"  step speedup {s / o:.3f}x, attention backward speedup "
             f"{(a / b) if b > 0 else float('nan'):.3f}x")
    elif device == "cuda" and first_calls == 0:
        _say("")
        _say("no attention backward was routed (the speed gate kept stock on these shapes): "
             "the compiled step is stock's, so there is no speed comparison")
    ok = math.isfinite(worst) and worst < (1e-3 if cpu_route else 5e-2)
    _say("")
    _say("OK" if ok else f"gradient mismatch: worst relative error {worst:.2e}")
    return 0 if ok else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="sequence length (default: 64 on CPU, 2048 on CUDA)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default 2 CPU, 8 CUDA)")
    p.add_argument("--dim", type=int, default=None,
                   help="model dim (default 64 CPU; CUDA: 8 heads of a compiled head dim, "
                        "128 if there is one)")
    p.add_argument("--heads", type=int, default=None,
                   help="attention heads (default 4 CPU, 8 CUDA)")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="key/value heads (GQA when fewer than --heads; default: half)")
    p.add_argument("--layers", type=int, default=2, help="blocks (default 2)")
    p.add_argument("--no-causal", action="store_true",
                   help="bidirectional self-attention (is_causal=False, no mask), as an encoder; "
                        "the loss is still next-token prediction (for timing, not to learn)")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary size (default 256)")
    p.add_argument("--lr", type=float, default=1e-3,
                   help="AdamW learning rate (default 0.001)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the model's initial weights and the tokens (default 0)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto (default): cuda on an SM90 GPU with a compiled kernel for the "
                        "model's head dim, else cpu")
    p.add_argument("--timing-iters", type=int, default=10,
                   help="timed steps per round, CUDA only (default 10)")
    p.add_argument("--timing-rounds", type=int, default=3,
                   help="interleaved rounds of stock and rewritten steps, CUDA only (default 3)")
    p.add_argument("--only-faster", action="store_true",
                   help="route as the default enable() does: only the calls the speed gates "
                        "measured faster than stock, forward nodes included (default: every "
                        "eligible backward call, the stock forward)")


CPU_DEFAULTS = dict(dim=64, heads=4, seq_len=64, batch=2)
CUDA_DEFAULTS = dict(heads=8, seq_len=2048, batch=8)  # dim: 8 heads of a compiled head dim


def _cuda_head_dim() -> int:
    """The head dim of the CUDA defaults: 128 if compiled (bf16), else 64, else any."""
    dims = sorted(d for name, d in _extension.build_info()["variants"] if name == "bf16")
    for d in (128, 64):
        if d in dims:
            return d
    return dims[0] if dims else 128


def _fill_defaults(args) -> None:
    """Resolve --device (args.resolved_device, args.device_why), then the unset sizes for it."""
    cuda = dict(CUDA_DEFAULTS, dim=CUDA_DEFAULTS["heads"] * _cuda_head_dim())
    if args.device == "cpu":
        device, why = "cpu", "--device cpu"
    else:  # decided with the head dim the CUDA run would have
        dim = args.dim if args.dim is not None else cuda["dim"]
        heads = args.heads if args.heads is not None else cuda["heads"]
        kv_heads = args.kv_heads if args.kv_heads is not None else max(1, heads // 2)
        device, why = _pick_device(args.device, dim // max(heads, 1), heads, kv_heads,
                                   torch.bfloat16)
    defaults = CPU_DEFAULTS if device == "cpu" else cuda
    if args.dim is None:
        args.dim = defaults["dim"]
    if args.heads is None:
        args.heads = defaults["heads"]
    if args.kv_heads is None:
        args.kv_heads = max(1, args.heads // 2)
    if args.seq_len is None:
        args.seq_len = defaults["seq_len"]
    if args.batch is None:
        args.batch = defaults["batch"]
    if args.dim % args.heads or args.heads % args.kv_heads:
        raise SystemExit("--dim must be a multiple of --heads, and --heads of --kv-heads")
    args.resolved_device, args.device_why = device, why


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m torch_sm90_sdpa demo", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    _fill_defaults(args)
    return run(args)
