"""Numerics of the SM90 main backward kernel through torch.ops.torch_sm90_sdpa.sdpa_backward.

Each case compares dq/dk/dv with a float64 reference (autograd of explicit attention on the
GPU, SDPA's top-left causal mask) and requires our error to be at most twice the error of the
stock fused backward on the same fp16/bf16 inputs plus a small term, elementwise and in norm.
Runs only on an SM90 GPU with the variant compiled; skips cleanly elsewhere.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import torch_sm90_sdpa  # noqa: F401  (registers the ops)
from conftest import load_generator, requires_sm90_kernels
from torch_sm90_sdpa import _extension

pytestmark = requires_sm90_kernels

sdpa_backward = torch.ops.torch_sm90_sdpa.sdpa_backward
DTYPES = [torch.float16, torch.bfloat16]
HEAD_DIMS = [64, 96, 128, 192, 256]
SEQ_PAIRS = [(1, 1), (17, 17), (128, 128), (1000, 1000), (4097, 4097), (17, 1000), (1000, 17),
             (128, 4097), (4097, 128), (1, 1000), (1000, 1)]


def need_variant(head_dim, dtype):
    if not _extension.has_variant(head_dim, dtype):
        pytest.skip(f"main kernel variant d={head_dim} {dtype} not compiled")


def causal_mask(sq, sk, device):
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()  # top-left, like SDPA


def make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, layout="bhsd", seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.float32, generator=g).to(dtype)

    if layout == "packed":  # q, k, v sliced from one [B, S, 3, H, D] tensor
        assert Hq == Hkv and Sq == Sk
        qkv = randn(B, Sq, 3, Hq, D)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    elif layout == "bshd":
        q = randn(B, Sq, Hq, D).transpose(1, 2)
        k = randn(B, Sk, Hkv, D).transpose(1, 2)
        v = randn(B, Sk, Hkv, D).transpose(1, 2)
    else:
        q, k, v = randn(B, Hq, Sq, D), randn(B, Hkv, Sk, D), randn(B, Hkv, Sk, D)
    dout = randn(B, Hq, Sq, D)
    return q, k, v, dout


def reference(q, k, v, dout, is_causal, scale):
    """float64: (out, lse, dq, dk, dv) of explicit attention."""
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    ke, ve = k64.repeat_interleave(g, 1), v64.repeat_interleave(g, 1)
    s = (q64 @ ke.transpose(-1, -2)) * scale
    if is_causal:
        s = s.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1) @ ve
    dq, dk, dv = torch.autograd.grad(o, (q64, k64, v64), dout.double())
    return o.detach(), lse.detach(), dq, dk, dv


def stock_forward(q, k, v, is_causal, scale):
    """out (input dtype) and lse [B, Hq, Sq] fp32 from the stock fused forward (FA2).

    Not for causal with Sq != Sk: FA2 aligns that mask bottom-right, SDPA top-left (run_case
    then takes out / lse from the float64 reference instead)."""
    assert not (is_causal and q.shape[2] != k.shape[2])
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)[:2]
    return out, lse


def stock_backward(q, k, v, dout, is_causal, scale):
    """Gradients of the stock fused SDPA backward on the same inputs (kv heads expanded for GQA)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = q.shape[1] // k.shape[1]
    qs, ks, vs = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    ke, ve = ks.repeat_interleave(g, 1), vs.repeat_interleave(g, 1)
    sq, sk = q.shape[2], k.shape[2]
    backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    with sdpa_kernel(backends):
        if is_causal and sq != sk:
            o = F.scaled_dot_product_attention(qs, ke, ve, attn_mask=causal_mask(sq, sk, q.device), scale=scale)
        else:
            o = F.scaled_dot_product_attention(qs, ke, ve, is_causal=is_causal, scale=scale)
    return torch.autograd.grad(o, (qs, ks, vs), dout)


