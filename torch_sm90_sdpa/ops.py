"""The torch.library ops of torch_sm90_sdpa.

- ``torch.ops.torch_sm90_sdpa.sdpa_backward(grad_out, q, k, v, out, lse, is_causal=False,
  scale=None, deterministic=False, attn_mask=None) -> (dq, dk, dv)``: the attention backward. CPU kernel: the fp32 reference in
  :mod:`torch_sm90_sdpa.reference`; CUDA kernel: C++ in ``_C`` (registered through torch's
  stable ABI, so a call runs no Python), or, where that registration is not possible, the same
  steps in Python (:func:`torch_sm90_sdpa._cuda_backend.sdpa_backward_python`). It has no
  autograd formula (its results never require grad); the differentiable ``sdpa`` below refuses
  double backward with a clear error.
- ``torch.ops.torch_sm90_sdpa.sdpa(q, k, v, is_causal=False, scale=None, enable_gqa=False,
  attn_mask=None) -> (out, lse)``: forward through the SM90 forward kernel for a call with a
  boolean mask, or a bf16 / fp32 additive one broadcast over heads, it serves on CUDA (it
  skips the tiles the mask hides, where the stock fused forwards apply a mask densely), else
  through the stock fused forward (or, where stock SDPA runs no fused kernel, e.g. an empty
  size, the reference forward); backward through ``sdpa_backward``.

- ``torch.ops.torch_sm90_sdpa.sdpa_forward(q, k, v, is_causal=False, scale=None,
  enable_gqa=False, attn_mask=None) -> (out, lse)``: ``sdpa`` with the SM90 forward kernel on
  CUDA wherever it serves the call (fp16 / bf16, a compiled head dim, any mask; else the stock
  forward), the same lse layout, fake kernel and backward.

``scale=None`` means 1/sqrt(D) (1 for D = 0, where every score is 0 whatever the scale).
Empty sizes (batch, heads, query or key length, head dim) give stock SDPA's result: empty
outputs, or out = 0 / lse = -inf / zero gradients for queries that see no key.

attn_mask: None, or a bool mask (True = attend) or an additive float mask (fp32 / fp16 / bf16:
0 = attend, -inf = masked, other values added to the scaled scores), of any shape broadcastable
to [B, Hq, Sq, Sk] (e.g. [B, 1, Sq, Sk] causal + padding, [B, 1, 1, Sk] key padding), combined
with is_causal when both are given. A row that sees no key gets zero gradients. The backward
computes no gradient for the mask: ``sdpa`` refuses a mask that requires grad.

Shapes: q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv], out / grad_out
[B, Hq, Sq, Dv], lse [B, Hq, Sq] float32, natural log. Any strides with a contiguous
last dim; dq / dk / dv come back with the strides of q / k / v (``empty_like``), which is
what the stock backward ops' meta functions promise and Inductor asserts.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from typing import Optional

import torch
from torch import Tensor

from . import _extension, _validation, eligibility
from ._cuda_backend import forward_unserved, sdpa_backward_python, sdpa_forward_cuda
from .reference import (attention_backward_reference, attention_forward_reference, causal_mask,
                        expand_mask)

log = logging.getLogger("torch_sm90_sdpa")

# ---------------------------------------------------------------------------------------
# sdpa_backward
# ---------------------------------------------------------------------------------------

_lib = torch.library.Library("torch_sm90_sdpa", "FRAGMENT")  # noqa: TOR901
_lib.define(
    "sdpa_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
    "bool is_causal=False, float? scale=None, bool deterministic=False, "
    "Tensor? attn_mask=None) -> (Tensor, Tensor, Tensor)"
)
SDPA_BACKWARD = torch.ops.torch_sm90_sdpa.sdpa_backward.default

# Calls of sdpa_backward by device type, other than those made by the eager sdpa's own
# backward (routing_stats() reads them: these are the calls compiled graphs made; counted at
# run time because on an FX graph cache hit the rewrite pass does not run). CUDA calls of the
# C++ kernel are counted in _C.
_python_calls: Counter = Counter()
_eager_cpp_calls = 0  # calls of the C++ CUDA kernel made by the eager sdpa's backward
_cpp_calls_base = 0  # _C.cuda_calls() at the last reset
_eager_backward = threading.local()


def _cpp_calls() -> int:
    mod = _extension.load()
    return mod.cuda_calls() if _cuda_kernel == "c++" and mod is not None else 0


def routed_calls() -> Counter:
    """{device type: calls of sdpa_backward made by compiled graphs (or direct callers)}."""
    counts = Counter(_python_calls)
    counts["cuda"] += _cpp_calls() - _cpp_calls_base - _eager_cpp_calls
    return +counts


def reset_routed_calls() -> None:
    global _eager_cpp_calls, _cpp_calls_base
    _python_calls.clear()
    _eager_cpp_calls = 0
    _cpp_calls_base = _cpp_calls()


def _check_and_count_direct_call(device, grad_out, q, k, v, out, lse, scale, attn_mask):
    """The checks of a Python kernel's call, and its count, unless the eager sdpa's own
    backward makes it (with inputs sdpa checked, and not a routed call)."""
    if not getattr(_eager_backward, "active", False):
        _validation.check_backward_inputs(grad_out, q, k, v, out, lse, scale)
        _validation.check_attn_mask(attn_mask, q, k)
        _python_calls[device] += 1


def _sdpa_backward_cpu(grad_out, q, k, v, out, lse, is_causal=False, scale=None,
                       deterministic=False, attn_mask=None):
    scale = _validation.resolve_scale(scale, q)
    _check_and_count_direct_call("cpu", grad_out, q, k, v, out, lse, scale, attn_mask)
    # The reference is deterministic whatever `deterministic` says.
    return attention_backward_reference(grad_out, q, k, v, out, lse, is_causal, scale, attn_mask)


def _sdpa_backward_fake(grad_out, q, k, v, out, lse, is_causal=False, scale=None,
                        deterministic=False, attn_mask=None):
    scale = _validation.resolve_scale(scale, q)
    _validation.check_backward_inputs(grad_out, q, k, v, out, lse, scale)
    _validation.check_attn_mask(attn_mask, q, k)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_lib.impl("sdpa_backward", _sdpa_backward_cpu, "CPU")
# No autograd formula, and no Python at the Autograd key (it would cost several microseconds
# per call): the results simply do not require grad.
_lib.impl("sdpa_backward", torch.library.fallthrough_kernel, "Autograd")
torch.library.register_fake("torch_sm90_sdpa::sdpa_backward", _sdpa_backward_fake, lib=_lib)

# Which CUDA kernel sdpa_backward has: "c++" (_C, through torch's stable ABI), "python" (the
# fallback when that registration is not possible), or None (no _C: a kernel that explains).
_cuda_kernel = None


def cuda_kernel_kind():
    return _cuda_kernel


def _sdpa_backward_cuda_python(grad_out, q, k, v, out, lse, is_causal=False, scale=None,
                               deterministic=False, attn_mask=None):
    scale = _validation.resolve_scale(scale, q)
    _check_and_count_direct_call("cuda", grad_out, q, k, v, out, lse, scale, attn_mask)
    return sdpa_backward_python(grad_out, q, k, v, out, lse, is_causal, scale, deterministic,
                                attn_mask)


def _sdpa_backward_cuda_unavailable(grad_out, q, k, v, out, lse, is_causal=False, scale=None,
                                    deterministic=False, attn_mask=None):
    raise RuntimeError("torch_sm90_sdpa: the SM90 CUDA kernels are not available: "
                       f"{_extension.unavailable_reason()}")


def _install_cuda_kernel() -> None:
    global _cuda_kernel
    if torch.version.cuda is None:  # a CPU-only torch: no CUDA call can reach the op
        _lib.impl("sdpa_backward", _sdpa_backward_cuda_unavailable, "CUDA")
        return
    why = _extension.register_cuda_kernel()
    if why is None:
        _cuda_kernel = "c++"
        _extension.set_cuda_op(_cuda_kernel)
        return
    if _extension.load() is not None:
        log.warning("torch_sm90_sdpa: the C++ CUDA kernel of sdpa_backward could not be "
                    "registered (%s); using the Python path (slower host side)", why)
        _lib.impl("sdpa_backward", _sdpa_backward_cuda_python, "CUDA")
        _cuda_kernel = "python"
        _extension.set_cuda_op(_cuda_kernel)
    else:
        _lib.impl("sdpa_backward", _sdpa_backward_cuda_unavailable, "CUDA")


_install_cuda_kernel()


def define_stable_abi_probe() -> bool:
    """Define and register ``torch_sm90_sdpa::_stable_abi_probe`` (tests only; see
    registration/torch_op.cpp). True when the C++ CPU kernel is registered."""
    if not hasattr(torch.ops.torch_sm90_sdpa, "_stable_abi_probe"):
        _lib.define("_stable_abi_probe(Tensor t, bool flag, float? x, Tensor? maybe=None) "
                    "-> (Tensor, Tensor)")
    return _extension.register_stable_abi_probe() is None


# ---------------------------------------------------------------------------------------
# sdpa: stock fused forward + our backward
# ---------------------------------------------------------------------------------------


def _lse_dtype(q: Tensor) -> torch.dtype:
    """The op's lse dtype: float64 for float64 inputs (the CPU forward), else float32."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _float_mask(attn_mask, dtype):
    """A bool mask as the additive bias the stock kernels take (0 / -inf), in `dtype`."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    bias = torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device)
    return bias.masked_fill_(~attn_mask, float("-inf"))


def _efficient_bias(bias: Tensor, q: Tensor, k: Tensor) -> Tensor:
    """The bias as the memory-efficient kernel takes it: [B, Hq, Sq, Sk], its strides multiples
    of 16 elements (a copy with padded rows where they are not, as SDPA's frontend makes),
    broadcast dims with stride 0."""
    while bias.dim() < 4:
        bias = bias.unsqueeze(0)
    sk = bias.size(-1)
    misaligned = any(size > 1 and stride % 16 for size, stride in
                     zip(bias.shape[:-1], bias.stride()[:-1]))
    if misaligned or (sk > 1 and bias.stride(-1) != 1):
        padded = bias.new_zeros(*bias.shape[:-1], (sk + 15) // 16 * 16)
        padded[..., :sk].copy_(bias)
        bias = padded[..., :sk]
    return expand_mask(bias, q.size(0), q.size(1), q.size(2), k.size(2))


def _stock_picks_cudnn(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float) -> bool:
    """Whether stock SDPA would run cuDNN's fused forward for this unmasked call: torch's own
    choice (its priority order, the user's backend switches, what each kernel takes). With
    torch 2.11 and cuDNN >= 9.15 on SM90 that is cuDNN, whose forward ran 1.6-1.9x
    FlashAttention-2's at d128, 2k / 8k keys (benchmarks/bench_fwd.py, H100); elsewhere it may
    be FlashAttention-2, which _stock_forward then runs, as stock would."""
    choice = torch.ops.aten._fused_sdp_choice(q, k, v, None, 0.0, is_causal, scale=scale,
                                             enable_gqa=q.size(1) != k.size(1))
    return choice == int(torch.nn.attention.SDPBackend.CUDNN_ATTENTION)


def _cudnn_forward(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float,
                   attn_mask) -> Optional[tuple[Tensor, Tensor]]:
    """(out, lse [B, Hq, Sq]) from cuDNN's fused forward for a masked CUDA call, an unmasked
    one where stock SDPA picks cuDNN itself (_stock_picks_cudnn), or an unmasked one with
    Dv != D (FlashAttention-2 needs Dv == D); is_causal without a mask only with Sq == Sk,
    where the alignment of the causal mask does not matter. None where torch says cuDNN
    cannot take it (torch.backends.cuda.can_use_cudnn_attention: the user's
    backend switches, dtype, head dim, mask layout; a mask combined with is_causal, which
    stock SDPA never passes, stays on the memory-efficient kernel). This is the forward
    stock SDPA picks for a masked call on Hopper, and it takes GQA natively; the
    memory-efficient kernel, the other choice, has no GQA and was 2-3x slower there (H200:
    forward + backward through the drop-in at d64 was 0.76-0.94x of stock with it).
    A bool mask becomes a 0 / -inf bias of q's dtype (not torch's 0 / -65504 for cuDNN), so
    that a row without visible keys gets out = 0, as in every other SDPA backend, and the
    backward (which takes the user's mask) agrees with the forward."""
    stock_choice = False
    if attn_mask is None:
        if is_causal and q.size(2) != k.size(2):
            return None
        if v.size(-1) == q.size(-1):
            try:
                if not _stock_picks_cudnn(q, k, v, is_causal, scale):
                    return None
            except RuntimeError as e:
                log.debug("sdpa forward: no stock backend choice (%s)", e)
                return None
            stock_choice = True
        bias = None
    elif is_causal:
        return None
    else:
        bias = _float_mask(attn_mask, q.dtype).to(q.dtype)
        while bias.dim() < 4:
            bias = bias.unsqueeze(0)
    gqa = q.size(1) != k.size(1)
    # Either step may raise where cuDNN is not usable after all (the check itself raised
    # "CUDA driver version is insufficient" on a CUDA build of torch 2.9 without a driver;
    # cuDNN can refuse a graph it was offered): the memory-efficient kernel then serves the
    # call, with the same semantics (rows without keys give 0; the backward takes the mask).
    try:
        if not stock_choice:  # (stock's choice has checked cuDNN's conditions)
            params = torch.backends.cuda.SDPAParams(q, k, v, bias, 0.0, is_causal, gqa)
            if not torch.backends.cuda.can_use_cudnn_attention(params, False):
                return None
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, bias, True, 0.0, is_causal, False, scale=scale
        )
    except RuntimeError as e:
        log.debug("sdpa forward: cuDNN not usable (%s); memory-efficient kernel", e)
        return None
    log.debug("sdpa forward: cuDNN%s", " with the mask as a bias" if bias is not None else "")
    lse = res[1]  # [B, Hq, Sq, 1]
    return res[0], lse[..., 0] if lse.dim() == 4 else lse


def _no_work(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """An empty size (batch, heads, query or key length, head dim): no fused kernel is asked,
    as stock SDPA asks none (its math path serves these)."""
    return q.numel() == 0 or k.numel() == 0 or v.numel() == 0


def _cpu_stock_mask(attn_mask, q: Tensor):
    """The mask as the CPU kernel reads it: an additive bias of q's dtype (a bool mask as
    0 / -inf; the kernel misreads a float mask of another dtype)."""
    mask = _float_mask(attn_mask, q.dtype)
    return mask.to(q.dtype) if mask is not None else None


def _rows_without_key(bias: Tensor, q: Tensor, k: Tensor, is_causal: bool) -> Tensor:
    """[B, Hq, Sq] bool: the rows whose every key the additive bias (broadcastable to [B, Hq,
    Sq, Sk]) hides with -inf, or is_causal's cut (top-left) does."""
    hidden = bias == float("-inf")
    if is_causal:
        hidden = hidden | ~causal_mask(q.size(2), k.size(2), q.device)
    rows = hidden.all(dim=-1)
    while rows.dim() < 3:
        rows = rows.unsqueeze(0)
    return rows.expand(q.shape[:3])


def _empty_out(q: Tensor, head_dim_v: int) -> Tensor:
    """An uninitialized out [B, Hq, Sq, Dv] laid out like q: torch.empty_like(q) when Dv == D,
    else q's outer dims in q's stride order (outermost first; ties keep the logical order) and
    the last dim innermost (a dim q broadcasts with stride 0 would sort below it)."""
    if head_dim_v == q.size(-1):
        return torch.empty_like(q)
    order = sorted(range(q.dim() - 1), key=lambda d: (-q.stride(d), d)) + [q.dim() - 1]
    return torch.empty_permuted((*q.shape[:-1], head_dim_v), order, dtype=q.dtype,
                                device=q.device)


def _stock_forward(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float,
                   attn_mask=None, enable_gqa: bool = False):
    """(out, lse) from the stock fused forward, in the op's layouts (see _sdpa_fake); the
    reference forward where stock SDPA would not run a fused kernel either."""
    if _no_work(q, k, v):
        out, lse = attention_forward_reference(q, k, v, is_causal, scale, attn_mask)
    elif q.device.type == "cpu":
        # the CPU flash kernel only where stock SDPA would pick it for this call, and not for
        # a float mask of another dtype than q's (an fp32 mask with fp16 / bf16 q): the kernel
        # reads the mask in q's dtype, where values past its range overflow (1e5 to inf in
        # fp16, fp32's minimum to -inf), and stock SDPA keeps them; the reference reads fp32
        flash, mask = False, None
        if attn_mask is None or attn_mask.dtype in (torch.bool, q.dtype):
            mask = _cpu_stock_mask(attn_mask, q)
            if mask is not None and mask.dim() < 2:  # a [Sk] mask: stock's kernels index dim -2
                mask = mask.view(1, -1)
            flash = torch.ops.aten._fused_sdp_choice(
                q, k, v, mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa
            ) == int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)
        if flash:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale
            )
            if mask is not None:  # (the kernel gives lse 0 where a row sees no key)
                lse = lse.masked_fill(_rows_without_key(mask, q, k, is_causal), float("-inf"))
        else:
            out, lse = attention_forward_reference(q, k, v, is_causal, scale, attn_mask)
    elif q.device.type == "cuda":
        res = _cudnn_forward(q, k, v, is_causal, scale, attn_mask)
        if res is not None:
            out, lse = res
        elif attn_mask is not None or (is_causal and q.size(2) != k.size(2)) or \
                v.size(-1) != q.size(-1):
            # The memory-efficient kernel: it takes a mask (an additive bias of q's dtype,
            # [B, H, Sq, Sk]-broadcastable), aligns a causal mask top-left like SDPA (FA2
            # aligns it bottom-right when Sq != Sk) and takes Dv != D. It has no GQA: repeat
            # the kv heads. Its lse is padded to a multiple of 32 rows: keep the first Sq.
            group = q.size(1) // k.size(1)
            if group > 1:
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            bias = _float_mask(attn_mask, q.dtype)
            if bias is not None:
                bias = _efficient_bias(bias.to(q.dtype), q, k)
            res = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, bias, True, 0.0, is_causal, scale=scale
            )
            out, lse = res[0], res[1][:, :, : q.size(2)]
        else:
            # FlashAttention-2, where stock picks it for an unmasked call (or cuDNN declined).
            # It handles Hq a multiple of Hkv natively; its lse is [B, Hq, Sq] fp32.
            res = torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, is_causal, False, scale=scale
            )
            out, lse = res[0], res[1]
    else:
        raise RuntimeError(
            f"torch_sm90_sdpa.sdpa: no forward for device type {q.device.type!r} "
            "(expected cpu or cuda)"
        )
    want = _empty_out(q, v.size(-1))
    if out.stride() != want.stride():
        out = want.copy_(out)
    return out, lse.to(_lse_dtype(q)).contiguous()


