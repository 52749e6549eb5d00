"""One contract: the compile-time policy, the op and the kernels agree on what is served.

The contract lives in C++ (registration/bwd_device.cpp, `can_implement`). A table of layouts
goes through the three places that use it:
  * the policy (torch_sm90_sdpa.policy.decide, at compile time, from metadata only);
  * the kernels' contract asked with the real tensors' addresses and strides, as the op does
    at run time (_cuda_backend.problem_of -> _C.can_implement);
  * on an SM90 GPU, the op itself (its C++ CUDA kernel): it serves exactly the calls the
    policy routes, with gradients equal to the float64 reference, and refuses the others.
Also the stable-ABI plumbing of the C++ op (registration/torch_op.cpp) on CPU, through its
test op `_stable_abi_probe`.
"""
import math

import pytest
import torch

from torch_sm90_sdpa import _extension, eligibility, ops, policy
from torch_sm90_sdpa import _cuda_backend as cb
from conftest import reference_grads_fp64, rel_err, requires_sm90

C = _extension.load()
needs_C = pytest.mark.skipif(C is None, reason=f"_C not loaded: {_extension.unavailable_reason()}")

D = 128
B, HQ, HKV, S = 2, 4, 2, 40


def _layout(name, device="cpu", dtype=torch.bfloat16):
    """(q, k, v, grad_out) of one named layout; q [B, HQ, S, D], k/v [B, HKV, S, D]. Made on
    `device` directly (a .to(device) would not keep views' offsets and strides)."""
    def _randn(*shape):
        return torch.randn(*shape, device=device).to(dtype)

    if name == "bhsd":
        q, k, v = _randn(B, HQ, S, D), _randn(B, HKV, S, D), _randn(B, HKV, S, D)
    elif name == "bshd":
        q = _randn(B, S, HQ, D).transpose(1, 2)
        k, v = (_randn(B, S, HKV, D).transpose(1, 2) for _ in range(2))
    elif name == "packed":  # views into one [B, S, HQ + 2 HKV, D] projection
        qkv = _randn(B, S, HQ + 2 * HKV, D)
        q, k, v = (t.transpose(1, 2) for t in qkv.split([HQ, HKV, HKV], dim=2))
    elif name == "misaligned q":  # 4 elements (8 bytes) past an aligned address
        q = _randn(B * HQ * S * D + 4)[4:].view(B, HQ, S, D)
        k, v = _randn(B, HKV, S, D), _randn(B, HKV, S, D)
    elif name == "padded k rows":  # row stride D + 4: not a multiple of 16 bytes
        q, v = _randn(B, HQ, S, D), _randn(B, HKV, S, D)
        k = _randn(B, HKV, S, D + 4)[..., :D]
    elif name == "broadcast kv heads":  # one kv head expanded to HKV (stride 0)
        q = _randn(B, HQ, S, D)
        k, v = (_randn(B, 1, S, D).expand(B, HKV, S, D) for _ in range(2))
    elif name == "broadcast batch of grad_out":
        q, k, v = _randn(B, HQ, S, D), _randn(B, HKV, S, D), _randn(B, HKV, S, D)
    elif name == "last dim not contiguous":
        q = _randn(B, HQ, D, S).transpose(-1, -2)
        k, v = _randn(B, HKV, S, D), _randn(B, HKV, S, D)
    else:
        raise ValueError(name)
    if name == "broadcast batch of grad_out":
        go = _randn(1, HQ, S, D).expand(B, HQ, S, D)
    else:
        go = _randn(B, HQ, S, D)
    return q, k, v, go


# (layout, the operands copied for TMA, or the reason the call is not served)
TABLE = [
    ("bhsd", ()),
    ("bshd", ()),
    ("packed", ()),
    ("misaligned q", ("q",)),
    ("padded k rows", ("k",)),
    ("broadcast kv heads", ("k", "v")),
    ("broadcast batch of grad_out", ("dout",)),
    ("last dim not contiguous", policy.R_LAST_DIM),
]


def _spec(t):
    """The metadata of t as the policy sees it at compile time (on an SM90 device)."""
    return policy.TensorSpec(tuple(t.shape), t.dtype, "cuda:0", strides=tuple(t.stride()),
                             offset=t.storage_offset())