def poison_allocator(*like):
    """Leave NaN-filled blocks of the outputs' sizes in the caching allocator, so that the op's
    torch.empty_like(q / k / v) (allocated in that order) hands out NaN memory; checks that
    it does. One block per output, allocated and freed in the op's order on an emptied cache:
    the freed blocks coalesce and are split again in the same order."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # no other free blocks of these sizes left to hand out
    blocks = [torch.full_like(t, float("nan")) for t in like]
    del blocks
    probes = [torch.empty_like(t) for t in like]
    assert all(torch.isnan(p).all() for p in probes if p.numel()), \
        "the caching allocator did not hand the poisoned blocks back: the test proves nothing"
    del probes


def assert_close_to_reference(ours, stock, ref, name):
    assert ours.shape == ref.shape and ours.dtype == stock.dtype, name
    assert not torch.isnan(ours).any(), f"{name}: NaN"
    assert torch.isfinite(ours).all(), f"{name}: inf"
    o, s = ours.double(), stock.double()
    ref_max = ref.abs().max().item() if ref.numel() else 0.0
    err_max = (o - ref).abs().max().item() if ref.numel() else 0.0
    stock_max = (s - ref).abs().max().item() if ref.numel() else 0.0
    ref_norm = ref.norm().item()
    err_norm = (o - ref).norm().item() / max(ref_norm, 1e-30)
    stock_norm = (s - ref).norm().item() / max(ref_norm, 1e-30)
    small = 1e-3 * ref_max + 1e-5
    assert err_max <= 2 * stock_max + small, (
        f"{name}: max abs err {err_max:.3e} > 2 * stock {stock_max:.3e} + {small:.1e} (ref max {ref_max:.3e})")
    assert err_norm <= 2 * stock_norm + 1e-4, f"{name}: rel err {err_norm:.3e} > 2 * stock {stock_norm:.3e}"


def assert_bitwise_repeatable(first, run, repeats):
    """`run()` gives the gradients `first` gave, bit for bit, `repeats` more times."""
    for i in range(repeats):
        for a, b, name in zip(first, run(), ("dq", "dk", "dv")):
            assert torch.equal(a, b), (
                f"{name} differs on repeat {i + 1}: max abs diff {(a.double() - b.double()).abs().max():.3e}")


class KnownOverBound(Exception):
    """A gradient over the fp64 criterion on an input where that is known and recorded."""


def run_case(B, Hq, Hkv, Sq, Sk, D, dtype, is_causal, layout="bhsd", seed=0, scale=None,
             deterministic=False, repeats=19, known_over_bound=()):
    """deterministic: the kernel's deterministic mode, and `repeats` more runs bitwise equal.
    known_over_bound: names of gradients known to miss the criterion on this input: checked
    after everything else, their failure raised as KnownOverBound (for a strict xfail)."""
    need_variant(D, dtype)
    q, k, v, dout = make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, layout, seed)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    o64, lse64, rdq, rdk, rdv = reference(q, k, v, dout, is_causal, scale)
    if is_causal and Sq != Sk:  # no stock fused forward with SDPA's top-left mask here
        out, lse = o64.to(dtype), lse64.float()
    else:
        out, lse = stock_forward(q, k, v, is_causal, scale)
    sdq, sdk, sdv = stock_backward(q, k, v, dout, is_causal, scale)
    poison_allocator(q, k, v)
    dq, dk, dv = sdpa_backward(dout, q, k, v, out, lse, is_causal, scale, deterministic)
    # outputs come back with the strides empty_like gives (what the stock meta functions say)
    for g, t in ((dq, q), (dk, k), (dv, v)):
        assert g.stride() == torch.empty_like(t).stride()
    for ours, st, ref, name in ((dq, sdq, rdq, "dq"), (dk, sdk, rdk, "dk"), (dv, sdv, rdv, "dv")):
        if name not in known_over_bound:
            assert_close_to_reference(ours, st, ref, name)
    if deterministic:
        assert_bitwise_repeatable(
            (dq, dk, dv), lambda: sdpa_backward(dout, q, k, v, out, lse, is_causal, scale, True),
            repeats)
    else:
        # repeated runs agree (fp32 atomics may reorder additions: rounding-level differences only)
        dq2, dk2, dv2 = sdpa_backward(dout, q, k, v, out, lse, is_causal, scale, False)
        for a, b, name in ((dq, dq2, "dq"), (dk, dk2, "dk"), (dv, dv2, "dv")):
            torch.testing.assert_close(a, b, atol=2e-3 * max(b.abs().max().item(), 1e-3), rtol=1e-2, msg=name)
    for ours, st, ref, name in ((dq, sdq, rdq, "dq"), (dk, sdk, rdk, "dk"), (dv, sdv, rdv, "dv")):
        if name in known_over_bound:
            try:
                assert_close_to_reference(ours, st, ref, name)
            except AssertionError as err:
                raise KnownOverBound(str(err)) from None
    return dq, dk, dv


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqs", SEQ_PAIRS, ids=[f"q{a}k{b}" for a, b in SEQ_PAIRS])
def test_mha_against_fp64(dtype, head_dim, is_causal, seqs):
    sq, sk = seqs
    B, H = (1, 2) if max(sq, sk) > 2000 else (2, 3)
    run_case(B, H, H, sq, sk, head_dim, dtype, is_causal, seed=sq * 7 + sk)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(8, 2), (8, 1)], ids=["gqa", "mqa"])
@pytest.mark.parametrize("seqs", [(1000, 1000), (333, 777), (777, 333)], ids=["s1000", "q333k777", "q777k333"])
def test_gqa_against_fp64(dtype, head_dim, is_causal, heads, seqs):
    run_case(2, heads[0], heads[1], seqs[0], seqs[1], head_dim, dtype, is_causal)


def heads_per_cta(B, Hq, Hkv, Sq, Sk, D, dtype, is_causal=False, deterministic=False):
    """BwdParams::heads_per_cta the device layer picks for this problem (make_params)."""
    from torch_sm90_sdpa import _cuda_backend as cb

    q, k, v, dout = make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype)
    lse = torch.zeros(B, Hq, Sq, device="cuda")
    return cb.make_params(dout, q, k, v, q, lse, is_causal, 1.0, deterministic)[0].heads_per_cta


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(8, 2), (8, 1)], ids=["gqa", "mqa"])
@pytest.mark.parametrize("seqs", [(1000, 1000), (333, 777), (81, 2048)], ids=["s1000", "q333k777", "q81k2048"])
def test_gqa_group_walk_against_fp64(dtype, head_dim, is_causal, heads, seqs, switch_env):
    """TORCH_SM90_SDPA_GQA_WALK=1: each CTA walks its kv head's whole group of q heads, dK /
    dV summed in registers and stored directly (no fp32 accumulators): the same criterion."""
    need_variant(head_dim, dtype)
    switch_env.setenv("TORCH_SM90_SDPA_GQA_WALK", "1")
    assert heads_per_cta(2, heads[0], heads[1], seqs[0], seqs[1], head_dim, dtype) == heads[0] // heads[1]
    run_case(2, heads[0], heads[1], seqs[0], seqs[1], head_dim, dtype, is_causal)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_gqa_group_walk_by_default(is_causal, switch_env):
    """Without the switch the walk starts at 512 kv-head key-block CTAs (4 x 8 kv heads x 16
    key blocks of 128 at d128 2k) and not below; deterministic mode never walks."""
    need_variant(128, torch.bfloat16)
    switch_env.delenv("TORCH_SM90_SDPA_GQA_WALK", raising=False)
    assert heads_per_cta(4, 16, 8, 2048, 2048, 128, torch.bfloat16) == 2
    assert heads_per_cta(4, 16, 8, 2048, 1920, 128, torch.bfloat16) == 1  # 480 CTAs
    assert heads_per_cta(4, 16, 8, 2048, 2048, 128, torch.bfloat16, deterministic=True) == 1
    run_case(4, 16, 8, 2048, 2048, 128, torch.bfloat16, is_causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("layout", ["packed", "bshd"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_strided_views(dtype, head_dim, layout, is_causal):
    dq, dk, dv = run_case(2, 4, 4, 1000, 1000, head_dim, dtype, is_causal, layout=layout)


# d128 calls without a mask, deterministic or not, run the 80 x 128 full-tile kernel
# (TILES_FULL in csrc/generate_instantiations.py) past FULL_TILE_MIN_QUERIES queries; up to it
# the default 64 x 128 tile (csrc/bwd_main_launch_template.h). Lengths that are not multiples of the
# full tile's 80-row m-blocks, among them ones whose last m-block reaches past the rounded length
# (881, 1000 and 2048: 12 x 80 = 960 > 896, 13 x 80 = 1040 > 1024 and 26 x 80 = 2080 > 2048
# rows; their lse / dpsum come by TMA, zero-filled. Those rows have Q = dO = 0, so these tests
# would catch an inf / NaN there, not a finite wrong value, which adds nothing either); and the
# lengths around the switch (FULL_TILE_MIN_QUERIES and one more) and below it (80, 81, 160: the
# default tile).
FULL_TILE_MIN_QUERIES = load_generator().FULL_TILE_MIN_QUERIES
_T = FULL_TILE_MIN_QUERIES
FULL_TILE_SEQS = [(80, 80), (81, 300), (_T, _T), (_T + 1, _T + 1), (800, 800), (881, 300),
                  (1000, 1000), (2048, 2048), (2081, 513), (160, 4097), (840, 4097)]


# Over the bound on this input (seed 0), measured on the H200 (the numerics probe of commit
# 6787db2): dq max error 1.26e-2 against stock's 3.9e-3 (bound 9.97e-3), with the full tile
# and the default tile alike (the tile does not change the numerics), while seeds 1-3 of the
# same shape give 4.6-5.6e-3 against stock's 4.9-6.5e-3. Kept as a strict xfail so that it is
# seen, not hidden. Explained by the float64 emulation of commit 1966688: our dq equals, at
# the worst element and to one bf16 ulp everywhere, a float64 emulation whose only roundings
# are dS to bf16 (the dQ wgmma's operand) and dq to bf16: -2.14062 against the reference's
# -2.12805. Without the dS rounding the emulation gives -2.12500, stock's value. The excess is
# the bf16 dS operand (0.005 here) plus a near tie of the final rounding where bf16's ulp is
# 1/64, not a kernel fault. Only dq's bound may fail (KnownOverBound); dk, dv and the repeat
# check are asserted as in every case.
KNOWN_OVER_BOUND = {((80, 80), (8, 2), torch.bfloat16): ("dq",)}


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("seqs", FULL_TILE_SEQS, ids=[f"q{a}k{b}" for a, b in FULL_TILE_SEQS])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_full_tile_lengths(dtype, heads, seqs, is_causal, request):
    known = () if is_causal else KNOWN_OVER_BOUND.get((seqs, heads, dtype), ())
    if known:
        request.applymarker(pytest.mark.xfail(
            strict=True, raises=KnownOverBound,
            reason="dq max error over 2x stock's on this input, both tiles (see KNOWN_OVER_BOUND)"))
    run_case(2, heads[0], heads[1], seqs[0], seqs[1], 128, dtype, is_causal, known_over_bound=known)


def main_kernel_names(*args):
    """The main kernel's (demangled) names that one sdpa_backward call launches."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        sdpa_backward(*args)
        torch.cuda.synchronize()
    return [e.key for e in prof.key_averages() if "bwd_main_kernel" in e.key]


