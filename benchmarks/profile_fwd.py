"""Kernel-level breakdown of torch.ops.torch_sm90_sdpa.sdpa_forward calls (GPU machine): the
device time of every kernel per call, for full attention (with --modes full), is_causal, for
the causal mask as a bool [B, 1, S, S] tensor and as a bf16 bias of 0 / bf16's minimum
(transformers' additive form), so that the mask path's cost shows kernel by kernel
(classification, key ranges, fill rows, main kernel):
    python benchmarks/profile_fwd.py [--b 8 --h 16 --kv-heads 4 --s 2048 --d 128]
                                     [--modes causal,bool,bias] [--reps 10]
--once calls each mode of --modes once, unprofiled (for Nsight Compute: tools/gpu.sh ncu with
NCU_SCRIPT=benchmarks/profile_fwd.py NCU_KERNEL=fwd_main_kernel, one mode per case, e.g.
NCU_CASES="--modes causal;--modes bool": the tool adds --once).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_sm90_sdpa  # noqa: E402,F401  (registers the ops)
from profile_bwd import kernel_ms  # noqa: E402

MODES = ("causal", "bool", "bias", "full")
DEFAULT_MODES = ("causal", "bool", "bias")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--b", type=int, default=8)
    ap.add_argument("--h", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--s", type=int, default=2048)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES),
                    help="comma-separated: causal (is_causal), bool (a causal bool mask), bias "
                         "(the causal mask as a bf16 0 / minimum bias), full (no mask, not "
                         "causal)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--once", action="store_true", help="one call per mode, no profiler (for ncu)")
    args = ap.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or not args.modes:
        ap.error(f"--modes: expected some of {', '.join(MODES)}, got {args.modes}")
    return args


def main(argv=None):
    args = parse_args(argv)
    b, h, hkv, s, d = args.b, args.h, args.kv_heads, args.s, args.d
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            for _ in range(2))
    scale = d ** -0.5
    keep = torch.ones(s, s, dtype=torch.bool, device="cuda").tril()
    keep = keep[None, None].expand(b, 1, s, s).contiguous()  # [B, 1, S, S], as transformers builds it
    fwd = torch.ops.torch_sm90_sdpa.sdpa_forward
    gqa = h != hkv
    calls = {"causal": lambda: fwd(q, k, v, True, scale, gqa),
             "full": lambda: fwd(q, k, v, False, scale, gqa)}
    if "bool" in args.modes:
        calls["bool"] = lambda: fwd(q, k, v, False, scale, gqa, keep)
    if "bias" in args.modes:
        bias = torch.zeros(keep.shape, device="cuda", dtype=torch.bfloat16).masked_fill(
            ~keep, torch.finfo(torch.bfloat16).min)
        calls["bias"] = lambda: fwd(q, k, v, False, scale, gqa, bias)
    if args.once:
        for mode in args.modes:
            calls[mode]()
        torch.cuda.synchronize()
        return
    print(f"{torch.cuda.get_device_name()}, b{b} h{h}/{hkv} s{s} d{d}, bf16; device us per call "
          f"(mean of {args.reps})")
    for mode in args.modes:
        per_kernel = kernel_ms(calls[mode], args.reps)
        print(f"-- {mode}: total {sum(per_kernel.values()) * 1e3:9.1f} us")
        for name, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1]):
            print(f"   {ms * 1e3:9.1f}  {name[:110]}")


if __name__ == "__main__":
    main()
