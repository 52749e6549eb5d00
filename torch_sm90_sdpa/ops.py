"""The torch.library ops of torch_sm90_sdpa.

- ``torch.ops.torch_sm90_sdpa.sdpa_backward(grad_out, q, k, v, out, lse, is_causal, scale,
  deterministic) -> (dq, dk, dv)``: the attention backward. CPU kernel: the fp32
  reference in :mod:`torch_sm90_sdpa.reference`; CUDA kernel: the SM90 kernels in ``_C``.
  Differentiating through it (double backward) raises a clear error.
- ``torch.ops.torch_sm90_sdpa.sdpa(q, k, v, is_causal, scale, enable_gqa) -> (out, lse)``:
  forward through the stock fused forward, backward through ``sdpa_backward``.

Shapes: q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv], out / grad_out
[B, Hq, Sq, Dv], lse [B, Hq, Sq] float32, natural log. Any strides with a contiguous
last dim; dq / dk / dv come back with the strides of q / k / v (``empty_like``), which is
what the stock backward ops' meta functions promise and Inductor asserts.
"""
from __future__ import annotations

import threading
from collections import Counter

import torch
from torch import Tensor

from . import _validation
from .reference import attention_backward_reference

# ---------------------------------------------------------------------------------------
# sdpa_backward
# ---------------------------------------------------------------------------------------

# Runs of sdpa_backward's kernels by device type, except those of the eager sdpa's own
# backward: the calls made by compiled graphs (torch_sm90_sdpa.routing_stats() reads it;
# counted here because on an FX graph cache hit the rewrite pass does not run).
routed_calls: Counter = Counter()
_eager_backward = threading.local()


def _count_call(q: Tensor) -> None:
    if not getattr(_eager_backward, "active", False):
        routed_calls[q.device.type] += 1


@torch.library.custom_op("torch_sm90_sdpa::sdpa_backward", mutates_args=(), device_types="cpu")
def sdpa_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    is_causal: bool,
    scale: float,
    deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    _validation.check_backward_inputs(grad_out, q, k, v, out, lse, scale)
    _count_call(q)
    # The reference is deterministic whatever `deterministic` says.
    return attention_backward_reference(grad_out, q, k, v, out, lse, is_causal, scale)


@sdpa_backward.register_kernel("cuda")
def _sdpa_backward_cuda(grad_out, q, k, v, out, lse, is_causal, scale, deterministic):
    _validation.check_backward_inputs(grad_out, q, k, v, out, lse, scale)
    _validation.check_cuda_kernel_dtype(q)
    _count_call(q)
    if deterministic:
        # The SM90 kernel adds dQ with atomics in a varying order. Routing never sends
        # deterministic calls here; a direct call (or deterministic mode switched on
        # between forward and backward) gets the reference math on the GPU: slow, memory-
        # hungry ([Hq, Sq, Sk] per batch element), but deterministic and correct.
        return attention_backward_reference(grad_out, q, k, v, out, lse, is_causal, scale)
    from ._cuda_backend import sdpa_backward_cuda

    return sdpa_backward_cuda(grad_out, q, k, v, out, lse, is_causal, scale, deterministic)


@sdpa_backward.register_fake
def _sdpa_backward_fake(grad_out, q, k, v, out, lse, is_causal, scale, deterministic):
    _validation.check_backward_inputs(grad_out, q, k, v, out, lse, scale)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _double_backward_unsupported(ctx, grad_dq, grad_dk, grad_dv):
    raise RuntimeError(
        "torch_sm90_sdpa.sdpa_backward does not support double backward (differentiating "
        "the attention gradients again, e.g. create_graph=True followed by another "
        "backward). Use torch.nn.functional.scaled_dot_product_attention without "
        "torch_sm90_sdpa for higher-order gradients."
    )


sdpa_backward.register_autograd(
    _double_backward_unsupported, setup_context=lambda ctx, inputs, output: None
)

# ---------------------------------------------------------------------------------------
# sdpa: stock fused forward + our backward
# ---------------------------------------------------------------------------------------


def _stock_forward(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float):
    """(out [B, Hq, Sq, Dv], lse [B, Hq, Sq] fp32) from the stock fused forward.

    Works on real and fake tensors alike, so the fake kernel reproduces the stock
    forward's output strides exactly."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, scale=scale
        )
    if q.device.type == "cuda":
        if is_causal and q.size(2) != k.size(2):
            # FA2 aligns a causal mask bottom-right when Sq != Sk; SDPA (and our backward)
            # align it top-left, as the memory-efficient kernel does. It has no GQA: repeat
            # the kv heads. Its lse is padded to a multiple of 32 rows: keep the first Sq.
            group = q.size(1) // k.size(1)
            if group > 1:
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            res = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, None, True, 0.0, True, scale=scale
            )
            return res[0], res[1][:, :, : q.size(2)]
        # FA2 handles Hq a multiple of Hkv natively; its lse is [B, Hq, Sq] fp32.
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, is_causal, False, scale=scale
        )
        return res[0], res[1]
    raise RuntimeError(
        f"torch_sm90_sdpa.sdpa: no forward for device type {q.device.type!r} "
        "(expected cpu or cuda)"
    )


def _check_sdpa_inputs(q, k, v, scale, enable_gqa):
    _validation.check_attention_inputs(q, k, v)
    _validation.check_scale(scale)
    if v.size(-1) != q.size(-1):
        raise ValueError(
            f"value: expected head dim {q.size(-1)} (query.size(-1); the fused forward "
            f"needs Dv == D), got {v.size(-1)}"
        )
    if q.size(1) != k.size(1) and not enable_gqa:
        raise ValueError(
            f"key: expected {q.size(1)} heads like query, got {k.size(1)}; pass "
            "enable_gqa=True for grouped-query attention"
        )


@torch.library.custom_op("torch_sm90_sdpa::sdpa", mutates_args=(), device_types=("cpu", "cuda"))
def sdpa(
    q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float, enable_gqa: bool
) -> tuple[Tensor, Tensor]:
    _check_sdpa_inputs(q, k, v, scale, enable_gqa)
    if q.device.type == "cuda":
        _validation.check_cuda_kernel_dtype(q)
    out, lse = _stock_forward(q, k, v, is_causal, scale)
    # The CPU forward returns fp64 lse for fp64 inputs; everything else is fp32.
    return out, lse


@sdpa.register_fake
def _sdpa_fake(q, k, v, is_causal, scale, enable_gqa):
    _check_sdpa_inputs(q, k, v, scale, enable_gqa)
    return _stock_forward(q, k, v, is_causal, scale)


def _sdpa_setup_context(ctx, inputs, output):
    q, k, v, is_causal, scale, _ = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.is_causal = is_causal
    ctx.scale = scale
    ctx.mark_non_differentiable(lse)


def _sdpa_backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    if grad_out.size(-1) > 1 and grad_out.stride(-1) != 1:
        # e.g. the expanded gradient of out.sum(): the kernels need a contiguous last dim.
        grad_out = grad_out.contiguous()
    deterministic = torch.are_deterministic_algorithms_enabled()
    _eager_backward.active = True
    try:
        dq, dk, dv = torch.ops.torch_sm90_sdpa.sdpa_backward(
            grad_out, q, k, v, out, lse, ctx.is_causal, ctx.scale, deterministic
        )
    finally:
        _eager_backward.active = False
    return dq, dk, dv, None, None, None


sdpa.register_autograd(_sdpa_backward, setup_context=_sdpa_setup_context)
