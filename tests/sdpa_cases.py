"""A seeded generator of SDPA calls and the comparison of every public entry point with stock
SDPA against a float64 reference. tests/test_edge_inputs.py runs it on CPU (CI);
tests/test_cuda_edge_inputs.py runs it on an SM90 GPU for the kernels.

A case covers: sizes with zeros and ones (batch, heads, query / key length, head dim), GQA
ratios, Sq != Sk, is_causal, dtypes, layouts (contiguous, [B, S, H, D] views, a last dim with
stride 2), masks (none, bool, additive of query's dtype or fp32, broadcast shapes, rows with
no visible key, all masked) and scale None or given.

Where stock refuses a call, every entry point must refuse it too. Where the op refuses a call
stock takes, the refusal must be one of OP_REFUSALS (documented limits of the op's contract).
"""
from __future__ import annotations

import dataclasses
import math
import random
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import torch_sm90_sdpa
from torch_sm90_sdpa import api as _api

sdpa_op = torch.ops.torch_sm90_sdpa.sdpa
sdpa_backward_op = torch.ops.torch_sm90_sdpa.sdpa_backward

MASK_KINDS = ("none", "bool [Sq, Sk]", "bool [B, 1, Sq, Sk]", "bool key padding [B, 1, 1, Sk]",
              "bool per head [B, Hq, Sq, Sk]", "bool rows without keys", "bool all masked",
              "additive fp32 with -inf", "additive query dtype [B, 1, Sq, Sk]",
              "additive dtype minimum, left padding [B, 1, Sq, Sk]")
LAYOUTS = ("bhsd", "bshd", "last dim stride 2")

# The op's documented limits where stock SDPA takes the call (message fragments): its
# contract asks for a contiguous last dim, a backward kernel for Dv != D on CUDA, and
# enable_gqa=True when the head counts differ (stock raises there too, with its own message).
# On CUDA the ops run the SM90 kernels only: a head dim or dtype without one is refused there
# ("head dim not compiled"), where the drop-in passes the call to stock.
OP_REFUSALS = ("expected a contiguous last dimension", "(Dv != D) has no SM90 backward", "pass enable_gqa=True",
               "head dim not compiled")


@dataclasses.dataclass
class Case:
    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: torch.dtype
    layout: str
    mask: str
    is_causal: bool
    scale: Optional[float]
    enable_gqa: bool
    seed: int

    def __str__(self) -> str:
        return (f"B{self.batch} H{self.heads_q}/{self.heads_kv} S{self.seqlen_q}x{self.seqlen_k} "
                f"D{self.head_dim} {str(self.dtype)[6:]} {self.layout} mask={self.mask} "
                f"causal={self.is_causal} scale={self.scale} gqa={self.enable_gqa}")


def random_cases(n: int, seed: int, dtypes, head_dims, max_seqlen: int = 19,
                 max_batch: int = 2) -> list[Case]:
    """n cases from a seeded generator; sizes 0 and 1 come up often on purpose."""
    rng = random.Random(seed)

    def size(hi):
        return rng.choice([0, 1, 1, rng.randint(2, hi), rng.randint(2, hi), rng.randint(2, hi)])

    cases = []
    for i in range(n):
        heads_kv = rng.choice([0, 1, 1, 2, 2, 3])
        group = rng.choice([1, 1, 2, 4])
        heads_q = heads_kv * group if heads_kv else rng.choice([0, 1, 2])
        seqlen_q = size(max_seqlen)
        seqlen_k = seqlen_q if rng.random() < 0.3 else size(max_seqlen)
        cases.append(Case(
            batch=rng.choice([0, 1, 1, max_batch]),
            heads_q=heads_q, heads_kv=heads_kv, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
            head_dim=rng.choice(list(head_dims)),
            dtype=rng.choice(list(dtypes)),
            layout=rng.choice(LAYOUTS[:2] * 4 + LAYOUTS[2:]),
            mask=rng.choice(MASK_KINDS[:1] * 3 + MASK_KINDS[1:]),
            is_causal=rng.random() < 0.4,
            scale=rng.choice([None, None, 0.3]),
            enable_gqa=heads_q != heads_kv or rng.random() < 0.2,
            seed=seed * 100003 + i,
        ))
    return cases


