"""Masks on CPU: the reference against float64 autograd of stock SDPA, the op layer (fake,
opcheck, errors, the drop-in) and the compile rewrite of masked SDPA calls."""
import math

import pytest
import torch
import torch.nn.functional as F

import torch_sm90_sdpa
from conftest import (as_bias, causal_bool, documents, make_qkv, padding,
                      reference_grads_fp64_masked, sliding_window)

sdpa = torch.ops.torch_sm90_sdpa.sdpa
sdpa_backward = torch.ops.torch_sm90_sdpa.sdpa_backward

B, HQ, HKV, S = 2, 4, 2, 37


def _mask(kind, sq=S, sk=S, heads=HQ):
    g = torch.Generator().manual_seed(7)
    if kind == "causal [Sq, Sk]":
        return causal_bool(sq, sk)
    if kind == "padding right [B, 1, Sq, Sk]":
        return padding(B, sq, sk, [sk, sk - 9])
    if kind == "padding left [B, 1, Sq, Sk]":
        return padding(B, sq, sk, [sk - 5, sk], left=True)
    if kind == "key padding [B, 1, 1, Sk]":
        return padding(B, 1, sk, [sk - 3, sk - 11], causal=False)
    if kind == "sliding window":
        return sliding_window(sq, sk, 8)
    if kind == "documents":
        return documents([10, 20, sq - 30])
    if kind == "random bool per head [B, Hq, Sq, Sk]":
        return torch.rand(B, heads, sq, sk, generator=g) > 0.3
    if kind == "all-masked rows":
        m = causal_bool(sq, sk).clone()
        m[3] = False
        m[20:23] = False
        return m
    if kind == "additive fp32 with -inf":
        bias = torch.randn(sq, sk, generator=g)
        return bias.masked_fill(torch.rand(sq, sk, generator=g) > 0.8, float("-inf"))
    if kind == "additive bf16 0/-inf [B, 1, Sq, Sk]":
        return as_bias(padding(B, sq, sk, [sk, sk - 4]), torch.bfloat16)
    raise ValueError(kind)


MASKS = ["causal [Sq, Sk]", "padding right [B, 1, Sq, Sk]", "padding left [B, 1, Sq, Sk]",
         "key padding [B, 1, 1, Sk]", "sliding window", "documents",
         "random bool per head [B, Hq, Sq, Sk]", "all-masked rows", "additive fp32 with -inf",
         "additive bf16 0/-inf [B, 1, Sq, Sk]"]


@pytest.mark.parametrize("is_causal", [False, True], ids=["mask", "mask+causal"])
@pytest.mark.parametrize("kind", MASKS)
def test_reference_with_masks_matches_fp64_autograd(kind, is_causal):
    torch.manual_seed(0)
    q, k, v = make_qkv(B, HQ, HKV, S, S, 16, dtype=torch.float64)
    mask = _mask(kind)
    scale = 0.25
    out, lse = sdpa(q, k, v, is_causal, scale, True, mask)
    grad_out = torch.randn_like(out)
    ref_out, *ref = reference_grads_fp64_masked(q, k, v, grad_out, mask, is_causal, scale)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    grads = sdpa_backward(grad_out, q, k, v, out, lse, is_causal, scale, False, mask)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        assert not g.isnan().any(), name
        torch.testing.assert_close(g, r, rtol=1e-8, atol=1e-10, msg=name)


def test_rows_without_keys_have_zero_gradients():
    q, k, v = make_qkv(1, 2, 2, 8, 8, 16, dtype=torch.float64)
    mask = causal_bool(8, 8).clone()
    mask[2] = False
    out, lse = sdpa(q, k, v, False, 0.3, False, mask)
    assert (out[:, :, 2] == 0).all()
    # lse of such a row: whatever the forward says (-inf or 0): the gradients are 0 either way
    for row_lse in (float("-inf"), 0.0):
        lse2 = lse.clone()
        lse2[:, :, 2] = row_lse
        dq, dk, dv = sdpa_backward(torch.randn_like(out), q, k, v, out, lse2, False, 0.3, False,
                                   mask)
        assert (dq[:, :, 2] == 0).all() and not dq.isnan().any() and not dk.isnan().any()


@pytest.mark.parametrize("kind", ["padding right [B, 1, Sq, Sk]", "key padding [B, 1, 1, Sk]",
                                  "additive fp32 with -inf", "sliding window"])