@pytest.mark.parametrize("case", ["full", "causal", "deterministic", "deterministic causal",
                                  "threshold queries", "threshold + 1 queries"])
def test_full_tile_serves_long_dense_calls(case):
    """The full-tile kernel runs the d128 calls without a mask of more than
    FULL_TILE_MIN_QUERIES queries, causal or full, deterministic or not (the dQ semaphores,
    laid out for the default tile's 64-row m-blocks, cover its 80-row ones); calls of up to
    FULL_TILE_MIN_QUERIES queries keep the default tile (where 64-row m-blocks pad 512 queries
    to none and 80-row ones pad them to 560)."""
    need_variant(128, torch.bfloat16)
    sq = {"threshold queries": _T, "threshold + 1 queries": _T + 1}.get(case, _T + 32)
    q, k, v, dout = make_inputs(1, 2, 2, sq, sq, 128, torch.bfloat16)  # (FA2's causal: Sq = Sk)
    causal = "causal" in case
    out, lse = stock_forward(q, k, v, causal, 1 / math.sqrt(128))
    names = main_kernel_names(dout, q, k, v, out, lse, causal, 1 / math.sqrt(128),
                              case.startswith("deterministic"))
    assert len(names) == 1, names
    full_tile = case != "threshold queries"
    assert ("FullBwdConfig<128>" in names[0]) == full_tile, names[0]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_large_batch_times_heads(head_dim):
    """B * H = 70000 CTAs per key block: the grid must not overflow gridDim.y/z."""
    run_case(7000, 10, 10, 17, 17, head_dim, torch.bfloat16, True)


