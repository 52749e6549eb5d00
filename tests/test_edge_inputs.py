"""Every public entry point against stock SDPA on a seeded generator of calls (CPU): empty and
size-1 batch, heads, query / key lengths and head dims, GQA ratios, Sq != Sk, is_causal,
dtypes, layouts and masks (tests/sdpa_cases.py). Same result as stock within 2x stock's error
against float64, or a refusal where stock refuses too; the drop-in gives stock's answer with
and without grad."""
import pytest
import torch
import torch.nn.functional as F

import torch_sm90_sdpa
from torch_sm90_sdpa.reference import causal_mask
from sdpa_cases import check_case, random_cases

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
CHUNKS, PER_CHUNK = 8, 50


@pytest.mark.parametrize("chunk", range(CHUNKS))
@pytest.mark.parametrize("grad_mode", [True, False], ids=["grad", "no_grad"])
def test_entry_points_match_stock_on_random_calls(chunk, grad_mode):
    failures = []
    for case in random_cases(PER_CHUNK, seed=chunk, dtypes=DTYPES, head_dims=(1, 4, 8, 16)):
        problems = check_case(case, "cpu", grad_mode=grad_mode)
        if problems:
            failures.append(f"{case}: {'; '.join(problems)}")
    assert not failures, "\n".join(failures)


def _sdpa_op_out(q, k, v, attn_mask=None, enable_gqa=False):
    return torch.ops.torch_sm90_sdpa.sdpa(q, k, v, False, None, enable_gqa, attn_mask)[0]


ENTRY_POINTS = {"drop-in": torch_sm90_sdpa.scaled_dot_product_attention, "sdpa op": _sdpa_op_out}


EMPTY_SHAPES = {  # (B, Hq, Hkv, Sq, Sk, D)
    "no query": (2, 4, 2, 0, 5, 8),
    "no key": (2, 4, 2, 5, 0, 8),
    "no query, no key": (2, 4, 2, 0, 0, 8),
    "no batch": (0, 4, 2, 5, 5, 8),
    "no head": (2, 0, 0, 5, 5, 8),
    "no kv head": (2, 4, 0, 5, 5, 8),
    "one query, one key": (1, 1, 1, 1, 1, 8),
}


@pytest.mark.parametrize("masked", [False, True], ids=["no mask", "bool mask"])
@pytest.mark.parametrize("name", list(EMPTY_SHAPES))
def test_empty_sizes_give_stocks_result(name, masked):
    """The shapes that ended the interpreter (a private CPU kernel fed no key): every entry
    point returns stock's result, forward and backward."""
    b, hq, hkv, sq, sk, d = EMPTY_SHAPES[name]
    q, k, v = (torch.randn(b, h, s, d) for h, s in ((hq, sq), (hkv, sk), (hkv, sk)))
    mask = torch.rand(sq, sk) > 0.5 if masked else None
    ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
    if hkv == 0:  # stock before torch 2.13 ends the process here; 2.13 gives zeros
        ref = torch.zeros(b, hq, sq, d)
        for t in (ql, kl, vl):
            t.grad = torch.zeros_like(t)
    else:
        ref = F.scaled_dot_product_attention(ql, kl, vl, attn_mask=mask, enable_gqa=True)
        ref.backward(torch.ones_like(ref))
    for fn in ENTRY_POINTS.values():
        qo, ko, vo = (t.clone().requires_grad_() for t in (q, k, v))
        out = fn(qo, ko, vo, attn_mask=mask, enable_gqa=True)
        out.backward(torch.ones_like(out))
        torch.testing.assert_close(out, ref)
        for ours, stock in zip((qo, ko, vo), (ql, kl, vl)):
            torch.testing.assert_close(ours.grad, stock.grad)


@pytest.mark.parametrize("name", ["no query", "no key", "no batch", "one query, one key"])
def test_compile_route_with_empty_sizes(name):
    """torch.compile with the CPU route on: stock's result and gradients. Stock's forward makes
    no fused node for an empty size (nothing to route); a 1 x 1 call is routed to our op.
    (No key head is left out: the compiled graph keeps stock's forward, which ends the process
    there before torch 2.13.)"""
    b, hq, hkv, sq, sk, d = EMPTY_SHAPES[name]
    q, k, v = (torch.randn(b, h, s, d) for h, s in ((hq, sq), (hkv, sk), (hkv, sk)))
    weight = torch.randn(b, hq, sq, d)  # (a sum's expanded gradient is not routed)

    def f(q, k, v):
        return (F.scaled_dot_product_attention(q, k, v, enable_gqa=True) * weight).sum()

    grads = []
    for compiled in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if compiled:
            torch._dynamo.reset()
            torch_sm90_sdpa.routing.reset_stats()
            with torch_sm90_sdpa.enable(cpu=True):
                loss = torch.compile(f, dynamic=False)(*leaves)
                loss.backward()
            routed = torch_sm90_sdpa.routing_stats()["routed_calls"]
            assert routed == (1 if name == "one query, one key" else 0)
        else:
            loss = f(*leaves)
            loss.backward()
        grads.append([loss.detach()] + [t.grad for t in leaves])
    for ours, stock in zip(grads[1], grads[0]):
        torch.testing.assert_close(ours, stock)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("layout", ["dense", "gqa", "dv"])
