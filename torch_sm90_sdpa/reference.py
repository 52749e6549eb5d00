"""The reference attention forward and backward: plain tensor math in fp32 (fp64 for
fp64 inputs), written out explicitly (no autograd: custom-op kernels run below the
Autograd key). The backward is what CI, opcheck and the CPU route of the compile pass run;
the forward serves the calls no fused kernel takes (empty sizes: no key, no query, no head,
a zero head dim), on any device. Together they state the semantics the CUDA kernels match.
"""
from __future__ import annotations

import torch


def causal_mask(seqlen_q: int, seqlen_k: int, device) -> torch.Tensor:
    """SDPA's causal mask, aligned top-left: key j is visible to query i iff j <= i
    (also when Sq != Sk; FlashAttention kernels align bottom-right instead)."""
    return torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device).tril()


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def expand_mask(attn_mask: torch.Tensor, batch: int, heads_q: int, seqlen_q: int,
                seqlen_k: int) -> torch.Tensor:
    """attn_mask as a [B, Hq, Sq, Sk] view (stride 0 on the broadcast dims)."""
    while attn_mask.dim() < 4:
        attn_mask = attn_mask.unsqueeze(0)
    return attn_mask.expand(batch, heads_q, seqlen_q, seqlen_k)


def mask_bias(attn_mask_b: torch.Tensor, math_dtype: torch.dtype) -> torch.Tensor:
    """The additive form of one batch element's [Hq, Sq, Sk] mask: 0 / -inf for a bool mask
    (True = attend), the values themselves for a float mask."""
    if attn_mask_b.dtype == torch.bool:
        zero = torch.zeros((), dtype=math_dtype, device=attn_mask_b.device)
        return torch.where(attn_mask_b, zero, torch.tensor(float("-inf"), dtype=math_dtype,
                                                           device=attn_mask_b.device))
    return attn_mask_b.to(math_dtype)


