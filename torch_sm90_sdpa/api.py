"""The eager drop-in: ``torch_sm90_sdpa.scaled_dot_product_attention``.

Same signature and result as ``torch.nn.functional.scaled_dot_product_attention``. Calls
we can serve run ``torch_sm90_sdpa::sdpa`` (the stock fused forward, or ours for a boolean
mask or a bf16 / fp32 additive one broadcast over heads on CUDA, and our backward); in eager
mode its body inside ``ops.EagerSdpa``, a plain autograd.Function, without the op's dispatch
and with a lighter backward node. Every other
call goes to the stock function unchanged. Each decision is logged on the
``torch_sm90_sdpa`` logger at DEBUG.
"""
from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

from . import eligibility
from ._validation import KERNEL_DTYPES, MASK_DTYPES, SUPPORTED_DTYPES, resolve_scale
from .ops import EagerSdpa

log = logging.getLogger("torch_sm90_sdpa")


def _kernel_verdict_of(dtype, head_dim, head_dim_v, heads_q, heads_kv, device,
                       deterministic) -> str | None:
    """eligibility.kernel_verdict on the call's device. A constant to torch.compile: Dynamo
    calls it while tracing instead of tracing into the device layer, whose pybind objects it
    cannot trace (a graph break at every attention call of a compiled model that uses the
    drop-in, e.g. through transformers' attention interface)."""
    return eligibility.kernel_verdict(dtype, head_dim, head_dim_v, heads_q, heads_kv,
                                      eligibility.device_capability(device), deterministic)


# What torch.compiler.assume_constant_result does (torch 2.9 to 2.13), without importing
# torch._dynamo, and with it torch._inductor, at package import (tests/test_autoload.py;
# tests/test_compile_routing.py checks that Dynamo takes the mark)
_kernel_verdict_of._dynamo_marked_constant = True