def make_inputs(case: Case, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                             Optional[torch.Tensor]]:
    """q [B, Hq, Sq, D], k / v [B, Hkv, Sk, D] in the case's layout, and its mask."""
    g = torch.Generator().manual_seed(case.seed)
    b, hq, hkv, sq, sk, d = (case.batch, case.heads_q, case.heads_kv, case.seqlen_q,
                             case.seqlen_k, case.head_dim)

    def tensor(heads, seqlen):
        if case.layout == "bshd":
            t = torch.randn(b, seqlen, heads, d, generator=g).transpose(1, 2)
        elif case.layout == "last dim stride 2":
            t = torch.randn(b, heads, seqlen, 2 * d, generator=g)[..., ::2]
        else:
            t = torch.randn(b, heads, seqlen, d, generator=g)
        return t.to(device=device, dtype=case.dtype)

    q, k, v = tensor(hq, sq), tensor(hkv, sk), tensor(hkv, sk)
    kind = case.mask
    if kind == "none":
        mask = None
    elif kind == "bool [Sq, Sk]":
        mask = torch.rand(sq, sk, generator=g) > 0.3
    elif kind == "bool [B, 1, Sq, Sk]":
        mask = torch.rand(b, 1, sq, sk, generator=g) > 0.3
    elif kind == "bool key padding [B, 1, 1, Sk]":
        mask = torch.arange(sk).view(1, 1, 1, sk) < torch.randint(0, sk + 1, (b, 1, 1, 1),
                                                                   generator=g)
    elif kind == "bool per head [B, Hq, Sq, Sk]":
        mask = torch.rand(b, hq, sq, sk, generator=g) > 0.5
    elif kind == "bool rows without keys":
        mask = torch.rand(sq, sk, generator=g) > 0.3
        mask[: (sq + 1) // 2] = False
    elif kind == "bool all masked":
        mask = torch.zeros(sq, sk, dtype=torch.bool)
    elif kind == "additive fp32 with -inf":
        mask = torch.randn(sq, sk, generator=g)
        mask = mask.masked_fill(torch.rand(sq, sk, generator=g) > 0.7, float("-inf"))
    elif kind == "additive query dtype [B, 1, Sq, Sk]":
        keep = torch.rand(b, 1, sq, sk, generator=g) > 0.3
        mask = torch.zeros(b, 1, sq, sk).masked_fill(~keep, float("-inf")).to(case.dtype)
    elif kind == "additive dtype minimum, left padding [B, 1, Sq, Sk]":
        # transformers' form: causal, the first keys of each sequence padding, the minimum of
        # the query's dtype as fill (bf16: rows of the fill only, which SDPA weighs uniformly)
        pad = torch.randint(0, sk + 1, (b, 1, 1, 1), generator=g)
        j, i = torch.arange(sk).view(1, 1, 1, sk), torch.arange(sq).view(1, 1, sq, 1)
        keep = (j >= pad) & (j <= i)
        mask = torch.zeros(b, 1, sq, sk, dtype=case.dtype).masked_fill(
            ~keep, torch.finfo(case.dtype).min)
    else:
        raise ValueError(kind)
    return q, k, v, mask.to(device) if mask is not None else None


# ---- the entry points ---------------------------------------------------------------------


def run_stock(q, k, v, mask, case, grad_out=None):
    """(out, (dq, dk, dv) or None) from F.scaled_dot_product_attention. Key heads 0:
    torch 2.13's answer (zeros; it takes any such call), computed here, as stock before
    2.13 ends the process on it (a division by zero)."""
    # (batch 0 on CUDA: stock before 2.13 raises "'NoneType' object is not iterable" in its
    # backward; 2.13's answer, the empty result, is computed here alike)
    if q.dim() == k.dim() == 4 and (k.size(1) == 0 or (q.is_cuda and q.size(0) == 0)):
        if k.size(1) != 0:
            with torch.no_grad():  # stock's own refusals: its forward runs at batch 0
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=case.is_causal,
                                               scale=case.scale, enable_gqa=case.enable_gqa)
        out = q.new_zeros(q.shape[:3] + v.shape[3:])
        if grad_out is None:
            return out, None
        return out, (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
    return _run_autograd(lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=case.is_causal, scale=case.scale,
        enable_gqa=case.enable_gqa), q, k, v, grad_out)


def run_drop_in(q, k, v, mask, case, grad_out=None):
    return _run_autograd(lambda q, k, v: torch_sm90_sdpa.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=case.is_causal, scale=case.scale,
        enable_gqa=case.enable_gqa), q, k, v, grad_out)


def run_op(q, k, v, mask, case, grad_out=None):
    """The differentiable op `sdpa` (stock forward, our backward through autograd)."""
    return _run_autograd(lambda q, k, v: sdpa_op(q, k, v, case.is_causal, case.scale,
                                                 case.enable_gqa, mask)[0], q, k, v, grad_out)


