"""GPU tests of the preprocess / postprocess kernels (csrc/prepost.cu) through _C, against
torch computations. Skipped unless an SM90 GPU is present and torch_sm90_sdpa._C loaded.
Every output and workspace is poisoned (NaN) before the call, and memory next to the
outputs must stay poisoned (no stray writes)."""
import math

import pytest
import torch

from torch_sm90_sdpa import _extension

C = _extension.load()
_HAVE_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _HAVE_SM90, reason="needs an SM90 (compute capability 9.0) GPU"),
    pytest.mark.skipif(C is None, reason=f"torch_sm90_sdpa._C not loaded: "
                                         f"{_extension.unavailable_reason()}"),
]

if C is not None:
    from torch_sm90_sdpa import _cuda_backend as cb

DEV = "cuda"
LOG2E = math.log2(math.e)
NAN = float("nan")


def _poisoned_view(shape_bhsd, dtype, layout, *, extra_heads=0):
    """A [B, H, S, D] output/input view of the given layout inside a NaN-filled storage.
    Returns (view, storage, covered) where covered marks the view's elements in storage."""
    B, H, S, D = shape_bhsd
    if layout == "bhsd":
        storage = torch.full((B, H, S, D), NAN, dtype=dtype, device=DEV)
        view_of = lambda t: t  # noqa: E731
    elif layout == "bshd":  # attention modules: [B, S, H, D] memory viewed as BHSD
        storage = torch.full((B, S, H, D), NAN, dtype=dtype, device=DEV)
        view_of = lambda t: t.transpose(1, 2)  # noqa: E731
    elif layout == "packed":  # a slice of a packed qkv tensor [B, S, H + extra, D]
        storage = torch.full((B, S, H + extra_heads, D), NAN, dtype=dtype, device=DEV)
        view_of = lambda t: t[:, :, extra_heads // 2: extra_heads // 2 + H].transpose(1, 2)  # noqa: E731
    elif layout == "padded_rows":  # row stride D + 3: no 16-byte vectors possible
        storage = torch.full((B, H, S, D + 3), NAN, dtype=dtype, device=DEV)
        view_of = lambda t: t[..., :D]  # noqa: E731
    elif layout == "misaligned":  # base pointer 2 bytes past a 16-byte boundary
        n = B * H * S * D
        storage = torch.full((n + 1,), NAN, dtype=dtype, device=DEV)
        view_of = lambda t: t[1:].view(B, H, S, D)  # noqa: E731
    else:
        raise ValueError(layout)
    view = view_of(storage)
    covered = torch.zeros(storage.shape, dtype=torch.bool, device=DEV)
    view_of(covered).fill_(True)
    assert view.shape == (B, H, S, D)
    return view, storage, covered


def _randn_like_layout(shape_bhsd, dtype, layout, **kw):
    view, storage, covered = _poisoned_view(shape_bhsd, dtype, layout, **kw)
    view.copy_(torch.randn(shape_bhsd, device=DEV).to(dtype))
    return view


def _assert_untouched(storage, covered, what):
    outside = storage[~covered]
    assert torch.isnan(outside.float()).all(), f"{what}: wrote outside the tensor"


# ---- preprocess ----------------------------------------------------------------------------

PRE_CASES = [
    # B, Hq, Hkv, Sq, Sk, D, layout
    (2, 4, 4, 1, 1, 64, "bhsd"),
    (2, 4, 2, 17, 33, 64, "bshd"),
    (1, 3, 1, 1000, 129, 128, "packed"),
    (3, 2, 2, 128, 128, 96, "bhsd"),
    (1, 2, 1, 17, 1000, 256, "bshd"),
    (2, 2, 2, 130, 7, 128, "padded_rows"),
    (1, 2, 2, 17, 17, 64, "misaligned"),
    (1, 2, 1, 33, 40, 36, "bhsd"),  # D % 8 != 0: scalar loads everywhere
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", PRE_CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("lse_kind", ["bhs", "cudnn", "padded"])
def test_preprocess(case, dtype, lse_kind):
    B, Hq, Hkv, Sq, Sk, D, layout = case
    torch.manual_seed(0)
    extra = 2 * Hkv
    out = _randn_like_layout((B, Hq, Sq, D), dtype, layout, extra_heads=extra)
    dout = _randn_like_layout((B, Hq, Sq, D), dtype, layout, extra_heads=extra)
    q = _randn_like_layout((B, Hq, Sq, D), dtype, "bhsd")
    k = torch.randn(B, Hkv, Sk, D, device=DEV).to(dtype)
    v = torch.randn(B, Hkv, Sk, D, device=DEV).to(dtype)
    if lse_kind == "bhs":
        lse = torch.randn(B, Hq, Sq, device=DEV) * 4
    elif lse_kind == "cudnn":  # [B, H, S, 1] in BSHD memory, viewed as [B, H, S]
        lse = (torch.randn(B, Sq, Hq, 1, device=DEV) * 4).transpose(1, 2)[..., 0]
    else:  # the efficient backend's padded [B, H, ceil(S / 32) * 32]
        lse = (torch.randn(B, Hq, (Sq + 31) // 32 * 32, device=DEV) * 4)[..., :Sq]
    gqa = Hq != Hkv
    p, ws = cb.make_params(dout, q, k, v, out, lse, False, 0.5, False, gqa_accum=gqa)
    ws.buffer.fill_(NAN)
    cb.run_preprocess(p)
    torch.cuda.synchronize()

    Sqr = p.seqlen_q_rounded
    assert Sqr == (Sq + 127) // 128 * 128 and ws.dpsum.shape == (B, Hq, Sqr)
    ref_dpsum = (dout.double() * out.double()).sum(-1)
    torch.testing.assert_close(ws.dpsum[:, :, :Sq].double(), ref_dpsum, rtol=1e-5, atol=1e-4)
    assert (ws.dpsum[:, :, Sq:] == 0).all()
    ref_lse2 = lse * LOG2E
    torch.testing.assert_close(ws.lse_log2[:, :, :Sq], ref_lse2, rtol=1e-6, atol=1e-6)
    pad = ws.lse_log2[:, :, Sq:]
    assert (torch.isinf(pad) & (pad > 0)).all()
    assert (ws.dq_accum == 0).all()
    if gqa:
        assert (ws.dk_accum == 0).all() and (ws.dv_accum == 0).all()
        assert ws.dk_accum.shape == (B, Hkv, (Sk + 127) // 128 * 128, D)


def test_preprocess_on_a_side_stream():
    B, H, S, D = 2, 4, 300, 128
    out = torch.randn(B, H, S, D, device=DEV, dtype=torch.bfloat16)
    dout = torch.randn_like(out)
    lse = torch.randn(B, H, S, device=DEV)
    p, ws = cb.make_params(dout, out, out, out, out, lse)
    ws.buffer.fill_(NAN)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cb.run_preprocess(p)
    s.synchronize()
    ref = (dout.double() * out.double()).sum(-1)
    torch.testing.assert_close(ws.dpsum[:, :, :S].double(), ref, rtol=1e-5, atol=1e-4)
    assert (ws.dq_accum == 0).all()


# ---- postprocess ---------------------------------------------------------------------------

POST_CASES = [
    # B, Hq, Hkv, Sq, Sk, D, layout of the outputs
    (2, 4, 4, 1, 1, 64, "bhsd"),
    (2, 4, 2, 17, 1000, 64, "bshd"),
    (1, 6, 2, 1000, 17, 128, "packed"),
    (3, 2, 1, 128, 128, 96, "bshd"),
    (1, 2, 2, 128, 130, 256, "bhsd"),
    (1, 2, 1, 200, 64, 192, "bshd"),
    (2, 2, 1, 17, 33, 128, "padded_rows"),
    (2, 2, 1, 19, 33, 256, "padded_rows"),  # D % 32 == 0 on the scalar path
    (1, 4, 2, 1000, 128, 64, "misaligned"),
    (1, 2, 1, 33, 17, 36, "bshd"),  # D % 8 != 0: scalar path
]


def _natural_order(dq_accum, permuted):
    """dq_accum [B, H, S, D] in natural column order: with the main kernel's permutation
    (BwdParams.dq_accum_permuted) row s holds column c at c ^ ((s & 3) << 3)."""
    if not permuted:
        return dq_accum
    S, D = dq_accum.shape[-2:]
    s = torch.arange(S, device=dq_accum.device).view(S, 1)
    c = torch.arange(D, device=dq_accum.device).view(1, D)
    where = (c ^ ((s & 3) << 3)).expand(*dq_accum.shape)
    return torch.gather(dq_accum, -1, where)


def test_natural_order_undoes_the_permutation():
    # the test's own reading of the order: row 5 (5 & 3 = 1) swaps 8-column segments 0 / 1, 2 / 3
    acc = torch.arange(8 * 64, dtype=torch.float32, device=DEV).view(1, 1, 8, 64)
    nat = _natural_order(acc, True)
    assert nat[0, 0, 5, 0].item() == acc[0, 0, 5, 8].item()
    assert nat[0, 0, 5, 40].item() == acc[0, 0, 5, 32].item()
    assert nat[0, 0, 6, 3].item() == acc[0, 0, 6, 19].item()  # 6 & 3 = 2: segment 0 <-> 2
    assert torch.equal(nat[0, 0, 4], acc[0, 0, 4])
    assert torch.equal(_natural_order(nat, True), acc)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case,order",
                         # order: dq_accum in the order make_params sets for D (its main
                         # kernel's), or in the other one (the permuted order needs D % 32 == 0)
                         [(c, o) for c in POST_CASES for o in ("kernel", "other")
                          if o == "kernel" or c[5] % 32 == 0],
                         ids=lambda x: "-".join(map(str, x)) if isinstance(x, tuple) else x)
@pytest.mark.parametrize("gqa_accum", [False, True], ids=["dq", "dq_dk_dv"])
def test_postprocess(case, order, dtype, gqa_accum):
    B, Hq, Hkv, Sq, Sk, D, layout = case
    torch.manual_seed(1)
    scale = 0.37
    q = torch.randn(B, Hq, Sq, D, device=DEV).to(dtype)
    k = torch.randn(B, Hkv, Sk, D, device=DEV).to(dtype)
    v = torch.randn(B, Hkv, Sk, D, device=DEV).to(dtype)
    lse = torch.randn(B, Hq, Sq, device=DEV)
    extra_q, extra_kv = 2 * Hkv, Hq + Hkv
    dq, dq_st, dq_cov = _poisoned_view((B, Hq, Sq, D), dtype, layout, extra_heads=extra_q)
    dk, dk_st, dk_cov = _poisoned_view((B, Hkv, Sk, D), dtype, layout, extra_heads=extra_kv)
    dv, dv_st, dv_cov = _poisoned_view((B, Hkv, Sk, D), dtype, layout, extra_heads=extra_kv)
    p, ws = cb.make_params(q, q, k, v, q, lse, False, scale, False, dq=dq, dk=dk, dv=dv,
                           gqa_accum=gqa_accum)
    # make_params sets the order of this head dim's main kernel; "other" reads the other one
    assert p.dq_accum_permuted == (D in (64, 192, 256))
    if order == "other":
        p.dq_accum_permuted = not p.dq_accum_permuted
    ws.dq_accum.normal_()
    ws.dq_accum[:, :, Sq:] = NAN  # padding rows must not be read
    if gqa_accum:
        ws.dk_accum.normal_()
        ws.dv_accum.normal_()
        ws.dk_accum[:, :, Sk:] = NAN
        ws.dv_accum[:, :, Sk:] = NAN
    cb.run_postprocess(p)
    torch.cuda.synchronize()

    tol = dict(rtol=1e-2, atol=1e-5) if dtype == torch.bfloat16 else dict(rtol=1e-3, atol=1e-6)
    acc = _natural_order(ws.dq_accum, p.dq_accum_permuted)
    torch.testing.assert_close(dq, (acc[:, :, :Sq] * scale).to(dtype), **tol)
    _assert_untouched(dq_st, dq_cov, "dq")
    if gqa_accum:
        torch.testing.assert_close(dk, (ws.dk_accum[:, :, :Sk] * scale).to(dtype), **tol)
        torch.testing.assert_close(dv, ws.dv_accum[:, :, :Sk].to(dtype), **tol)
        _assert_untouched(dk_st, dk_cov, "dk")
        _assert_untouched(dv_st, dv_cov, "dv")
    else:  # dk / dv are the main kernel's business: untouched
        assert torch.isnan(dk_st.float()).all() and torch.isnan(dv_st.float()).all()


def test_postprocess_large_bh_uses_grid_stride():
    # B * H * S rows far beyond one grid of the kernel
    B, H, S, D = 64, 32, 200, 64
    q = torch.randn(B, H, S, D, device=DEV, dtype=torch.float16)
    lse = torch.randn(B, H, S, device=DEV)
    dq = torch.full_like(q, NAN)
    p, ws = cb.make_params(q, q, q, q, q, lse, False, 2.0, False, dq=dq)
    ws.dq_accum.uniform_(-1, 1)
    cb.run_postprocess(p)
    torch.cuda.synchronize()
    acc = _natural_order(ws.dq_accum, p.dq_accum_permuted)
    torch.testing.assert_close(dq, (acc[:, :, :S] * 2.0).half(), rtol=1e-3, atol=1e-6)


# ---- the whole backward entry point --------------------------------------------------------

BACKWARD = torch.ops.torch_sm90_sdpa.sdpa_backward


@pytest.mark.parametrize("path", ["op", "python"])
@pytest.mark.parametrize("shape", [(0, 2, 2, 5, 5), (2, 2, 2, 0, 5), (2, 2, 1, 5, 0),
                                   (2, 0, 0, 5, 5)])
def test_backward_empty_inputs_launch_nothing(shape, path):
    B, Hq, Hkv, Sq, Sk = shape
    D = 64
    q = torch.randn(B, Hq, Sq, D, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, Sk, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, Sk, D, device=DEV, dtype=torch.bfloat16)
    out = torch.randn_like(q)
    lse = torch.randn(B, Hq, Sq, device=DEV)
    fn = BACKWARD if path == "op" else cb.sdpa_backward_python
    # (Hq = Hkv = 0: no head, zero-size gradients, as stock gives them)
    dq, dk, dv = fn(out, q, k, v, out, lse, False, 0.125, False)
    for g, t in ((dq, q), (dk, k), (dv, v)):
        assert g.shape == t.shape and g.stride() == t.stride() and g.dtype == t.dtype
        assert (g == 0).all()


def test_backward_of_an_uncompiled_variant_names_it():
    D = 72  # never compiled (no tile configuration)
    q = torch.randn(1, 2, 8, D, device=DEV, dtype=torch.bfloat16)
    lse = torch.randn(1, 2, 8, device=DEV)
    with pytest.raises(RuntimeError, match=r"head dim not compiled: no kernel for head dim 72"):
        BACKWARD(q, q, q, q, q, lse, False, 0.1, False)


def _variants():
    return [(dt, d) for dt, d in _extension.build_info()["variants"] if d in (64, 128)]


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("variant", _variants() or [None], ids=str)
def test_backward_smoke_vs_fp64(variant, heads, is_causal):
    """End to end through the op (pre + main + post) on a small odd-length problem.
    The kernel's own accuracy tests live with the ops; this checks the plumbing."""
    if variant is None:
        pytest.skip("the main kernel is not compiled into this build")
    import torch.nn.functional as F

    dt_name, D = variant
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dt_name]
    Hq, Hkv = heads
    B, Sq, Sk = 2, 177, 177
    torch.manual_seed(2)
    q = torch.randn(B, Sq, Hq, D, device=DEV, dtype=dtype).transpose(1, 2)
    k = torch.randn(B, Sk, Hkv, D, device=DEV, dtype=dtype).transpose(1, 2)
    v = torch.randn(B, Sk, Hkv, D, device=DEV, dtype=dtype).transpose(1, 2)
    scale = D ** -0.5
    # forward in fp32 (out in the input dtype, lse fp32 natural log), SDPA's top-left causal
    kf = k.float().repeat_interleave(Hq // Hkv, 1)
    vf = v.float().repeat_interleave(Hq // Hkv, 1)
    s = (q.float() @ kf.transpose(-1, -2)) * scale
    if is_causal:
        keep = torch.ones(Sq, Sk, dtype=torch.bool, device=DEV).tril()
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = (torch.softmax(s, -1) @ vf).to(dtype)
    dout = torch.randn_like(out)
    dq, dk, dv = BACKWARD(dout, q, k, v, out, lse, is_causal, scale, False)
    assert dq.stride() == q.stride() and dk.stride() == k.stride() and dv.stride() == v.stride()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o64 = F.scaled_dot_product_attention(q64, k64, v64, is_causal=is_causal, scale=scale,
                                         enable_gqa=Hq != Hkv)
    refs = torch.autograd.grad(o64, (q64, k64, v64), dout.double())
    for name, got, ref in zip("qkv", (dq, dk, dv), refs):
        err = (got.double() - ref).norm() / ref.norm()
        assert err < 2e-2, f"d{name}: relative error {err:.2e}"