def _check_sdpa_inputs(q, k, v, scale, enable_gqa, attn_mask):
    _validation.check_attention_inputs(q, k, v)
    _validation.check_scale(scale)
    _validation.check_attn_mask(attn_mask, q, k)
    if q.size(1) != k.size(1) and k.size(1) != 0 and not enable_gqa:
        raise ValueError(
            f"key: expected {q.size(1)} heads like query, got {k.size(1)}; pass "
            "enable_gqa=True for grouped-query attention"
        )
    if q.device.type == "cuda":
        _validation.check_cuda_kernel_dtype(q)
        if v.size(-1) != q.size(-1):
            # the forward is stock's (cuDNN or the memory-efficient kernel), the backward ours:
            # refuse here a pair the backward kernel was not built for, not at backward time
            why = eligibility.kernel_verdict(q.dtype, q.size(-1), v.size(-1), q.size(1),
                                             k.size(1), eligibility.device_capability(q.device),
                                             False)
            if why is not None:
                raise ValueError(f"value: head dim {v.size(-1)} with query's {q.size(-1)} (Dv != "
                                 f"D) has no SM90 backward here ({why})")


def _sdpa_body(
    q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False, scale: Optional[float] = None,
    enable_gqa: bool = False, attn_mask: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """The forward of ``sdpa`` (its CPU and CUDA kernel); EagerSdpa calls it directly."""
    _check_sdpa_inputs(q, k, v, scale, enable_gqa, attn_mask)
    scale = _validation.resolve_scale(scale, q)
    # Our forward for a boolean mask: 2.11-7.09x cuDNN's masked forward for a causal-shaped one
    # (benchmarks/bench_fwd.py, H100, 308254a), and for an additive mask whose fill it hides
    # (bf16 / fp32, broadcast over heads: transformers' additive form). fp16 and per-head biases
    # keep the stock forward (eligibility.additive_mask_slower_forward).
    if attn_mask is not None and q.device.type == "cuda":
        why_not = (None if attn_mask.dtype == torch.bool
                   else eligibility.additive_mask_slower_forward(attn_mask))
        why_not = why_not or forward_unserved(q, k, v, is_causal, attn_mask)
        if why_not is None:
            return sdpa_forward_cuda(q, k, v, is_causal, scale, attn_mask)
        log.debug("sdpa: stock masked forward (%s)", why_not)
    return _stock_forward(q, k, v, is_causal, scale, attn_mask, enable_gqa)


sdpa = torch.library.custom_op("torch_sm90_sdpa::sdpa", _sdpa_body, mutates_args=(),
                               device_types=("cpu", "cuda"))


@sdpa.register_fake
def _sdpa_fake(q, k, v, is_causal=False, scale=None, enable_gqa=False, attn_mask=None):
    """The op's contract: out [B, Hq, Sq, Dv] laid out like q (torch.empty_like(q) when
    Dv == D); lse [B, Hq, Sq] contiguous, float64 for float64 inputs, else float32."""
    _check_sdpa_inputs(q, k, v, scale, enable_gqa, attn_mask)
    return _empty_out(q, v.size(-1)), q.new_empty(q.shape[:3], dtype=_lse_dtype(q))


def _sdpa_setup_context(ctx, inputs, output):
    q, k, v, is_causal, scale, _, attn_mask = inputs
    # autograd records this call: a mask that requires grad would need a gradient we do not
    # compute
    _validation.check_mask_not_differentiable(attn_mask)
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask)
    ctx.is_causal = is_causal
    ctx.scale = _validation.resolve_scale(scale, q)
    ctx.mark_non_differentiable(lse)
    # lse gets no gradient: without this, autograd hands the backward a zero-filled [B, H, Sq]
    # tensor for it on every call (an allocation and a fill kernel the backward never reads)
    ctx.set_materialize_grads(False)


