"""The SM90 forward kernel (torch_sm90_sdpa::sdpa_forward on CUDA): out and lse against float64
within twice the error of stock SDPA's fused forward on the same inputs, every compiled head dim
and dtype, causal (top-left, also Sq != Sk) and full, GQA / MQA, odd lengths, strided views;
bitwise repeatable; and the calls it does not serve go to the stock forward."""
import pytest
import torch
import torch.nn.functional as F

import torch_sm90_sdpa  # noqa: F401
from torch_sm90_sdpa import _cuda_backend, _extension
from conftest import make_qkv, requires_sm90

pytestmark = [requires_sm90, pytest.mark.gpu]

sdpa_forward = torch.ops.torch_sm90_sdpa.sdpa_forward


def _built():
    C = _extension.load()
    listed = getattr(C, "compiled_fwd_variants", None)  # (a build from before the forward: none)
    return [(d, dt) for dt, d in (listed() if listed is not None else [])]


_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
VARIANTS = [pytest.param(d, _DTYPES[dt], id=f"d{d}-{dt}") for d, dt in _built()]


@pytest.fixture(params=["0", "1"], ids=["in-turn", "overlap"])
def kernel_kind(request, monkeypatch):
    """Both forward kernels: FwdParams::overlap from TORCH_SM90_SDPA_FWD_OVERLAP (read per call)."""
    monkeypatch.setenv("TORCH_SM90_SDPA_FWD_OVERLAP", request.param)
    return request.param


def _reference(q, k, v, is_causal, scale):
    group = q.size(1) // k.size(1)
    kk, vv = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = q.double() @ kk.transpose(-1, -2) * scale
    if is_causal:
        keep = torch.ones(q.size(2), k.size(2), dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    out = scores.softmax(-1) @ vv
    lse = scores.logsumexp(-1)
    # rows without a visible key: out 0, lse -inf (SDPA's math gives NaN there)
    return torch.nan_to_num(out, nan=0.0), lse


def _err(a, b):
    return (a.double() - b).abs().max().item()


CASES = [  # (batch, Hq, Hkv, Sq, Sk)
    (2, 4, 4, 128, 128), (1, 4, 4, 1, 1), (2, 4, 4, 300, 300), (1, 8, 2, 200, 333),
    (1, 8, 2, 333, 200), (1, 8, 1, 1000, 1000), (2, 2, 2, 1030, 517), (1, 2, 2, 64, 2100),
]


@pytest.mark.skipif(not VARIANTS, reason="no forward kernel compiled")
@pytest.mark.parametrize("head_dim,dtype", VARIANTS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_forward_matches_fp64_within_stock_error(head_dim, dtype, is_causal, case, layout, kernel_kind):
    b, hq, hkv, sq, sk = case
    torch.manual_seed(sum(case) + head_dim)
    q, k, v = make_qkv(b, hq, hkv, sq, sk, head_dim, dtype=dtype, device="cuda", layout=layout)
    assert _cuda_backend.forward_unserved(q, k, v, is_causal) is None
    scale = head_dim ** -0.5
    out, lse = sdpa_forward(q, k, v, is_causal, None, hq != hkv)
    want_out, want_lse = _reference(q, k, v, is_causal, scale)
    stock = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=hq != hkv)
    stock = torch.nan_to_num(stock.double(), nan=0.0)
    assert out.shape == q.shape and out.dtype == dtype and out.stride() == torch.empty_like(q).stride()
    assert torch.isfinite(out).all()
    err, stock_err = _err(out, want_out), _err(stock, want_out)
    assert err <= 2 * stock_err + 1e-3, (err, stock_err)
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)  # -inf exactly where no key is visible
    torch.testing.assert_close(lse.double()[finite], want_lse[finite], atol=2e-3, rtol=1e-4)


@pytest.mark.skipif(not VARIANTS, reason="no forward kernel compiled")
@pytest.mark.parametrize("head_dim,dtype", VARIANTS)
def test_forward_is_bitwise_repeatable(head_dim, dtype, kernel_kind):
    q, k, v = make_qkv(2, 8, 2, 777, 1500, head_dim, dtype=dtype, device="cuda", layout="bshd")
    first = sdpa_forward(q, k, v, True, None, True)
    for _ in range(3):
        again = sdpa_forward(q, k, v, True, None, True)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.skipif(not VARIANTS, reason="no forward kernel compiled")
def test_forward_then_our_backward_matches_stock_gradients(kernel_kind):
    d, dtype = _built()[0]
    dtype = _DTYPES[dtype]
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 8, 2, 600, 600, d, dtype=dtype, device="cuda",
                                                    layout="bshd"))
    out, _ = sdpa_forward(q, k, v, True, None, True)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True, enable_gqa=True)
    want = torch.autograd.grad(ref, (q64, k64, v64), grad.double())
    stock = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    stock_grads = torch.autograd.grad(stock, (q, k, v), grad)
    for g, s, w in zip(grads, stock_grads, want):
        assert _err(g, w) <= 2 * _err(s, w) + 1e-3


def test_unserved_calls_take_the_stock_forward():
    q, k, v = make_qkv(1, 2, 2, 64, 64, 64, dtype=torch.bfloat16, device="cuda")
    keep = torch.ones(64, 64, dtype=torch.bool, device="cuda").tril()
    assert "attn_mask" in _cuda_backend.forward_unserved(q, k, v, False, keep)
    out, lse = sdpa_forward(q, k, v, False, None, False, keep)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)
    q32, k32, v32 = (t.float() for t in (q, k, v))
    assert _cuda_backend.forward_unserved(q32, k32, v32) == "dtype"
