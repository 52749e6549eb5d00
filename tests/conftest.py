"""Shared helpers of the test suite: input builders and the float64 reference."""
import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

import torch_sm90_sdpa  # noqa: F401  (registers the ops)
from torch_sm90_sdpa import _extension
from torch_sm90_sdpa.reference import causal_mask  # SDPA's top-left causal mask


def load_generator():
    """csrc/generate_instantiations.py as a module (TILES, TILES_FULL, dense_tile, ...): what
    can be built, whether or not this checkout built it."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc",
                        "generate_instantiations.py")
    spec = importlib.util.spec_from_file_location("tsdpa_generator_for_tests", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_qkv(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, dtype=torch.float64,
             device="cpu", layout="bhsd", generator=None):
    """q [B, Hq, Sq, D], k/v [B, Hkv, Sk, D] with the requested memory layout:
    'bhsd' (contiguous), 'bshd' (transposed views, as attention modules make them) or
    'packed' (views into one [B, S, Hq + 2*Hkv, D] tensor, needs Sq == Sk)."""
    def randn(*shape):
        return torch.randn(*shape, dtype=torch.float32, generator=generator).to(dtype).to(device)

    if layout == "bhsd":
        return (randn(batch, heads_q, seqlen_q, head_dim),
                randn(batch, heads_kv, seqlen_k, head_dim),
                randn(batch, heads_kv, seqlen_k, head_dim))
    if layout == "bshd":
        return (randn(batch, seqlen_q, heads_q, head_dim).transpose(1, 2),
                randn(batch, seqlen_k, heads_kv, head_dim).transpose(1, 2),
                randn(batch, seqlen_k, heads_kv, head_dim).transpose(1, 2))
    if layout == "packed":
        assert seqlen_q == seqlen_k
        qkv = randn(batch, seqlen_q, heads_q + 2 * heads_kv, head_dim)
        q, k, v = qkv.split([heads_q, heads_kv, heads_kv], dim=2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    raise ValueError(layout)


def reference_grads_fp64(q, k, v, grad_out, is_causal, scale):
    """(out, dq, dk, dv) in float64 from autograd of stock SDPA (math in float64)."""
    q64, k64, v64 = (t.detach().to(torch.float64).requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        q64, k64, v64, is_causal=is_causal, scale=scale, enable_gqa=q.size(1) != k.size(1)
    )
    dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), grad_out.to(torch.float64))
    return out.detach(), dq, dk, dv


def stock_forward_cpu(q, k, v, is_causal, scale):
    """(out, lse [B, Hq, Sq]) from the stock CPU fused forward."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, scale=scale
    )


def rel_err(actual, expected):
    """||actual - expected|| / ||expected|| in float64 (0 for empty tensors)."""
    expected = expected.to(torch.float64)
    if expected.numel() == 0:
        return 0.0
    diff = (actual.to(torch.float64) - expected).norm().item()
    return diff / max(expected.norm().item(), 1e-30)


def significant_strides(t):
    """Strides of the dims of size > 1: the others do not affect the memory layout."""
    return tuple(st for sz, st in zip(t.shape, t.stride()) if sz > 1)


class SwitchEnv:
    """setenv / delenv of the device layer's experiment switches (TORCH_SM90_SDPA_GQA_WALK,
    _SPLIT_TAIL, _DETERMINISTIC_ORDER, _PDL, _PERSISTENT, _PREPOST_ORDER, _SECTION_HEADS;
    registration/bwd_device.h, Switches) for one test. _C reads them once, so every change,
    and the restore at the end of the test, is followed by _extension.reload_switches()."""

    def __init__(self):
        self._patch = pytest.MonkeyPatch()

    def setenv(self, var: str, value: str) -> None:
        self._patch.setenv(var, value)
        _extension.reload_switches()

    def delenv(self, var: str, raising: bool = True) -> None:
        self._patch.delenv(var, raising=raising)
        _extension.reload_switches()

    def undo(self) -> None:
        self._patch.undo()
        _extension.reload_switches()


@pytest.fixture
def switch_env():
    """A SwitchEnv, undone after the test."""
    env = SwitchEnv()
    yield env
    env.undo()


_HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
requires_sm90 = pytest.mark.skipif(not _HAS_SM90, reason="needs an SM90 (Hopper) GPU")
# pytestmark of GPU tests that call the kernels: skip cleanly without an SM90 GPU, or on one
# where torch_sm90_sdpa._C was not built
requires_sm90_kernels = [
    requires_sm90,
    pytest.mark.skipif(_HAS_SM90 and _extension.load() is None,
                       reason="torch_sm90_sdpa._C is not built"),
    pytest.mark.gpu,
]


# ---- attention masks: [Sq, Sk] patterns, True = attend -------------------------------------

def causal_bool(sq, sk, device="cpu"):
    return causal_mask(sq, sk, device)


def sliding_window(sq, sk, window, device="cpu"):
    """Causal, and each query sees only the last `window` keys (Mistral style)."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    return (j <= i) & (j > i - window)


def documents(lengths, device="cpu"):
    """Block-diagonal causal mask of packed documents of these lengths."""
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                  torch.tensor(lengths, device=device))
    s = doc.numel()
    return (doc[:, None] == doc[None, :]) & causal_bool(s, s, device)


def padding(batch, sq, sk, valid_k, left=False, causal=True, device="cpu"):
    """[B, 1, Sq, Sk]: keys beyond each row's valid length masked (right padding; with
    left=True the first Sk - valid keys are), combined with causal."""
    j = torch.arange(sk, device=device)
    masks = []
    for n in valid_k:
        keep = (j >= sk - n) if left else (j < n)
        m = keep[None, :].expand(sq, sk)
        if causal:
            m = m & causal_bool(sq, sk, device)
        masks.append(m)
    return torch.stack(masks)[:, None]


def as_bias(mask, dtype):
    """A bool mask as an additive mask of `dtype` (0 attend, -inf masked)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        ~mask, float("-inf"))


def reference_grads_fp64_masked(q, k, v, grad_out, attn_mask, is_causal, scale):
    """(out, dq, dk, dv) in float64 from autograd of stock SDPA with the mask (and the causal
    cut folded into it: stock SDPA takes one or the other)."""
    q64, k64, v64 = (t.detach().to(torch.float64).requires_grad_() for t in (q, k, v))
    mask = attn_mask
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(torch.float64)
    if is_causal:
        tril = causal_bool(q.size(2), k.size(2), q.device)
        if mask is None:
            mask = tril
        elif mask.dtype == torch.bool:
            mask = mask & tril
        else:
            mask = mask.masked_fill(~tril, float("-inf"))
    out = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=mask, scale=scale,
                                         enable_gqa=q.size(1) != k.size(1))
    dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), grad_out.to(torch.float64))
    return out.detach(), dq, dk, dv