class _NoDoubleBackward(torch.autograd.Function):
    """Passes the gradients (dq, dk, dv) through, tied to the differentiable inputs they came
    from (anchors), so that differentiating them again raises a clear error."""

    @staticmethod
    def forward(ctx, dq, dk, dv, *anchors):
        return dq.clone(), dk.clone(), dv.clone()

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            "torch_sm90_sdpa.sdpa_backward does not support double backward (differentiating "
            "the attention gradients again, e.g. create_graph=True followed by another "
            "backward). Use torch.nn.functional.scaled_dot_product_attention without "
            "torch_sm90_sdpa for higher-order gradients."
        )


def _sdpa_backward(ctx, grad_out, _grad_lse):
    global _eager_cpp_calls
    q, k, v, out, lse, attn_mask = ctx.saved_tensors
    if grad_out is None:  # (grads are not materialized) nothing flows back through out
        return None, None, None, None, None, None, None
    if grad_out.size(-1) > 1 and grad_out.stride(-1) != 1:
        # e.g. the expanded gradient of out.sum(): the kernels need a contiguous last dim.
        grad_out = grad_out.contiguous()
    # Deterministic algorithms on at backward time (also when switched on after the forward):
    # the kernel's deterministic mode (bitwise-repeatable gradients).
    deterministic = torch.are_deterministic_algorithms_enabled()
    create_graph = torch.is_grad_enabled()
    _eager_backward.active = True
    try:
        # (autograd runs a backward with grad mode off unless create_graph=True: only then a
        # no_grad to enter, a few microseconds less host latency on the common path)
        with torch.no_grad() if create_graph else contextlib.nullcontext():
            grads = SDPA_BACKWARD(grad_out, q, k, v, out, lse, ctx.is_causal, ctx.scale,
                                  deterministic, attn_mask)
    finally:
        _eager_backward.active = False
    if q.device.type == "cuda" and _cuda_kernel == "c++":
        _eager_cpp_calls += 1
    if create_graph:
        grads = _NoDoubleBackward.apply(*grads, q, k, v, out, grad_out)
    return (*grads, None, None, None, None)