def test_rows_of_finite_fill_only_get_uniform_weights(entry, layout):
    """A row whose every key carries a huge finite fill (transformers' additive masks) gets
    SDPA's uniform weights, its out the mean of v, also where the op's forward is the reference
    (GQA with grad, Dv != D): normalizing by exp(lse), whose log(Sk) rounds away next to the
    fill, gave the sum of v (and the reference backward Sk times dV). Gradients against float64
    softmax math within 1e-4 (fp32 inputs); stock's CPU flash backward, which F.sdpa runs here
    also for float64, normalizes by exp(lse) and is Sk times off on such rows."""
    g = torch.Generator().manual_seed(7)
    hkv = 1 if layout == "gqa" else 2
    dv = 3 if layout == "dv" else 4
    q = torch.randn(1, 2, 3, 4, generator=g)
    k = torch.randn(1, hkv, 8, 4, generator=g)
    v = torch.randn(1, hkv, 8, dv, generator=g)
    for fill in (torch.finfo(torch.float32).min, -1e6):
        mask = torch.zeros(3, 8)
        mask[1] = fill  # row 1: every key filled
        mask[2, 5:] = fill
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ENTRY_POINTS[entry](*leaves, attn_mask=mask, enable_gqa=layout == "gqa")
        gqa = layout == "gqa"
        ref = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)),
                                             attn_mask=mask.double(), enable_gqa=gqa)
        stock = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        # (-1e6 rounds the scores to 1/16 in fp32: stock's own error)
        assert (out.double() - ref).abs().max() <= 2 * (stock.double() - ref).abs().max() + 1e-5
        if fill < -1e30:  # the scores vanish next to the fill: uniform weights
            torch.testing.assert_close(out[0, :, 1],
                                       v[0].mean(-2).repeat_interleave(2 // hkv, 0))
            grad_out = torch.randn(out.shape, generator=g)
            ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
            qd, kd, vd = ref_leaves
            kd, vd = (t.repeat_interleave(2 // hkv, 1) for t in (kd, vd))
            probs = torch.softmax(qd @ kd.transpose(-1, -2) / 2.0 + mask.double(), dim=-1)
            ref = probs @ vd  # (scale 1 / sqrt(4))
            for ours, want in zip(torch.autograd.grad(out, leaves, grad_out),
                                  torch.autograd.grad(ref, ref_leaves, grad_out.double())):
                torch.testing.assert_close(ours.double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp32_mask_with_half_inputs_keeps_its_values(entry, dtype):
    """An fp32 additive mask with fp16 / bf16 q / k / v keeps values past the half dtype's range
    (1e5 is inf in fp16, fp32's minimum -inf in both), as stock SDPA does."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g).to(dtype) for _ in range(3))
    mask = torch.zeros(4, 4)
    mask[0, 1] = 1e5
    mask[1] = torch.finfo(torch.float32).min
    mask[2, 2:] = torch.finfo(torch.float32).min
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ENTRY_POINTS[entry](*leaves, attn_mask=mask)
    stock = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), attn_mask=mask.double())
    assert out.isfinite().all()
    assert (out.double() - ref).abs().max() <= 2 * (stock.double() - ref).abs().max() + 1e-2


def test_no_query_head_gives_zero_gradients():
    """Hq = 0 with key heads (enable_gqa): out empty, zero dK / dV as stock gives, through the
    drop-in and the op (the reference backward's group of 0 q heads failed a reshape)."""
    q = torch.randn(1, 0, 2, 4)
    k, v = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    for fn in ENTRY_POINTS.values():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, enable_gqa=True)
        assert out.shape == (1, 0, 2, 4)
        dq, dk, dv = torch.autograd.grad(out.sum(), leaves, allow_unused=True)
        assert dq.shape == q.shape
        assert dk.shape == k.shape and not dk.any() and dv.shape == v.shape and not dv.any()


def test_expanded_query_with_another_v_head_dim():
    """q broadcast over heads (stride 0) with Dv != D: out keeps a contiguous last dim, so the
    op's backward takes the op's own out (it refused it, and a compiled graph failed)."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(1, 1, 3, 4, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 3, 4, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 3, 8, generator=g, dtype=torch.float64)
    out, lse = torch.ops.torch_sm90_sdpa.sdpa(base.expand(1, 2, 3, 4), k, v, False, None, False,
                                              None)
    assert out.stride(-1) == 1
    grad_out = torch.randn_like(out)
    dq, dk, dv = torch.ops.torch_sm90_sdpa.sdpa_backward(
        grad_out, base.expand(1, 2, 3, 4), k, v, out, lse, False, None, False, None)
    leaves = [t.clone().requires_grad_() for t in (base, k, v)]
    ref = F.scaled_dot_product_attention(leaves[0].expand(1, 2, 3, 4), leaves[1], leaves[2])
    torch.testing.assert_close(out, ref.detach())
    ref_dq, ref_dk, ref_dv = torch.autograd.grad(ref, leaves, grad_out)
    torch.testing.assert_close(dq.sum(1, keepdim=True), ref_dq)
    torch.testing.assert_close(dk, ref_dk)
    torch.testing.assert_close(dv, ref_dv)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_lse_is_minus_inf_where_a_row_sees_no_key(is_causal, dtype):
    """The op's lse is -inf for a query that sees no key (its docstring), also where its CPU
    forward is stock's flash kernel, which writes 0 there; out is 0 and the rest is stock's."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 2, 5, 8, generator=g).to(dtype) for _ in range(3))
    mask = torch.rand(2, 1, 5, 5, generator=g) > 0.3
    mask[0, 0, 1] = False  # row 1 of batch 0: no key
    mask[1, 0, 2, :3] = False  # under is_causal row 2 of batch 1 sees no key either
    out, lse = torch.ops.torch_sm90_sdpa.sdpa(q, k, v, is_causal, None, False, mask)
    keep = mask & causal_mask(5, 5, "cpu") if is_causal else mask
    scores = q.double() @ k.double().transpose(-1, -2) / 8 ** 0.5
    scores = scores.masked_fill(~keep, float("-inf"))
    want = scores.logsumexp(-1)
    dead = ~keep.any(-1).expand(2, 2, 5)
    assert dead[0, :, 1].all() and (dead[1, :, 2].all() or not is_causal)
    assert torch.equal(lse.isneginf(), dead)
    torch.testing.assert_close(lse[~dead].double(), want[~dead], atol=1e-2, rtol=1e-3)
    assert not out[dead].any()


def test_no_key_head_with_a_mask_that_requires_grad():
    """Hkv = 0 with a mask that requires grad: stock's result (out 0, zero gradients, the mask
    left out of the graph), not the op's refusal of such a mask."""
    q = torch.randn(1, 2, 3, 4, requires_grad=True)
    k, v = (torch.randn(1, 0, 5, 4, requires_grad=True) for _ in range(2))
    mask = torch.zeros(3, 5, requires_grad=True)
    for is_causal in (False, True):
        out = torch_sm90_sdpa.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
        assert out.shape == (1, 2, 3, 4) and not out.any()
        out.sum().backward()
        assert not q.grad.any() and mask.grad is None


@pytest.mark.parametrize("heads_q", [0, 2])
def test_no_key_head_with_a_float64_mask(heads_q):
    """Hkv = 0 (and Hq = 0) with a float64 mask and inputs, which stock takes and the kernels
    never read: the drop-in gives out 0 and zero gradients itself (it passed such calls to
    stock, which ends the process with a division by zero before torch 2.13)."""
    q = torch.randn(1, heads_q, 3, 4, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 0, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = torch.zeros(1, 1, 3, 5, dtype=torch.float64)
    out = torch_sm90_sdpa.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert out.shape == (1, heads_q, 3, 4) and not out.any()
    out.sum().backward()
    assert not q.grad.any() and k.grad.shape == k.shape


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_op_takes_a_one_dimensional_mask(dtype):
    """A [Sk] mask is broadcastable to [B, Hq, Sq, Sk]: the ops serve it (stock's CPU kernels
    index its dim -2 and raised IndexError), with the result of the same mask as [1, Sk]."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 3 if i == 0 else 5, 4, generator=g) for i in range(3))
    keep = torch.tensor([True, False, True, True, False])
    mask = keep if dtype == torch.bool else torch.zeros(5).masked_fill(~keep, float("-inf"))
    out, lse = torch.ops.torch_sm90_sdpa.sdpa(q, k, v, False, None, False, mask)
    want_out, want_lse = torch.ops.torch_sm90_sdpa.sdpa(q, k, v, False, None, False, mask[None])
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None]))
