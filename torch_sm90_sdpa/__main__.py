"""The command line of torch_sm90_sdpa: ``python -m torch_sm90_sdpa COMMAND``.

    python -m torch_sm90_sdpa demo [--steps N] [--seq-len S] [--device auto|cpu|cuda] ...
        train a small compiled transformer with the rewrite: what was replaced, gradient
        agreement with stock, and on Hopper the speed against stock
    python -m torch_sm90_sdpa info [--build-info]
        what was built, the GPUs, whether routing is on, and what would be routed
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

COMMANDS = ("demo", "info")


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


INFO_SUMMARY = "what was built, the GPUs, whether routing is on, and what would be routed"


def _add_info_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--build-info", action="store_true",
                   help="also print build_info(), the full record of the build, as JSON")


def _kernels_in_words(info: dict) -> list:
    """Lines saying what was built, for a reader."""
    if not info.get("cuda_extension"):
        why = info.get("reason") or "not built"
        return [f"SM90 kernels: not available ({why}).",
                "  CUDA calls stay on torch's own backward; the CPU reference still serves "
                "CPU calls with enable(cpu=True)."]
    by_dim: dict = {}
    for dtype_name, d in info.get("variants") or []:
        by_dim.setdefault(d, []).append(str(dtype_name))
    toolchain = ", ".join(x for x in (
        f"for {info['arch']}" if info.get("arch") else "",
        f"nvcc {info['nvcc_version']}" if info.get("nvcc_version") else "",
        f"CUTLASS {info['cutlass_version']}" if info.get("cutlass_version") else "") if x)
    lines = [f"SM90 kernels: the extension torch_sm90_sdpa._C is built"
             + (f" ({toolchain})" if toolchain else "") + "."]
    by_pair: dict = {}
    for dtype_name, d, dv in info.get("dv_variants") or []:
        by_pair.setdefault((d, dv), []).append(str(dtype_name))
    if by_dim:
        dims = "; ".join(f"{d} ({', '.join(sorted(n))})" for d, n in sorted(by_dim.items()))
        lines.append(f"  head dims with a kernel: {dims}.")
    if by_pair:
        pairs = "; ".join(f"{d}x{dv} ({', '.join(sorted(n))})" for (d, dv), n in sorted(by_pair.items()))
        lines.append(f"  q/k x v head dims (Dv != D) with a backward kernel: {pairs} (used by the "
                     "ops and the drop-in; the compile route's speed gate routes a pair's "
                     "unmasked MHA calls where its rows measured faster, speed_gate.dv_gate_lengths).")
    if not by_dim and not by_pair:
        lines.append("  no head dim has a kernel (the main kernel was not compiled): "
                     "no CUDA call can be routed.")
    return lines


def _routing_in_words(options: dict, env) -> str:
    from . import routing

    if options["enabled"]:
        what = ("CUDA calls where our kernel measured faster than stock" if options["only_faster"]
                else "every CUDA call the kernels serve")
        if options["cpu"]:
            what += ", and CPU calls (to the CPU reference)"
        masks = "; provably causal masks are dropped" if options["causal_masks"] else ""
        forward = ("; forward nodes too, with their backward" if options.get("forward")
                   else "; forward nodes stay on stock")
        text = f"Routing: on, for {what}{masks}{forward}"
    else:
        text = "Routing: off"
    env_text = f"{routing.ENV_VAR} is not set" if env is None else f"{routing.ENV_VAR}={env!r}"
    text = f"{text} ({env_text})."
    if not options["enabled"]:
        text += (" torch_sm90_sdpa.enable() before torch.compile turns it on; "
                 f"{routing.ENV_VAR}=1 does so without a code change.")
    return text


def _verdict_in_words(verdict: str) -> str:
    if verdict == "routed":
        return "routed"
    reason, _, detail = verdict.partition(": ")
    return f"not routed: {reason}" + (f" ({detail})" if detail else "")


def info(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m torch_sm90_sdpa info", description=INFO_SUMMARY)
    _add_info_arguments(p)
    return run_info(p.parse_args(argv))


def run_info(args) -> int:
    import platform

    import torch_sm90_sdpa
    from . import _extension, eligibility, policy, routing

    build = _extension.build_info()
    print(f"torch_sm90_sdpa {torch_sm90_sdpa.__version__} on torch {torch.__version__}, "
          f"Python {platform.python_version()}")
    print()
    for line in _kernels_in_words(build):
        print(line)
    print("GPUs:")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = eligibility.device_capability(torch.device("cuda", i))
            model = policy.gate_device(torch.device("cuda", i))
            served = ("SM90: served" if cap == (9, 0)
                      else "not SM90: its calls stay on torch's backward")
            gate = (f"the speed gate uses the rows measured on {model}" if model
                    else "the speed gate uses the rows of every GPU measured")
            cc = f"{cap[0]}.{cap[1]}" if cap else "unknown"
            print(f"  cuda:{i} {torch.cuda.get_device_name(i)}, compute capability {cc} "
                  f"({served}); {gate}")
    else:
        print("  none: no CUDA call to route here. enable(cpu=True) routes CPU calls to the "
              "CPU reference (to check the rewrite; not for speed).")
    print(_routing_in_words(routing.routing_options(), os.environ.get(routing.ENV_VAR)))
    print()

    compiled = {d for _, d in build["variants"]}
    head_dims = sorted({64, 96, 128, 192, 256} | compiled)
    dtypes = (torch.bfloat16, torch.float16)
    have_sm90 = torch.cuda.is_available() and any(
        eligibility.device_capability(torch.device("cuda", i)) == (9, 0)
        for i in range(torch.cuda.device_count()))
    title = ("a causal [2, 16, 1024, D] SDPA call on cuda:0 (cuDNN backward)" if have_sm90 else
             "a causal [2, 16, 1024, D] SDPA call on an SM90 GPU (hypothetical: none here)")
    print(f"What would be routed, {title}:")
    rows = _routing_table(torch.device("cuda", 0), head_dims, dtypes, assume_sm90=not have_sm90)
    reasons = sorted({verdict.partition(": ")[0] for _, _, verdict in rows})
    if len(reasons) == 1 and reasons != ["routed"]:  # one line says it all
        print(f"  head dims {', '.join(map(str, head_dims))} in "
              f"{' and '.join(_fmt_dtype(dt) for dt in dtypes)}: not routed: {reasons[0]}")
    else:
        for d, dt, verdict in rows:
            print(f"  head dim {d:<4} {_fmt_dtype(dt):<9} {_verdict_in_words(verdict)}")
    print("  fp32 (and fp64): served by the CPU reference only, for CPU calls with "
          "enable(cpu=True); the SM90 kernels take fp16 and bf16.")
    print("Never routed: dropout_p > 0, a mask that needs a gradient or of another dtype than "
          "bool / fp32 / fp16 / bf16, nested tensors, Dv != D (but for a built pair such as "
          "192x128), tensors without a contiguous "
          "last dim, flash with is_causal and Sq != Sk. The default speed gate also keeps on "
          "stock the cuDNN calls where cuDNN measured faster (by GPU model, head dim, causal / "
          "full / mask, key length, and for GQA the group a CTA walks); enable(only_faster=False) "
          "routes them. See docs/ROUTING.md.")
    if args.build_info:
        print()
        print("build_info():")
        print(json.dumps(build, indent=2, default=str, sort_keys=True))
    else:
        print("(python -m torch_sm90_sdpa info --build-info adds the full build_info() record)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m torch_sm90_sdpa``: one subcommand per command."""
    from . import demo

    parser = argparse.ArgumentParser(
        prog="python -m torch_sm90_sdpa",
        description="The command line of torch_sm90_sdpa, an SM90 (Hopper) attention backward "
                    "for PyTorch. 'python -m torch_sm90_sdpa COMMAND --help' describes a "
                    "command's options.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    p = sub.add_parser("demo", help=demo.SUMMARY, description=demo.DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_arguments(p)
    p = sub.add_parser("info", help=INFO_SUMMARY, description=INFO_SUMMARY)
    _add_info_arguments(p)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.command is None:
        parser.error(f"a command is needed: {' or '.join(COMMANDS)} "
                     "('python -m torch_sm90_sdpa --help' describes them)")
    if args.command == "demo":
        from .demo import _fill_defaults, run

        _fill_defaults(args)
        return run(args)
    return run_info(args)


if __name__ == "__main__":
    sys.exit(main())
