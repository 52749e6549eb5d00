"""The SM90 forward kernel (torch_sm90_sdpa::sdpa_forward on CUDA): out and lse against float64
within twice the error of stock SDPA's fused forward on the same inputs, every compiled head dim
and dtype, causal (top-left, also Sq != Sk) and full, GQA / MQA, odd lengths, strided views;
every mask kind of the backward's tests (bool and additive, broadcast, per head, rows without
keys, combined with is_causal) on every head dim, and classified tiles whose 64-key halves
differ (two key blocks for the head dims of 64-key blocks); bitwise repeatable; and the calls it
does not serve go to the stock forward."""
import pytest
import torch
import torch.nn.functional as F

import torch_sm90_sdpa  # noqa: F401
from torch_sm90_sdpa import _cuda_backend, _extension
from conftest import causal_bool, make_qkv, requires_sm90
from test_cuda_backward import poison_allocator
from test_cuda_masks import KINDS as MASK_KINDS, make_mask, reference_out_lse

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
@pytest.mark.parametrize("scale", [-0.3, 0.0, 0.02, 1.5])
@pytest.mark.parametrize("mask", [None, "bool"])
def test_forward_takes_any_scale(head_dim, dtype, scale, mask, kernel_kind):
    """The kernel folds the scale into the exponent after the row max, which needs scale > 0:
    sdpa_forward_cuda hands it -q for a negative scale and zero scores for scale 0."""
    torch.manual_seed(int(scale * 10) + head_dim)
    q, k, v = make_qkv(1, 4, 2, 300, 300, head_dim, dtype=dtype, device="cuda", layout="bshd")
    keep = None
    if mask == "bool":  # causal, with a hidden band: every kind of tile
        i = torch.arange(300, device="cuda")
        keep = (i[None, :] <= i[:, None]) & ((i[:, None] - i[None, :]) % 97 < 80)
    out, lse = sdpa_forward(q, k, v, keep is None, scale, True, keep)
    want_out, want_lse = (_reference(q, k, v, True, scale) if keep is None
                          else reference_out_lse(q, k, v, keep, False, scale))
    stock = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=keep is None,
                                           scale=scale, enable_gqa=True)
    err, stock_err = _err(out, want_out), _err(torch.nan_to_num(stock.double()), want_out)
    assert err <= 2 * stock_err + 1e-3, (err, stock_err)
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
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
    keep = torch.ones(64, 64, dtype=torch.int32, device="cuda").tril()
    assert "attn_mask dtype" in _cuda_backend.forward_unserved(q, k, v, False, keep)
    q32, k32, v32 = (t.float() for t in (q, k, v))
    assert _cuda_backend.forward_unserved(q32, k32, v32) == "dtype"
    assert _cuda_backend.forward_unserved(q32, k32, v32, False, keep.bool()) == "dtype"
    q8, k8, v8 = make_qkv(1, 2, 2, 64, 64, 8, dtype=torch.bfloat16, device="cuda")
    assert _cuda_backend.forward_unserved(q8, k8, v8) == "head dim not compiled"
    out, lse = sdpa_forward(q8, k8, v8, False, None, False, keep.bool())
    want = F.scaled_dot_product_attention(q8, k8, v8, attn_mask=keep.bool())
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)


# ---- masks -----------------------------------------------------------------------------------

def _stock_masked_err(q, k, v, mask, is_causal, scale, want_out):
    """The error of stock SDPA's fused forward with this mask (kv heads expanded)."""
    g = q.size(1) // k.size(1)
    m = mask
    if is_causal:
        tril = causal_bool(q.size(2), k.size(2), "cuda")
        m = (m & tril) if m.dtype == torch.bool else m.masked_fill(~tril, float("-inf"))
    if m.dtype != torch.bool:
        m = m.to(q.dtype)
    stock = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                           attn_mask=m, scale=scale)
    return _err(torch.nan_to_num(stock.double(), nan=0.0), want_out)