sdpa.register_autograd(_sdpa_backward, setup_context=_sdpa_setup_context)


@torch.library.custom_op("torch_sm90_sdpa::sdpa_forward", mutates_args=(),
                         device_types=("cpu", "cuda"))
def sdpa_forward(
    q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False, scale: Optional[float] = None,
    enable_gqa: bool = False, attn_mask: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    _check_sdpa_inputs(q, k, v, scale, enable_gqa, attn_mask)
    scale = _validation.resolve_scale(scale, q)
    if q.device.type == "cuda":
        why_not = forward_unserved(q, k, v, is_causal, attn_mask)
        if why_not is None:
            return sdpa_forward_cuda(q, k, v, is_causal, scale, attn_mask)
        log.debug("sdpa_forward: stock forward (%s)", why_not)
    return _stock_forward(q, k, v, is_causal, scale, attn_mask, enable_gqa)


sdpa_forward.register_fake(_sdpa_fake)
sdpa_forward.register_autograd(_sdpa_backward, setup_context=_sdpa_setup_context)


class EagerSdpa(torch.autograd.Function):
    """``sdpa`` with the same forward, saved tensors and backward (``_sdpa_backward``), as a
    plain autograd.Function: what the eager drop-in applies outside torch.compile. The custom
    op's generated autograd node cost more host time per backward than a plain Function
    around the same ops (H200, synchronized call, event time over the op's, d128 causal b32
    s512: 0.123 against 0.071 ms, cuDNN's own public path 0.069 ms; measured with the
    `--nodes` probe of commit 22b1ca0); with this class the drop-in's extra per call back to
    back at up to 2k keys fell from 0.098 to 0.078 ms (median over bench_bwd.py's rows, commit
    c886836).
    Compiled graphs keep the custom op (its fake kernel and the rewrite need it).

    apply(q, k, v, is_causal, scale, enable_gqa, attn_mask) -> (out, lse), shapes as ``sdpa``.
    """

    @staticmethod
    def forward(ctx, q, k, v, is_causal, scale, enable_gqa, attn_mask):
        # The op's body without the dispatcher: the eager drop-in only comes here with plain
        # CPU / CUDA tensors, where the op would run this same body after its autograd and
        # device dispatch (about 11 us more host time per call; grad mode is off in here).
        out, lse = _sdpa_body(q, k, v, is_causal, scale, enable_gqa, attn_mask)
        _sdpa_setup_context(ctx, (q, k, v, is_causal, scale, enable_gqa, attn_mask), (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        return _sdpa_backward(ctx, grad_out, grad_lse)
