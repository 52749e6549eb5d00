"""The op layer on an SM90 GPU, apart from the main kernel's numerics (test_cuda_backward.py):
the CUDA forward of `sdpa`, and the drop-in's routing on CUDA."""
import pytest
import torch
import torch.nn.functional as F

import torch_sm90_sdpa
from torch_sm90_sdpa import _extension
from conftest import make_qkv, requires_sm90

pytestmark = [requires_sm90, pytest.mark.gpu]

sdpa = torch.ops.torch_sm90_sdpa.sdpa


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("seqlens", [(300, 300), (200, 333), (333, 200)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_sdpa_forward_matches_fp64(dtype, heads, is_causal, seqlens):
    """out and lse of the CUDA forward, causal aligned top-left also when Sq != Sk."""
    torch.manual_seed(0)
    sq, sk = seqlens
    q, k, v = make_qkv(2, heads[0], heads[1], sq, sk, 128, dtype=dtype, device="cuda", layout="bshd")
    out, lse = sdpa(q, k, v, is_causal, 0.1, True)
    group = heads[0] // heads[1]
    kk, vv = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = q.double() @ kk.transpose(-1, -2) * 0.1
    if is_causal:
        mask = torch.ones(sq, sk, dtype=torch.bool, device="cuda").tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    expected_out = scores.softmax(-1) @ vv
    torch.testing.assert_close(out.double(), expected_out, atol=2e-2, rtol=2e-2)
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), scores.logsumexp(-1), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
def test_drop_in_unmasked_forward_is_stocks_own_choice(monkeypatch, heads, is_causal):
    """Without a mask the drop-in's forward is the kernel stock SDPA picks for the call (cuDNN
    on SM90 with torch 2.11; FlashAttention-2 where stock prefers it): the output equals
    F.scaled_dot_product_attention's bitwise, and cuDNN ran exactly where stock picks it."""
    from torch_sm90_sdpa import api, ops

    built = [d for d in (128, 64, 96, 192, 256) if _extension.has_variant(d, torch.bfloat16)]
    if not built:
        pytest.skip("no bf16 backward kernel built")
    d = built[0]
    q, k, v = (t.requires_grad_() for t in make_qkv(2, heads[0], heads[1], 512, 512, d,
                                                    dtype=torch.bfloat16, device="cuda",
                                                    layout="bshd"))
    gqa = heads[0] != heads[1]
    assert api._unservable_reason(q, k, v, None, 0.0, gqa, is_causal, None) is None
    picks_cudnn = ops._stock_picks_cudnn(q, k, v, is_causal, d ** -0.5)
    ran = []
    real = ops._cudnn_forward
    monkeypatch.setattr(ops, "_cudnn_forward", lambda *a: ran.append(real(*a)) or ran[-1])
    out = torch_sm90_sdpa.scaled_dot_product_attention(q, k, v, is_causal=is_causal,
                                                       enable_gqa=gqa)
    assert "EagerSdpa" in type(out.grad_fn).__name__
    assert len(ran) == 1 and (ran[0] is not None) == picks_cudnn
    want = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=gqa)
    assert torch.equal(out, want)


def test_sdpa_fake_matches_real_on_cuda():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = make_qkv(2, 8, 2, 100, 100, 64, dtype=torch.bfloat16, device="cuda", layout="bshd")
    real = sdpa(q, k, v, True, 0.125, True)
    with FakeTensorMode() as mode:
        fake = sdpa(*(mode.from_tensor(t) for t in (q, k, v)), True, 0.125, True)
    for r, f in zip(real, fake):
        assert (f.shape, f.stride(), f.dtype) == (r.shape, r.stride(), r.dtype)


def test_drop_in_falls_back_for_unsupported_cuda_calls(monkeypatch):
    """fp32 has no SM90 kernel: the call goes to stock SDPA and gives its gradients."""
    for owner, name in ((torch.ops.torch_sm90_sdpa, "sdpa"),
                        (torch_sm90_sdpa.ops, "_sdpa_body")):  # (the eager drop-in's call)
        monkeypatch.setattr(owner, name, lambda *a: pytest.fail("op called"))
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 64, 64, 64, dtype=torch.float32, device="cuda"))
    out = torch_sm90_sdpa.scaled_dot_product_attention(q, k, v, is_causal=True)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    expected = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True).sum(), (q, k, v))
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e)


