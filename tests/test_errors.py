"""Bad input to the public functions gives a clear error naming the argument."""
import math

import pytest
import torch

import torch_sm90_sdpa
from conftest import make_qkv, stock_forward_cpu

sdpa_backward = torch.ops.torch_sm90_sdpa.sdpa_backward
sdpa = torch.ops.torch_sm90_sdpa.sdpa


def _valid_backward_args():
    q, k, v = make_qkv(2, 4, 2, 6, 7, 8, dtype=torch.float32)
    out, lse = stock_forward_cpu(q, k, v, False, 0.5)
    return dict(grad_out=torch.randn_like(out), q=q, k=k, v=v, out=out, lse=lse)


def _call_backward(args):
    a = args
    return sdpa_backward(a["grad_out"], a["q"], a["k"], a["v"], a["out"], a["lse"], False, 0.5, False)


def _non_contiguous_last_dim(t):
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


BACKWARD_CASES = [
    # (argument to replace, how, exception, message pattern)
    ("q", lambda a: a["q"].to(torch.int32), TypeError, r"query: expected dtype in"),
    ("k", lambda a: a["k"].to(torch.float64), TypeError, r"key: expected dtype torch.float32"),
    ("lse", lambda a: a["lse"].to(torch.float16), TypeError, r"lse: expected dtype torch.float32"),
    ("v", lambda a: a["v"].to("meta"), ValueError, r"value: expected a tensor on cpu"),
    ("lse", lambda a: a["lse"].to("meta"), ValueError, r"lse: expected a tensor on cpu"),
    ("k", lambda a: a["k"][:1], ValueError, r"key: expected batch size 2"),
    ("k", lambda a: a["k"][..., :4], ValueError, r"key: expected head dim 8"),
    ("v", lambda a: a["v"][:, :1], ValueError, r"value: expected number of heads 2"),
    ("v", lambda a: a["v"][:, :, :3], ValueError, r"value: expected sequence length 7"),
    ("k", lambda a: torch.randn(2, 3, 7, 8), ValueError, r"key: expected a number of heads that divides query's 4"),
    ("q", lambda a: a["q"][0], ValueError, r"query: expected a 4-D tensor"),
    ("q", lambda a: _non_contiguous_last_dim(a["q"]), ValueError, r"query: expected a contiguous last dimension"),
    ("grad_out", lambda a: _non_contiguous_last_dim(a["grad_out"]), ValueError, r"grad_out: expected a contiguous last dimension"),
    ("out", lambda a: a["out"][:, :, :5], ValueError, r"out: expected shape \(2, 4, 6, 8\)"),
    ("lse", lambda a: a["lse"].unsqueeze(-1), ValueError, r"lse: expected a 3-D tensor"),
    ("lse", lambda a: a["lse"][:, :2], ValueError, r"lse: expected shape \(2, 4, 6\)"),
    # The dispatcher itself names the argument and the type it expected.
    ("q", lambda a: "not a tensor", RuntimeError, r"Expected a value of type 'Tensor' for argument 'q'"),
]


@pytest.mark.parametrize("name,make_bad,exc,pattern", BACKWARD_CASES,
                         ids=[c[3].split(":")[0] + "-" + str(i) for i, c in enumerate(BACKWARD_CASES)])
def test_sdpa_backward_errors(name, make_bad, exc, pattern):
    args = _valid_backward_args()
    args[name] = make_bad(args)
    with pytest.raises(exc, match=pattern):
        _call_backward(args)


def test_sdpa_backward_valid_args_pass():
    _call_backward(_valid_backward_args())  # the cases above differ from this in one argument only


def test_sdpa_backward_bad_scale():
    a = _valid_backward_args()
    with pytest.raises(ValueError, match="scale: expected a finite float"):
        sdpa_backward(a["grad_out"], a["q"], a["k"], a["v"], a["out"], a["lse"], False, float("nan"), False)


def test_sdpa_backward_fake_reports_the_same_errors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _valid_backward_args()
    args["k"] = args["k"][..., :4]
    with FakeTensorMode() as mode:
        fake = {n: mode.from_tensor(t) for n, t in args.items()}
        with pytest.raises(ValueError, match="key: expected head dim 8"):
            _call_backward(fake)