def _check_masked(kind, b, hq, hkv, sq, sk, d, dtype, is_causal=False, mask_dtype=None, seed=0,
                  mask=None):
    """kind: a make_mask kind, or a name for the given mask."""
    if (d, dtype) not in [(dd, _DTYPES[dt]) for dd, dt in _built()]:
        pytest.skip(f"no forward kernel for d{d} {dtype}")
    torch.manual_seed(seed)
    q = torch.randn(b, sq, hq, d, device="cuda").to(dtype).transpose(1, 2)
    k = torch.randn(b, sk, hkv, d, device="cuda").to(dtype).transpose(1, 2)
    v = torch.randn(b, sk, hkv, d, device="cuda").to(dtype).transpose(1, 2)
    if mask is None:
        mask = make_mask(kind, b, hq, sq, sk, mask_dtype or dtype)
    scale = d ** -0.5
    assert _cuda_backend.forward_unserved(q, k, v, is_causal, mask) is None
    want_out, want_lse = reference_out_lse(q, k, v, mask, is_causal, scale)
    poison_allocator(q, k, v)
    out, lse = sdpa_forward(q, k, v, is_causal, scale, hq != hkv, mask)
    assert out.stride() == torch.empty_like(q).stride()
    assert torch.isfinite(out).all() and not lse.isnan().any()
    dead = want_lse == float("-inf")  # rows that see no key: out 0, lse -inf
    assert (out[dead] == 0).all() and (lse[dead] == float("-inf")).all()
    err, stock_err = _err(out, want_out), _stock_masked_err(q, k, v, mask, is_causal, scale, want_out)
    assert err <= 2 * stock_err + 1e-3, (kind, err, stock_err)
    torch.testing.assert_close(lse.double()[~dead], want_lse[~dead], atol=2e-3, rtol=1e-4)
    return q, k, v, mask, out, lse


def _masked_variants():
    """Every built variant: each head dim's tile walks the classified tiles its own way (d192 and
    d256 in 64-key halves)."""
    return [pytest.param(d, _DTYPES[dt], id=f"d{d}-{dt}") for d, dt in _built()]


def _one_dtype_per_head_dim():
    """A variant of each built head dim (bf16 where built): for the longer mask tests."""
    by_dim = {}
    for d, dt in _built():
        if d not in by_dim or dt == "bf16":
            by_dim[d] = dt
    return [pytest.param(d, _DTYPES[dt], id=f"d{d}-{dt}") for d, dt in sorted(by_dim.items())]


@pytest.mark.skipif(not VARIANTS, reason="no forward kernel compiled")
@pytest.mark.parametrize("head_dim,dtype", _masked_variants())
@pytest.mark.parametrize("kind", MASK_KINDS + ["cuDNN fill causal", "cuDNN fill padding left"])
def test_masked_forward_matches_fp64_within_stock_error(kind, head_dim, dtype, kernel_kind):
    _check_masked(kind, 2, 4, 2, 333, 333, head_dim, dtype)


@pytest.mark.skipif(not VARIANTS, reason="no forward kernel compiled")
@pytest.mark.parametrize("head_dim,dtype", _one_dtype_per_head_dim())
@pytest.mark.parametrize("kind", ["causal", "padding left", "key padding [B,1,1,Sk]",
                                  "random per head", "additive bias"])
@pytest.mark.parametrize("sq,sk", [(300, 700), (700, 300), (1, 129), (1030, 1030)])
def test_masked_forward_with_is_causal_and_sq_not_sk(kind, sq, sk, head_dim, dtype, kernel_kind):
    _check_masked(kind, 2, 8, 2, sq, sk, head_dim, dtype, is_causal=True, seed=sq + sk)