def test_custom_scale_and_lse_layouts():
    """A non-default scale, and an lse that is a strided view (row stride 2)."""
    need_variant(128, torch.bfloat16)
    q, k, v, dout = make_inputs(2, 4, 4, 500, 500, 128, torch.bfloat16, seed=3)
    scale = 0.3
    out, lse = stock_forward(q, k, v, True, scale)
    lse2 = torch.full((*lse.shape, 2), float("nan"), device="cuda")
    lse2[..., 0] = lse
    _, _, rdq, rdk, rdv = reference(q, k, v, dout, True, scale)
    sdq, sdk, sdv = stock_backward(q, k, v, dout, True, scale)
    dq, dk, dv = sdpa_backward(dout, q, k, v, out, lse2[..., 0], True, scale, False)
    for ours, st, ref, name in ((dq, sdq, rdq, "dq"), (dk, sdk, rdk, "dk"), (dv, sdv, rdv, "dv")):
        assert_close_to_reference(ours, st, ref, name)


def test_expanded_kv_heads():
    """k / v expanded along heads (stride 0): the backend copies what TMA cannot address,
    so the gradients are right (per expanded head, as the stock backward gives them)."""
    need_variant(128, torch.bfloat16)
    q, k1, v1, dout = make_inputs(2, 4, 1, 300, 300, 128, torch.bfloat16, seed=5)
    k, v = k1.expand(2, 4, 300, 128), v1.expand(2, 4, 300, 128)
    scale = 1 / math.sqrt(128)
    out, lse = stock_forward(q, k.contiguous(), v.contiguous(), False, scale)
    dq, dk, dv = sdpa_backward(dout, q, k, v, out, lse, False, scale, False)
    _, _, rdq, rdk, rdv = reference(q, k.contiguous(), v.contiguous(), dout, False, scale)
    sdq, sdk, sdv = stock_backward(q, k.contiguous(), v.contiguous(), dout, False, scale)
    for ours, st, ref, name in ((dq, sdq, rdq, "dq"), (dk, sdk, rdk, "dk"), (dv, sdv, rdv, "dv")):
        assert_close_to_reference(ours, st, ref, name)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mode", ["default", "gqa", "deterministic", "mask", "mask-deterministic",
                                  "bias"])
