"""Bad input to the public functions gives a clear error naming the argument."""
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


@pytest.mark.parametrize("fn", ["op", "drop_in"])
def test_sdpa_and_drop_in_errors(fn):
    def call(q, k, v, enable_gqa=True):
        if fn == "op":
            return sdpa(q, k, v, False, 0.5, enable_gqa)
        return torch_sm90_sdpa.scaled_dot_product_attention(q, k, v, enable_gqa=enable_gqa)

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
    if fn == "op":
        with pytest.raises(ValueError, match="query: expected a contiguous last dimension"):
            call(_non_contiguous_last_dim(q), k, v)
        with pytest.raises(ValueError, match="pass enable_gqa=True"):
            call(q, k, v, enable_gqa=False)