def _halves_mask(sq, sk, additive_dtype=None):
    """A [1, 1, Sq, Sk] mask whose classified 128 x 128 tiles differ between their two 64-key
    halves (what a kernel with 64-key blocks reads as two blocks of one tile): keys 0-63 hidden
    and 64-127 random (a partial tile with an empty half), keys 128-191 visible and 192-255
    random (a partial tile with a full half), the tile of queries and keys 128-255 hidden whole
    (an empty tile between non-empty ones), keys 320 on hidden (the last tile's second half and
    the key tail), and row 5 hidden whole. additive_dtype: as a 0 / -inf bias of that dtype
    (the classification's bits as well)."""
    g = torch.Generator(device="cpu").manual_seed(5)
    keep = torch.rand(sq, sk, generator=g) > 0.5
    keep[:, 0:64] = False
    keep[:, 128:192] = True
    keep[128:256, 128:256] = False
    keep[:, 320:] = False
    keep[5] = False
    keep = keep.cuda()[None, None]
    if additive_dtype is None:
        return keep
    return torch.zeros(keep.shape, device="cuda", dtype=additive_dtype).masked_fill(~keep, float("-inf"))


def _bands_mask(b, sq, sk, additive_dtype=None):
    """A [B, 1, Sq, Sk] mask whose query blocks (128 rows) each see a different band of the
    classified 128-key tiles, so that every query block's range of non-empty key tiles
    (run_fwd_key_ranges) starts and ends elsewhere: query block m sees keys from 128 (m - 2)
    + 40 to 128 (m + 2) + 90 (clipped), with the key tile after its diagonal hidden whole (a hole
    inside the range), block 3 of batch 1 sees no key, and batch 1 is shifted by a tile.
    additive_dtype: as a 0 / -inf bias of that dtype."""
    keep = torch.zeros(b, 1, sq, sk, dtype=torch.bool)
    for bb in range(b):
        for m in range((sq + 127) // 128):
            lo, hi = max(0, 128 * (m - 2 + bb) + 40), min(sk, 128 * (m + 2 + bb) + 90)
            keep[bb, 0, 128 * m:128 * (m + 1), lo:hi] = True
            keep[bb, 0, 128 * m:128 * (m + 1), 128 * (m + 1 + bb):128 * (m + 2 + bb)] = False
    if b > 1:
        keep[1, 0, 3 * 128:4 * 128] = False
    keep = keep.cuda()
    if additive_dtype is None:
        return keep
    return torch.zeros(keep.shape, device="cuda", dtype=additive_dtype).masked_fill(~keep, float("-inf"))


@pytest.mark.skipif(not VARIANTS, reason="no forward kernel compiled")
@pytest.mark.parametrize("head_dim,dtype", _one_dtype_per_head_dim())
@pytest.mark.parametrize("form", ["bool", "0/-inf bias"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mask_case", ["halves 300x333", "halves 333x300", "halves 129x330",
                                       "bands 1100x1250"])
def test_masked_forward_walks_the_classified_tiles(form, is_causal, mask_case, head_dim, dtype,
                                                   kernel_kind):
    """The key blocks within a classified tile (_halves_mask: d192 / d256 walk 64-key halves)
    and each query block's range of non-empty key tiles (_bands_mask)."""
    name, size = mask_case.split()
    sq, sk = map(int, size.split("x"))
    additive = None if form == "bool" else dtype
    mask = _halves_mask(sq, sk, additive) if name == "halves" else _bands_mask(2, sq, sk, additive)
    seed = sq + sk if name == "halves" else 11
    _check_masked(form, 2, 4, 2, sq, sk, head_dim, dtype, is_causal=is_causal, seed=seed, mask=mask)


@pytest.mark.skipif(not VARIANTS, reason="no forward kernel compiled")
@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_masked_forward_with_every_bias_dtype(mask_dtype):
    d, dt = _built()[0]
    _check_masked("additive bias", 1, 4, 4, 260, 520, d, _DTYPES[dt], mask_dtype=mask_dtype)


@pytest.mark.skipif(not VARIANTS, reason="no forward kernel compiled")
def test_finite_fill_rows_get_uniform_weights(kernel_kind):
    """A row whose every key carries fp32's finite minimum: the scores vanish next to it, so
    SDPA (and the float64 reference) average V there; so does the kernel (the bias stays
    finite in the log2 domain, where its product with log2(e) would overflow)."""
    d, dt = _built()[0]
    dtype = _DTYPES[dt]
    q, k, v = make_qkv(1, 2, 2, 200, 300, d, dtype=dtype, device="cuda")
    mask = torch.zeros(200, 300, device="cuda")
    mask[:, 150:] = torch.finfo(torch.float32).min
    mask[7] = torch.finfo(torch.float32).min
    out, lse = sdpa_forward(q, k, v, False, None, False, mask)
    want_out, _ = reference_out_lse(q, k, v, mask, False, d ** -0.5)
    torch.testing.assert_close(out[:, :, 7].float(), v.float().mean(2), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.double(), want_out, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not VARIANTS, reason="no forward kernel compiled")
@pytest.mark.parametrize("head_dim,dtype", _one_dtype_per_head_dim())
@pytest.mark.parametrize("fill_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kind", ["causal", "padding left", "padding right", "documents",
                                  "rows without keys", "random per head"])
def test_masked_forward_with_the_dtype_minimum_as_fill(kind, is_causal, fill_dtype, head_dim, dtype,
                                                      kernel_kind):
    """A boolean mask in transformers' additive form: 0 where it attends, the dtype's minimum
    elsewhere. For bf16 and fp32 the kernel clamps that fill's term to -FLT_MAX, so the
    classification hides it: rows that see a key get the boolean mask's out and lse; rows
    that see only the fill (left padding, rows without keys) get SDPA's uniform weights over
    the keys inside the causal cut, from the element path."""
    b, hq, hkv, s = 2, 4, 2, 333
    keep = make_mask(kind, b, hq, s, s, dtype)
    q, k, v, _, out_bool, lse_bool = _check_masked(kind, b, hq, hkv, s, s, head_dim, dtype,
                                                   is_causal=is_causal, mask=keep)
    bias = torch.zeros(keep.shape, dtype=fill_dtype, device="cuda").masked_fill(
        ~keep, torch.finfo(fill_dtype).min)
    poison_allocator(q, k, v)
    out, lse = sdpa_forward(q, k, v, is_causal, head_dim ** -0.5, True, bias)
    in_cut = causal_bool(s, s, "cuda") if is_causal else torch.ones(s, s, dtype=torch.bool,
                                                                    device="cuda")
    seen = (keep & in_cut).expand(b, hq, s, s).any(-1)  # [B, Hq, Sq]
    assert seen.any()
    # (one bf16 rounding apart at most: the bias enters the exponent's FFMA, the bits do not)
    torch.testing.assert_close(out[seen], out_bool[seen], atol=5e-4, rtol=1.6e-2)
    torch.testing.assert_close(lse[seen], lse_bool[seen], atol=1e-4, rtol=1e-5)
    fill_rows = ~seen
    if kind in ("padding left", "rows without keys"):
        assert fill_rows.any()
    # a fill row: the mean of V over the keys inside the cut (kv heads expanded)
    vv = v.float().repeat_interleave(hq // hkv, 1)
    mean_v = (in_cut.float() @ vv) / in_cut.sum(-1, keepdim=True)  # [B, Hq, Sq, D]
    torch.testing.assert_close(out[fill_rows].float(), mean_v[fill_rows], atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not VARIANTS, reason="no forward kernel compiled")
def test_sdpa_takes_additive_masks_whose_fill_our_forward_hides(monkeypatch):
    """The differentiable op (and so the drop-in) runs our forward for an additive mask in
    transformers' form, bf16 or fp32 and broadcast over heads; a per-head bias (and an fp16
    mask, whose fill -65504 hides nothing) keeps the stock forward."""
    from torch_sm90_sdpa import ops

    d, dt = _built()[0]
    dtype = _DTYPES[dt]
    q, k, v = make_qkv(2, 4, 4, 300, 300, d, dtype=dtype, device="cuda")
    keep = causal_bool(300, 300, "cuda")[None, None]
    calls = []
    real = ops.sdpa_forward_cuda
    monkeypatch.setattr(ops, "sdpa_forward_cuda", lambda *a: calls.append(a[-1]) or real(*a))
    cases = [(torch.bfloat16, 1, True), (torch.float32, 1, True), (torch.bfloat16, 4, False)]
    if dtype == torch.float16:
        cases.append((torch.float16, 1, False))
    for mask_dtype, heads, ours in cases:
        bias = torch.zeros(2, heads, 300, 300, dtype=mask_dtype, device="cuda").masked_fill(
            ~keep, torch.finfo(mask_dtype).min)
        calls.clear()
        out, lse = torch.ops.torch_sm90_sdpa.sdpa(q, k, v, False, None, False, bias)
        assert (len(calls) == 1 and calls[0].data_ptr() == bias.data_ptr()) == ours, \
            (mask_dtype, heads)
        want, _ = reference_out_lse(q, k, v, keep, False, d ** -0.5)
        assert _err(out, want) < 2e-2


@pytest.mark.skipif(not VARIANTS, reason="no forward kernel compiled")
def test_masked_forward_is_bitwise_repeatable_and_sdpa_takes_it(kernel_kind):
    d, dt = _built()[0]
    q, k, v, mask, out, lse = _check_masked("padding left", 2, 8, 2, 777, 1500, d, _DTYPES[dt])
    for _ in range(3):
        again = sdpa_forward(q, k, v, False, None, True, mask)
        assert torch.equal(again[0], out) and torch.equal(again[1], lse)
    # the differentiable op and the drop-in run the same forward on a masked call
    via_sdpa = torch.ops.torch_sm90_sdpa.sdpa(q, k, v, False, None, True, mask)
    assert torch.equal(via_sdpa[0], out) and torch.equal(via_sdpa[1], lse)
    # (the drop-in takes the call when a gradient is needed; else it is stock's)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    dropin = torch_sm90_sdpa.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=True)
    assert torch.equal(dropin.detach(), out)


@pytest.mark.skipif(not VARIANTS, reason="no forward kernel compiled")
@pytest.mark.parametrize("head_dim,dtype", _one_dtype_per_head_dim())
@pytest.mark.parametrize("kind", [None, "causal", "padding left", "rows without keys",
                                  "bf16-min fill, padding left"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_persistent_ctas_give_what_one_cta_per_tile_gives(kind, is_causal, head_dim, dtype,
                                                          kernel_kind, monkeypatch):
    """More tiles than SMs (288 on 132: three rounds, the second dealt backward, the last
    partial): persistent CTAs (FwdParams::persistent), longest first where causal or masked,
    compute each tile as one CTA per tile does, bitwise, and within stock's error of float64.
    Masks with query blocks that see no key (left padding under the causal cut) and a fill
    whose rows of fill only send some query blocks to the second kernel of the pair."""
    b, hq, hkv, s = 2, 16, 4, 1100
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert b * hq * -(-s // 128) > sms
    monkeypatch.setenv("TORCH_SM90_SDPA_FWD_PERSISTENT", "1")
    scale = head_dim ** -0.5
    if kind is None:
        if (head_dim, dtype) not in [(d, _DTYPES[dt]) for d, dt in _built()]:
            pytest.skip(f"no forward kernel for d{head_dim} {dtype}")
        torch.manual_seed(3)
        q, k, v = make_qkv(b, hq, hkv, s, s, head_dim, dtype=dtype, device="cuda", layout="bshd")
        mask = None
        assert _cuda_backend.forward_unserved(q, k, v, is_causal) is None
        out, lse = sdpa_forward(q, k, v, is_causal, scale, True)
        want_out, want_lse = _reference(q, k, v, is_causal, scale)
        stock = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
        assert _err(out, want_out) <= 2 * _err(stock, want_out) + 1e-3
        torch.testing.assert_close(lse.double(), want_lse, atol=2e-3, rtol=1e-4)
    elif kind.startswith("bf16-min fill"):
        keep = make_mask("padding left", b, hq, s, s, dtype)
        q, k, v, _, out_bool, lse_bool = _check_masked("padding left", b, hq, hkv, s, s, head_dim,
                                                       dtype, is_causal=is_causal, mask=keep)
        mask = torch.zeros(keep.shape, dtype=torch.bfloat16, device="cuda").masked_fill(
            ~keep, torch.finfo(torch.bfloat16).min)
        assert _cuda_backend.forward_unserved(q, k, v, is_causal, mask) is None
        out, lse = sdpa_forward(q, k, v, is_causal, scale, True, mask)
        seen = lse_bool > float("-inf")
        # (one bf16 rounding apart at most: the bias enters the exponent's FFMA, the bits do not)
        torch.testing.assert_close(out[seen], out_bool[seen], atol=5e-4, rtol=1.6e-2)
    else:
        q, k, v, mask, out, lse = _check_masked(kind, b, hq, hkv, s, s, head_dim, dtype,
                                                is_causal=is_causal)
    monkeypatch.setenv("TORCH_SM90_SDPA_FWD_PERSISTENT", "0")
    one_per_tile = sdpa_forward(q, k, v, is_causal, scale, True, mask)
    assert torch.equal(one_per_tile[0], out) and torch.equal(one_per_tile[1], lse)


@pytest.mark.skipif(not VARIANTS, reason="no forward kernel compiled")
@pytest.mark.parametrize("head_dim,dtype", VARIANTS)
@pytest.mark.parametrize("slack", ["0", "3", "8"])
@pytest.mark.parametrize("mask", [None, "bool"])
def test_forward_rescale_slack_keeps_stock_error(head_dim, dtype, slack, mask, kernel_kind,
                                                 monkeypatch):
    """The reference max moves only when a key block passes it by more than the slack
    (TORCH_SM90_SDPA_FWD_RESCALE_SLACK, log2 units), P up to 2^slack. Keys scaled up towards
    the first key (blocks run last to first) so that the max keeps growing, by more and by
    less than the slack, from block to block: within stock's error of float64 at every slack."""
    monkeypatch.setenv("TORCH_SM90_SDPA_FWD_RESCALE_SLACK", slack)
    torch.manual_seed(5)
    b, hq, hkv, sq, sk = 2, 4, 2, 300, 1100
    q, k, v = make_qkv(b, hq, hkv, sq, sk, head_dim, dtype=dtype, device="cuda")
    growth = torch.linspace(4.0, 1.0, sk, device="cuda")[None, None, :, None]
    k = (k.float() * growth).to(dtype)
    keep = None
    if mask is not None:
        keep = torch.rand(b, 1, sq, sk, device="cuda") > 0.3
    scale = 1.5 * head_dim ** -0.5
    assert _cuda_backend.forward_unserved(q, k, v, True, keep) is None
    out, lse = sdpa_forward(q, k, v, True, scale, True, keep)
    if keep is None:
        want_out, want_lse = _reference(q, k, v, True, scale)
        stock = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        stock_err = _err(torch.nan_to_num(stock.double(), nan=0.0), want_out)
    else:
        want_out, want_lse = reference_out_lse(q, k, v, keep, True, scale)
        stock_err = _stock_masked_err(q, k, v, keep, True, scale, want_out)
    assert torch.isfinite(out).all()
    assert _err(out, want_out) <= 2 * stock_err + 1e-3
    live = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.double()[live], want_lse[live], atol=2e-3, rtol=1e-4)