def _cuda_unservable_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the SM90 kernel cannot take this CUDA call, or None if it can."""
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return "query/key/value dtypes differ"
    q_shape = q.shape
    return _kernel_verdict_of(q.dtype, q_shape[-1], v.shape[-1], q_shape[1], k.shape[1],
                              q.device, torch.are_deterministic_algorithms_enabled())


def _mask_unservable_reason(attn_mask, is_causal) -> str | None:
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, torch.Tensor) or attn_mask.dtype not in MASK_DTYPES:
        return "attn_mask of a dtype the kernels do not read"
    if is_causal:
        return "attn_mask with is_causal=True (stock SDPA's own handling of the pair is kept)"
    if attn_mask.requires_grad:
        return "attn_mask requires grad (no mask gradient is computed here)"
    return None


# (The checks below run on every eager call: each reads a tensor's shape once, as a tuple,
# rather than through size() calls, and tests in plain boolean chains.)
def _stock_takes_differently(query, key, value, attn_mask, scale) -> str | None:
    """Inputs the op would refuse (or read otherwise) where stock SDPA has its own answer: they
    go to stock, which gives its result or its error whatever the grad mode, so a call is
    accepted or refused alike with and without torch.no_grad(). q / k / v: 4-D tensors."""
    dtype = query.dtype
    if dtype not in SUPPORTED_DTYPES or key.dtype != dtype or value.dtype != dtype:
        return "query/key/value dtypes the op does not take"
    device = query.device
    if key.device != device or value.device != device:
        return "query/key/value on different devices"
    b, hq, sq, d = query.shape
    kb, hkv, sk, kd = key.shape
    vb, vh, vs, _ = value.shape
    if kb != b or vb != b or kd != d or vh != hkv or vs != sk:
        return "key/value shapes that are not [B, Hkv, Sk, D] of query's B and D"
    if hkv != 0 and hq % hkv != 0:
        return "key heads that do not divide query's heads"
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        return "a scale that is not a finite number"
    if attn_mask is not None:
        # stock's rule (validate_sdpa_input): bool, float32 or query's dtype
        if attn_mask.dtype not in (torch.bool, torch.float32, dtype):
            return "attn_mask dtype is not bool, float32 or query's dtype"
        if attn_mask.device != device:
            return "attn_mask on another device"
        target = (b, hq, sq, sk)
        shape = attn_mask.shape
        if len(shape) > 4 or any(s not in (1, t) for s, t in zip(reversed(shape),
                                                                  reversed(target))):
            return "attn_mask not broadcastable to [B, Hq, Sq, Sk]"
    return None


def _is_4d_tensors(query, key, value) -> bool:
    T = torch.Tensor
    return (isinstance(query, T) and isinstance(key, T) and isinstance(value, T)
            and query.dim() == 4 and key.dim() == 4 and value.dim() == 4)


def _empty_cuda_call(query, key, value, attn_mask, dropout_p, enable_gqa) -> bool:
    """An empty size on CUDA (fp16 / bf16, no dropout, a mask that needs no gradient): no
    kernel runs, the op gives the empty result (out 0, zero gradients) in every grad mode and
    for any head dim, after stock's forward has had its say on the arguments (it runs there).
    Stock SDPA of torch 2.11 fails in its backward on such calls ("'NoneType' object is not
    iterable" at batch 0, or a division by zero that ends the process). q / k / v: 4-D tensors
    (the callers have checked); the zero size, rare, is tested first."""
    q_shape, k_shape, v_shape = query.shape, key.shape, value.shape
    if not (0 in q_shape or 0 in k_shape or 0 in v_shape) or query.device.type != "cuda" or \
            query.dtype not in KERNEL_DTYPES or dropout_p != 0.0:
        return False
    return (v_shape[3] == q_shape[3]
            and (enable_gqa or q_shape[1] == k_shape[1])
            and (attn_mask is None or (isinstance(attn_mask, torch.Tensor)
                                       and attn_mask.dtype in MASK_DTYPES
                                       and not attn_mask.requires_grad)))


def _unservable_reason(query, key, value, attn_mask, dropout_p, enable_gqa,
                       is_causal=False, scale=None) -> str | None:
    four_d = _is_4d_tensors(query, key, value)
    if four_d and key.shape[1] == 0 and query.device.type in ("cpu", "cuda"):
        # No key head: every query sees no key (out 0, zero gradients). Served in every grad
        # mode, with any mask stock takes (of any dtype it takes: the mask is not read),
        # is_causal or dropout: stock SDPA before torch 2.13 ends the process here with a
        # division by zero; the op gives what 2.13 gives.
        if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
            return "attn_mask is not a tensor"
        return _stock_takes_differently(query, key, value, attn_mask, scale)
    if four_d and _empty_cuda_call(query, key, value, attn_mask, dropout_p, enable_gqa):
        return _stock_takes_differently(query, key, value, attn_mask, scale)
    why = _mask_unservable_reason(attn_mask, is_causal)
    if why is not None:
        return why
    if dropout_p != 0.0:
        return "dropout_p > 0"
    if not four_d:
        T = torch.Tensor
        if not (isinstance(query, T) and isinstance(key, T) and isinstance(value, T)):
            return "query/key/value are not all tensors"
        return "query/key/value are not all 4-D"
    why = _stock_takes_differently(query, key, value, attn_mask, scale)
    if why is not None:
        return why
    if not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or
                                         value.requires_grad)):
        return "no gradient is needed"
    device_type = query.device.type
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        # Stock SDPA casts mixed inputs under autocast; keep exactly its behaviour.
        return "autocast is enabled"
    heads_kv = key.shape[1]
    if query.shape[1] != heads_kv and heads_kv != 0 and not enable_gqa:
        return "head counts differ and enable_gqa is False"
    if device_type == "cuda":
        return _cuda_unservable_reason(query, key, value)
    if device_type != "cpu":
        return f"device type {device_type} is not served"
    return None


def _last_dim_dense(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy when its last dim (of more than one element) has a stride other than 1."""
    return t.contiguous() if t.shape[-1] > 1 and t.stride(-1) != 1 else t


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Drop-in for ``F.scaled_dot_product_attention`` whose backward runs on our kernels.

    query [B, Hq, Sq, D], key [B, Hkv, Sk, D], value [B, Hkv, Sk, Dv]; Hq % Hkv == 0 with
    ``enable_gqa=True``. A value of another length than key's raises ValueError (stock SDPA
    does not check it). ``scale=None`` means ``1 / sqrt(D)``. attn_mask: a bool mask (True =
    attend) or an additive float mask (fp32 / fp16 / bf16) broadcastable to [B, Hq, Sq, Sk]; its
    backward skips the tiles the mask hides, and so does its forward (our SM90 forward kernel)
    for a bool mask and a bf16 / fp32 additive mask broadcast over heads; other masks take stock
    cuDNN's forward with the mask as a 0 / -inf bias where torch allows it (else the
    memory-efficient kernel's). A row without a visible key gives 0 (one whose every key
    carries a finite fill: uniform weights, as in SDPA). Calls with dropout, a mask that requires grad or
    comes with ``is_causal=True``, other ranks, no gradient to compute, autocast on, or (on
    CUDA) a non-SM90 device or a dtype or head dim without a compiled kernel fall back to the
    stock function. Under ``torch.use_deterministic_algorithms(True)`` the backward runs the
    kernel's deterministic mode (bitwise-repeatable gradients). On CPU the backward is the fp32 reference: correct,
    but slower than stock (it is there for tests and for checking the route).
    """
    if _is_4d_tensors(query, key, value) and key.shape[2] != value.shape[2]:
        # stock SDPA does not check this: its CPU flash kernel reads value with key's length,
        # past its end, and its backward with enable_gqa=True corrupts the heap
        raise ValueError(
            f"value: expected sequence length {key.shape[2]} like key (dim 2), got "
            f"{value.shape[2]}")
    reason = _unservable_reason(query, key, value, attn_mask, dropout_p, enable_gqa, is_causal,
                                scale)
    return _run_decided(reason, query, key, value, attn_mask, dropout_p, is_causal, scale,
                        enable_gqa)


def _run_decided(reason, query, key, value, attn_mask, dropout_p, is_causal, scale,
                 enable_gqa) -> torch.Tensor:
    """The drop-in's call once ``_unservable_reason`` gave `reason` for exactly these arguments
    (the transformers interface has asked it already for grouped heads)."""
    compiling = torch.compiler.is_compiling()
    if reason is not None:
        if not compiling:  # (Dynamo breaks the graph at a logging call)
            log.debug("scaled_dot_product_attention: stock path (%s)", reason)
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
        )
    if key.shape[1] != 0 and _empty_cuda_call(query, key, value, attn_mask, dropout_p,
                                              enable_gqa):
        # stock's refusals of the arguments (nothing to compute; with no key head stock
        # of torch 2.11 divides by zero even in its forward)
        with torch.no_grad():
            F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                           is_causal=is_causal, scale=scale,
                                           enable_gqa=enable_gqa)
    # A call we serve: the op checks it (bad input is reported naming the argument);
    # calls we do not serve went to stock SDPA untouched, which reports its own errors.
    if key.shape[1] == 0:
        # no key head: out is 0 whatever the mask (_unservable_reason ran stock's checks of
        # it), and stock leaves the mask out of the graph (its grad stays None); the op takes
        # no mask that requires grad, nor one of a dtype its kernels do not read (float64)
        attn_mask = None
    query, key, value = _last_dim_dense(query), _last_dim_dense(key), _last_dim_dense(value)
    resolved_scale = resolve_scale(scale, query)
    if not compiling:
        log.debug("scaled_dot_product_attention: torch_sm90_sdpa backward")
    if compiling or type(query) is not torch.Tensor:
        # traced (Dynamo, export) or a tensor subclass (fake, functional): the custom op, whose
        # fake kernel and registered autograd the tracers use
        out, _ = torch.ops.torch_sm90_sdpa.sdpa(query, key, value, is_causal, resolved_scale,
                                                enable_gqa, attn_mask)
    else:
        # eager: the op's body in a plain autograd.Function, lighter on the host both ways
        out, _ = EagerSdpa.apply(query, key, value, is_causal, resolved_scale, enable_gqa,
                                 attn_mask)
    return out
