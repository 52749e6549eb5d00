"""Masks on the SM90 GPU: gradients of the masked backward against float64 (within 2x the
stock masked backward's error), the tile classification, and the drop-in end to end.

Mask kinds: causal, padding (left and right), sliding window, packed documents
(block-diagonal), random, rows with no visible key, bool and additive, broadcast over batch
and heads, with GQA. out / lse come from the float64 reference (the backward is tested on its
own); the stock backward compared against is SDPA's with the same mask.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import torch_sm90_sdpa
from conftest import (as_bias, causal_bool, documents, padding, reference_grads_fp64_masked,
                      requires_sm90, sliding_window)
from test_cuda_backward import (assert_bitwise_repeatable, assert_close_to_reference,
                                need_variant, poison_allocator)

pytestmark = [requires_sm90, pytest.mark.gpu]

sdpa_backward = torch.ops.torch_sm90_sdpa.sdpa_backward
DEV = "cuda"


def make_mask(kind, b, hq, sq, sk, dtype):
    """A mask of `kind`; bool unless the kind says additive (then `dtype`, or fp32)."""
    g = torch.Generator(device="cpu").manual_seed(11)
    if kind == "causal":
        m = causal_bool(sq, sk)
    elif kind == "padding right":
        m = padding(b, sq, sk, [sk, max(1, sk // 3)])[:b]
    elif kind == "padding left":
        m = padding(b, sq, sk, [max(1, sk // 2), sk], left=True)[:b]
    elif kind == "key padding [B,1,1,Sk]":
        m = padding(b, 1, sk, [sk - 70, sk][:b], causal=False)
    elif kind == "sliding window":
        m = sliding_window(sq, sk, 200)
    elif kind == "documents":
        assert sq == sk
        m = documents([sq // 4, sq // 2, sq - sq // 4 - sq // 2])
    elif kind == "random per head":
        m = torch.rand(b, hq, sq, sk, generator=g) > 0.5
    elif kind == "rows without keys":
        m = causal_bool(sq, sk).clone()
        m[5] = False
        m[sq // 2: sq // 2 + 70] = False  # more than a whole m-block
    elif kind == "additive bias":
        m = (torch.randn(sq, sk, generator=g) * 2).masked_fill(causal_bool(sq, sk).logical_not(),
                                                               float("-inf"))
        return m.to(DEV, dtype)
    elif kind == "additive 0/-inf [B,1,Sq,Sk]":
        return as_bias(padding(b, sq, sk, [sk, sk - 100][:b]), dtype).to(DEV)
    elif kind == "left padding, dtype minimum":  # transformers' additive form: fill rows
        keep = padding(b, sq, sk, [sk - 40, sk, sk - 3][:b], left=True)
        return min_fill(keep, dtype).to(DEV)
    elif kind.startswith("cuDNN fill "):  # a bool mask as torch hands it to cuDNN: 0 / -65504
        m = make_mask(kind[len("cuDNN fill "):], b, hq, sq, sk, dtype)
        return cudnn_fill(m, dtype)
    else:
        raise ValueError(kind)
    return m.to(DEV)


def min_fill(mask, dtype):
    """A bool mask in transformers' additive form: 0 attend, the dtype's minimum masked."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        ~mask, torch.finfo(dtype).min)


