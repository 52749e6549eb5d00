"""The command line of torch_sm90_sdpa.

    python -m torch_sm90_sdpa demo [--steps N] [--seq-len S] [--device auto|cpu|cuda] ...
        train a small compiled transformer with the rewrite: what was replaced, gradient
        agreement with stock, and on Hopper the speed against stock
    python -m torch_sm90_sdpa info
        build_info(), the devices, the routing state and what would be routed
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def _fmt_dtype(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def _routing_table(device: torch.device, head_dims, dtypes, *, assume_sm90: bool) -> list:
    """[(head_dim, dtype, 'routed' | reason)] for a typical call (B=2, H=16, S=1024,
    q/k/v as [B, S, H, D] memory, causal) on `device`."""
    from . import eligibility, policy, routing

    rows = []
    saved = eligibility.device_capability
    if assume_sm90:
        eligibility.device_capability = lambda dev: (9, 0) if dev.type == "cuda" else None
    try:
        for d in head_dims:
            for dt in dtypes:
                b, h, s = 2, 16, 1024
                bshd = policy.TensorSpec((b, h, s, d), dt, device, strides=(s * h * d, d, h * d, 1))
                lse = policy.TensorSpec((b, h, s, 1), torch.float32, device)
                call = policy.AttentionBackwardCall(
                    backend="cudnn", grad_out=bshd, q=bshd, k=bshd, v=bshd, out=bshd, lse=lse,
                    is_causal=True, deterministic=torch.are_deterministic_algorithms_enabled(),
                )
                dec = policy.decide(call, only_faster=routing.routing_options()["only_faster"])
                rows.append((d, dt, "routed" if dec.routed else f"{dec.reason}: {dec.detail}"))
    finally:
        eligibility.device_capability = saved
    return rows


def info(argv=None) -> int:
    argparse.ArgumentParser(
        prog="python -m torch_sm90_sdpa info",
        description="print build_info() and what would be routed").parse_args(argv)
    import torch_sm90_sdpa
    from . import _extension, eligibility, policy, routing

    print(f"torch_sm90_sdpa {torch_sm90_sdpa.__version__}, torch {torch.__version__}")
    print("build_info():")
    print(json.dumps(_extension.build_info(), indent=2, default=str, sort_keys=True))
    print("devices:")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = eligibility.device_capability(torch.device("cuda", i))
            model = policy.gate_device(torch.device("cuda", i))
            print(f"  cuda:{i} {torch.cuda.get_device_name(i)}, compute capability {cap}"
                  f"{' (SM90: served)' if cap == (9, 0) else ' (not SM90: not served)'}; speed "
                  f"gate: the rows measured {'on ' + model if model else 'on every GPU measured'}")
    else:
        print("  no CUDA device (CUDA calls are never routed here; enable(cpu=True) routes "
              "CPU calls to the CPU reference)")
    env = os.environ.get(routing.ENV_VAR)
    print(f"routing: {routing.routing_options()}  ({routing.ENV_VAR}={env!r})")

    compiled = {d for _, d in _extension.build_info()["variants"]}
    head_dims = sorted({64, 96, 128, 192, 256} | compiled)
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    have_sm90 = torch.cuda.is_available() and any(
        eligibility.device_capability(torch.device("cuda", i)) == (9, 0)
        for i in range(torch.cuda.device_count()))
    title = ("a causal [2, 16, 1024, D] SDPA call on cuda:0 (cuDNN backward)" if have_sm90 else
             "a causal [2, 16, 1024, D] SDPA call on an SM90 GPU (hypothetical: none here)")
    print(f"what would be routed, {title}:")
    for d, dt, verdict in _routing_table(torch.device("cuda", 0), head_dims, dtypes,
                                         assume_sm90=not have_sm90):
        print(f"  D={d:<4} {_fmt_dtype(dt):<9} {verdict}")
    print("never routed: dropout_p > 0, a mask that needs a gradient or of another dtype than "
          "bool / fp32 / fp16 / bf16, nested tensors, Dv != D, tensors without a contiguous "
          "last dim, flash with is_causal and Sq != Sk. The default speed gate also keeps on "
          "stock the cuDNN calls where cuDNN measured faster (by GPU model, head dim, causal / "
          "full / mask, key length, and for GQA the group a CTA walks); enable(only_faster=False) "
          "routes them. See docs/ROUTING.md")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = {"demo": None, "info": info}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(__doc__.strip())
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    return info(rest)


if __name__ == "__main__":
    sys.exit(main())