def test_sdpa_backward_cuda_rejects_fp32():
    q, k, v = make_qkv(1, 2, 2, 16, 16, 64, dtype=torch.float32, device="cuda")
    out = torch.zeros_like(q)
    lse = torch.zeros(q.shape[:3], device="cuda")
    with pytest.raises(RuntimeError, match="SM90 CUDA kernel expects dtype"):
        torch.ops.torch_sm90_sdpa.sdpa_backward(out, q, k, v, out, lse, False, 0.1, False)


def test_cuda_kernel_is_the_cpp_one():
    """On the GPU machine's torch the C++ kernel registers through the stable ABI."""
    from torch_sm90_sdpa import ops

    assert ops.cuda_kernel_kind() == "c++", _extension.cuda_kernel_reason()
    assert torch_sm90_sdpa.build_info()["cuda_op"] == "c++"


import test_errors  # noqa: E402

# The CPU table of tests/test_errors.py, on CUDA: the C++ kernel checks the same rules and
# names the same argument (as RuntimeError: a C++ kernel raises no TypeError / ValueError).
# Not the cases whose message is about CPU (a tensor moved to "meta", int dtypes) or that the
# dispatcher itself reports (a non-tensor argument).
CUDA_ERROR_CASES = [c for c in test_errors.BACKWARD_CASES[:16]
                    if "expected a tensor on cpu" not in c[3] and "expected dtype in" not in c[3]]


@pytest.mark.parametrize("case", CUDA_ERROR_CASES, ids=[c[3].split(":")[0] + "-" + str(i)
                                                        for i, c in enumerate(CUDA_ERROR_CASES)])
def test_cuda_errors_name_the_argument(case):
    name, make_bad, _, pattern = case
    args = test_errors._valid_backward_args()
    args[name] = make_bad(args)  # on CPU in fp32, then to CUDA in bf16 (the kernel's dtype)
    args = {k: (v.to(torch.bfloat16) if v.dtype == torch.float32 and k != "lse" else v).cuda()
            for k, v in args.items()}
    pattern = pattern.replace("torch.float32", "torch.bfloat16") if name != "lse" else pattern
    with pytest.raises(RuntimeError, match=pattern):
        test_errors._call_backward(args)


def test_python_path_matches_the_cpp_op():
    """_cuda_backend.sdpa_backward_python (the fallback and the measured alternative) gives
    the C++ op's gradients (up to the order of the fp32 dQ additions)."""
    from torch_sm90_sdpa import _cuda_backend

    torch.manual_seed(3)
    q, k, v = make_qkv(2, 8, 2, 333, 200, 128, dtype=torch.bfloat16, device="cuda", layout="bshd")
    out, lse = sdpa(q, k, v, False, 0.1, True)
    go = torch.randn_like(out)
    args = (go, q, k, v, out, lse, False, 0.1, False)
    ours = torch.ops.torch_sm90_sdpa.sdpa_backward(*args)
    py = _cuda_backend.sdpa_backward_python(*args)
    for a, b in zip(ours, py):
        assert a.stride() == b.stride()
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)


def test_build_info_reports_cuda_extension():
    info = torch_sm90_sdpa.build_info()
    assert info["cuda_extension"] is True, info
    assert info["arch"] == "sm_90a"
    for dtype_name, head_dim in info["variants"]:
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
        assert _extension.has_variant(head_dim, dtype)


def test_drop_in_backward_under_late_deterministic_mode():
    """Deterministic algorithms switched on between forward and backward: the drop-in's
    backward runs the kernel's deterministic mode (bitwise repeatable, close to the default
    mode)."""
    torch.manual_seed(1)
    q, k, v = (t.requires_grad_() for t in
               make_qkv(1, 4, 2, 100, 80, 64, dtype=torch.bfloat16, device="cuda"))
    grads = []
    for deterministic in (True, True, False):
        out = torch_sm90_sdpa.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                           enable_gqa=True)
        torch.use_deterministic_algorithms(deterministic)
        try:
            grads.append(torch.autograd.grad(out.sum(), (q, k, v)))
        finally:
            torch.use_deterministic_algorithms(False)
    for a, b, c in zip(*grads):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, atol=2e-2, rtol=2e-2)
