"""Masked attention backward: ours (which skips the tiles a mask hides) next to cuDNN's masked
backward (which applies the mask densely), and both against their is_causal backward.

The mask is what a compiled transformers model hands the cuDNN backward: an additive bf16 bias
(0 / -inf) of shape [B, 1, S, S]. Rows per mask kind and sequence length,
bf16, d = 128 (--head-dim), 2048 / d q heads (hidden 2048), batch 16384 / s (at least 2: padding needs two
sequences). Backward only, interleaved (ours masked, cuDNN masked, ours causal, cuDNN causal,
...), median of the repeats. Mask kinds:
  causal          the causal mask as a bias (what transformers builds without padding)
  padding         causal, every other sequence right-padded to half its length
  sliding window  causal, window s / 4 (Mistral style)
  documents       causal within 4 packed documents of equal length (block-diagonal)
  key padding     bidirectional, every other sequence padded to half its length (encoders)
  alibi           a per-head linear bias [1, H, S, S], nothing masked (not routed by default)
  dense           N(0, 1) bias [B, 1, S, S], nothing masked (ours' worst case)
The default kinds are the first four; --stock efficient compares with the memory-efficient
masked backward (what stock runs under deterministic algorithms) instead of cuDNN's.

    python benchmarks/bench_masks.py [--seqs 2048,4096,8192,16384] [--reps 10] [--json OUT]
                                     [--head-dim 128] [--kv-heads 4] [--classes]

--public also times forward + backward through the public entry points, interleaved:
torch_sm90_sdpa.scaled_dot_product_attention (the drop-in, which routes the forward and the
backward where ours serves them) and F.scaled_dot_product_attention, each with the boolean mask
a user passes (keep = bias == 0), with the additive bias itself (what transformers' sdpa
interface passes: run it with --fill min) and with is_causal (what the model would cost without
a mask); the row's dropin_bias_over_causal is the drop-in's speed with the bias over its
speed with is_causal, dropin_over_stock_causal the drop-in's is_causal speed over F's.

--kv-heads: GQA (k / v with fewer heads, as Llama-style models); --classes prints the share of
empty / partial / full tiles the classification found for each mask; --fill cudnn makes the
bias 0 / -65504, as torch 2.11 hands a boolean mask to cuDNN (its convert_boolean_attn_mask_cudnn),
--fill min 0 / bf16's minimum, as transformers builds an additive mask, instead of 0 / -inf.
"""
import argparse

import torch

import torch_sm90_sdpa  # registers the ops; the drop-in (--public)
from bench_bwd import time_interleaved, write_json  # the interleaved CUDA-event timer (median)

aten = torch.ops.aten


