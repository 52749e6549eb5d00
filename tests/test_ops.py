"""The op layer: opcheck, fake / meta kernels, autograd of sdpa, the eager drop-in."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_sm90_sdpa
from conftest import make_qkv, reference_grads_fp64, significant_strides, stock_forward_cpu

sdpa_backward = torch.ops.torch_sm90_sdpa.sdpa_backward
sdpa = torch.ops.torch_sm90_sdpa.sdpa

OPCHECK_CASES = [
    # (B, Hq, Hkv, Sq, Sk, D, layout, is_causal, dtype)
    (2, 4, 4, 17, 17, 16, "bhsd", True, torch.float32),
    (1, 4, 2, 9, 23, 16, "bhsd", False, torch.float32),
    (2, 4, 2, 12, 12, 16, "packed", True, torch.bfloat16),
    (1, 2, 1, 1, 5, 8, "bshd", True, torch.float64),
]


def _dispatched_ops(fn):
    """(the ops the dispatcher hands a TorchDispatchMode while fn runs, outermost only; fn())"""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Record():
        result = fn()
    return seen, result


def _backward_args(case, requires_grad=False):
    *shape, layout, is_causal, dtype = case
    q, k, v = make_qkv(*shape, dtype=dtype, layout=layout)
    scale = 1 / math.sqrt(q.size(-1))
    out, lse = stock_forward_cpu(q, k, v, is_causal, scale)
    grad_out = torch.randn_like(out)
    return (grad_out, q, k, v, out, lse, is_causal, scale, False)


class TestSdpaBackwardOp:
    @pytest.mark.parametrize("case", OPCHECK_CASES, ids=str)
    def test_opcheck(self, case):
        # All default checks (schema, autograd registration, fake tensor, AOT dispatch).
        # Inputs do not require grad: the op is itself a backward, and differentiating it
        # is unsupported (test_double_backward_raises).
        torch.library.opcheck(sdpa_backward.default, _backward_args(case))

    @pytest.mark.parametrize("case", OPCHECK_CASES, ids=str)
    def test_fake_and_meta_match_real(self, case):
        args = _backward_args(case)
        real = sdpa_backward(*args)
        with FakeTensorMode() as mode:
            fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            fake = sdpa_backward(*fake_args)
        # Rebuild strided views exactly on the meta device (.to keeps dense strides only).
        meta_args = [
            torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
            if isinstance(a, torch.Tensor) else a for a in args
        ]
        meta = sdpa_backward(*meta_args)
        for r, f, m in zip(real, fake, meta):
            for other in (f, m):
                assert other.shape == r.shape
                assert significant_strides(other) == significant_strides(r)
                assert other.dtype == r.dtype

    def test_double_backward_raises(self):
        q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 8, 8, 8))
        out = torch_sm90_sdpa.scaled_dot_product_attention(q, k, v, is_causal=True)
        (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
        with pytest.raises(RuntimeError, match="does not support double backward"):
            dq.sum().backward()


class TestSdpaOp:
    @pytest.mark.parametrize("case", OPCHECK_CASES, ids=str)
    def test_opcheck(self, case):
        *shape, layout, is_causal, dtype = case
        q, k, v = (t.requires_grad_() for t in make_qkv(*shape, dtype=dtype, layout=layout))
        torch.library.opcheck(sdpa.default, (q, k, v, is_causal, 0.25, True))

    @pytest.mark.parametrize("case", OPCHECK_CASES, ids=str)
    def test_fake_matches_real(self, case):
        *shape, layout, is_causal, dtype = case
        q, k, v = make_qkv(*shape, dtype=dtype, layout=layout)
        real = sdpa(q, k, v, is_causal, 0.25, True)
        with FakeTensorMode() as mode:
            fake = sdpa(*(mode.from_tensor(t) for t in (q, k, v)), is_causal, 0.25, True)
        for r, f in zip(real, fake):
            assert (f.shape, f.dtype) == (r.shape, r.dtype)
            assert significant_strides(f) == significant_strides(r)

    @pytest.mark.parametrize("is_causal", [False, True])
    def test_gradients_match_fp64(self, is_causal):
        torch.manual_seed(3)
        q, k, v = (t.requires_grad_() for t in make_qkv(2, 4, 2, 19, 31, 16, layout="bshd"))
        out, lse = sdpa(q, k, v, is_causal, 0.2, True)
        assert not lse.requires_grad
        grad_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        ref_out, *ref = reference_grads_fp64(q, k, v, grad_out, is_causal, 0.2)
        torch.testing.assert_close(out, ref_out)
        for g, r in zip(grads, ref):
            torch.testing.assert_close(g, r, rtol=1e-8, atol=1e-10)

    @pytest.mark.parametrize("layout", ["bhsd", "bshd"])
    @pytest.mark.parametrize("is_causal", [False, True])
    def test_value_head_dim_differs(self, layout, is_causal):
        """Dv != D (multi-head latent attention's q / k 192, v 128, scaled down): out [B, Hq,
        Sq, Dv] laid out like q, the fake kernel agreeing, gradients against float64, opcheck."""
        torch.manual_seed(4)
        q, k, _ = make_qkv(2, 4, 2, 13, 21, 24, dtype=torch.float32, layout=layout)
        v = make_qkv(2, 2, 2, 21, 21, 16, dtype=torch.float32, layout=layout)[0]
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out, lse = sdpa(q, k, v, is_causal, 0.2, True)
        assert out.shape == (2, 4, 13, 16) and lse.shape == (2, 4, 13)
        assert out.permute(*(sorted(range(4), key=lambda d: -q.stride(d)))).is_contiguous()
        with FakeTensorMode() as mode:
            fake = sdpa(*(mode.from_tensor(t) for t in (q, k, v)), is_causal, 0.2, True)
        for r, f in zip((out, lse), fake):
            assert (f.shape, f.stride(), f.dtype) == (r.shape, r.stride(), r.dtype)
        grad_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        ref_out, *ref = reference_grads_fp64(q, k, v, grad_out, is_causal, 0.2)
        torch.testing.assert_close(out, ref_out.float())
        for g, r in zip(grads, ref):
            assert g.shape == r.shape
            torch.testing.assert_close(g, r.float(), rtol=1e-4, atol=1e-5)
        torch.library.opcheck(sdpa.default, (q, k, v, is_causal, 0.2, True))

    def test_masked_forward_picks_cudnn_only_where_torch_allows(self, monkeypatch):
        """The CUDA forward's cuDNN choice (ops._cudnn_forward) declines without asking
        can_use_cudnn_attention for calls it keeps off cuDNN (a mask with is_causal; is_causal
        with Sq != Sk and no mask) or decides by stock's own choice (no mask, Dv == D: the
        test below), asks torch for a masked call, with the
        mask as a 4-D bias of q's dtype, and for an unmasked one with Dv != D, and declines
        where torch says no (here CPU tensors; a CUDA build of torch without a driver raises
        from the check, which counts as no), or where the check or cuDNN raises. The GPU suite
        checks that it takes the usual masked calls (tests/test_cuda_masks.py)."""
        from torch_sm90_sdpa import ops

        q, k, v = make_qkv(1, 4, 2, 16, 16, 16, dtype=torch.bfloat16)
        mask = torch.ones(16, 16, dtype=torch.bool).tril()
        asked = []
        real = torch.backends.cuda.can_use_cudnn_attention

        def spy(params, debug=False):
            asked.append(params)
            return real(params, debug)

        monkeypatch.setattr(torch.backends.cuda, "can_use_cudnn_attention", spy)
        v_narrow = v[..., :8]  # Dv != D
        assert ops._cudnn_forward(q, k, v, False, 0.25, None) is None
        assert ops._cudnn_forward(q, k, v, True, 0.25, mask) is None
        assert ops._cudnn_forward(q[:, :, :8], k, v_narrow, True, 0.25, None) is None
        assert asked == []
        assert ops._cudnn_forward(q, k, v, False, 0.25, mask) is None  # CPU: torch says no
        assert len(asked) == 1
        bias = asked[0].attn_mask
        assert bias.dtype == q.dtype and bias.dim() == 4
        assert torch.equal(bias[0, 0] == 0, mask) and torch.isinf(bias[0, 0][~mask]).all()
        assert ops._cudnn_forward(q, k, v_narrow, True, 0.25, None) is None
        assert len(asked) == 2 and asked[1].attn_mask is None and asked[1].is_causal

        def refuse(params, debug=False):
            raise RuntimeError("CUDA driver version is insufficient for CUDA runtime version")

        monkeypatch.setattr(torch.backends.cuda, "can_use_cudnn_attention", refuse)
        assert ops._cudnn_forward(q, k, v, False, 0.25, mask) is None

    def test_unmasked_forward_takes_cudnn_where_stock_picks_it(self, monkeypatch):
        """An unmasked call with Dv == D asks stock SDPA's own backend choice
        (ops._stock_picks_cudnn), except is_causal with Sq != Sk (the causal alignment), and
        takes cuDNN only where stock picks it; here (CPU tensors) stock picks its CPU kernel,
        and where the choice says cuDNN, cuDNN itself refuses CPU tensors: None either way.
        The GPU suite checks the drop-in's forward on cuDNN (tests/test_cuda_ops.py)."""
        from torch_sm90_sdpa import ops

        q, k, v = make_qkv(1, 4, 2, 16, 16, 16, dtype=torch.bfloat16)
        assert not ops._stock_picks_cudnn(q, k, v, True, 0.25)
        asked = []
        monkeypatch.setattr(ops, "_stock_picks_cudnn",
                            lambda *a: asked.append(a[3]) or picks)
        picks = False
        assert ops._cudnn_forward(q, k, v, True, 0.25, None) is None
        assert ops._cudnn_forward(q, k, v, False, 0.25, None) is None
        assert asked == [True, False]
        assert ops._cudnn_forward(q[:, :, :8], k, v, True, 0.25, None) is None  # Sq != Sk
        assert len(asked) == 2
        picks = True
        assert ops._cudnn_forward(q, k, v, True, 0.25, None) is None  # cuDNN: no CPU kernel
        assert asked == [True, False, True]

    def test_backward_runs_our_op(self):
        """The backward of sdpa is sdpa_backward, seen by the dispatcher."""
        q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 8, 8, 8))
        out, _ = sdpa(q, k, v, True, 0.5, False)
        seen, _ = _dispatched_ops(lambda: out.sum().backward())
        assert "torch_sm90_sdpa.sdpa_backward.default" in seen

    def test_backward_gets_no_zero_filled_lse_gradient(self):
        """lse has no gradient: autograd must not build a zero-filled one for it on every
        backward (set_materialize_grads(False)); only sdpa_backward runs at that level."""
        q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 8, 8, 8))
        out, _ = sdpa(q, k, v, True, 0.5, False)
        grad_out = torch.randn_like(out)
        seen, grads = _dispatched_ops(lambda: torch.autograd.grad(out, (q, k, v), grad_out))
        # (autograd's own aten.detach may come too)
        assert [f for f in seen if f != "aten.detach.default"] == [
            "torch_sm90_sdpa.sdpa_backward.default"], seen
        _, *ref = reference_grads_fp64(q, k, v, grad_out, True, 0.5)
        for g, r in zip(grads, ref):
            torch.testing.assert_close(g, r.to(g.dtype), rtol=1e-4, atol=1e-5)