def _policy_verdict(q, k, v, go):
    out = torch.empty_like(q)
    lse = policy.TensorSpec((B, HQ, S, 1), torch.float32, "cuda:0")
    call = policy.AttentionBackwardCall(
        backend="cudnn", grad_out=_spec(go), q=_spec(q), k=_spec(k), v=_spec(v),
        out=_spec(out), lse=lse, is_causal=True)
    d = policy.decide(call, only_faster=False)
    if not d.routed:
        return d.reason
    prefix = "copies "
    if not d.detail.startswith(prefix):
        return ()
    return tuple(d.detail[len(prefix):].split(" (")[0].split(", "))


def _runtime_verdict(q, k, v, go):
    """What the op's contract check says with the tensors' real addresses and strides."""
    out, lse = torch.empty_like(q), torch.empty(B, HQ, S)
    problem = cb.problem_of(go, q, k, v, out, lse, True, False, torch.empty_like(q),
                            torch.empty_like(k), torch.empty_like(v))
    problem.cc_major, problem.cc_minor = 9, 0  # the SM90 GPU this CPU test stands for
    d = C.can_implement(problem)
    return d.reason if d.verdict == "unsupported" else tuple(d.copy)


@needs_C
@pytest.mark.parametrize("name,expected", TABLE, ids=[t[0] for t in TABLE])
def test_policy_and_kernel_contract_agree(name, expected, monkeypatch):
    if not _extension.has_variant(D, torch.bfloat16):
        pytest.skip(f"the bf16 head-dim-{D} kernel is not compiled")
    monkeypatch.setattr(eligibility, "device_capability", lambda dev: (9, 0))
    q, k, v, go = _layout(name)
    assert _policy_verdict(q, k, v, go) == expected
    assert _runtime_verdict(q, k, v, go) == expected


@needs_C
@pytest.mark.parametrize("mask_batch,served", [(B, False), (1, True)], ids=["per batch", "broadcast"])
def test_mask_tile_grid_beyond_int_is_refused(mask_batch, served):
    """The masked main kernel indexes the tile classes of every mask instance with an int: a
    problem whose mask tile grid (instances x 64-row blocks x 64-key blocks, at most) passes
    INT_MAX is refused as too large; the same sizes with a mask broadcast over the batch (one
    instance) are not. Sizes only: the problem's numbers are set past what any tensor here has."""
    q, k, v, go = _layout("bhsd")
    mask = torch.ones(mask_batch, 1, S, S, dtype=torch.bool).expand(B, HQ, S, S)
    out, lse = torch.empty_like(q), torch.empty(B, HQ, S)
    problem = cb.problem_of(go, q, k, v, out, lse, False, False, torch.empty_like(q),
                            torch.empty_like(k), torch.empty_like(v), attn_mask=mask)
    problem.cc_major, problem.cc_minor = 9, 0
    assert C.can_implement(problem).verdict == "served"
    problem.seqlen_q = problem.seqlen_k = 1 << 21  # (2^21 / 64)^2 = 2^30 tiles per instance
    d = C.can_implement(problem)
    if served:
        assert d.verdict != "unsupported" or d.reason != "sizes exceed the kernel's int32 indexing", d
    else:
        assert d.verdict == "unsupported" and d.reason == "sizes exceed the kernel's int32 indexing", d


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("name,expected", TABLE, ids=[t[0] for t in TABLE])
def test_the_op_serves_what_the_policy_routes(name, expected):
    """On the GPU: the C++ op serves every layout the policy routes, with the gradients of
    the float64 reference, and refuses the others with the policy's reason."""
    if C is None or not _extension.has_variant(D, torch.bfloat16):
        pytest.skip("the bf16 head-dim-128 kernel is not compiled")
    torch.manual_seed(0)
    q, k, v, go = _layout(name, device="cuda")
    assert _policy_verdict(q, k, v, go) == expected
    scale = 1 / math.sqrt(D)
    qd, kd, vd = (t.clone(memory_format=torch.contiguous_format) for t in (q, k, v))  # aligned
    # (the stock forward's FA2 kernel needs 16-byte aligned inputs: the misaligned view is the
    # backward's business only)
    out, lse = torch.ops.torch_sm90_sdpa.sdpa(qd, kd, vd, True, scale, True)
    if isinstance(expected, str):  # the op's own argument check names it first
        with pytest.raises(RuntimeError, match="contiguous last dim"):
            torch.ops.torch_sm90_sdpa.sdpa_backward(go, q, k, v, out, lse, True, scale, False)
        return
    dq, dk, dv = torch.ops.torch_sm90_sdpa.sdpa_backward(go, q, k, v, out, lse, True, scale,
                                                         False)
    for g, t in ((dq, q), (dk, k), (dv, v)):
        assert g.stride() == torch.empty_like(t).stride()
    # (broadcast kv heads: one gradient per expanded head, as the stock backward gives)
    _, *ref = reference_grads_fp64(qd, kd, vd, go.contiguous(), True, scale)
    for ours, r, n in zip((dq, dk, dv), ref, "qkv"):
        assert rel_err(ours, r) < 2e-2, f"d{n}: {rel_err(ours, r):.2e}"