def test_opcheck_with_masks(kind):
    q, k, v = make_qkv(B, HQ, HKV, S, S, 16, dtype=torch.float32)
    mask = _mask(kind)
    out, lse = sdpa(q, k, v, False, 0.25, True, mask)
    torch.library.opcheck(sdpa_backward.default,
                          (torch.randn_like(out), q, k, v, out, lse, False, 0.25, False, mask))
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    torch.library.opcheck(sdpa.default, (qs, ks, vs, True, 0.25, True, mask))


@pytest.mark.parametrize("bad,exc,pattern", [
    (lambda: torch.ones(S, S, dtype=torch.int32), TypeError, "attn_mask: expected dtype torch.bool"),
    (lambda: torch.ones(3, 1, S, S, dtype=torch.bool), ValueError,
     r"attn_mask: expected a shape broadcastable to \[B, Hq, Sq, Sk\] = \(2, 4, 37, 37\)"),
    (lambda: torch.ones(1, 1, 1, S, S, dtype=torch.bool), ValueError, "broadcastable"),
    (lambda: torch.ones(S, S, dtype=torch.bool, device="meta"), ValueError,
     "attn_mask: expected a tensor on cpu"),
])
def test_bad_masks_are_named(bad, exc, pattern):
    q, k, v = make_qkv(B, HQ, HKV, S, S, 16, dtype=torch.float32)
    out, lse = sdpa(q, k, v, False, 0.25, True)
    with pytest.raises(exc, match=pattern):
        sdpa_backward(torch.randn_like(out), q, k, v, out, lse, False, 0.25, False, bad())
    with pytest.raises(exc, match=pattern):
        sdpa(q, k, v, False, 0.25, True, bad())


def test_a_mask_that_requires_grad_is_refused_by_the_op_and_left_to_stock_by_the_drop_in():
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 8, 8, 16, dtype=torch.float32))
    bias = torch.zeros(8, 8, requires_grad=True)
    with pytest.raises(ValueError, match="attn_mask: a mask that requires grad is not served"):
        sdpa(q, k, v, False, 0.25, False, bias)
    out = torch_sm90_sdpa.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    out.sum().backward()  # stock: the mask gets its gradient
    assert bias.grad is not None


@pytest.mark.parametrize("kind", ["padding right [B, 1, Sq, Sk]", "documents",
                                  "additive fp32 with -inf", "all-masked rows"])
def test_drop_in_with_masks_matches_stock(kind):
    torch.manual_seed(1)
    q, k, v = make_qkv(B, HQ, HKV, S, S, 16, dtype=torch.float32)
    mask = _mask(kind)
    results = []
    for fn in (torch_sm90_sdpa.scaled_dot_product_attention, F.scaled_dot_product_attention):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = fn(qq, kk, vv, attn_mask=mask, enable_gqa=True)
        out.backward(torch.ones_like(out))
        results.append((out, qq.grad, kk.grad, vv.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_drop_in_serves_masks_with_our_op(monkeypatch):
    calls = []
    real = torch_sm90_sdpa.ops._sdpa_body  # the op's body, which the eager drop-in calls
    monkeypatch.setattr(torch_sm90_sdpa.ops, "_sdpa_body", lambda *a: calls.append(a) or real(*a))
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 8, 8, 16, dtype=torch.float32))
    torch_sm90_sdpa.scaled_dot_product_attention(q, k, v, attn_mask=causal_bool(8, 8))
    assert len(calls) == 1 and calls[0][-1] is not None


@pytest.mark.parametrize("shape,dtype,routed", [
    ((2, 1, 5, 7), torch.bfloat16, True),   # transformers' additive form: fill hidden
    ((5, 7), torch.float32, True),          # broadcast over batch and heads
    ((2, 1, 5, 7), torch.float16, False),   # fp16's minimum (-65504) hides nothing
    ((2, 3, 5, 7), torch.bfloat16, False),  # a bias per head (ALiBi, T5): dense
    ((3, 5, 7), torch.float32, False),
])
def test_which_additive_masks_our_forward_takes(shape, dtype, routed):
    """eligibility.additive_mask_slower_forward: the additive masks whose forward stays on
    stock (sdpa, the drop-in and the compile route's forward gate ask it)."""
    from torch_sm90_sdpa import eligibility

    mask = torch.zeros(shape, dtype=dtype)
    why = eligibility.additive_mask_slower_forward(mask)
    assert (why is None) == routed, why
    if len(shape) == 4 and shape[1] == 1:  # expanded over heads (stride 0): still one bias
        assert (eligibility.additive_mask_slower_forward(mask.expand(2, 3, 5, 7)) is None) == routed