class TestDropIn:
    @pytest.mark.parametrize("is_causal", [False, True])
    @pytest.mark.parametrize("scale", [None, 0.1])
    def test_matches_stock(self, is_causal, scale):
        torch.manual_seed(4)
        q, k, v = make_qkv(2, 4, 2, 24, 40, 16, dtype=torch.float32)
        grads = []
        for fn in (torch_sm90_sdpa.scaled_dot_product_attention, F.scaled_dot_product_attention):
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            out = fn(qq, kk, vv, is_causal=is_causal, scale=scale, enable_gqa=True)
            out.backward(torch.ones_like(out))  # also exercises an expanded grad_out
            grads.append((out, qq.grad, kk.grad, vv.grad))
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

    def test_eager_forward_skips_the_op_dispatch(self):
        """The eager drop-in runs the op's body itself (ops._sdpa_body): the dispatcher sees
        the body's aten ops, not torch_sm90_sdpa.sdpa (its dispatch cost host time for
        nothing); the backward is still the sdpa_backward op."""
        q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 8, 8, 8, dtype=torch.float32))
        seen, out = _dispatched_ops(
            lambda: torch_sm90_sdpa.scaled_dot_product_attention(q, k, v, is_causal=True))
        assert type(out.grad_fn).__name__ == "EagerSdpaBackward"
        assert seen and not any(op.startswith("torch_sm90_sdpa.") for op in seen), seen
        seen, _ = _dispatched_ops(lambda: out.sum().backward())
        assert "torch_sm90_sdpa.sdpa_backward.default" in seen

    @pytest.mark.parametrize("is_causal", [False, True])
    def test_value_head_dim_differs(self, is_causal):
        """Dv != D on CPU: the drop-in serves it (its node, not stock's) with stock's result."""
        torch.manual_seed(6)
        q, k, _ = make_qkv(2, 4, 2, 24, 40, 24, dtype=torch.float32)
        v = torch.randn(2, 2, 40, 16)
        grads = []
        for fn in (torch_sm90_sdpa.scaled_dot_product_attention, F.scaled_dot_product_attention):
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            out = fn(qq, kk, vv, is_causal=is_causal, enable_gqa=True)
            grads.append((out, *torch.autograd.grad(out, (qq, kk, vv), torch.ones_like(out))))
            if fn is not F.scaled_dot_product_attention:
                assert type(out.grad_fn).__name__ == "EagerSdpaBackward"
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

    def test_eager_node_is_the_plain_function_compiled_graphs_the_custom_op(self):
        """Eager calls get ops.EagerSdpa's node (a lighter host path), traced calls the custom
        op; both give the op's gradients (the same sdpa_backward underneath)."""
        torch.manual_seed(5)
        q, k, v = make_qkv(1, 4, 2, 12, 20, 16, dtype=torch.float64)
        dout = torch.randn(1, 4, 12, 16, dtype=torch.float64)
        _, *ref = reference_grads_fp64(q, k, v, dout, True, 0.3)

        def run(fn):
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            out = fn(qq, kk, vv)
            return out, torch.autograd.grad(out, (qq, kk, vv), dout)

        def drop_in(qq, kk, vv):
            return torch_sm90_sdpa.scaled_dot_product_attention(qq, kk, vv, is_causal=True,
                                                               scale=0.3, enable_gqa=True)

        out, grads = run(drop_in)
        assert type(out.grad_fn).__name__ == "EagerSdpaBackward"
        for g, r in zip(grads, ref):
            torch.testing.assert_close(g, r, rtol=1e-8, atol=1e-10)
        seen = []

        def backend(gm, example_inputs):
            seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return gm

        torch._dynamo.reset()
        out, grads = run(torch.compile(drop_in, backend=backend))
        assert "torch_sm90_sdpa.sdpa" in seen and not any("EagerSdpa" in n for n in seen), seen
        for g, r in zip(grads, ref):
            torch.testing.assert_close(g, r, rtol=1e-8, atol=1e-10)

    def test_eager_node_refuses_a_mask_that_requires_grad(self):
        q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 8, 8, 8))
        mask = torch.zeros(8, 8, requires_grad=True)
        with pytest.raises(Exception, match="grad"):
            torch_sm90_sdpa.ops.EagerSdpa.apply(q, k, v, False, 0.3, False, mask)

    def test_non_contiguous_last_dim_is_copied(self):
        q, k, v = (t.transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_()
                   for t in make_qkv(1, 2, 2, 8, 8, 8))
        out = torch_sm90_sdpa.scaled_dot_product_attention(q, k, v, is_causal=True)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        _, *ref = reference_grads_fp64(q, k, v, torch.ones_like(out), True, 8 ** -0.5)
        for g, r in zip(grads, ref):
            torch.testing.assert_close(g, r, rtol=1e-8, atol=1e-10)

    def test_autocast_goes_to_stock(self):
        """Under autocast stock SDPA casts mixed inputs (bf16 q, fp32 k/v); so do we, by
        handing the call to it."""
        q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 8, 8, 8, dtype=torch.float32))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = torch_sm90_sdpa.scaled_dot_product_attention(q.bfloat16(), k, v)
            expected = F.scaled_dot_product_attention(q.bfloat16(), k, v)
        assert out.dtype == expected.dtype
        torch.testing.assert_close(out, expected)

    @pytest.mark.parametrize(
        "kwargs",
        [dict(attn_mask="mask"), dict(attn_mask="mask", is_causal=True), dict(dropout_p=0.5),
         dict(no_grad=True)],
        ids=["attn_mask_requires_grad", "attn_mask_and_is_causal", "dropout", "no_grad"],
    )
    def test_unservable_calls_go_to_stock(self, kwargs, monkeypatch, caplog):
        calls = []
        for owner, name in ((torch.ops.torch_sm90_sdpa, "sdpa"),
                            (torch_sm90_sdpa.ops, "_sdpa_body")):  # (the eager drop-in's call)
            monkeypatch.setattr(owner, name, lambda *a: calls.append(a) or pytest.fail("op called"))
        q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 8, 8, 8, dtype=torch.float32))
        no_grad = kwargs.pop("no_grad", False)
        if kwargs.get("attn_mask") == "mask":
            if kwargs.get("is_causal"):  # the pair: whatever stock SDPA does with it
                kwargs["attn_mask"] = torch.ones(8, 8, dtype=torch.bool).tril()
            else:
                kwargs["attn_mask"] = torch.randn(8, 8, requires_grad=True)  # needs its grad
        torch.manual_seed(5)
        with caplog.at_level("DEBUG", logger="torch_sm90_sdpa"), torch.set_grad_enabled(not no_grad):
            out = torch_sm90_sdpa.scaled_dot_product_attention(q, k, v, **kwargs)
        torch.manual_seed(5)
        with torch.set_grad_enabled(not no_grad):
            expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
        torch.testing.assert_close(out, expected)
        assert not calls
        assert "stock path" in caplog.text