def run_op_pair(q, k, v, mask, case, grad_out=None):
    """`sdpa` forward without autograd, then `sdpa_backward` called directly."""
    with torch.no_grad():
        out, lse = sdpa_op(q, k, v, case.is_causal, case.scale, case.enable_gqa, mask)
        if grad_out is None:
            return out, None
        grads = sdpa_backward_op(grad_out, q, k, v, out, lse, case.is_causal, case.scale,
                                 False, mask)
    return out, grads


ENTRY_POINTS: dict[str, Callable] = {"drop-in": run_drop_in, "sdpa": run_op,
                                     "sdpa + sdpa_backward": run_op_pair}


def _run_autograd(fn, q, k, v, grad_out):
    if grad_out is None:
        with torch.no_grad():
            return fn(q, k, v), None
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    grads = tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves))
    return out.detach(), grads


def run_reference(q, k, v, mask, case, grad_out=None):
    """(out, grads) of SDPA's math in float64, with autograd: a row without a visible key gives
    0 and zero gradients, as the fused kernels (the math path gives NaN there), and a row whose
    every key carries a huge finite fill gets uniform weights (the fused CPU kernel's backward
    is Sk times off there, its lse having lost log(Sk) next to the fill). Empty sizes: stock's
    answer (run_stock)."""
    if 0 in q.shape or 0 in k.shape or 0 in v.shape:
        return run_stock(q, k, v, mask, case, grad_out)
    scale = case.scale if case.scale is not None else default_scale(q.size(-1))

    def attention(q, k, v):
        group = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = q @ k.transpose(-1, -2) * scale
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
        if case.is_causal:
            s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
        top = s.amax(-1, keepdim=True).detach()
        e = torch.exp(s - top.masked_fill(top == float("-inf"), 0.0))
        total = e.sum(-1, keepdim=True)
        return (e / total.masked_fill(total == 0, 1.0)) @ v

    return _run_autograd(attention, q, k, v, grad_out)


def outcome(fn):
    """("ok", result) or ("error", exception)."""
    try:
        return "ok", fn()
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        return "error", e


# ---- the comparison -----------------------------------------------------------------------

# Slack on top of 2x stock's error, per dtype (relative to the reference's largest magnitude).
TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-2,
             torch.float16: 2e-3}


def _err(x, ref) -> float:
    if ref.numel() == 0:
        return 0.0
    diff = (x.to(torch.float64) - ref).abs().max().item()
    return diff / max(1.0, ref.abs().max().item())


def _drop_in_serves(q, k, v, mask, case, grad_mode) -> bool:
    """Whether the drop-in runs the call itself (api._unservable_reason finds nothing), with
    the inputs as check_case hands them to it (leaves that need a gradient in grad mode)."""
    leaves = [t.detach().requires_grad_(grad_mode) for t in (q, k, v)]
    with torch.set_grad_enabled(grad_mode):
        return _api._unservable_reason(*leaves, mask, 0.0, case.enable_gqa, case.is_causal,
                                       case.scale) is None