def make_bias(kind, b, h, s, fill=float("-inf")):
    """The bias of a mask kind: [B, 1, S, S] bf16, 0 where visible and `fill` where masked;
    "alibi" [1, H, S, S] (a per-head linear penalty, nothing masked), "dense" N(0, 1) values."""
    i = torch.arange(s, device="cuda")[:, None]
    j = torch.arange(s, device="cuda")[None, :]
    causal = j <= i
    if kind == "causal":
        keep = causal[None].expand(b, s, s)
    elif kind == "padding":
        valid = torch.tensor([s if n % 2 == 0 else s // 2 for n in range(b)], device="cuda")
        keep = causal[None] & (j[None] < valid[:, None, None])
    elif kind == "sliding window":
        keep = (causal & (j > i - s // 4))[None].expand(b, s, s)
    elif kind == "documents":
        doc = torch.arange(s, device="cuda") // (s // 4)
        keep = (causal & (doc[:, None] == doc[None, :]))[None].expand(b, s, s)
    elif kind == "key padding":  # bidirectional (encoder): every other sequence half padded
        valid = torch.tensor([s if n % 2 == 0 else s // 2 for n in range(b)], device="cuda")
        keep = (j[None] < valid[:, None, None]).expand(b, s, s)
    elif kind == "alibi":  # per head: nothing hidden, every tile partial
        slopes = 2.0 ** (-8.0 * torch.arange(1, h + 1, device="cuda") / h)
        return (-slopes[:, None, None] * (i - j).abs()).to(torch.bfloat16)[None]
    elif kind == "dense":  # broadcast over heads, nothing hidden
        g = torch.Generator(device="cuda").manual_seed(s)
        return torch.randn(b, 1, s, s, device="cuda", dtype=torch.bfloat16, generator=g)
    else:
        raise ValueError(kind)
    bias = torch.zeros(b, 1, s, s, device="cuda", dtype=torch.bfloat16)
    return bias.masked_fill_(~keep[:, None], fill)


def cudnn_backward(q, k, v, dout, bias, causal, scale):
    """A run() of cuDNN's backward (forward outputs saved); bias [B, 1, S, S] (as SDPA hands
    it over) or None."""
    b4 = bias
    o, lse, cq, ck, mq, mk, seed, off = aten._scaled_dot_product_cudnn_attention(
        q, k, v, b4, True, 0.0, causal, False, scale=scale)[:8]

    def run():
        return aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, o, lse, seed, off, b4, cq, ck, mq, mk, 0.0, causal, scale=scale)
    return run, (o, lse[..., 0])


def efficient_backward(q, k, v, dout, bias, causal, scale):
    """A run() of the memory-efficient backward (stock's masked kernel under deterministic
    algorithms); it has no GQA: kv heads repeated, as SDPA does."""
    g = q.size(1) // k.size(1)
    ke, ve = (t.repeat_interleave(g, 1) if g > 1 else t for t in (k, v))
    b4 = bias.expand(q.size(0), q.size(1), q.size(2), k.size(2)) if bias is not None else None
    o, lse, seed, off = aten._scaled_dot_product_efficient_attention(
        q, ke, ve, b4, True, 0.0, causal, scale=scale)

    def run():
        return aten._scaled_dot_product_efficient_attention_backward(
            dout, q, ke, ve, b4, o, lse, seed, off, 0.0, [True, True, True, False], causal,
            scale=scale)
    return run, (o, lse[..., : q.size(2)].contiguous())


def ours_backward(q, k, v, dout, bias, causal, scale, o, lse):
    op = torch.ops.torch_sm90_sdpa.sdpa_backward.default
    b4 = bias

    def run():
        return op(dout, q, k, v, o, lse, causal, scale, False, b4)
    return run


def public_times(q, k, v, dout, bias, reps):
    """Forward + backward ms through the public entry points, interleaved: the drop-in and
    F.scaled_dot_product_attention, each with the boolean mask keep = bias == 0, with the
    additive bias [B, 1, S, S] itself and with is_causal (no mask)."""
    import torch.nn.functional as F

    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    gqa = q.size(1) != k.size(1)
    keep = bias == 0

    def fwd_bwd(fn, **kw):
        def run():
            out = fn(qg, kg, vg, enable_gqa=gqa, **kw)
            return torch.autograd.grad(out, (qg, kg, vg), dout)
        return run
    runs = {}
    for name, fn in (("dropin", torch_sm90_sdpa.scaled_dot_product_attention),
                     ("F.sdpa", F.scaled_dot_product_attention)):
        runs[f"{name} mask fwdbwd"] = fwd_bwd(fn, attn_mask=keep)
        runs[f"{name} bias fwdbwd"] = fwd_bwd(fn, attn_mask=bias)
        runs[f"{name} causal fwdbwd"] = fwd_bwd(fn, is_causal=True)
    return time_interleaved(runs, reps, warmup=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="2048,4096,8192,16384")
    ap.add_argument("--kinds", default="causal,padding,sliding window,documents")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json")
    ap.add_argument("--head-dim", type=int, default=128, help="hidden 2048: 2048 / d q heads")
    ap.add_argument("--kv-heads", type=int, default=None, help="default: as many as q heads")
    ap.add_argument("--classes", action="store_true")
    ap.add_argument("--public", action="store_true",
                    help="also forward + backward through the drop-in and F.sdpa (bool mask)")
    ap.add_argument("--stock", choices=("cudnn", "efficient"), default="cudnn",
                    help="the stock masked backward to compare with")
    ap.add_argument("--fill", choices=("inf", "cudnn", "min"), default="inf",
                    help="masked bias entries: -inf, -65504 as torch hands cuDNN a bool mask, "
                         "or bf16's minimum as transformers fills an additive mask")
    args = ap.parse_args()
    d = args.head_dim
    h = 2048 // d
    hkv = args.kv_heads or h
    scale = d ** -0.5
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; bf16, d={d}, h={h}, "
          f"kv heads {hkv}; backward ms (median)")
    stock = args.stock
    fill = {"inf": float("-inf"), "cudnn": -65504.0,
            "min": torch.finfo(torch.bfloat16).min}[args.fill]
    stock_masked = cudnn_backward if stock == "cudnn" else efficient_backward
    print(f"{'mask':<15} {'s':>6} {'b':>3} | {'ours mask':>9} {stock + ' mask':>14} "
          f"{'ours causal':>11} {'cuDNN causal':>12} | {stock + '/ours':>14} {'mask/causal':>11}")
    for s in (int(x) for x in args.seqs.split(",")):
        b = max(2, 16384 // s)
        g = torch.Generator(device="cuda").manual_seed(s)
        q, k, v, dout = (torch.randn(b, s, heads, d, device="cuda", dtype=torch.bfloat16,
                                     generator=g).transpose(1, 2) for heads in (h, hkv, hkv, h))
        causal_run, (o_c, lse_c) = cudnn_backward(q, k, v, dout, None, True, scale)
        ours_causal = ours_backward(q, k, v, dout, None, True, scale, o_c, lse_c)
        for kind in args.kinds.split(","):
            bias = make_bias(kind, b, h, s, fill)
            stock_mask, (o_m, lse_m) = stock_masked(q, k, v, dout, bias, False, scale)
            ours_mask = ours_backward(q, k, v, dout, bias, False, scale, o_m, lse_m)
            t = time_interleaved({"ours mask": ours_mask, f"{stock} mask": stock_mask,
                                  "ours causal": ours_causal, "cudnn causal": causal_run},
                                 args.reps, warmup=1)
            row = dict(mask=kind, s=s, b=b, head_dim=d, heads=h, kv_heads=hkv, fill=args.fill,
                       stock=stock, **t,
                       stock_over_ours=t[f"{stock} mask"] / t["ours mask"],
                       ours_mask_over_causal=t["ours mask"] / t["ours causal"])
            if args.classes:
                from torch_sm90_sdpa import _cuda_backend
                cls = _cuda_backend.tile_classes(bias.expand(b, h, s, s), q, k, lse=lse_m,
                                                 scale=scale)
                # partial: the mask read per element (1) or as the classification's bits (3)
                row["tile_classes"] = {name: (cls == code).float().mean().item()
                                       for code, name in enumerate(("empty", "partial", "full", "bits"))}
            if args.public:
                row.update(public_times(q, k, v, dout, bias, args.reps))
                # speed of the masked call over the is_causal one, each through its entry point
                row["dropin_bias_over_causal"] = (row["dropin causal fwdbwd"]
                                                  / row["dropin bias fwdbwd"])
                row["dropin_over_stock_causal"] = (row["F.sdpa causal fwdbwd"]
                                                   / row["dropin causal fwdbwd"])
            rows.append(row)
            print(f"{kind:<15} {s:>6} {b:>3} | {t['ours mask']:>9.3f} {t[stock + ' mask']:>14.3f} "
                  f"{t['ours causal']:>11.3f} {t['cudnn causal']:>12.3f} | "
                  f"{row['stock_over_ours']:>13.2f}x {row['ours_mask_over_causal']:>10.2f}x"
                  f"{'  tiles ' + str(row['tile_classes']) if args.classes else ''}",
                  flush=True)
            if args.public:
                print(f"{'':<15} {'':>6} {'':>3} | public fwd+bwd, drop-in / F.sdpa: bool mask "
                      f"{row['dropin mask fwdbwd']:.3f} / {row['F.sdpa mask fwdbwd']:.3f}, "
                      f"bias {row['dropin bias fwdbwd']:.3f} / {row['F.sdpa bias fwdbwd']:.3f}, "
                      f"is_causal {row['dropin causal fwdbwd']:.3f} / "
                      f"{row['F.sdpa causal fwdbwd']:.3f}; drop-in bias / is_causal speed "
                      f"{row['dropin_bias_over_causal']:.2f}, drop-in / F.sdpa is_causal "
                      f"{row['dropin_over_stock_causal']:.2f}", flush=True)
            del bias, stock_mask, ours_mask, o_m, lse_m
        del q, k, v, dout, causal_run, ours_causal
        torch.cuda.empty_cache()
    if args.json:
        write_json(args.json, "bench_masks", rows)


if __name__ == "__main__":
    main()
