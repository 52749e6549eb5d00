"""The CPU reference kernel of sdpa_backward against autograd of stock SDPA in float64."""
import math

import pytest
import torch

from conftest import make_qkv, reference_grads_fp64, rel_err, stock_forward_cpu

sdpa_backward = torch.ops.torch_sm90_sdpa.sdpa_backward

SHAPES = [
    # (B, Hq, Hkv, Sq, Sk, D)
    (2, 4, 4, 17, 17, 32),
    (1, 2, 2, 1, 1, 16),
    (1, 2, 2, 1, 17, 16),
    (1, 2, 2, 17, 1, 16),
    (1, 2, 2, 1000, 1000, 64),
    (2, 3, 3, 17, 40, 32),     # Sq < Sk
    (2, 3, 3, 40, 17, 32),     # Sq > Sk
    (2, 8, 2, 33, 33, 16),     # GQA
    (1, 4, 1, 17, 30, 16),     # MQA, Sq != Sk
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_reference_matches_fp64_autograd(shape, is_causal):
    batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim = shape
    torch.manual_seed(hash((shape, is_causal)) % 2**31)
    q, k, v = make_qkv(*shape, dtype=torch.float64)
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = stock_forward_cpu(q, k, v, is_causal, scale)
    grad_out = torch.randn_like(out)
    ref_out, *ref = reference_grads_fp64(q, k, v, grad_out, is_causal, scale)
    assert rel_err(out, ref_out) < 1e-12
    grads = sdpa_backward(grad_out, q, k, v, out, lse, is_causal, scale, False)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        assert g.shape == r.shape and g.dtype == torch.float64
        torch.testing.assert_close(g, r, rtol=1e-8, atol=1e-10, msg=name)


def test_causal_is_top_left_aligned():
    """With Sq > Sk the first query sees only key 0: its dq depends on key 0 alone, and
    keys beyond the diagonal get no gradient from early queries (bottom-right alignment
    would differ)."""
    torch.manual_seed(0)
    q, k, v = make_qkv(1, 1, 1, 6, 3, 8)
    scale = 0.5
    out, lse = stock_forward_cpu(q, k, v, True, scale)
    grad_out = torch.zeros_like(out)
    grad_out[..., 0, :] = torch.randn(8, dtype=torch.float64)  # only query 0 matters
    dq, dk, dv = sdpa_backward(grad_out, q, k, v, out, lse, True, scale, False)
    # query 0 attends to key 0 only: P = 1, so dv[0] = grad_out[0] and dk = dq = 0.
    torch.testing.assert_close(dv[0, 0, 0], grad_out[0, 0, 0])
    assert dv[0, 0, 1:].abs().max() == 0 and dk[0, 0, 1:].abs().max() == 0
    assert dk.abs().max() < 1e-12 and dq.abs().max() < 1e-12


@pytest.mark.parametrize("layout", ["bshd", "packed"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_strided_views_and_output_strides(layout, heads):
    """q/k/v as views (transposed, or sliced from one packed qkv tensor): right values,
    and dq/dk/dv come back with the strides of q/k/v (empty_like semantics)."""
    torch.manual_seed(1)
    heads_q, heads_kv = heads
    q, k, v = make_qkv(2, heads_q, heads_kv, 20, 20, 16, layout=layout)
    scale = 0.3  # explicit, not 1/sqrt(D)
    out, lse = stock_forward_cpu(q, k, v, True, scale)
    grad_out = torch.randn_like(out)
    _, *ref = reference_grads_fp64(q, k, v, grad_out, True, scale)
    grads = sdpa_backward(grad_out, q, k, v, out, lse, True, scale, False)
    for g, r, inp in zip(grads, ref, (q, k, v)):
        torch.testing.assert_close(g, r, rtol=1e-8, atol=1e-10)
        assert g.stride() == torch.empty_like(inp).stride()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_low_precision_error_within_stock(dtype, is_causal):
    """In fp16/bf16/fp32 the reference (fp32 math) is at least as accurate as the stock
    CPU backward, measured against float64."""
    torch.manual_seed(2)
    q, k, v = make_qkv(2, 4, 2, 70, 50, 32, dtype=dtype)
    scale = 1 / math.sqrt(32)
    out, lse = stock_forward_cpu(q, k, v, is_causal, scale)
    grad_out = torch.randn_like(out)
    _, *ref = reference_grads_fp64(q, k, v, grad_out, is_causal, scale)
    ours = sdpa_backward(grad_out, q, k, v, out, lse, is_causal, scale, False)
    k_rep, v_rep = (t.repeat_interleave(2, dim=1) for t in (k, v))
    stock = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k_rep, v_rep, out, lse, 0.0, is_causal, scale=scale
    )
    stock = (stock[0], stock[1].unflatten(1, (2, 2)).sum(2), stock[2].unflatten(1, (2, 2)).sum(2))
    for g, s, r in zip(ours, stock, ref):
        assert g.dtype == dtype
        assert not g.isnan().any()
        assert rel_err(g, r) <= 2 * rel_err(s, r) + 1e-5


def test_empty_inputs():
    for shape in [(0, 2, 2, 5, 5, 8), (1, 2, 2, 0, 5, 8), (1, 2, 2, 5, 0, 8)]:
        q, k, v = make_qkv(*shape)
        out = torch.zeros(*q.shape[:3], v.size(-1), dtype=q.dtype)
        lse = torch.zeros(q.shape[:3], dtype=torch.float32)
        dq, dk, dv = sdpa_backward(torch.ones_like(out), q, k, v, out, lse, True, 0.5, False)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        for g in (dq, dk, dv):
            assert g.numel() == 0 or g.abs().max() == 0
