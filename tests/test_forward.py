"""torch_sm90_sdpa::sdpa_forward on CPU: the forward op's results (the stock CPU forward or the
reference, against float64 SDPA), its fake kernel, its autograd through sdpa_backward, and
opcheck. The SM90 kernel's numerics are tests/test_cuda_forward.py's."""
import pytest
import torch
import torch.nn.functional as F

import torch_sm90_sdpa  # noqa: F401  (registers the ops)
from conftest import make_qkv

sdpa_forward = torch.ops.torch_sm90_sdpa.sdpa_forward


def _expected(q, k, v, is_causal, scale, attn_mask=None):
    """out and lse in float64: SDPA's math (GQA heads repeated, causal aligned top-left)."""
    group = q.size(1) // k.size(1)
    kk, vv = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = q.double() @ kk.transpose(-1, -2) * scale
    if is_causal:
        keep = torch.ones(q.size(2), k.size(2), dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    return scores.softmax(-1) @ vv, scores.logsumexp(-1)


class TestSdpaForward:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    @pytest.mark.parametrize("is_causal", [False, True])
    @pytest.mark.parametrize("shape", [(2, 4, 4, 33, 33, 16), (1, 4, 2, 17, 40, 8),
                                       (2, 6, 2, 40, 17, 32), (1, 2, 1, 1, 1, 8)],
                             ids=["mha", "gqa-sq<sk", "gqa-sq>sk", "ones"])
    def test_matches_float64(self, dtype, is_causal, shape):
        b, hq, hkv, sq, sk, d = shape
        q, k, v = make_qkv(b, hq, hkv, sq, sk, d, dtype=dtype, layout="bshd",
                           generator=torch.Generator().manual_seed(0))
        out, lse = sdpa_forward(q, k, v, is_causal, None, hq != hkv)
        want_out, want_lse = _expected(q, k, v, is_causal, d ** -0.5)
        tol = 1e-10 if dtype == torch.float64 else 2e-5
        torch.testing.assert_close(out.double(), want_out, atol=tol, rtol=tol)
        assert lse.shape == q.shape[:3] and lse.dtype == (torch.float64 if dtype == torch.float64
                                                          else torch.float32)
        torch.testing.assert_close(lse.double(), want_lse, atol=tol, rtol=tol)
        # out has the strides of torch.empty_like(q), as the op's fake kernel says
        assert out.stride() == torch.empty_like(q).stride()

    def test_mask_and_the_same_result_as_sdpa(self):
        q, k, v = make_qkv(2, 4, 4, 24, 24, 16, dtype=torch.float64,
                           generator=torch.Generator().manual_seed(1))
        keep = torch.rand(2, 1, 24, 24, generator=torch.Generator().manual_seed(2)) > 0.3
        keep[..., 0] = True  # every row sees a key
        out, lse = sdpa_forward(q, k, v, False, 0.3, False, keep)
        want_out, want_lse = _expected(q, k, v, False, 0.3, keep)
        torch.testing.assert_close(out, want_out)
        torch.testing.assert_close(lse, want_lse)
        for got, same in zip((out, lse), torch.ops.torch_sm90_sdpa.sdpa(q, k, v, False, 0.3, False, keep)):
            torch.testing.assert_close(got, same)

    def test_gradients_match_stock(self):
        q, k, v = (t.requires_grad_() for t in make_qkv(
            2, 4, 2, 20, 28, 16, dtype=torch.float64, layout="bshd",
            generator=torch.Generator().manual_seed(3)))
        out, _ = sdpa_forward(q, k, v, True, None, True)
        grads = torch.autograd.grad((out * out).sum(), (q, k, v))
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        want = torch.autograd.grad((ref * ref).sum(), (q, k, v))
        for g, w in zip(grads, want):
            torch.testing.assert_close(g, w)

    def test_empty_sizes(self):
        q, k, v = make_qkv(1, 2, 2, 5, 0, 8, dtype=torch.float32)
        out, lse = sdpa_forward(q, k, v, False)
        assert torch.equal(out, torch.zeros_like(q))
        assert torch.equal(lse, torch.full((1, 2, 5), float("-inf")))

    def test_fake_matches_real(self):
        from torch._subclasses.fake_tensor import FakeTensorMode

        q, k, v = make_qkv(2, 4, 2, 9, 13, 16, dtype=torch.float32, layout="bshd")
        real = sdpa_forward(q, k, v, True, 0.2, True)
        with FakeTensorMode() as mode:
            fake = sdpa_forward(*(mode.from_tensor(t) for t in (q, k, v)), True, 0.2, True)
        for r, f in zip(real, fake):
            assert (f.shape, f.stride(), f.dtype) == (r.shape, r.stride(), r.dtype)

    def test_bad_input_is_refused_with_the_argument_named(self):
        q, k, v = make_qkv(1, 4, 3, 8, 8, 16, dtype=torch.float32)
        with pytest.raises(ValueError, match="heads"):
            sdpa_forward(q, k, v, False, None, True)

    @pytest.mark.parametrize("is_causal", [False, True])
    def test_opcheck(self, is_causal):
        q, k, v = (t.requires_grad_() for t in make_qkv(
            1, 4, 2, 12, 12, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4)))
        torch.library.opcheck(sdpa_forward, (q, k, v, is_causal, 0.25, True))


@pytest.mark.parametrize("value, slack, warns", [
    (None, 0.0, False), ("3", 3.0, False), ("0", 0.0, False), ("-1", 0.0, False),
    ("99", 8.0, False), ("inf", 8.0, False), ("nan", 0.0, True), ("eight", 0.0, True)])
def test_rescale_slack_from_the_environment(value, slack, warns, caplog):
    """TORCH_SM90_SDPA_FWD_RESCALE_SLACK as the CUDA forward reads it (FwdParams::rescale_slack):
    clamped to [0, 8]; a value that is not a number (nan included, which a clamp would pass on
    to the kernel) gives the default, with a warning naming the variable."""
    from torch_sm90_sdpa import _cuda_backend

    _cuda_backend.rescale_slack.cache_clear()
    with caplog.at_level("WARNING", logger="torch_sm90_sdpa"):
        assert _cuda_backend.rescale_slack(value) == slack
    assert ("TORCH_SM90_SDPA_FWD_RESCALE_SLACK" in caplog.text) == warns