def test_sdpa_op_errors():
    def call(q, k, v, enable_gqa=True):
        return sdpa(q, k, v, False, 0.5, enable_gqa)

    q, k, v = (t.requires_grad_() for t in make_qkv(2, 4, 2, 6, 7, 8, dtype=torch.float32))
    with pytest.raises(TypeError, match="key: expected dtype torch.float32"):
        call(q, k.to(torch.float16), v)
    with pytest.raises(TypeError, match="query: expected dtype in"):
        call(q.to(torch.int64), k, v)
    with pytest.raises(ValueError, match="value: expected a tensor on cpu"):
        call(q, k, v.to("meta"))
    with pytest.raises(ValueError, match="value: expected batch size 2"):
        call(q, k, v[:1])
    with pytest.raises(ValueError, match="key: expected head dim 8"):
        call(q, k[..., :4], v)
    with pytest.raises(ValueError, match="divides query's 4 heads"):
        call(q, torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8))
    with pytest.raises(ValueError, match="query: expected a contiguous last dimension"):
        call(_non_contiguous_last_dim(q), k, v)
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        call(q, k, v, enable_gqa=False)


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 (the outcome is what is compared)
        return ("error", type(e), str(e))


@pytest.mark.parametrize("case", ["key fp16", "query int64", "value batch 1", "key head dim 4",
                                  "3 kv heads for 4", "fp16 mask, fp32 inputs",
                                  "fp64 mask, fp32 inputs", "mask of 5 dims",
                                  "mask not broadcastable", "scale nan"])
def test_drop_in_refuses_what_stock_refuses_in_every_grad_mode(case):
    """Inputs stock SDPA refuses (or reads otherwise than the op) go to stock: the drop-in
    gives stock's answer, the same with and without grad."""
    q, k, v = make_qkv(2, 4, 2, 6, 7, 8, dtype=torch.float32)
    mask, scale, gqa = None, None, True
    if case == "key fp16":
        k = k.half()
    elif case == "query int64":
        q = q.long()
    elif case == "value batch 1":
        v = v[:1]
    elif case == "key head dim 4":
        k = k[..., :4]
    elif case == "3 kv heads for 4":
        k, v = torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8)
    elif case == "fp16 mask, fp32 inputs":
        mask = torch.zeros(6, 7, dtype=torch.float16)
    elif case == "fp64 mask, fp32 inputs":
        mask = torch.zeros(6, 7, dtype=torch.float64)
    elif case == "mask of 5 dims":
        mask = torch.ones(1, 1, 1, 6, 7, dtype=torch.bool)
    elif case == "mask not broadcastable":
        mask = torch.ones(5, 7, dtype=torch.bool)
    elif case == "scale nan":
        scale = float("nan")
    outcomes = []
    for grad in (True, False):
        args = [t.detach().requires_grad_(grad and t.is_floating_point()) for t in (q, k, v)]
        with torch.set_grad_enabled(grad):
            ours = _outcome(lambda: torch_sm90_sdpa.scaled_dot_product_attention(
                *args, attn_mask=mask, scale=scale, enable_gqa=gqa))
            stock = _outcome(lambda: torch.nn.functional.scaled_dot_product_attention(
                *args, attn_mask=mask, scale=scale, enable_gqa=gqa))
        assert ours[0] == stock[0], (grad, ours, stock)
        if ours[0] == "error":
            assert ours[1:] == stock[1:]
        else:
            torch.testing.assert_close(ours[1], stock[1], equal_nan=True)
        outcomes.append(ours[0])
    assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("grad", [False, True], ids=["no grad", "grad"])
def test_drop_in_refuses_key_and_value_of_different_lengths(gqa, grad):
    """Stock SDPA takes value shorter than key without a word (on CPU its flash kernel reads
    past value's end, and its backward with enable_gqa=True corrupts the heap): the drop-in
    names the mismatch instead, in every grad mode (stock is not called here)."""
    q, k, v = make_qkv(1, 4, 2 if gqa else 4, 8, 8, 16, dtype=torch.float32)
    args = [t.detach().requires_grad_(grad) for t in (q, k, v[:, :, :6])]
    with pytest.raises(ValueError, match=r"value: expected sequence length 8 like key .* got 6"):
        torch_sm90_sdpa.scaled_dot_product_attention(*args, enable_gqa=gqa)


def test_sdpa_op_takes_scale_none_as_one_over_sqrt_d():
    q, k, v = make_qkv(2, 4, 2, 6, 7, 8, dtype=torch.float64)
    out, lse = sdpa(q, k, v, False, None, True)
    out2, lse2 = sdpa(q, k, v, False, 1 / math.sqrt(8), True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    out3, lse3 = sdpa(q, k, v, enable_gqa=True)  # every argument after v has a default
    assert torch.equal(out, out3) and torch.equal(lse, lse3)
    go = torch.randn_like(out)
    grads = sdpa_backward(go, q, k, v, out, lse, False, None, False)
    grads2 = sdpa_backward(go, q, k, v, out, lse, False, 1 / math.sqrt(8), False)
    for g, g2 in zip(grads, grads2):
        assert torch.equal(g, g2)
    for g, g2 in zip(sdpa_backward(go, q, k, v, out, lse), grads2):
        assert torch.equal(g, g2)