def test_programmatic_launch_matches_plain_launches(head_dim, dtype, mode, switch_env):
    """The main and post kernels launched programmatically (csrc/grid_dependency.h: they start
    while the kernel before them drains and wait for its writes) give the gradients of plain
    launches (TORCH_SM90_SDPA_PDL=0): bit for bit in deterministic mode, to the rounding of
    reordered fp32 atomics otherwise; both within the fp64 criterion."""
    need_variant(head_dim, dtype)
    hkv = 1 if mode == "gqa" else 4
    q, k, v, dout = make_inputs(2, 4, hkv, 1000, 1000, head_dim, dtype, seed=11)
    scale = 1 / math.sqrt(head_dim)
    out, lse = stock_forward(q, k, v, True, scale)
    # "mask*": a causal bool mask, for the masked kernel (it waits before walking the tile
    # classes); "bias": the same as torch's 0 / -65504 bias for cuDNN, whose empty tiles come
    # from the score bounds of the preprocess launch's extra CTAs
    mask = None
    if mode.startswith("mask"):
        mask = causal_mask(1000, 1000, "cuda")
    elif mode == "bias":
        mask = torch.zeros(1000, 1000, dtype=dtype, device="cuda").masked_fill(
            ~causal_mask(1000, 1000, "cuda"), -65504.0)
    is_causal = mask is None
    det = mode.endswith("deterministic")
    _, _, rdq, rdk, rdv = reference(q, k, v, dout, True, scale)
    sdq, sdk, sdv = stock_backward(q, k, v, dout, True, scale)

    def run():
        return sdpa_backward(dout, q, k, v, out, lse, is_causal, scale, det, mask)

    switch_env.setenv("TORCH_SM90_SDPA_PDL", "1")
    programmatic = run()
    switch_env.setenv("TORCH_SM90_SDPA_PDL", "0")
    plain = run()
    for a, b, st, ref, name in zip(programmatic, plain, (sdq, sdk, sdv), (rdq, rdk, rdv),
                                   ("dq", "dk", "dv")):
        assert_close_to_reference(a, st, ref, name)
        if det:
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a, b, atol=2e-3 * max(b.abs().max().item(), 1e-3), rtol=1e-2,
                                       msg=name)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("mode", ["default", "gqa", "gqa-walk", "mask", "bias", "cross"])
def test_prepost_order_gives_the_same_gradients(head_dim, mode, switch_env):
    """The pre- and postprocess walking their rows last (batch, head) first
    (TORCH_SM90_SDPA_PREPOST_ORDER=reversed) compute every row as the forward order does:
    deterministic mode gives the same bits either way, and both orders meet the fp64
    criterion (GQA: the kv accumulators' chunks too; bias: the score-bound CTAs of the same
    launch; cross: Sq != Sk, rows past Sq in the rounded workspaces)."""
    dtype = torch.bfloat16
    need_variant(head_dim, dtype)
    hkv = 1 if mode.startswith("gqa") else 4
    switch_env.setenv("TORCH_SM90_SDPA_GQA_WALK", "1" if mode == "gqa-walk" else "0")
    sq, sk = (700, 1000) if mode == "cross" else (1000, 1000)
    q, k, v, dout = make_inputs(3, 4, hkv, sq, sk, head_dim, dtype, seed=41)
    scale = 1 / math.sqrt(head_dim)
    mask = None
    if mode == "mask":
        mask = causal_mask(sq, sk, "cuda")
    elif mode == "bias":
        mask = torch.zeros(sq, sk, dtype=dtype, device="cuda").masked_fill(
            ~causal_mask(sq, sk, "cuda"), -65504.0)
    is_causal = mask is None and mode != "cross"
    out, lse = stock_forward(q, k, v, mask is not None or is_causal, scale)
    _, _, rdq, rdk, rdv = reference(q, k, v, dout, mask is not None or is_causal, scale)
    sdq, sdk, sdv = stock_backward(q, k, v, dout, mask is not None or is_causal, scale)
    results = {}
    for order in ("forward", "reversed"):
        switch_env.setenv("TORCH_SM90_SDPA_PREPOST_ORDER", order)
        results[order] = [sdpa_backward(dout, q, k, v, out, lse, is_causal, scale, det, mask)
                          for det in (False, True)]
    for order, (fast, det) in results.items():
        for g, st, ref, name in zip(fast + det, (sdq, sdk, sdv) * 2, (rdq, rdk, rdv) * 2,
                                    ("dq", "dk", "dv", "dq det", "dk det", "dv det")):
            assert_close_to_reference(g, st, ref, f"{order} {name}")
    for a, b, name in zip(results["forward"][1], results["reversed"][1], ("dq", "dk", "dv")):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_programmatic_launch_back_to_back(head_dim, switch_env):
    """Calls on different problems issued back to back without a sync, programmatically
    launched: each call's main kernel starts while the previous kernel drains, and its
    workspace (lse_log2, dpsum, dq_accum) may be the memory the previous call just used, so a
    read before its own preprocess finished would take the other problem's values. Each result
    must be the one plain launches give (deterministic mode: bit for bit)."""
    dtype = torch.bfloat16
    need_variant(head_dim, dtype)
    problems = []
    for i, (hkv, s, causal) in enumerate([(4, 700, True), (1, 1000, False), (4, 1000, True)]):
        q, k, v, dout = make_inputs(2, 4, hkv, s, s, head_dim, dtype, seed=20 + i)
        scale = 1 / math.sqrt(head_dim)
        out, lse = stock_forward(q, k, v, causal, scale)
        problems.append((dout, q, k, v, out, lse, causal, scale))

    def run_all():
        results = [sdpa_backward(*p, True, None) for p in problems for _ in range(3)]
        torch.cuda.synchronize()
        return results

    switch_env.setenv("TORCH_SM90_SDPA_PDL", "0")
    plain = run_all()
    switch_env.setenv("TORCH_SM90_SDPA_PDL", "1")
    for _ in range(3):
        for got, want in zip(run_all(), plain):
            for a, b, name in zip(got, want, ("dq", "dk", "dv")):
                assert torch.equal(a, b), name