# ---- the stable-ABI plumbing of the C++ op, on CPU -------------------------------------------

@pytest.fixture(scope="module")
def probe():
    if C is None:
        pytest.skip(f"_C not loaded: {_extension.unavailable_reason()}")
    if not ops.define_stable_abi_probe():
        pytest.fail("the stable-ABI test op could not be registered: "
                    f"{_extension.register_stable_abi_probe()}")
    return torch.ops.torch_sm90_sdpa._stable_abi_probe.default


PROBE_TENSORS = {
    "contiguous": lambda: torch.randn(2, 4, 6, 8),
    "bshd view": lambda: torch.randn(2, 6, 4, 8).transpose(1, 2),
    "expanded heads": lambda: torch.randn(2, 1, 6, 8).expand(2, 4, 6, 8),
    "padded rows": lambda: torch.randn(2, 4, 6, 11)[..., :8],
    "offset view": lambda: torch.randn(200)[3:3 + 2 * 4 * 2 * 8].view(2, 4, 2, 8),
    "packed qkv view": lambda: torch.randn(2, 6, 3, 4, 8)[:, :, 1].transpose(1, 2),
    "gqa packed view": lambda: torch.randn(2, 6, 8, 8).split([4, 2, 2], dim=2)[1].transpose(1, 2),
    "expanded batch": lambda: torch.randn(1, 4, 6, 8).expand(3, 4, 6, 8),
    "reversed order": lambda: torch.randn(8, 6, 4, 2).permute(3, 2, 1, 0),
    "size-1 dims": lambda: torch.randn(1, 4, 1, 8).transpose(0, 2),
    "3-D bf16": lambda: torch.randn(3, 5, 7).to(torch.bfloat16).transpose(0, 1),
    "float64": lambda: torch.randn(2, 3, dtype=torch.float64).t(),
}


@pytest.mark.parametrize("name", list(PROBE_TENSORS))
def test_stable_abi_reads_tensors_and_allocates_like_torch(probe, name):
    t = PROBE_TENSORS[name]()
    for flag, x in ((True, 0.125), (False, -3.5)):
        info, like = probe(t, flag, x)
        n = t.dim()
        codes = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
        assert info.tolist()[:3] == [n, codes[t.dtype], int(flag)]
        assert info.tolist()[3:3 + n] == list(t.shape)
        assert info.tolist()[3 + n:3 + 2 * n] == list(t.stride())
        assert info[3 + 2 * n].item() == round(x * 1000)
        align = t.data_ptr() & -t.data_ptr()
        assert info[4 + 2 * n].item() == min(align, 16)
        want = torch.empty_like(t)
        assert (like.shape, like.stride(), like.dtype) == (want.shape, want.stride(), want.dtype)


def test_stable_abi_reads_an_optional_float(probe):
    """`float?` arguments (sdpa_backward's scale) arrive as a value or as None."""
    t = torch.randn(2, 3)
    n = t.dim()
    assert probe(t, True, 0.25)[0][3 + 2 * n].item() == 250
    assert probe(t, True, None)[0][3 + 2 * n].item() == torch.iinfo(torch.int64).min
