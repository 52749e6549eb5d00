"""The SM90 backward with a value head dim Dv != D: the (192, 128) pair of TILES_DV
(DeepSeek-style multi-head latent attention: q / k 192 wide, v and out 128 wide).

Gradients are compared with a float64 reference (autograd of explicit attention) under the
criterion of test_cuda_backward.py: our error at most twice the stock fused backward's
(cuDNN or the memory-efficient kernel: FlashAttention-2 has no Dv != D) on the same inputs
plus a small term, elementwise and in norm. Runs only on an SM90 GPU with the pair compiled
(TORCH_SM90_SDPA_HEAD_DIMS with 192x128); skips cleanly elsewhere.

test_pair_runs comes first: a tiny call per dtype, worth running alone under a short timeout
(`-k test_pair_runs`) before the rest: a wrong TMA transaction byte count hangs rather than
fails.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import torch_sm90_sdpa
from conftest import as_bias, padding, requires_sm90_kernels, sliding_window
from test_cuda_backward import assert_bitwise_repeatable, assert_close_to_reference
from test_cuda_compile import compile_env  # noqa: F401  (a fixture)
from torch_sm90_sdpa import _extension

pytestmark = requires_sm90_kernels

sdpa_backward = torch.ops.torch_sm90_sdpa.sdpa_backward
D, DV = 192, 128
DTYPES = [torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp16", "bf16"]


def need_pair(dtype):
    if not _extension.has_variant(D, dtype, DV):
        pytest.skip(f"main kernel pair {D}x{DV} {dtype} not compiled (TORCH_SM90_SDPA_HEAD_DIMS)")


def make_inputs(B, Hq, Hkv, Sq, Sk, dtype, layout="bhsd", seed=0):
    """q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv], dout [B, Hq, Sq, Dv].
    layout "bshd": transposed views of [B, S, H, *]; "mla": q a view of [B, Sq, Hq, D], k and v
    slices of one [B, Sk, Hkv, D + Dv] tensor (v's rows D + Dv elements apart)."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.float32, generator=g).to(dtype)

    if layout == "bshd":
        q = randn(B, Sq, Hq, D).transpose(1, 2)
        k = randn(B, Sk, Hkv, D).transpose(1, 2)
        v = randn(B, Sk, Hkv, DV).transpose(1, 2)
    elif layout == "mla":
        q = randn(B, Sq, Hq, D).transpose(1, 2)
        kv = randn(B, Sk, Hkv, D + DV)
        k, v = kv[..., :D].transpose(1, 2), kv[..., D:].transpose(1, 2)
    else:
        q, k, v = randn(B, Hq, Sq, D), randn(B, Hkv, Sk, D), randn(B, Hkv, Sk, DV)
    dout = randn(B, Hq, Sq, DV)
    return q, k, v, dout


def full_mask(Sq, Sk, is_causal, attn_mask, device):
    """The bool mask of the call (is_causal folded in: top-left, like SDPA), or None."""
    mask = attn_mask
    if mask is not None and mask.dtype != torch.bool:
        mask = torch.isfinite(mask)  # (the additive masks here are 0 / -inf)
    if is_causal:
        tril = torch.ones(Sq, Sk, dtype=torch.bool, device=device).tril()
        mask = tril if mask is None else mask & tril
    return mask


def reference(q, k, v, dout, is_causal, scale, attn_mask=None):
    """float64: (out, lse, dq, dk, dv) of explicit attention."""
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    ke, ve = k64.repeat_interleave(g, 1), v64.repeat_interleave(g, 1)
    s = (q64 @ ke.transpose(-1, -2)) * scale
    mask = full_mask(q.shape[2], k.shape[2], is_causal, attn_mask, q.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1) @ ve
    dq, dk, dv = torch.autograd.grad(o, (q64, k64, v64), dout.double())
    return o.detach(), lse.detach(), dq, dk, dv


def stock_backward(q, k, v, dout, is_causal, scale, attn_mask=None):
    """Gradients of the stock fused SDPA backward (cuDNN or memory-efficient: both take
    Dv != D), kv heads expanded for GQA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = q.shape[1] // k.shape[1]
    qs, ks, vs = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    ke, ve = ks.repeat_interleave(g, 1), vs.repeat_interleave(g, 1)
    mask = full_mask(q.shape[2], k.shape[2], is_causal, attn_mask, q.device)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        o = F.scaled_dot_product_attention(qs, ke, ve, attn_mask=mask, scale=scale)
    return torch.autograd.grad(o, (qs, ks, vs), dout)


def run_pair(B, Hq, Hkv, Sq, Sk, dtype, is_causal, layout="bhsd", seed=0, attn_mask=None,
             deterministic=False, repeats=4):
    need_pair(dtype)
    q, k, v, dout = make_inputs(B, Hq, Hkv, Sq, Sk, dtype, layout, seed)
    scale = 1.0 / math.sqrt(D)
    o64, lse64, rdq, rdk, rdv = reference(q, k, v, dout, is_causal, scale, attn_mask)
    out, lse = o64.to(dtype), lse64.float()
    sdq, sdk, sdv = stock_backward(q, k, v, dout, is_causal, scale, attn_mask)
    dq, dk, dv = sdpa_backward(dout, q, k, v, out, lse, is_causal, scale, deterministic, attn_mask)
    torch.cuda.synchronize()
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for ours, st, ref, name in ((dq, sdq, rdq, "dq"), (dk, sdk, rdk, "dk"), (dv, sdv, rdv, "dv")):
        assert_close_to_reference(ours, st, ref, name)
    if deterministic:
        assert_bitwise_repeatable(
            (dq, dk, dv),
            lambda: sdpa_backward(dout, q, k, v, out, lse, is_causal, scale, True, attn_mask), repeats)
    return dq, dk, dv


# ---- first: the smoke test ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("seqlen", [64, 100])
def test_pair_runs(dtype, seqlen):
    """One head, one key block (64) or two with a tail (100): the kernel finishes (a wrong
    TMA transaction byte count would hang it) and its gradients meet the criterion."""
    run_pair(1, 1, 1, seqlen, seqlen, dtype, False, seed=seqlen)


# ---- the contract -----------------------------------------------------------------------------

def test_pair_is_served_and_others_refused():
    from torch_sm90_sdpa import eligibility

    built = [dt for dt in DTYPES if _extension.has_variant(D, dt, DV)]
    if not built:
        need_pair(torch.bfloat16)  # (skips)
    for dtype in built:
        assert eligibility.kernel_verdict(dtype, D, DV, 8, 2, (9, 0), False) is None
        assert eligibility.kernel_verdict(dtype, D, DV, 8, 8, (9, 0), True) is None
    why = eligibility.kernel_verdict(torch.bfloat16, 128, 64, 8, 8, (9, 0), False)
    assert why is not None and why.startswith("Dv != D") and "192x128" in why
    q, k, v, _ = make_inputs(1, 2, 2, 16, 16, torch.bfloat16)
    with pytest.raises(ValueError, match=r"\(Dv != D\) has no SM90 backward"):
        torch.ops.torch_sm90_sdpa.sdpa(q[..., :128], k[..., :128], v[..., :64], False, None, False)


# ---- numerics -------------------------------------------------------------------------------

SEQ_PAIRS = [(1, 1), (17, 17), (128, 128), (333, 333), (1000, 1000), (2049, 2049), (17, 1000),
             (1000, 17), (100, 777), (777, 100), (1, 300), (300, 1)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqs", SEQ_PAIRS, ids=[f"q{a}k{b}" for a, b in SEQ_PAIRS])
def test_mha_against_fp64(dtype, is_causal, seqs):
    sq, sk = seqs
    run_pair(2, 3, 3, sq, sk, dtype, is_causal, seed=sq * 7 + sk)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(8, 2), (8, 1)], ids=["gqa", "mqa"])
@pytest.mark.parametrize("seqs", [(1000, 1000), (333, 777), (777, 333)], ids=["s1000", "q333k777", "q777k333"])
def test_gqa_against_fp64(dtype, is_causal, heads, seqs):
    """GQA with fp32 dk_accum [.., D] / dv_accum [.., Dv] (one q head per CTA)."""
    run_pair(2, heads[0], heads[1], seqs[0], seqs[1], dtype, is_causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_gqa_group_walk_against_fp64(dtype, is_causal, switch_env):
    """TORCH_SM90_SDPA_GQA_WALK=1: a CTA walks its kv head's group, dK / dV stored directly."""
    need_pair(dtype)
    switch_env.setenv("TORCH_SM90_SDPA_GQA_WALK", "1")
    from torch_sm90_sdpa import _cuda_backend as cb

    q, k, v, dout = make_inputs(2, 8, 2, 500, 700, dtype)
    lse = torch.zeros(2, 8, 500, device="cuda")
    assert cb.make_params(dout, q, k, v, dout, lse, is_causal, 1.0, False)[0].heads_per_cta == 4
    run_pair(2, 8, 2, 500, 700, dtype, is_causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("mask_kind", ["padding", "window", "bias"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_masks_against_fp64(dtype, mask_kind, heads):
    """The masked kernel: a bool padding mask with causal folded in (one row of [B, 1, Sq, Sk]
    per batch), a sliding window shared by all, the padding as an additive bias of q's dtype."""
    B, sq, sk = 2, 700, 700
    if mask_kind == "window":
        mask = sliding_window(sq, sk, 200, device="cuda")
    else:
        mask = padding(B, sq, sk, [700, 450], device="cuda")
        if mask_kind == "bias":
            mask = as_bias(mask, dtype)
    run_pair(B, heads[0], heads[1], sq, sk, dtype, False, attn_mask=mask)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_mask_with_is_causal_against_fp64(dtype):
    mask = padding(2, 300, 500, [500, 321], causal=False, device="cuda")
    run_pair(2, 4, 4, 300, 500, dtype, True, attn_mask=mask)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_deterministic_against_fp64(dtype, is_causal, heads):
    """Deterministic mode (GQA: one fp32 dK / dV tile per q head, summed by the postprocess):
    the criterion, and bitwise equal repeats."""
    run_pair(2, heads[0], heads[1], 777, 999, dtype, is_causal, deterministic=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", ["bshd", "mla"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_strided_views(dtype, layout, is_causal):
    """Transposed [B, S, H, *] views, and k / v as slices of one [B, S, H, D + Dv] tensor."""
    run_pair(2, 4, 4, 600, 600, dtype, is_causal, layout=layout)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_split_tail_against_fp64(dtype, switch_env):
    """Full attention on persistent CTAs with the split tail forced: the fragments' fp32 dK and
    dV sums share a slot of block_n * (D + Dv) floats."""
    need_pair(dtype)
    switch_env.setenv("TORCH_SM90_SDPA_SPLIT_TAIL", "1")
    switch_env.setenv("TORCH_SM90_SDPA_PERSISTENT", "1")
    from torch_sm90_sdpa import _cuda_backend as cb

    B, H, S = 1, 5, 4160  # 65 key blocks x 5 heads: 325 tiles, 325 % SMs left over
    q, k, v, dout = make_inputs(B, H, H, S, S, dtype)
    lse = torch.zeros(B, H, S, device="cuda")
    params = cb.make_params(dout, q, k, v, dout, lse, False, 1.0, False)[0]
    if params.split_tiles == 0:
        pytest.skip(f"no split tail on this GPU's {torch.cuda.get_device_properties(0).multi_processor_count} SMs")
    assert params.split_slot_floats == 64 * (D + DV)
    run_pair(B, H, H, S, S, dtype, False)


# ---- the drop-in ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_drop_in_against_fp64(dtype, is_causal, heads):
    """torch_sm90_sdpa.scaled_dot_product_attention serves the pair (stock forward, our
    backward) with gradients within the criterion."""
    from torch_sm90_sdpa import api

    need_pair(dtype)
    hq, hkv = heads
    q, k, v, dout = make_inputs(2, hq, hkv, 513, 513, dtype, seed=hq)
    qs, ks, vs = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    assert api._unservable_reason(qs, ks, vs, None, 0.0, hq != hkv, is_causal) is None
    out = torch_sm90_sdpa.scaled_dot_product_attention(qs, ks, vs, is_causal=is_causal,
                                                       enable_gqa=hq != hkv)
    assert out.shape == (2, hq, 513, DV)
    kernel_calls = _extension.load().cuda_calls()
    dq, dk, dv = torch.autograd.grad(out, (qs, ks, vs), dout)
    # the backward ran our kernel, not a fallback to stock
    assert _extension.load().cuda_calls() == kernel_calls + 1
    scale = 1.0 / math.sqrt(D)
    o64, _, rdq, rdk, rdv = reference(q, k, v, dout, is_causal, scale)
    torch.testing.assert_close(out.double(), o64, atol=2e-2, rtol=2e-2)
    sdq, sdk, sdv = stock_backward(q, k, v, dout, is_causal, scale)
    for ours, st, ref, name in ((dq, sdq, rdq, "dq"), (dk, sdk, rdk, "dk"), (dv, sdv, rdv, "dv")):
        assert_close_to_reference(ours, st, ref, name)


# ---- the compile route ------------------------------------------------------------------------

def test_compile_route_takes_the_pair_where_the_gate_routes(compile_env):
    """enable()'s default (the speed gate: the pair's own rows, speed_gate.dv_gate_lengths)
    replaces the stock backward node of an unmasked, non-causal MHA call of the pair at 2048
    keys by ours, whose gradients meet the criterion against float64."""
    dtype = torch.bfloat16
    need_pair(dtype)
    q, k, v, dout = make_inputs(1, 4, 4, 2048, 2048, dtype, layout="bshd", seed=7)
    qs, ks, vs = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    with torch_sm90_sdpa.enable():
        f = torch.compile(lambda a, b, c: F.scaled_dot_product_attention(a, b, c))
        out = f(qs, ks, vs)
        kernel_calls = _extension.load().cuda_calls()
        dq, dk, dv = torch.autograd.grad(out, (qs, ks, vs), dout)
        ran = _extension.load().cuda_calls() - kernel_calls
    stats = torch_sm90_sdpa.routing_stats()
    assert sum(stats["routed_nodes"].values()) == 1 and not stats["not_routed"], stats
    assert ran == 1, (ran, stats)  # the backward ran our kernel
    scale = 1.0 / math.sqrt(D)
    _, _, rdq, rdk, rdv = reference(q, k, v, dout, False, scale)
    sdq, sdk, sdv = stock_backward(q, k, v, dout, False, scale)
    for ours, st, ref, name in ((dq, sdq, rdq, "dq"), (dk, sdk, rdk, "dk"), (dv, sdv, rdv, "dv")):
        assert_close_to_reference(ours, st, ref, name)