def test_programmatic_launch_in_a_cuda_graph(switch_env):
    """Captured into a CUDA graph, the programmatic launches become programmatic edges of the
    graph: its replays give the gradients of plain eager launches, bit for bit (deterministic
    mode), also when the inputs change between replays."""
    dtype = torch.bfloat16
    head_dim = 128
    need_variant(head_dim, dtype)
    scale = 1 / math.sqrt(head_dim)
    inputs = [make_inputs(2, 4, 2, 1000, 1000, head_dim, dtype, seed=30 + i) for i in range(2)]
    problems = []
    for q, k, v, dout in inputs:
        out, lse = stock_forward(q, k, v, True, scale)
        problems.append((dout, q, k, v, out, lse))
    switch_env.setenv("TORCH_SM90_SDPA_PDL", "0")
    want = [sdpa_backward(*p, True, scale, True, None) for p in problems]
    switch_env.setenv("TORCH_SM90_SDPA_PDL", "1")
    static = [t.clone() for t in problems[0]]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture (attributes, occupancy)
        sdpa_backward(*static, True, scale, True, None)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = sdpa_backward(*static, True, scale, True, None)
    for _ in range(2):
        for i in (0, 1, 0):
            for dst, src in zip(static, problems[i]):
                dst.copy_(src)
            graph.replay()
            torch.cuda.synchronize()
            for a, b, name in zip(got, want[i], ("dq", "dk", "dv")):
                assert torch.equal(a, b), (i, name)


def main_kernel_grid(*args):
    """gridDim.x of the main kernel of one sdpa_backward call (from the profiler's trace)."""
    import json
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        sdpa_backward(*args)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    grids = [e["args"]["grid"][0] for e in events
             if "bwd_main_kernel" in e.get("name", "") and "grid" in e.get("args", {})]
    assert len(grids) == 1, grids
    return grids[0]


# Persistent CTAs (TORCH_SM90_SDPA_PERSISTENT=1, BwdParams.persistent): shapes with several
# tiles per CTA (B * H * key blocks well over the 132 SMs), key blocks that see no query
# (causal with Sk > Sq: a CTA's tiles without a K / V load between tiles with one), odd lengths,
# GQA walked and not walked (the latter keeps one tile per CTA: fp32 dK / dV accumulators), masks.
PERSISTENT_CASES = {
    "full": dict(heads=(16, 16), seqs=(1000, 1000), causal=False),
    "causal": dict(heads=(16, 16), seqs=(1000, 1000), causal=True),
    "causal-q300k1000": dict(heads=(16, 16), seqs=(300, 1000), causal=True),
    "full-q77k1500": dict(heads=(16, 16), seqs=(77, 1500), causal=False),
    "gqa-walk": dict(heads=(16, 8), seqs=(1000, 1000), causal=True, walk="1"),
    "gqa-accum": dict(heads=(16, 4), seqs=(1000, 1000), causal=True, walk="0"),
    "mask": dict(heads=(16, 16), seqs=(1000, 1000), causal=False, mask="bool"),
    "bias": dict(heads=(16, 16), seqs=(1000, 1000), causal=False, mask="bias"),
}


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("case", list(PERSISTENT_CASES))
def test_persistent_matches_one_tile_per_cta(head_dim, case, switch_env):
    """The main kernel with persistent CTAs (each taking tiles from the scheduler's counter,
    the next tile's loads overlapping the epilogue) gives the gradients of one CTA per tile
    (TORCH_SM90_SDPA_PERSISTENT=0) to the rounding of reordered fp32 atomics, both within the
    fp64 criterion; the grid is one CTA per SM where the variant and the call allow it, else
    one per tile. Twice in a row: the preprocess zeroes the counter again."""
    c = PERSISTENT_CASES[case]
    dtype = torch.bfloat16
    need_variant(head_dim, dtype)
    (hq, hkv), (sq, sk), causal = c["heads"], c["seqs"], c["causal"]
    switch_env.setenv("TORCH_SM90_SDPA_GQA_WALK", c.get("walk", "0"))
    q, k, v, dout = make_inputs(4, hq, hkv, sq, sk, head_dim, dtype, seed=41)
    scale = 1 / math.sqrt(head_dim)
    mask = None
    if "mask" in c:  # a causal mask: bits tiles, full tiles and skipped ones
        mask = causal_mask(sq, sk, "cuda")
        if c["mask"] == "bias":
            mask = torch.zeros(sq, sk, dtype=dtype, device="cuda").masked_fill(~mask, -65504.0)
    ref_causal = causal or mask is not None
    o64, lse64, rdq, rdk, rdv = reference(q, k, v, dout, ref_causal, scale)
    if ref_causal and sq != sk:
        out, lse = o64.to(dtype), lse64.float()
    else:
        out, lse = stock_forward(q, k, v, ref_causal, scale)
    sdq, sdk, sdv = stock_backward(q, k, v, dout, ref_causal, scale)
    args = (dout, q, k, v, out, lse, causal, scale, False, mask)

    switch_env.setenv("TORCH_SM90_SDPA_PERSISTENT", "0")
    one_tile = sdpa_backward(*args)
    grid_one = main_kernel_grid(*args)
    switch_env.setenv("TORCH_SM90_SDPA_PERSISTENT", "1")
    poison_allocator(q, k, v)
    persistent = sdpa_backward(*args)
    grid_persistent = main_kernel_grid(*args)
    poison_allocator(q, k, v)
    again = sdpa_backward(*args)

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert grid_one > sms, f"{grid_one} tiles: the case does not give a CTA several tiles"
    # GQA's fp32 accumulators take the mainloop's shared memory: one CTA per tile there (every
    # head dim's dK / dV tiles in the input dtype fit outside it, d256's in turn)
    capable = case != "gqa-accum"
    assert grid_persistent == (sms if capable else grid_one), (grid_persistent, grid_one)
    for a, b, st, ref, name in zip(persistent, one_tile, (sdq, sdk, sdv), (rdq, rdk, rdv),
                                   ("dq", "dk", "dv")):
        assert_close_to_reference(a, st, ref, name)
        torch.testing.assert_close(a, b, atol=2e-3 * max(b.abs().max().item(), 1e-3), rtol=1e-2,
                                   msg=name)
    for a, b, name in zip(again, persistent, ("dq", "dk", "dv")):
        torch.testing.assert_close(a, b, atol=2e-3 * max(b.abs().max().item(), 1e-3), rtol=1e-2,
                                   msg=f"second call: {name}")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("case", ["causal", "full", "gqa-walk-causal"])
