"""Attention forward: the SM90 forward kernel (torch.ops.torch_sm90_sdpa.sdpa_forward) next to
stock SDPA's fused forwards, in one process on the same inputs, interleaved, synchronized per
call, median of the repeats.

Columns per row (bf16 unless --dtype fp16, BSHD memory viewed as BHSD, 16k tokens per batch: b = 16384 / s):
  ours          sdpa_forward, is_causal or full, with TORCH_SM90_SDPA_FWD_OVERLAP=0 (the kernel
                that runs each block in turn)
  ours_overlap  the same with TORCH_SM90_SDPA_FWD_OVERLAP=1 (softmax overlapping P V: the
                default)
  ours_overlap@NAME   with --ab NAME:VAR=VALUE[,VAR=VALUE]: ours_overlap with those
                environment variables set for the call (an A/B of the forward's switches in
                one process, e.g. --ab per_tile:TORCH_SM90_SDPA_FWD_PERSISTENT=0; the column's
                kernel is the overlap one: TORCH_SM90_SDPA_FWD_OVERLAP is refused)
  cudnn         F.scaled_dot_product_attention under sdpa_kernel(CUDNN_ATTENTION)
  flash         the same under FLASH_ATTENTION (FlashAttention-2)
  cudnn_mask    causal rows only: cuDNN given the causal mask as a bool [B, 1, S, S] tensor
                (what compiled transformers models hand SDPA)
  ours_mask, ours_mask_overlap   causal rows only: sdpa_forward given that bool mask, both
                kernels (the classification skips the hidden tiles); with --ab also
                ours_mask_overlap@NAME
  ours_bias, ours_bias_overlap   causal rows only: sdpa_forward given the mask as a bias of
                0 and the dtype's minimum (transformers' additive form), both kernels; for bf16
                the fill counts as hidden (the kernel clamps it to -FLT_MAX), for fp16 (-65504)
                it does not and every tile above the diagonal is computed from the elements
  stock_bias    causal rows only: F.scaled_dot_product_attention given that bias, stock's own
                choice of kernel (what a user who passes it has)
  ours_alibi, stock_alibi   full rows only: a dense finite bias [B, 1, S, S] (ALiBi's
                -|i - j| / 16): no tile hidden or bias-free, every tile read from the elements
  cudnn_mask_dense, ours_mask_dense   full rows only: cuDNN and sdpa_forward given a bool
                [B, 1, S, S] mask that hides nothing (all True): what a mask costs ours when it
                hides no tile (the forward speed gate's worst case, tools/speed_table.py)
TFLOP/s count the visible half under causal masking: 4 * b * hq * s^2 * d (/ 2).

    python benchmarks/bench_fwd.py [--dims 64,128] [--seqs 512,2048,8192,16384] [--reps 20]
                                   [--dtype bf16|fp16] [--ab NAME:VAR=VALUE[,VAR=VALUE]] ...
                                   [--json OUT]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_sm90_sdpa  # noqa: E402,F401
from bench_bwd import time_interleaved  # noqa: E402
from torch_sm90_sdpa import _cuda_backend  # noqa: E402

HEADS = {64: (32, 8), 96: (16, 4), 128: (16, 4), 192: (16, 4), 256: (8, 8)}  # (q heads, kv heads)


def make(b, hq, hkv, s, d, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, s, hq, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
    k = torch.randn(b, s, hkv, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
    v = torch.randn(b, s, hkv, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
    return q, k, v


def parse_ab(specs):
    """--ab NAME:VAR=VALUE[,VAR=VALUE] -> {NAME: {VAR: VALUE}}"""
    out = {}
    for spec in specs or []:
        name, _, assigns = spec.partition(":")
        env = dict(a.split("=", 1) for a in assigns.split(",") if a)
        if not name or not env:
            raise SystemExit(f"--ab {spec!r}: expected NAME:VAR=VALUE[,VAR=VALUE]")
        if "TORCH_SM90_SDPA_FWD_OVERLAP" in env:
            raise SystemExit(f"--ab {spec!r}: the ours_overlap@NAME columns set "
                             "TORCH_SM90_SDPA_FWD_OVERLAP=1 themselves (the in-turn kernel is "
                             "the ours column)")
        out[name] = env
    return out


def columns(q, k, v, causal, ab=None):
    gqa = q.size(1) != k.size(1)

    def ours_kernel(overlap, mask=None, env=None):
        env = dict(env or {}, TORCH_SM90_SDPA_FWD_OVERLAP=overlap)

        def run():
            saved = {name: os.environ.get(name) for name in env}
            os.environ.update(env)
            try:
                return torch.ops.torch_sm90_sdpa.sdpa_forward(q, k, v, causal and mask is None,
                                                              None, gqa, mask)
            finally:
                for name, value in saved.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
        return run

    def stock(backend, mask=None):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                      is_causal=causal and mask is None,
                                                      enable_gqa=gqa)
        return run

    def stock_default(mask):
        def run():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return run

    cols = {"ours": ours_kernel("0"), "ours_overlap": ours_kernel("1"),
            "cudnn": stock(SDPBackend.CUDNN_ATTENTION),
            "flash": stock(SDPBackend.FLASH_ATTENTION)}
    for name, env in (ab or {}).items():
        cols[f"ours_overlap@{name}"] = ours_kernel("1", env=env)
    if not causal:  # a mask that hides nothing
        dense = torch.ones(q.size(0), 1, q.size(2), k.size(2), dtype=torch.bool, device="cuda")
        cols["cudnn_mask_dense"] = stock(SDPBackend.CUDNN_ATTENTION, dense)
        cols["ours_mask_dense"] = ours_kernel("0", dense)
        pos = torch.arange(q.size(2), device="cuda", dtype=torch.float32)
        alibi = (-(pos[:, None] - pos[None, :]).abs() / 16).to(q.dtype)[None, None]
        alibi = alibi.expand(q.size(0), 1, q.size(2), k.size(2))
        cols["ours_alibi"] = ours_kernel("1", alibi)
        cols["stock_alibi"] = stock_default(alibi)
    if causal:
        s = q.size(2)
        keep = torch.ones(s, s, dtype=torch.bool, device="cuda").tril()[None, None]
        keep = keep.expand(q.size(0), 1, s, s)
        cols["cudnn_mask"] = stock(SDPBackend.CUDNN_ATTENTION, keep)
        cols["ours_mask"] = ours_kernel("0", keep)
        cols["ours_mask_overlap"] = ours_kernel("1", keep)
        for name, env in (ab or {}).items():
            cols[f"ours_mask_overlap@{name}"] = ours_kernel("1", keep, env=env)
        bias = torch.zeros(keep.shape, dtype=q.dtype, device="cuda").masked_fill(
            ~keep, torch.finfo(q.dtype).min)
        cols["ours_bias"] = ours_kernel("0", bias)
        cols["ours_bias_overlap"] = ours_kernel("1", bias)
        cols["stock_bias"] = stock_default(bias)
    usable = {}
    for name, fn in cols.items():  # a backend that refuses the row is left out
        try:
            with torch.no_grad():
                fn()
            usable[name] = fn
        except RuntimeError as exc:
            print(f"  {name}: not run ({str(exc).splitlines()[0][:100]})")
    return usable


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--seqs", default="512,2048,8192,16384")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--ab", action="append", metavar="NAME:VAR=VALUE[,VAR=VALUE]",
                    help="extra columns of ours with these environment variables (repeatable)")
    ap.add_argument("--json")
    args = ap.parse_args()
    ab = parse_ab(args.ab)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}; TFLOP/s")
    for d in (int(x) for x in args.dims.split(",")):
        hq, hkv = HEADS[d]
        for s in (int(x) for x in args.seqs.split(",")):
            b = max(1, 16384 // s)
            q, k, v = make(b, hq, hkv, s, d, dtype)
            why_not = _cuda_backend.forward_unserved(q, k, v)
            if why_not is not None:
                print(f"d{d} s{s}: our forward does not serve it ({why_not})")
                continue
            for causal in (False, True):
                cols = columns(q, k, v, causal, ab)
                with torch.no_grad():
                    ms = time_interleaved(cols, args.reps, warmup=2)
                flops = 4 * b * hq * s * s * d / (2 if causal else 1)
                tflops = {n: flops / (t * 1e-3) / 1e12 for n, t in ms.items()}
                peers = {n: t for n, t in tflops.items() if n in ("cudnn", "flash")}
                best = max(peers.values()) if peers else float("nan")
                row = dict(d=d, hq=hq, hkv=hkv, b=b, s=s, causal=causal, ms=ms, tflops=tflops,
                           ours_over_best=max(tflops["ours"], tflops["ours_overlap"]) / best)
                if "ours_mask" in tflops and "cudnn_mask" in tflops:
                    mask_best = max(tflops["ours_mask"], tflops.get("ours_mask_overlap", 0.0))
                    row["mask_over_causal"] = mask_best / max(tflops["ours"], tflops["ours_overlap"])
                    row["mask_over_cudnn_mask"] = mask_best / tflops["cudnn_mask"]
                if "ours_bias_overlap" in tflops:
                    bias_best = max(tflops["ours_bias"], tflops["ours_bias_overlap"])
                    row["bias_over_causal"] = bias_best / max(tflops["ours"], tflops["ours_overlap"])
                    if "stock_bias" in tflops:
                        row["bias_over_stock_bias"] = bias_best / tflops["stock_bias"]
                if "ours_alibi" in tflops and "stock_alibi" in tflops:
                    row["alibi_over_stock_alibi"] = tflops["ours_alibi"] / tflops["stock_alibi"]
                rows.append(row)
                print(f"d{d} {hq}/{hkv} b{b} s{s} {'causal' if causal else 'full  '}: "
                      + "  ".join(f"{n} {t:6.1f}" for n, t in tflops.items())
                      + f"  ours/best {row['ours_over_best']:.3f}"
                      + (f"  mask/causal {row['mask_over_causal']:.3f} mask/cudnn_mask "
                         f"{row['mask_over_cudnn_mask']:.2f}" if "mask_over_causal" in row else "")
                      + "".join(f"  {key} {row[key]:.3f}" for key in
                                ("bias_over_causal", "bias_over_stock_bias",
                                 "alibi_over_stock_alibi") if key in row),
                      flush=True)
    if rows:
        geo = statistics.geometric_mean(r["ours_over_best"] for r in rows)
        print(f"ours (the faster kernel) / best stock (cuDNN, flash), geometric mean over "
              f"{len(rows)} rows: {geo:.3f}")
    if args.json:
        commit = os.environ.get("GIT_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(args.json, "w") as f:
            json.dump({"meta": {"bench": "bench_fwd", "device": torch.cuda.get_device_name(),
                                "torch": torch.__version__,
                                "commit": commit, "command": " ".join(sys.argv)},
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