def attention_forward_reference(
    q: torch.Tensor,  # [B, Hq, Sq, D]
    k: torch.Tensor,  # [B, Hkv, Sk, D]
    v: torch.Tensor,  # [B, Hkv, Sk, Dv]
    is_causal: bool,
    scale: float,
    attn_mask: torch.Tensor | None = None,  # broadcastable to [B, Hq, Sq, Sk], bool or float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out [B, Hq, Sq, Dv] in q's dtype, lse [B, Hq, Sq] in the math dtype).

    Same scores as the backward. A row that sees no key (no key at all, every key masked, or
    Hkv = 0) gets out = 0 and lse = -inf, as stock SDPA gives 0 for such rows."""
    batch, heads_q, seqlen_q, _ = q.shape
    heads_kv, seqlen_k, head_dim_v = k.size(1), k.size(2), v.size(3)
    math_dtype = _math_dtype(q.dtype)
    out = q.new_zeros(batch, heads_q, seqlen_q, head_dim_v)
    lse = torch.full((batch, heads_q, seqlen_q), float("-inf"), dtype=math_dtype,
                     device=q.device)
    if out.numel() == 0 and lse.numel() == 0:
        return out, lse
    if seqlen_k == 0 or heads_kv == 0:
        return out, lse  # no query sees any key
    group = heads_q // heads_kv
    mask = causal_mask(seqlen_q, seqlen_k, q.device) if is_causal else None
    full_mask = (expand_mask(attn_mask, batch, heads_q, seqlen_q, seqlen_k)
                 if attn_mask is not None else None)
    for b in range(batch):  # one batch element at a time bounds the [Hq, Sq, Sk] scores
        qb = q[b].to(math_dtype)
        kb = k[b].to(math_dtype).repeat_interleave(group, dim=0)
        vb = v[b].to(math_dtype).repeat_interleave(group, dim=0)
        scores = torch.matmul(qb, kb.transpose(-1, -2)) * scale  # [Hq, Sq, Sk]
        if full_mask is not None:
            scores = scores + mask_bias(full_mask[b], math_dtype)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        # normalized by the row's sum, not by exp(lse): where every key of a row carries a
        # huge finite fill (transformers' additive masks: the dtype's minimum) lse rounds to
        # the fill, log(Sk) lost, and exp(scores - lse) would sum to Sk instead of 1. A row
        # that sees no key sums to 0: probabilities 0, lse -inf.
        row_max = scores.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        probs = torch.exp(scores - row_max)
        row_sum = probs.sum(dim=-1, keepdim=True)
        probs = probs / row_sum.clamp_min(torch.finfo(math_dtype).tiny)
        out[b].copy_(torch.matmul(probs, vb))
        lse[b].copy_((row_max + torch.log(row_sum)).squeeze(-1))
    return out, lse


def attention_backward_reference(
    grad_out: torch.Tensor,  # [B, Hq, Sq, Dv]
    q: torch.Tensor,  # [B, Hq, Sq, D]
    k: torch.Tensor,  # [B, Hkv, Sk, D]
    v: torch.Tensor,  # [B, Hkv, Sk, Dv]
    out: torch.Tensor,  # [B, Hq, Sq, Dv]
    lse: torch.Tensor,  # [B, Hq, Sq], natural log of sum_j exp(scale * q_i . k_j)
    is_causal: bool,
    scale: float,
    attn_mask: torch.Tensor | None = None,  # broadcastable to [B, Hq, Sq, Sk], bool or float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dq, dk, dv) in the input dtype with the strides of q, k, v.

    Scores are scale * q k^T plus the mask's bias (a bool mask: 0 where True, -inf where
    False), with keys after the query masked when is_causal. A row that sees no key (lse =
    -inf, or any value when every score of the row is -inf) gets zero gradients."""
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    batch, heads_q, seqlen_q, _ = q.shape
    heads_kv, seqlen_k = k.size(1), k.size(2)
    if dq.numel() + dk.numel() + dv.numel() == 0:
        return dq, dk, dv
    if seqlen_q == 0 or seqlen_k == 0 or heads_kv == 0 or heads_q == 0:
        # No query sees any key (or there is no query head): every gradient is zero.
        return dq.zero_(), dk.zero_(), dv.zero_()

    group = heads_q // heads_kv
    math_dtype = _math_dtype(q.dtype)
    mask = causal_mask(seqlen_q, seqlen_k, q.device) if is_causal else None
    full_mask = (expand_mask(attn_mask, batch, heads_q, seqlen_q, seqlen_k)
                 if attn_mask is not None else None)
    # One batch element at a time bounds the [Hq, Sq, Sk] intermediates.
    for b in range(batch):
        qb = q[b].to(math_dtype)  # [Hq, Sq, D]
        dob = grad_out[b].to(math_dtype)  # [Hq, Sq, Dv]
        ob = out[b].to(math_dtype)
        # Repeat each kv head over its group of q heads: [Hkv, Sk, D] -> [Hq, Sk, D].
        kb = k[b].to(math_dtype).repeat_interleave(group, dim=0)
        vb = v[b].to(math_dtype).repeat_interleave(group, dim=0)
        lseb = lse[b].to(math_dtype).unsqueeze(-1)  # [Hq, Sq, 1]
        # a row that sees no key: +inf makes every probability 0 instead of NaN
        lseb = lseb.masked_fill(lseb == float("-inf"), float("inf"))

        scores = torch.matmul(qb, kb.transpose(-1, -2)) * scale  # [Hq, Sq, Sk]
        if full_mask is not None:
            scores = scores + mask_bias(full_mask[b], math_dtype)
        probs = torch.exp(scores - lseb)
        if mask is not None:
            probs = probs.masked_fill(~mask, 0.0)
        # rows normalized (a no-op up to rounding for the forward's lse), as the forward's: a
        # row whose every key carries a huge finite fill has an lse that lost its log(Sk)
        probs = probs / probs.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(math_dtype).tiny)
        dvb = torch.matmul(probs.transpose(-1, -2), dob)  # [Hq, Sk, Dv]
        dprobs = torch.matmul(dob, vb.transpose(-1, -2))  # [Hq, Sq, Sk]
        delta = (dob * ob).sum(dim=-1, keepdim=True)  # [Hq, Sq, 1] = rowsum(dO * O)
        dscores = probs * (dprobs - delta)
        dqb = torch.matmul(dscores, kb) * scale  # [Hq, Sq, D]
        dkb = torch.matmul(dscores.transpose(-1, -2), qb) * scale  # [Hq, Sk, D]
        # GQA: sum dK / dV over the q heads of each group.
        dkb = dkb.view(heads_kv, group, seqlen_k, -1).sum(dim=1)
        dvb = dvb.view(heads_kv, group, seqlen_k, -1).sum(dim=1)
        dq[b].copy_(dqb)
        dk[b].copy_(dkb)
        dv[b].copy_(dvb)
    return dq, dk, dv