@pytest.mark.parametrize("section_heads", ["1", "3", "1000"])
def test_forced_sections_against_fp64(head_dim, case, section_heads, switch_env):
    """TORCH_SM90_SDPA_SECTION_HEADS=N (scheduling sections of N head groups, for A/B
    measurement): one head per section, a count that leaves a partial last section (64 heads /
    3), and more than the heads; the tile order changes, the gradients keep the criterion."""
    need_variant(head_dim, torch.bfloat16)
    switch_env.setenv("TORCH_SM90_SDPA_SECTION_HEADS", section_heads)
    walk = case.startswith("gqa")
    switch_env.setenv("TORCH_SM90_SDPA_GQA_WALK", "1" if walk else "0")
    hkv = 8 if walk else 16
    run_case(4, 16, hkv, 1000, 1000, head_dim, torch.bfloat16, case != "full", seed=43)


# Split tail (TORCH_SM90_SDPA_SPLIT_TAIL=1: wherever the structure allows), shapes chosen for
# 132 SMs: tiles split in two or three fragments (d64, d128's 80-row tile, d96, d256, whose
# epilogue stores dK and dV in turn through the dQ staging tile), odd lengths with a partial
# key block (d192 s6000), many fragments per tile (3000 queries, 12000 keys), a walked GQA group
# (its fragments walk both q heads), fp16.
SPLIT_CASES = {
    "d64": (64, torch.bfloat16, (1, 5, 5, 8192, 8192), "0"),
    "d128": (128, torch.bfloat16, (1, 5, 5, 8192, 8192), "0"),
    "d128-fp16-q3000k12000": (128, torch.float16, (1, 3, 3, 3000, 12000), "0"),
    "d96": (96, torch.bfloat16, (1, 3, 3, 12288, 12288), "0"),
    "d192-s6000": (192, torch.bfloat16, (1, 3, 3, 6000, 6000), "0"),
    "d128-gqa-walk": (128, torch.bfloat16, (1, 8, 4, 9000, 9000), "1"),
    "d256": (256, torch.bfloat16, (1, 6, 6, 4096, 4096), "0"),
}