def check_case(case: Case, device, entry_points=None, grad_mode: bool = True) -> list[str]:
    """Runs every entry point and stock on the case; returns what differs (empty: agrees).
    The reference is stock SDPA on float64 copies of the inputs."""
    q, k, v, mask = make_inputs(case, device)
    orig_case, orig_mask = case, mask
    problems = []
    go = None
    if grad_mode:
        go = torch.randn(q.shape[:3] + v.shape[3:],
                         generator=torch.Generator().manual_seed(case.seed + 1))
        go = go.to(device=device, dtype=case.dtype)
    stock = outcome(lambda: run_stock(q, k, v, mask, case, go))
    # A float mask of another dtype than the query's: on CUDA stock refuses it with is_causal
    # ("should match query's dtype") and otherwise runs its math path, which gives NaN on rows
    # without a visible key. The ops take such a mask (documented) and give those rows 0, as
    # stock's fused kernels do: they are compared with stock given the mask in q's dtype. The
    # drop-in passes the refused calls to stock and must refuse them as stock does.
    # (the drop-in passes the math-path calls to stock: it must give stock's own answer)
    stock_refusal = drop_in_stock = None
    if mask is not None and mask.is_floating_point() and mask.dtype != q.dtype and (
            (stock[0] == "error" and "should match query's dtype" in str(stock[1]))
            or (stock[0] == "ok" and _has_nan(stock[1]))):
        fused = outcome(lambda: run_stock(q, k, v, mask.to(q.dtype), case, go))
        if fused[0] == "ok":
            stock_refusal = stock if stock[0] == "error" else None
            # The drop-in passes to stock a masked call with is_causal, and any call it does
            # not serve (on CUDA: a dtype or head dim this build has no kernel for): there it
            # gives stock's own answer
            if stock[0] == "ok" and (case.is_causal or not _drop_in_serves(q, k, v, mask, case,
                                                                          grad_mode)):
                drop_in_stock = stock
            stock = fused
    ref = None
    if stock[0] == "error" and case.is_causal and mask is not None and \
            "attn_mask should not be set when is_causal" in str(stock[1]):
        # stock's math path refuses a mask with is_causal; the ops apply both (documented):
        # stock with the causal mask folded into the mask is what they must give
        case = dataclasses.replace(case, is_causal=False)
        mask = _with_causal(mask, case, q.dtype)
        stock = outcome(lambda: run_stock(q, k, v, mask, case, go))
        entry_points = {n: (lambda fn: lambda q, k, v, _m, _c, go: fn(q, k, v, orig_mask,
                                                                       orig_case, go))(fn)
                        for n, fn in (entry_points or ENTRY_POINTS).items() if n != "drop-in"}
    if stock[0] == "ok":
        # the float64 reference runs stock's math path, which takes a mask or is_causal, not
        # both: the causal cut folded into the mask
        ref_case, ref_mask = case, mask
        if case.is_causal and mask is not None:
            ref_case, ref_mask = dataclasses.replace(case, is_causal=False), _with_causal(
                mask, case, q.dtype)
        q64, k64, v64 = (t.to(device="cpu", dtype=torch.float64) for t in (q, k, v))
        if ref_mask is not None:
            ref_mask = ref_mask.to(device="cpu", dtype=torch.float64
                                   if ref_mask.is_floating_point() else ref_mask.dtype)
        ref = run_reference(q64, k64, v64, ref_mask, ref_case,
                            go.to(device="cpu", dtype=torch.float64) if go is not None else None)
        ref = (ref[0].to(q.device), None if ref[1] is None else
               tuple(g.to(q.device) for g in ref[1]))
    for name, fn in (entry_points or ENTRY_POINTS).items():
        ours = outcome(lambda: fn(q, k, v, mask, case, go))
        if name == "drop-in" and stock_refusal is not None:
            if ours[0] == "ok":
                problems.append(f"{name}: accepted a call stock refuses ({stock_refusal[1]})")
            elif str(ours[1]) != str(stock_refusal[1]):
                problems.append(f"{name}: refused with {ours[1]!r}, stock with "
                                f"{stock_refusal[1]!r}")
            continue
        if stock[0] == "error":
            if ours[0] == "ok":
                problems.append(f"{name}: accepted a call stock refuses ({stock[1]})")
            elif name == "drop-in" and str(ours[1]) != str(stock[1]):
                problems.append(f"{name}: refused with {ours[1]!r}, stock with {stock[1]!r}")
            continue
        if ours[0] == "error":
            if name == "drop-in" or not any(r in str(ours[1]) for r in OP_REFUSALS):
                problems.append(f"{name}: refused a call stock takes: {ours[1]!r}")
            continue
        theirs = drop_in_stock if name == "drop-in" and drop_in_stock is not None else stock
        (out, grads), (s_out, s_grads), (r_out, r_grads) = ours[1], theirs[1], ref
        pairs = [("out", out, s_out, r_out)]
        if grads is not None:
            pairs += [(n, g, sg, rg) for n, g, sg, rg in zip(("dq", "dk", "dv"), grads, s_grads,
                                                             r_grads)]
        for what, x, s, r in pairs:
            if x.shape != s.shape or x.dtype != s.dtype:
                problems.append(f"{name} {what}: {tuple(x.shape)} {x.dtype}, stock "
                                f"{tuple(s.shape)} {s.dtype}")
                continue
            if bool(x.isnan().any()) != bool(s.isnan().any()):
                problems.append(f"{name} {what}: NaN where stock has none or the reverse")
                continue
            bound = 2 * _err(s, r) + TOLERANCE[case.dtype]
            if not s.isnan().any() and _err(x, r) > bound:
                problems.append(f"{name} {what}: error {_err(x, r):.3g} > {bound:.3g} "
                                f"(stock {_err(s, r):.3g})")
    return problems


def _has_nan(result) -> bool:
    out, grads = result
    return bool(out.isnan().any()) or any(bool(g.isnan().any()) for g in grads or ())


def _with_causal(mask, case, dtype):
    """The mask with SDPA's top-left causal mask applied, in the mask's kind."""
    causal = torch.ones(case.seqlen_q, case.seqlen_k, dtype=torch.bool,
                        device=mask.device).tril()
    if mask.dtype == torch.bool:
        return mask & causal
    return mask.masked_fill(~causal, float("-inf"))


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if head_dim else 1.0