def cudnn_fill(mask, dtype):
    """A bool mask as the bias torch's cuDNN path makes of it: 0 attend, -65504 masked."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, -65504.0)


def reference_out_lse(q, k, v, mask, is_causal, scale):
    """float64 (out, lse) with the mask (and the causal cut) applied; lse = -inf on rows that
    see no key. Rows are normalized by their sum: where every key carries a huge finite fill
    (the dtype's minimum) lse rounds to the fill, and exp(s - lse) would give 1 per key, not
    SDPA's uniform weights."""
    g = q.size(1) // k.size(1)
    kk, vv = (t.double().repeat_interleave(g, 1) for t in (k, v))
    s = q.double() @ kk.transpose(-1, -2) * scale
    if mask.dtype == torch.bool:
        s = s.masked_fill(~mask, float("-inf"))
    else:
        s = s + mask.double()
    if is_causal:
        s = s.masked_fill(~causal_bool(q.size(2), k.size(2), DEV), float("-inf"))
    top = s.amax(-1, keepdim=True)
    e = torch.exp(s - top.masked_fill(top == float("-inf"), 0.0))
    total = e.sum(-1, keepdim=True)
    lse = (top + total.log()).squeeze(-1)  # (-inf where a row sees no key)
    return (e / total.masked_fill(total == 0, 1.0)) @ vv, lse


def stock_grads(q, k, v, dout, mask, is_causal, scale):
    """The stock fused backward's gradients with this mask (kv heads expanded for GQA)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = q.size(1) // k.size(1)
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    m = mask
    if is_causal:
        tril = causal_bool(q.size(2), k.size(2), DEV)
        m = (m & tril) if m.dtype == torch.bool else m.masked_fill(~tril, float("-inf"))
    if m.dtype != torch.bool:
        m = m.to(q.dtype)
    for backends in ([SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
                     [SDPBackend.MATH]):
        with sdpa_kernel(backends):
            o = F.scaled_dot_product_attention(qs, ks.repeat_interleave(g, 1),
                                               vs.repeat_interleave(g, 1), attn_mask=m,
                                               scale=scale)
        grads = torch.autograd.grad(o, (qs, ks, vs), dout)
        if not any(t.isnan().any() for t in grads):  # fused kernels: NaN on rows without keys
            return grads
    return grads


def _masked_inputs(b, hq, hkv, sq, sk, d, dtype, seed=0):
    """q, k, v (a [B, S, H, D] layout transposed) and dout of run_masked for `seed`."""
    torch.manual_seed(seed)
    q = torch.randn(b, sq, hq, d, device=DEV).to(dtype).transpose(1, 2)
    k = torch.randn(b, sk, hkv, d, device=DEV).to(dtype).transpose(1, 2)
    v = torch.randn(b, sk, hkv, d, device=DEV).to(dtype).transpose(1, 2)
    dout = torch.randn(b, hq, sq, d, device=DEV).to(dtype)
    return q, k, v, dout


def run_masked(kind, b, hq, hkv, sq, sk, d, dtype, is_causal=False, mask_dtype=None, seed=0,
               deterministic=False, repeats=19):
    """deterministic: the kernel's deterministic mode, and `repeats` more runs bitwise equal."""
    need_variant(d, dtype)
    q, k, v, dout = _masked_inputs(b, hq, hkv, sq, sk, d, dtype, seed)
    mask = make_mask(kind, b, hq, sq, sk, mask_dtype or dtype)
    scale = 1 / math.sqrt(d)
    o64, lse64 = reference_out_lse(q, k, v, mask, is_causal, scale)
    out, lse = o64.to(dtype), lse64.float()
    _, rdq, rdk, rdv = reference_grads_fp64_masked(q, k, v, dout, mask, is_causal, scale)
    sdq, sdk, sdv = stock_grads(q, k, v, dout, mask, is_causal, scale)
    poison_allocator(q, k, v)
    dq, dk, dv = sdpa_backward(dout, q, k, v, out, lse, is_causal, scale, deterministic, mask)
    for ours, st, ref, name in ((dq, sdq, rdq, "dq"), (dk, sdk, rdk, "dk"), (dv, sdv, rdv, "dv")):
        assert_close_to_reference(ours, st, ref, f"{kind} {name}")
    if deterministic:
        assert_bitwise_repeatable(
            (dq, dk, dv),
            lambda: sdpa_backward(dout, q, k, v, out, lse, is_causal, scale, True, mask), repeats)
    return dq, dk, dv, mask


KINDS = ["causal", "padding right", "padding left", "key padding [B,1,1,Sk]", "sliding window",
         "documents", "random per head", "rows without keys", "additive bias",
         "additive 0/-inf [B,1,Sq,Sk]"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_masks_against_fp64(kind, head_dim, dtype):
    run_masked(kind, 2, 4, 4, 600, 600, head_dim, dtype)


@pytest.mark.parametrize("kind", ["padding right", "sliding window", "random per head",
                                  "additive bias"])
@pytest.mark.parametrize("head_dim", [96, 192])
def test_masks_other_head_dims(kind, head_dim):
    run_masked(kind, 2, 4, 4, 333, 333, head_dim, torch.bfloat16)


@pytest.mark.parametrize("kind", ["padding right", "documents", "random per head",
                                  "key padding [B,1,1,Sk]"])
@pytest.mark.parametrize("heads", [(8, 2), (8, 1)], ids=["gqa", "mqa"])
def test_masks_with_gqa(kind, heads):
    run_masked(kind, 2, heads[0], heads[1], 512, 512, 128, torch.bfloat16)


@pytest.mark.parametrize("kind", ["causal", "padding right", "documents", "random per head",
                                  "rows without keys", "additive bias", "key padding [B,1,1,Sk]"])
@pytest.mark.parametrize("heads", [(8, 2), (8, 1)], ids=["gqa", "mqa"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_masks_with_gqa_group_walk(kind, heads, head_dim, switch_env):
    """TORCH_SM90_SDPA_GQA_WALK=1: a mask shared by the heads lets one CTA walk the whole group
    (a per-head mask, "random per head", keeps one q head per CTA: the same criterion)."""
    from torch_sm90_sdpa import _cuda_backend as cb

    switch_env.setenv("TORCH_SM90_SDPA_GQA_WALK", "1")
    square = kind in ("documents", "padding right")  # (padding right also with is_causal)
    sq, sk = (400, 400) if square else (300, 700)
    q = torch.empty(2, heads[0], sq, head_dim, device=DEV, dtype=torch.bfloat16)
    k = torch.empty(2, heads[1], sk, head_dim, device=DEV, dtype=torch.bfloat16)
    mask = make_mask(kind, 2, heads[0], sq, sk, torch.bfloat16)
    layout = cb._module().workspace_layout(
        cb.problem_of(q, q, k, k, q, torch.empty(2, heads[0], sq, device=DEV), attn_mask=mask))
    assert layout.heads_per_cta == (1 if kind == "random per head" else heads[0] // heads[1])
    run_masked(kind, 2, heads[0], heads[1], sq, sk, head_dim, torch.bfloat16,
               is_causal=kind == "padding right")


@pytest.mark.parametrize("kind", ["padding right", "random per head", "additive bias"])
def test_masks_combined_with_is_causal(kind):
    run_masked(kind, 2, 4, 2, 400, 400, 128, torch.bfloat16, is_causal=True)


@pytest.mark.parametrize("sq,sk", [(200, 777), (777, 200), (1, 300), (130, 1)])
def test_masks_sq_not_sk(sq, sk):
    run_masked("random per head", 2, 4, 4, sq, sk, 128, torch.bfloat16)
    run_masked("additive 0/-inf [B,1,Sq,Sk]", 2, 4, 4, sq, sk, 64, torch.bfloat16)


def test_fp32_bias_with_bf16_inputs():
    run_masked("additive bias", 2, 4, 4, 300, 300, 128, torch.bfloat16, mask_dtype=torch.float32)


def test_rows_without_keys_give_zero_gradients():
    dq, dk, dv, mask = run_masked("rows without keys", 1, 2, 2, 300, 300, 128, torch.bfloat16)
    empty_rows = ~mask.any(-1)
    assert (dq[:, :, empty_rows] == 0).all() and torch.isfinite(dk).all()


def assert_fill_rows_match_fp64(ours, ref, rows, keys, name):
    """The gradients that fill rows give (dq on those rows, dk / dv on the keys only they see)
    within bf16's error of float64, wherever stock stands there."""
    dq, dk, dv = ours
    rdq, rdk, rdv = ref
    for got, want, what in ((dq[..., rows, :], rdq[..., rows, :], "dq"),
                            (dk[..., keys, :], rdk[..., keys, :], "dk"),
                            (dv[..., keys, :], rdv[..., keys, :], "dv")):
        err = (got.double() - want).norm() / want.norm()
        assert want.norm() > 0 and err < 2e-2, f"{name} {what}: rel err {err:.3e} on the fill rows"


@pytest.mark.parametrize("mask_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("heads,head_dim", [((4, 4), 128), ((8, 2), 64), ((4, 1), 256)],
                         ids=["mha-d128", "gqa-d64", "mqa-d256"])
def test_fill_rows_get_sdpas_uniform_weight_gradients(mask_dtype, heads, head_dim):
    """Left padding in transformers' additive form (the dtype's minimum as fill): batch 0's
    first 40 queries see no key but the fill, and SDPA (float64 here) gives them uniform
    weights over the fill's keys, so their gradients are not 0. The classification tags those
    rows with their fill's key count and the kernel gives them P = 1 / n (csrc/numeric.h)."""
    dq, dk, dv, mask = run_masked("left padding, dtype minimum", 2, heads[0], heads[1], 300, 300,
                                  head_dim, torch.bfloat16, mask_dtype=mask_dtype)
    q, k, v, dout = _masked_inputs(2, heads[0], heads[1], 300, 300, head_dim, torch.bfloat16)
    _, rdq, rdk, rdv = reference_grads_fp64_masked(q, k, v, dout, mask, False, head_dim ** -0.5)
    assert_fill_rows_match_fp64((dq[:1], dk[:1], dv[:1]), (rdq[:1], rdk[:1], rdv[:1]),
                                slice(0, 40), slice(0, 40), f"{mask_dtype}")


@pytest.mark.parametrize("fill_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_classification_tags_fill_rows_with_their_key_count(fill_dtype, is_causal):
    """A row whose lse is the clamped fill (the minimum of bf16 / fp32, as a forward that gave
    it SDPA's uniform weights writes it: its lse_log2 overflows) gets its lse_log2 replaced by
    0xFFC00000 | n, n its fill's keys inside the key tail and the causal cut; every tile of its
    query block is computed per element with the fill rows weighed (class 4). Rows that see a
    key, rows whose every key is -inf, and a fill row whose forward gave it an lse of -inf
    (cuDNN's, with out 0 there) keep the preprocess's lse_log2."""
    from torch_sm90_sdpa import _cuda_backend as cb

    need_variant(128, torch.bfloat16)
    b, h, sq, sk = 2, 2, 300, 500
    minimum = torch.finfo(fill_dtype).min
    mask = torch.zeros(b, 1, sq, sk, dtype=fill_dtype)
    mask[0, 0, :, 200:] = minimum          # rows see keys 0..199
    mask[0, 0, 5] = minimum                # row 5: the fill only
    mask[0, 0, 9, :100] = minimum          # row 9: the fill and -inf only
    mask[0, 0, 9, 100:] = float("-inf")
    mask[0, 0, 11] = float("-inf")         # row 11: no key at all (not a fill row)
    mask[1, 0, 250:, :] = minimum          # batch 1, rows 250..299: the fill only
    mask = mask.to(DEV)
    q = torch.randn(b, h, sq, 128, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(b, h, sk, 128, device=DEV, dtype=torch.bfloat16)
    rows = torch.arange(sq)
    in_cut = ((torch.arange(sk)[None, :] <= rows[:, None]) if is_causal
              else torch.ones(sq, sk, dtype=torch.bool))
    m = mask.cpu().float()
    fill = (m == minimum) & in_cut
    seen = ((m > float("-inf")) & (m != minimum) & in_cut).any(-1)
    fill_row = (fill.any(-1) & ~seen).expand(b, h, sq).clone()  # [B, 1, Sq] -> [B, Hq, Sq]
    assert fill_row[0, 0, 5] and fill_row[0, 0, 9] and not fill_row[0, 0, 11]
    # the lse a forward with SDPA's uniform weights gives: batch 0 SDPA's, the fill (log n
    # rounds away), batch 1 our forward's, about -FLT_MAX ln 2 (its row max is the clamped
    # -FLT_MAX); -inf where no key is visible, 0 (any finite value) elsewhere; batch 1's row
    # 260: -inf, as cuDNN's forward gives it
    empty = ~(m > float("-inf")).logical_and(in_cut).any(-1).expand(b, h, sq)
    lse = torch.zeros(b, h, sq).masked_fill(empty, float("-inf")).masked_fill(fill_row, minimum)
    ours = torch.tensor(-torch.finfo(torch.float32).max) * torch.tensor(0.6931471805599453)
    lse[1] = lse[1].masked_fill(fill_row[1], ours.item())
    lse[1, :, 260] = float("-inf")
    want_tagged = fill_row.clone()
    want_tagged[1, :, 260] = False
    classes, raw = cb.tile_classes(mask, q, k, is_causal=is_causal, lse=lse.to(DEV),
                                   scale=128 ** -0.5, lse_log2=True)
    u = raw.cpu().to(torch.int64) & 0xFFFFFFFF
    tagged = (u & 0xFFC00000) == 0xFFC00000
    assert torch.equal(tagged, want_tagged)
    counts = fill.sum(-1).expand(b, h, sq)
    assert torch.equal((u & 0x3FFFFF)[tagged], counts[tagged])
    # the other rows: the preprocess's lse * log2(e), 0 for lse 0 and +inf for -inf
    assert (u[~tagged & ~empty & ~fill_row] == 0).all()
    assert (u[(empty | fill_row) & ~tagged] == 0x7F800000).all()
    bm = 64  # d128's m-block
    for bi in range(b):
        for mb in range(classes.size(-1)):
            fill_block = bool(want_tagged[bi, 0, mb * bm:(mb + 1) * bm].any())
            assert ((classes[bi, 0, :, mb] == 4).all() if fill_block
                    else (classes[bi, 0, :, mb] != 4).all()), (bi, mb)


def test_drop_in_fill_rows_match_fp64_end_to_end():
    """The drop-in (our forward and backward) on a left-padded batch in transformers' additive
    form, bf16 minimum as fill, GQA: out and every gradient of the fill rows within bf16's
    error of float64 SDPA, as the rest."""
    need_variant(128, torch.bfloat16)
    torch.manual_seed(3)
    b, hq, hkv, s, d = 2, 8, 2, 320, 128
    keep = padding(b, s, s, [s - 70, s], left=True).to(DEV)  # batch 0: 70 padding keys
    mask = min_fill(keep, torch.bfloat16)
    q, k, v, dout = _masked_inputs(b, hq, hkv, s, s, d, torch.bfloat16)
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = torch_sm90_sdpa.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
    out.backward(dout)
    rout, rdq, rdk, rdv = reference_grads_fp64_masked(q, k, v, dout, mask, False, d ** -0.5)
    err = (out.double() - rout).norm() / rout.norm()
    assert err < 1e-2, f"out: rel err {err:.3e}"
    assert_fill_rows_match_fp64((qs.grad[:1], ks.grad[:1], vs.grad[:1]),
                                (rdq[:1], rdk[:1], rdv[:1]), slice(0, 70), slice(0, 70), "drop-in")
    for got, want, name in ((qs.grad, rdq, "dq"), (ks.grad, rdk, "dk"), (vs.grad, rdv, "dv")):
        e = (got.double() - want).norm() / want.norm()
        assert e < 2e-2, f"{name}: rel err {e:.3e}"


def test_tile_classes_of_a_causal_mask():
    """The classification kernel: a causal mask's tiles are empty above the diagonal, full
    below it, partial on it (and in the last, partial key block): as bits (3), a boolean mask
    hiding or keeping each entry; is_causal folds in. The bits hold exactly the visible
    entries. A bias with other values than 0 / -inf leaves its partial tiles to the per-element
    path (1)."""
    from torch_sm90_sdpa import _cuda_backend as cb

    need_variant(128, torch.bfloat16)
    sq = sk = 1000  # tiles 64 x 128 at d128: 16 m-blocks, 8 n-blocks
    q = torch.randn(1, 2, sq, 128, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(1, 2, sk, 128, device=DEV, dtype=torch.bfloat16)
    cls, bits = cb.tile_classes(causal_bool(sq, sk, DEV), q, k, bits=True)
    assert cls.shape == (1, 1, 8, 16) and bits.shape == (1, 1, 8, 16, 64, 128)
    i = torch.arange(16 * 64, device=DEV)[:, None]
    j = torch.arange(8 * 128, device=DEV)[None, :]
    keep = (j <= i) & (j < sk) & (i < sq)  # over the padded grid of tiles
    for n in range(8):
        for m in range(16):
            rows, cols = range(64 * m, min(64 * m + 64, sq)), range(128 * n, 128 * n + 128)
            visible = [c <= r for r in rows for c in cols if c < sk]
            has_tail = cols[-1] >= sk
            want = 0 if not any(visible) else (2 if all(visible) and not has_tail else 3)
            assert cls[0, 0, n, m].item() == want, (n, m)
            if want == 3:
                tile = keep[64 * m:64 * m + 64, 128 * n:128 * n + 128]
                assert torch.equal(bits[0, 0, n, m], tile), (n, m)
    bias = torch.randn(sq, sk, device=DEV).masked_fill(~causal_bool(sq, sk, DEV), float("-inf"))
    got = cb.tile_classes(bias, q, k, lse=torch.zeros(1, 2, sq, device=DEV))
    assert torch.equal(got == 0, cls == 0) and ((got == 1) == (cls != 0)).all()
    # a key-padding mask per batch element and head: instances are not expanded
    kp = torch.ones(2, 1, 1, sk, dtype=torch.bool, device=DEV)
    kp[1, ..., 500:] = False
    q2 = q.expand(2, 2, sq, 128)
    cls = cb.tile_classes(kp, q2, k.expand(2, 2, sk, 128), is_causal=True)
    assert cls.shape == (2, 1, 8, 16)
    assert (cls[1, 0, 4:] == 0).all()  # keys >= 512 masked for the second sequence


@pytest.mark.parametrize("kind", ["causal", "documents", "rows without keys", "all masked"])
def test_tile_ranges_bound_the_non_empty_tiles(kind):
    """The classification's second kernel: per n-block, [lo, hi) from the first to past the
    last non-empty m-block of its class row, (0, 0) when none; the main kernel walks only it."""
    from torch_sm90_sdpa import _cuda_backend as cb

    need_variant(128, torch.bfloat16)
    sq, sk = 3000, 2500  # 47 m-blocks (more than a warp's 32), 20 n-blocks at d128
    q = torch.randn(2, 2, sq, 128, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(2, 2, sk, 128, device=DEV, dtype=torch.bfloat16)
    i = torch.arange(sq, device=DEV)[:, None]
    j = torch.arange(sk, device=DEV)[None, :]
    keep = {"causal": j <= i, "documents": (j <= i) & (i // 700 == j // 700),
            "rows without keys": (j <= i) & (i >= 1500), "all masked": j < 0}[kind]
    classes, ranges = cb.tile_classes(keep[None, None].expand(2, 1, sq, sk), q, k, ranges=True)
    assert ranges.shape == (1, 1, classes.shape[2], 2)
    for n in range(classes.shape[2]):
        live = (classes[0, 0, n] != 0).nonzero().flatten().tolist()
        want = (live[0], live[-1] + 1) if live else (0, 0)
        assert tuple(ranges[0, 0, n].tolist()) == want, (kind, n)


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 4, 2), (128, 2, 2), (256, 4, 1), (96, 2, 1)])
def test_score_bounds_match_torch(head_dim, heads, kv_heads):
    """The score bounds' per-block values (max ||q|| and min lse_log2 over live rows per
    m-block, max ||k|| per n-block, per mask instance; computed by the preprocess launch's
    bounds CTAs, folded by the classification) against torch, on aligned rows (vector path)
    and on a misaligned view (scalar path)."""
    from torch_sm90_sdpa import _cuda_backend as cb

    need_variant(head_dim, torch.bfloat16)
    sq, sk, b = 333, 517, 2
    torch.manual_seed(head_dim)
    from test_build import gen  # the variants' tile sizes

    bm, bn = gen.TILES[head_dim].block_m, gen.TILES[head_dim].block_n
    log2e = 1.4426950408889634
    for aligned in (True, False):
        pad = 0 if aligned else 1  # rows one element off 16 bytes: the scalar path
        q = torch.randn(b, heads, sq, head_dim + pad, device=DEV, dtype=torch.bfloat16)
        q = (q * torch.rand(b, heads, sq, 1, device=DEV, dtype=torch.bfloat16) * 3)[..., pad:]
        k = torch.randn(b, kv_heads, sk, head_dim + pad, device=DEV, dtype=torch.bfloat16)[..., pad:]
        lse = torch.randn(b, heads, sq, device=DEV)
        lse[0, 0, 5] = float("-inf")  # a row without keys (lse_log2 +inf): not in the bounds
        bias = torch.zeros(b, 1, sq, sk, device=DEV, dtype=torch.bfloat16)  # per batch
        _, (qn, lo, kn) = cb.tile_classes(bias, q, k, lse=lse, scale=head_dim ** -0.5, bounds=True)
        assert qn.shape == lo.shape == (b, 1, -(-sq // bm)) and kn.shape == (b, 1, -(-sk // bn))
        for bi in range(b):
            for m in range(qn.shape[-1]):
                rows = slice(m * bm, min(m * bm + bm, sq))
                live = lse[bi, :, rows] != float("-inf")
                norms = q[bi, :, rows].float().norm(dim=-1)[live]
                torch.testing.assert_close(qn[bi, 0, m], norms.max(), rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(lo[bi, 0, m], (lse[bi, :, rows][live] * log2e).min(),
                                           rtol=1e-5, atol=1e-5)
            for n in range(kn.shape[-1]):
                keys = slice(n * bn, min(n * bn + bn, sk))
                torch.testing.assert_close(kn[bi, 0, n], k[bi, :, keys].float().norm(dim=-1).max(),
                                           rtol=1e-4, atol=1e-4)


def test_drop_in_with_a_padding_mask_matches_stock():
    need_variant(128, torch.bfloat16)
    torch.manual_seed(4)
    q, k, v = (torch.randn(2, 8, 700, 128, device=DEV, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    mask = padding(2, 700, 700, [700, 350]).to(DEV)
    grads = []
    for fn in (torch_sm90_sdpa.scaled_dot_product_attention, F.scaled_dot_product_attention):
        out = fn(q, k, v, attn_mask=mask)
        grads.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    for ours, stock in zip(*grads):
        torch.testing.assert_close(ours.float(), stock.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("kind,heads,kv_heads,dtype,expect_cudnn", [
    ("padding right", 8, 2, torch.bfloat16, True), ("rows without keys", 4, 4, torch.bfloat16, True),
    ("additive bias", 4, 2, torch.float16, True),
    ("key padding [B,1,1,Sk]", 4, 1, torch.bfloat16, False)])  # (either forward)
def test_masked_forward_matches_fp64(kind, heads, kv_heads, dtype, expect_cudnn):
    """The op's masked forward (the SM90 forward kernel; cuDNN's, which these calls would
    otherwise take, where torch allows it: GQA, bool and additive masks) against float64: out
    and lse within the bf16 / fp16 rounding, out = 0 and no NaN on rows without a visible key;
    then the drop-in's gradients within 2x the stock error."""
    from torch_sm90_sdpa import ops

    need_variant(128, dtype)
    b, s, d = 2, 333, 128
    torch.manual_seed(9)
    q = torch.randn(b, heads, s, d, device=DEV, dtype=dtype)
    k, v = (torch.randn(b, kv_heads, s, d, device=DEV, dtype=dtype) for _ in range(2))
    mask = make_mask(kind, b, heads, s, s, dtype)
    scale = d ** -0.5
    if expect_cudnn:
        assert ops._cudnn_forward(q, k, v, False, scale, mask) is not None, "not cuDNN"
    out, lse = torch.ops.torch_sm90_sdpa.sdpa(q, k, v, False, scale, True, mask)
    o64, lse64 = reference_out_lse(q, k, v, mask, False, scale)
    dead = lse64 == float("-inf")  # rows without a visible key
    assert (out[dead] == 0).all() and not lse.isnan().any() and not out.isnan().any()
    torch.testing.assert_close(out.double(), o64, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double()[~dead], lse64[~dead], atol=1e-3, rtol=1e-3)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)
    o = torch_sm90_sdpa.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale,
                                                     enable_gqa=True)
    grads = torch.autograd.grad(o, (qg, kg, vg), dout)
    _, rdq, rdk, rdv = reference_grads_fp64_masked(q, k, v, dout, mask, False, scale)
    sdq, sdk, sdv = stock_grads(q, k, v, dout, mask, False, scale)
    for ours, st, ref, name in zip(grads, (sdq, sdk, sdv), (rdq, rdk, rdv), ("dq", "dk", "dv")):
        assert_close_to_reference(ours, st, ref, f"{kind} {name}")


def test_opcheck_with_a_mask_on_cuda():
    need_variant(128, torch.bfloat16)
    q, k, v = (torch.randn(1, 4, 200, 128, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    mask = padding(1, 200, 200, [150]).to(DEV)
    o64, lse64 = reference_out_lse(q, k, v, mask, False, 0.1)
    torch.library.opcheck(sdpa_backward.default, (torch.randn_like(q), q, k, v, o64.to(q.dtype),
                                                  lse64.float(), False, 0.1, False, mask))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("kind", ["causal", "padding right", "padding left", "sliding window",
                                  "rows without keys"])
def test_cudnn_fill_masks_against_fp64(kind, dtype):
    """Finite biases as torch hands cuDNN a bool mask (-65504): the classification proves the
    hidden tiles empty from score bounds; rows whose every key carries the bias (left padding,
    rows without keys) keep their tiles and match float64 with the same finite bias."""
    run_masked(f"cuDNN fill {kind}", 2, 8, 2, 700, 700, 128, torch.bfloat16, mask_dtype=dtype)


def test_tile_classes_of_a_cudnn_fill_causal_mask():
    """The -65504 causal bias is classified like the -inf one where the score bound proves the
    fill hides the tiles, and not where it cannot (a row with no visible key)."""
    from torch_sm90_sdpa import _cuda_backend as cb

    need_variant(128, torch.bfloat16)
    sq = sk = 1000
    g = torch.Generator(device=DEV).manual_seed(5)
    q = torch.randn(1, 2, sq, 128, device=DEV, generator=g).to(torch.bfloat16)
    k = torch.randn(1, 2, sk, 128, device=DEV, generator=g).to(torch.bfloat16)
    scale = 128 ** -0.5
    want, want_bits = cb.tile_classes(causal_bool(sq, sk, DEV), q, k, bits=True)
    bias = cudnn_fill(causal_bool(sq, sk, DEV), torch.bfloat16)
    _, lse = reference_out_lse(q, k, k, bias, False, scale)
    got, got_bits = cb.tile_classes(bias, q, k, lse=lse.float(), scale=scale, bits=True)
    assert torch.equal(got, want)
    # the fill's entries proved dead are 0 bits, exactly as the bool mask's hidden ones
    bits_tiles = got == 3
    assert bits_tiles.any() and torch.equal(got_bits[bits_tiles], want_bits[bits_tiles])
    # a row whose every key carries the fill has an lse near the fill: its m-block's tiles
    # cannot be proved empty (test_cudnn_fill_masks_against_fp64 checks their gradients)
    rows = causal_bool(sq, sk, DEV).clone()
    rows[70] = False
    bias = cudnn_fill(rows, torch.bfloat16)
    _, lse = reference_out_lse(q, k, k, bias, False, scale)
    got = cb.tile_classes(bias, q, k, lse=lse.float(), scale=scale)
    assert (got[0, 0, :, 1] != 0).all()  # m-block 1 holds row 70
    assert torch.equal(got[..., 2:], want[..., 2:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_classification_hides_exactly_the_dead_bias_values(dtype):
    """The classification's rule for a finite bias entry x: hidden iff x * log2(e) (fp32, as the
    main kernel adds it) is below the tile's dead_below, whatever the dtype. With q = 0 and
    lse = 0 the score bound is exactly 1 (dead_below = -161): each tile carries the one value
    of `dtype` under test at a seventh of its entries, zeros elsewhere, the 128 consecutive
    values of the dtype around the boundary over the 128 tiles. A hidden value makes its tile
    bits (3) with 0 bits exactly there; a visible one, a per-element partial tile (1)."""
    from torch_sm90_sdpa import _cuda_backend as cb

    need_variant(128, torch.bfloat16)
    sq = sk = 1024  # tiles 64 x 128 at d128: 16 m-blocks x 8 n-blocks
    q = torch.zeros(1, 1, sq, 128, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(1, 1, sk, 128, device=DEV, dtype=torch.bfloat16)
    lse = torch.zeros(1, 1, sq, device=DEV)
    log2e = torch.tensor(1.4426950408889634, dtype=torch.float32)
    boundary = torch.tensor(-161.0, dtype=torch.float32) / log2e
    int_t = torch.int32 if dtype == torch.float32 else torch.int16
    raw = boundary.to(dtype).view(int_t).to(torch.int64) + torch.arange(-64, 64)  # (negative values)
    values = raw.to(int_t).view(dtype)
    hidden = values.float() * log2e < -161.0
    assert hidden.any() and not hidden.all()
    r = torch.arange(64)[:, None]
    c = torch.arange(128)[None, :]
    spots = (r + c) % 7 == 0  # where a tile holds its value
    bias = torch.zeros(sq, sk, dtype=dtype)
    for t in range(128):
        n, m = divmod(t, 16)
        bias[64 * m:64 * m + 64, 128 * n:128 * n + 128][spots] = values[t]
    cls, bits = cb.tile_classes(bias.to(DEV), q, k, lse=lse, scale=128 ** -0.5, bits=True)
    for t in range(128):
        n, m = divmod(t, 16)
        want = 3 if hidden[t] else 1
        assert cls[0, 0, n, m].item() == want, (t, values[t].item())
        if want == 3:
            assert torch.equal(bits[0, 0, n, m].cpu(), ~spots), t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bias_with_a_block_of_rows_without_keys_classifies_as_the_bool_mask(dtype):
    """A 0 / -inf bias whose rows 256..329 see no key: m-block 4 (rows 256..319 at d128) has no
    live row (lse = -inf, so the classification's dead bound is +inf there). Its tiles are
    empty and every tile is classified as the bool mask's, bits included. (Before the
    threshold search was clamped, an fp32 bias took millions of steps per warp on such a tile.)"""
    from torch_sm90_sdpa import _cuda_backend as cb

    need_variant(128, torch.bfloat16)
    sq = sk = 512
    keep = causal_bool(sq, sk, DEV).clone()
    keep[256:330] = False
    g = torch.Generator(device=DEV).manual_seed(8)
    q = torch.randn(1, 2, sq, 128, device=DEV, generator=g).to(torch.bfloat16)
    k = torch.randn(1, 2, sk, 128, device=DEV, generator=g).to(torch.bfloat16)
    scale = 128 ** -0.5
    want, want_bits = cb.tile_classes(keep, q, k, bits=True)
    bias = as_bias(keep, dtype)
    _, lse = reference_out_lse(q, k, k, bias, False, scale)
    assert torch.isinf(lse[..., 256:330]).all()
    got, got_bits = cb.tile_classes(bias, q, k, lse=lse.float(), scale=scale, bits=True)
    assert (got[0, 0, :, 4] == 0).all()
    assert torch.equal(got, want)
    bits_tiles = got == 3
    assert torch.equal(got_bits[bits_tiles], want_bits[bits_tiles])