def split_fragment_counts(r, m_blocks, pieces):
    """The pieces covering each of the r split tiles (piece q: the m-blocks
    [q R / P, (q + 1) R / P) of the split tiles' R = r M m-blocks in a row), piece by piece."""
    total = r * m_blocks
    counts = [0] * r
    for q in range(pieces):
        lo, hi = q * total // pieces, (q + 1) * total // pieces
        for i in range(lo // m_blocks, (hi - 1) // m_blocks + 1):
            counts[i] += 1
    return counts


@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_split_tail_against_fp64(case, switch_env):
    """Full attention's last partial wave dealt as one piece of m-blocks per SM: every split
    tile's fragments counted themselves in (the counts the preprocess zeroed equal the pieces
    covering each tile), the last one stored dK / dV (NaN-poisoned outputs), and the gradients
    keep the fp64 criterion and match the unsplit kernel's (TORCH_SM90_SDPA_SPLIT_TAIL=0) to
    the rounding of reordered fp32 sums; through the op and the Python device path."""
    from torch_sm90_sdpa import _cuda_backend as cb

    d, dtype, (b, hq, hkv, sq, sk), walk = SPLIT_CASES[case]
    need_variant(d, dtype)
    switch_env.setenv("TORCH_SM90_SDPA_GQA_WALK", walk)
    switch_env.setenv("TORCH_SM90_SDPA_PERSISTENT", "1")
    switch_env.setenv("TORCH_SM90_SDPA_SPLIT_TAIL", "1")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    from conftest import load_generator, requires_sm90_kernels

    tile = load_generator().dense_tile(d, sq)  # run_bwd_main's
    groups = hkv if walk == "1" else hq  # (a walking CTA takes a kv head's whole group)
    tiles = -(-sk // tile.block_n) * groups * b
    r, m_blocks = tiles % sms, -(-sq // tile.block_m)
    if not (tiles >= 2 * sms and r > 0 and r * m_blocks >= sms):
        pytest.skip(f"{tiles} tiles on {sms} SMs leave no split tail (shapes chosen for 132 SMs)")
    q, k, v, dout = make_inputs(b, hq, hkv, sq, sk, d, dtype, seed=47)
    scale = 1 / math.sqrt(d)
    out, lse = stock_forward(q, k, v, False, scale)

    py = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    params, ws = cb.make_params(dout, q, k, v, out, lse, False, scale, False, *py)
    assert params.split_tiles == r
    cb.run_backward(params)
    torch.cuda.synchronize()
    first = (params.split_count - ws.buffer.data_ptr()) // 4
    counts = ws.buffer[first:first + r].view(torch.int32).tolist()
    want = split_fragment_counts(r, m_blocks, sms)
    assert counts == want and max(want) > 1, (counts, want)

    poison_allocator(q, k, v)
    split = sdpa_backward(dout, q, k, v, out, lse, False, scale, False)
    switch_env.setenv("TORCH_SM90_SDPA_SPLIT_TAIL", "0")
    whole = sdpa_backward(dout, q, k, v, out, lse, False, scale, False)
    _, _, rdq, rdk, rdv = reference(q, k, v, dout, False, scale)
    stock = stock_backward(q, k, v, dout, False, scale)
    for i, (ref, name) in enumerate(zip((rdq, rdk, rdv), ("dq", "dk", "dv"))):
        assert_close_to_reference(split[i], stock[i], ref, name)
        assert_close_to_reference(py[i], stock[i], ref, f"python path {name}")
        scale_ = max(whole[i].abs().max().item(), 1e-3)
        torch.testing.assert_close(split[i], whole[i], atol=2e-3 * scale_, rtol=1e-2, msg=name)


def test_persistent_back_to_back(switch_env):
    """Persistent calls on different problems issued back to back without a sync, and with
    programmatic launches: each result is the one-tile-per-CTA result of its problem."""
    dtype = torch.bfloat16
    need_variant(128, dtype)
    problems = []
    for i, (hq, s, causal) in enumerate([(16, 700, True), (16, 1000, False), (8, 1500, True)]):
        q, k, v, dout = make_inputs(4, hq, hq, s, s, 128, dtype, seed=50 + i)
        scale = 1 / math.sqrt(128)
        out, lse = stock_forward(q, k, v, causal, scale)
        problems.append((dout, q, k, v, out, lse, causal, scale, False, None))

    def run_all():
        results = [sdpa_backward(*p) for p in problems for _ in range(2)]
        torch.cuda.synchronize()
        return results

    switch_env.setenv("TORCH_SM90_SDPA_PERSISTENT", "0")
    want = run_all()
    switch_env.setenv("TORCH_SM90_SDPA_PERSISTENT", "1")
    for pdl in ("0", "1"):
        switch_env.setenv("TORCH_SM90_SDPA_PDL", pdl)
        for got, ref in zip(run_all(), want):
            for a, b, name in zip(got, ref, ("dq", "dk", "dv")):
                torch.testing.assert_close(a, b, atol=2e-3 * max(b.abs().max().item(), 1e-3),
                                           rtol=1e-2, msg=f"pdl={pdl} {name}")


@pytest.mark.parametrize("shape", [(0, 4, 4, 100, 100), (2, 4, 4, 0, 100), (2, 4, 4, 100, 0)],
                         ids=["batch0", "sq0", "sk0"])
def test_empty(shape):
    need_variant(128, torch.bfloat16)
    B, Hq, Hkv, Sq, Sk = shape
    q, k, v, dout = make_inputs(B, Hq, Hkv, Sq, Sk, 128, torch.bfloat16)
    out = torch.zeros_like(dout)
    lse = torch.zeros(B, Hq, Sq, device="cuda")
    poison_allocator(q, k, v)
    dq, dk, dv = sdpa_backward(dout, q, k, v, out, lse, False, 0.1, False)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for t in (dq, dk, dv):
        assert not torch.isnan(t).any() and (t == 0).all()


def test_opcheck_cuda():
    need_variant(128, torch.bfloat16)
    q, k, v, dout = make_inputs(1, 2, 2, 200, 150, 128, torch.bfloat16, layout="bshd")
    out, lse = stock_forward(q, k, v, False, 0.125)
    torch.library.opcheck(sdpa_backward, (dout, q, k, v, out, lse, False, 0.125, False))
    q, k, v, dout = make_inputs(1, 4, 2, 130, 130, 128, torch.bfloat16)
    out, lse = stock_forward(q, k, v, True, 0.125)
    torch.library.opcheck(sdpa_backward, (dout, q, k, v, out, lse, True, 0.125, False))
