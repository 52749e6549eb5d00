"""Eligibility: which SDPA backward calls the kernels (or the CPU reference) can serve.

The torch.compile rewrite (:mod:`torch_sm90_sdpa.compile_pass`) describes each stock backward
node of a compiled graph as an :class:`AttentionBackwardCall` (from the nodes' fake tensors);
:func:`eligible` says whether our op can take it, and :func:`torch_sm90_sdpa.policy.decide`
adds the speed gate (:mod:`torch_sm90_sdpa.speed_gate`). Everything here runs at compile time
and sees only metadata: shapes, strides, dtypes, devices (fake tensors, meta tensors, real
tensors or :class:`TensorSpec` all work, symbolic sizes too). Nothing installs a shape guard:
a property that cannot be proved for every size the graph serves (e.g. a symbolic stride that
may be misaligned) counts as not met.

What we serve on CUDA is the kernels' contract, stated once in C++
(``registration/bwd_device.cpp``, ``can_implement``) and asked here through ``_C`` with the
call's metadata (:func:`kernel_decision`): an SM90 GPU, fp16 / bf16, a compiled head dim
(Dv == D, or a compiled (D, Dv) pair), Hq a multiple of Hkv, a contiguous last dim; under deterministic algorithms the
kernels' deterministic mode serves the call. Layouts its TMA cannot read (misaligned views,
broadcast heads, padded rows) are served too: the op copies those operands. The rest is about
the stock node, not the kernel:

* a non-nested call without dropout: 4-D q/k/v/out/grad_out, a logsumexp of the backend's
  layout, a constant scale; a mask / bias (the cuDNN and memory-efficient nodes get SDPA's
  mask as an additive bias) is served when its dtype is one the kernels read (bool, fp32,
  fp16, bf16), its shape broadcasts to [B, Hq, Sq, Sk] and no gradient is asked of it;
* SDPA's causal semantics (top-left). The flash op with ``is_causal`` and Sq != Sk is
  left alone: called directly, FlashAttention-2 aligns the mask bottom-right (SDPA itself
  never picks flash for such calls).

With the CPU route on (``enable(cpu=True)``), the CPU node of SDPA
(``_scaled_dot_product_flash_attention_for_cpu_backward``) goes to the op's CPU reference:
fp16 / bf16 / fp32 / fp64, any head dim, no alignment rule (last dim contiguous only).

Reasons are short stable strings (the keys of ``routing_stats()["not_routed"]``); the
details (which tensor, which stride) go to the log.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from . import _extension, _validation
from ._problem import bwd_problem, dense_layout

CPU_DTYPES = _validation.SUPPORTED_DTYPES  # the CPU reference's dtypes

# The stock backward ops the rewrite knows, by short name.
aten = torch.ops.aten
STOCK_BACKWARD_OPS = {
    "cudnn": aten._scaled_dot_product_cudnn_attention_backward.default,
    "flash": aten._scaled_dot_product_flash_attention_backward.default,
    "efficient": aten._scaled_dot_product_efficient_attention_backward.default,
    "cpu_flash": aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
}
CUDA_BACKENDS = ("cudnn", "flash", "efficient")
# The stock forward ops, by the same names (the joint-graph rewrite, forward_pass.py).
STOCK_FORWARD_OPS = {
    "cudnn": aten._scaled_dot_product_cudnn_attention.default,
    "flash": aten._scaled_dot_product_flash_attention.default,
    "efficient": aten._scaled_dot_product_efficient_attention.default,
    "cpu_flash": aten._scaled_dot_product_flash_attention_for_cpu.default,
}

# Reasons a call is not routed (stable strings: the keys of the not-routed counts).
R_CPU_ROUTE_OFF = "CPU route off"
R_DEVICE = "device not served"
R_NOT_SM90 = "not an SM90 GPU"
R_NESTED = "nested / variable-length inputs"
R_DROPOUT = "dropout_p > 0"
R_MASK = "attn_mask not served"  # a dtype or shape the kernels cannot read
R_MASK_GRAD = "attn_mask needs a gradient"
R_SHAPES = "unexpected shapes"
R_DTYPE = "dtype"
R_HEAD_DIM_SYMBOLIC = "symbolic head dim"
R_DV = "Dv != D"
R_HEADS = "Hq not a multiple of Hkv"
R_NOT_BUILT = "SM90 kernels not built"
R_VARIANT = "head dim not compiled"
R_CAUSAL_ALIGN = "causal with Sq != Sk (flash aligns bottom-right)"
R_LAST_DIM = "last dim not contiguous"
R_TOO_LARGE = "sizes exceed the kernel's int32 indexing"
R_LSE = "unexpected logsumexp"
R_SCALE = "scale not a constant"
R_OUTPUTS = "unsupported outputs used"
R_LAYOUT = "output layout not reproducible"
R_DEBUG_MASK = "debug attention weights asked"  # the forward node returns its softmax
R_BACKWARD_KEPT = "its backward stays on stock"  # the forward follows its backward's decision

@dataclass(frozen=True)
class TensorSpec:
    """A tensor described by its metadata only (tests, the `info` command).

    Offers the attributes and methods :func:`decide` reads: ``shape``, ``dtype``,
    ``device``, ``dim()``, ``size(i)``, ``stride(i)``, ``storage_offset()``."""

    shape: tuple
    dtype: torch.dtype
    device: torch.device = torch.device("cpu")
    strides: Optional[tuple] = None  # None: contiguous
    offset: int = 0

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(self.shape))
        object.__setattr__(self, "device", torch.device(self.device))
        if self.strides is None:
            strides, acc = [], 1
            for s in reversed(self.shape):
                strides.append(acc)
                acc *= max(int(s), 1)
            object.__setattr__(self, "strides", tuple(reversed(strides)))

    def dim(self) -> int:
        return len(self.shape)

    def size(self, i: Optional[int] = None):
        return self.shape if i is None else self.shape[i]

    def stride(self, i: Optional[int] = None):
        return self.strides if i is None else self.strides[i]

    def storage_offset(self) -> int:
        return self.offset


class _CallOnQuery:
    """What a described call says of itself: its device (the query's), whether it has a mask."""

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def has_mask(self) -> bool:
        return self.mask is not None


@dataclass
class AttentionBackwardCall(_CallOnQuery):
    """One stock SDPA backward call, as the rewrite sees it in a graph."""

    backend: str  # a key of STOCK_BACKWARD_OPS
    grad_out: Any
    q: Any
    k: Any
    v: Any
    out: Any
    lse: Any  # the backend's own logsumexp layout (see lse_shape_ok)
    is_causal: bool
    dropout_p: float = 0.0
    scale: Any = None  # None: 1/sqrt(D)
    mask: Any = None  # attn_mask (CPU) / attn_bias (cuDNN, efficient), or None
    mask_needs_grad: bool = False  # the efficient node asked for the bias's gradient
    nested: bool = False  # cum_seq_q / cum_seq_k given
    deterministic: bool = False
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    routed: bool
    reason: str = ""  # one of the R_* strings when not routed
    detail: str = ""  # for the log

    def __bool__(self) -> bool:
        return self.routed


ROUTE = Decision(True)


def _no(reason: str, detail: str = "") -> Decision:
    return Decision(False, reason, detail or reason)


def _known(cond) -> bool:
    """True only if `cond` holds for every value of its symbols (never guards)."""
    if isinstance(cond, bool):
        return cond
    # a symbolic condition comes from a compile, which has imported this (sympy: a third of a
    # second that importing the package does not pay)
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(cond)


def _dims(t) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def additive_mask_slower_forward(mask) -> Optional[str]:
    """Why our forward runs an additive `mask` slower than stock does (None: it does not).

    Our forward skips the tiles a mask hides and reads the others as bits where every visible
    entry adds 0 (csrc/mask_classify.h): hidden are -inf and, in a bf16 or fp32 mask, a fill
    the kernel clamps to -FLT_MAX (the dtype's minimum: transformers' additive masks). A tile
    holding other values is computed from the mask's elements, slower than stock's masked
    forward: every tile of an fp16 mask filled with its minimum (-65504), and of a bias that
    varies over heads (ALiBi, T5's position bias), dense by nature.
    """
    if mask.dtype == torch.float16:
        return "an fp16 additive mask: its fill (-65504) hides no tile"
    if mask.dim() >= 3 and _known(mask.size(-3) != 1) and _known(mask.stride(-3) != 0):
        return f"an additive mask per head {_dims(mask)}: a dense bias, read from its elements"
    return None


@functools.lru_cache(maxsize=None)
def _capability_cached(index: int):
    return torch.cuda.get_device_capability(index)


def _query_cuda_device(device: torch.device, query):
    """query(index) for a CUDA device present here, else None (not CUDA, no driver, bad
    index: not a device we can serve)."""
    if device.type != "cuda":
        return None
    try:
        if not torch.cuda.is_available():
            return None
        return query(device.index if device.index is not None else torch.cuda.current_device())
    except Exception:
        return None


def device_capability(device: torch.device):
    """(major, minor) of a CUDA device, or None if there is no such device here.

    Tests replace this function to describe a GPU this machine does not have."""
    return _query_cuda_device(device, _capability_cached)


def resolved_scale(call: AttentionBackwardCall) -> Optional[float]:
    """The float scale the op gets (None if it is not a compile-time constant)."""
    if call.scale is None:
        d = call.q.size(-1)
        if not isinstance(d, int):
            return None
        return 1.0 / math.sqrt(d)
    if isinstance(call.scale, (int, float)) and math.isfinite(call.scale):
        return float(call.scale)
    return None


def lse_shape_ok(call: AttentionBackwardCall) -> bool:
    """The logsumexp layouts of the backends: cuDNN [B,H,Sq,1], flash / CPU [B,H,Sq],
    efficient [B,H,ceil(Sq/32)*32] (padded); fp32 (fp64 for fp64 CPU inputs)."""
    lse, q = call.lse, call.q
    if lse is None or not hasattr(lse, "dim"):
        return False
    want_dtype = (torch.float32, torch.float64) if q.dtype == torch.float64 else (torch.float32,)
    if lse.dtype not in want_dtype:
        return False
    b, h, sq = q.size(0), q.size(1), q.size(2)
    if call.backend == "cudnn":
        if lse.dim() != 4 or not _known(lse.size(3) == 1):
            return False
    elif lse.dim() != 3:
        return False
    same = _known(lse.size(0) == b) and _known(lse.size(1) == h)
    if call.backend == "efficient":
        # padded to a multiple of 32 >= Sq by the op's contract (not provable symbolically)
        return same
    return same and _known(lse.size(2) == sq)


MASK_KIND_CODES = _extension.MASK_KIND_CODES


def _mask_view_layout(C, mask):
    """_C.OperandLayout of the mask's [B, Hq, Sq, Sk] broadcast view (stride 0 where it
    broadcasts; a symbolic stride counts as 1: plain loads read any layout)."""
    strides = [0, 0, 0, 0]
    for i in range(4):
        d = i - (4 - mask.dim())
        if d < 0 or _known(mask.size(d) == 1):
            continue
        st = mask.stride(d)
        strides[i] = st if isinstance(st, int) else 1
    return C.OperandLayout(batch_stride=strides[0], head_stride=strides[1],
                           row_stride=strides[2], col_stride=strides[3])


def _mask_reason(call: AttentionBackwardCall) -> Optional[Decision]:
    """Why the call's mask is not served (None: no mask, or one the op takes): the op's
    rules (_validation.check_attn_mask) on metadata that may be symbolic."""
    mask = call.mask
    if mask is None:
        return None
    if not hasattr(mask, "dim"):
        return _no(R_MASK, f"attn_mask {mask!r} is not a tensor")
    q, k = call.q, call.k
    allowed = tuple(MASK_KIND_CODES) if call.backend != "cpu_flash" else (
        tuple(MASK_KIND_CODES) + ((torch.float64,) if q.dtype == torch.float64 else ()))
    if mask.dtype not in allowed:
        return _no(R_MASK, f"attn_mask dtype {mask.dtype}")
    if mask.device != q.device:
        return _no(R_MASK, f"attn_mask on {mask.device}")
    target = (q.size(0), q.size(1), q.size(2), k.size(2))
    if mask.dim() > 4 or not all(
        _known(s == 1) or _known(s == t) for s, t in zip(reversed(mask.shape), reversed(target))
    ):
        return _no(R_MASK, f"attn_mask {_dims(mask)} does not broadcast to {list(target)}")
    return None


def _last_dim_contiguous(t) -> bool:
    return _known(t.stride(-1) == 1) or _known(t.size(-1) <= 1)


def _hint(x) -> int:
    """A concrete value of a size or stride (its hint when symbolic)."""
    if isinstance(x, torch.SymInt):
        return int(x.node.hint)
    return int(x)


def _operand_layout(C, t, elem_bytes: int):
    """_C.OperandLayout of a (fake / meta / real tensor or TensorSpec) [B, H, S(, X)] operand.
    A symbolic stride that may not be TMA-friendly is given as 1 (the op would copy it); a last
    dim not provably contiguous as stride 0 (not served); the address alignment is what the
    storage offset proves (storages are 16-byte aligned)."""
    def stride(i):
        st = t.stride(i)
        if isinstance(st, int):
            return st
        unit = 16 // elem_bytes
        return _hint(st) if _known(st > 0) and _known(st % unit == 0) else 1

    col = 1 if t.dim() < 4 or _last_dim_contiguous(t) else 0
    off = t.storage_offset() if hasattr(t, "storage_offset") else 0
    align = 16 if _known((off * elem_bytes) % 16 == 0) else 1
    return C.OperandLayout(batch_stride=stride(0), head_stride=stride(1), row_stride=stride(2),
                           col_stride=col, address_align=align)




def _problem(C, q, k, v, out, grad_out, *, is_causal: bool, deterministic: bool, capability,
             mask=None):
    """_C.BwdProblem of a call's metadata (symbolic sizes by their hints; head dims concrete)."""
    elem_bytes = 2
    layouts = {name: _operand_layout(C, t, elem_bytes)
               for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", grad_out))}
    # dq / dk / dv: what the op allocates (empty_like): dense, 16-byte aligned
    layouts.update(dq=dense_layout(C), dk=dense_layout(C), dv=dense_layout(C))
    if mask is not None:
        layouts["mask"] = _mask_view_layout(C, mask)
    return bwd_problem(C, q, k, v, layouts, is_causal=is_causal, deterministic=deterministic,
                       capability=capability, mask=mask, size=_hint)

def gqa_heads_per_cta(q, k, v, out, grad_out, *, is_causal: bool, deterministic: bool,
                      mask=None) -> int:
    """The q heads one main-kernel CTA walks for this call (the C++ rule, ``_C.workspace_layout``:
    the whole GQA group, of at most 4 q heads, when its kv heads' key blocks make enough CTAs,
    unmasked, not deterministic, ``TORCH_SM90_SDPA_GQA_WALK`` as _C read it (=1: any group,
    also deterministic); else 1). 1 when ``_C`` is not built, and when the batch, head counts
    or key length are symbolic: the count is then not known for every size the graph serves.
    Shapes as :func:`kernel_decision`'s."""
    sizes = (q.size(0), q.size(1), k.size(1), k.size(2), q.size(-1), v.size(-1))
    if not all(isinstance(x, int) for x in sizes) or sizes[1] == sizes[2]:
        return 1
    C = _extension.load()
    if C is None:
        return 1
    problem = _problem(C, q, k, v, out, grad_out, is_causal=is_causal,
                       deterministic=deterministic, capability=None, mask=mask)
    return int(C.workspace_layout(problem).heads_per_cta)


def kernel_decision(q, k, v, out, grad_out, *, is_causal: bool, deterministic: bool,
                    capability, mask=None) -> Decision:
    """The SM90 kernels' verdict on a call, from its metadata (the contract lives in C++:
    ``_C.can_implement``; this only translates the metadata, symbolic sizes included).
    q [B, Hq, Sq, D], k/v [B, Hkv, Sk, D/Dv], out / grad_out [B, Hq, Sq, Dv] (tensors, fake
    tensors or TensorSpecs). capability: the device's (major, minor), or None."""
    C = _extension.load()
    if C is None:  # the contract cannot be asked: the device, else the missing build
        if capability != (9, 0):
            return _no(R_NOT_SM90, f"compute capability {capability}")
        return _no(R_NOT_BUILT, str(_extension.unavailable_reason()))
    if any(t.dtype != q.dtype for t in (k, v, out, grad_out)):
        return _no(R_DTYPE, f"mixed dtypes {[str(t.dtype) for t in (q, k, v, out, grad_out)]}")
    if q.dtype not in _extension.KERNEL_DTYPES:  # said here in words (C++ knows only codes)
        served = " and ".join(_extension.dtype_name(_extension.dtype_code(d))
                              for d in _extension.KERNEL_DTYPES)
        also = (" (CPU calls of this dtype go to the CPU reference with enable(cpu=True))"
                if q.dtype in CPU_DTYPES else "")
        return _no(R_DTYPE, f"{str(q.dtype).replace('torch.', '')}: the SM90 kernels serve "
                            f"{served} only{also}")
    head_dim, head_dim_v = q.size(-1), v.size(-1)
    if not (isinstance(head_dim, int) and isinstance(head_dim_v, int)):
        return _no(R_HEAD_DIM_SYMBOLIC, f"head dim {head_dim}, {head_dim_v}")
    hq, hkv = q.size(1), k.size(1)
    if not (isinstance(hq, int) and isinstance(hkv, int)):
        if not (_known(hkv > 0) and _known(hq % hkv == 0)):
            return _no(R_HEADS, f"Hq = {hq}, Hkv = {hkv} (symbolic, not provably a multiple)")
    problem = _problem(C, q, k, v, out, grad_out, is_causal=is_causal,
                       deterministic=deterministic, capability=capability, mask=mask)
    d = C.can_implement(problem)
    if d.verdict == "unsupported":
        return _no(d.reason, d.detail)
    detail = f"copies {', '.join(d.copy)} (TMA cannot read them as they are)" if d.copy else ""
    return Decision(True, "", detail)


@functools.lru_cache(maxsize=256)
def kernel_verdict(dtype, head_dim, head_dim_v, heads_q, heads_kv, capability,
                   deterministic) -> Optional[str]:
    """:func:`kernel_decision` on a call of these facts: None when served, else "reason: detail".
    Layouts do not change the verdict (the op copies what TMA cannot read), nor do sequence
    lengths (any is served), so it is cached on these facts alone (the eager drop-in and the
    demo ask it per call)."""
    q = TensorSpec((1, heads_q, 1, head_dim), dtype, "cuda")
    k = TensorSpec((1, heads_kv, 1, head_dim), dtype, "cuda")
    v = TensorSpec((1, heads_kv, 1, head_dim_v), dtype, "cuda")
    o = TensorSpec((1, heads_q, 1, head_dim_v), dtype, "cuda")
    d = kernel_decision(q, k, v, o, o, is_causal=False, deterministic=deterministic,
                        capability=capability)
    return None if d.routed else f"{d.reason}: {d.detail}"


def _route_reason(backend: str, ops: dict, device: torch.device,
                  cpu_route: bool) -> Optional[Decision]:
    """Why a node of this backend on this device has no route (None: it has one): the CPU
    node needs the CPU route, the others a CUDA device."""
    if backend not in ops:
        return _no(R_DEVICE, f"unknown backend {backend!r}")
    if backend == "cpu_flash":
        if not cpu_route:
            return _no(R_CPU_ROUTE_OFF, "CPU route off (enable(cpu=True) serves CPU calls)")
        if device.type != "cpu":
            return _no(R_DEVICE, f"CPU op on device {device}")
    elif device.type != "cuda":
        return _no(R_DEVICE, f"device {device} is not served")
    return None


def eligible(call: AttentionBackwardCall, *, cpu_route: bool = False) -> Decision:
    """Whether ``torch_sm90_sdpa::sdpa_backward`` can serve this call (the CPU reference for
    the CPU node when cpu_route, else the SM90 kernels); the speed gate is
    :func:`torch_sm90_sdpa.speed_gate.faster_than_stock`."""
    backend, device = call.backend, call.device
    why = _route_reason(backend, STOCK_BACKWARD_OPS, device, cpu_route)
    if why is not None:
        return why
    if call.nested:
        return _no(R_NESTED)
    if not (isinstance(call.dropout_p, (int, float)) and call.dropout_p == 0):
        return _no(R_DROPOUT, f"dropout_p = {call.dropout_p}")
    if call.mask_needs_grad:
        return _no(R_MASK_GRAD, "the memory-efficient node computes the bias's gradient")

    q, k, v, out, go = call.q, call.k, call.v, call.out, call.grad_out
    named = {"query": q, "key": k, "value": v, "out": out, "grad_out": go}
    if not all(t is not None and hasattr(t, "dim") and t.dim() == 4 for t in named.values()):
        return _no(R_SHAPES, "q/k/v/out/grad_out are not all 4-D tensors")
    if any(t.device != device for t in named.values()) or call.lse.device != device:
        return _no(R_DEVICE, "tensors on different devices")

    b, hq, sq = q.size(0), q.size(1), q.size(2)
    hkv, sk = k.size(1), k.size(2)
    shapes_ok = (
        _known(k.size(0) == b) and _known(v.size(0) == b) and _known(v.size(1) == hkv)
        and _known(v.size(2) == sk) and _known(k.size(3) == q.size(3))
        and all(_known(t.size(i) == s)
                for t in (out, go) for i, s in enumerate((b, hq, sq, v.size(3))))
    )
    if not shapes_ok:
        return _no(R_SHAPES, f"q {_dims(q)}, k {_dims(k)}, v {_dims(v)}, out {_dims(out)}, "
                             f"grad_out {_dims(go)}")
    if not lse_shape_ok(call):
        lse = call.lse
        return _no(R_LSE, f"logsumexp {_dims(lse) if hasattr(lse, 'shape') else lse!r} "
                          f"{getattr(lse, 'dtype', '')} for the {backend} op")
    if resolved_scale(call) is None:
        return _no(R_SCALE, f"scale {call.scale!r}")
    why = _mask_reason(call)
    if why is not None:
        return why

    if backend == "cpu_flash":  # the CPU reference: any head dim, last dim contiguous
        if q.dtype not in CPU_DTYPES or any(t.dtype != q.dtype for t in named.values()):
            return _no(R_DTYPE, f"dtypes {[str(t.dtype) for t in named.values()]}; "
                                f"served: {[str(d) for d in CPU_DTYPES]}")
        if (v.size(-1) != q.size(-1)):
            return _no(R_DV, f"D = {q.size(-1)}, Dv = {v.size(-1)}")
        if not (isinstance(hq, int) and isinstance(hkv, int) and hkv > 0 and hq % hkv == 0) \
                and not _known(hq == hkv):
            return _no(R_HEADS, f"Hq = {hq}, Hkv = {hkv}")
        for name, t in named.items():
            if not _last_dim_contiguous(t):
                return _no(R_LAST_DIM, f"{name} has strides {tuple(t.stride())}")
        return ROUTE

    if backend == "flash" and call.is_causal and not _known(sq == sk):
        return _no(R_CAUSAL_ALIGN, f"Sq = {sq}, Sk = {sk}")
    return kernel_decision(q, k, v, out, go, is_causal=call.is_causal,
                           deterministic=call.deterministic,
                           capability=device_capability(device), mask=call.mask)


def describe(call: AttentionBackwardCall) -> str:
    """A one-line description for the log: shapes, dtype, device, causal, mask."""
    q, k = call.q, call.k
    gqa = "" if _known(q.size(1) == k.size(1)) else f", GQA {q.size(1)}/{k.size(1)}"
    mask = ""
    if call.mask is not None and hasattr(call.mask, "shape"):
        mask = f", mask {_dims(call.mask)} {str(call.mask.dtype).replace('torch.', '')}"
    return (f"q {_dims(q)} k {_dims(k)} {str(q.dtype).replace('torch.', '')} on {q.device}"
            f"{', causal' if call.is_causal else ''}{gqa}{mask}")


# ---------------------------------------------------------------------------------------
# the forward
# ---------------------------------------------------------------------------------------


@dataclass
class AttentionForwardCall(_CallOnQuery):
    """One stock SDPA forward call, as the joint-graph rewrite sees it (forward_pass.py).
    q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv] (fake tensors or TensorSpecs)."""

    backend: str  # a key of STOCK_FORWARD_OPS
    q: Any
    k: Any
    v: Any
    is_causal: bool
    dropout_p: float = 0.0
    scale: Any = None  # None: 1/sqrt(D)
    # the mask our op would get: the user's boolean mask where the node's bias is SDPA's
    # conversion of one (forward_pass.bool_mask_of), else the node's bias (or None)
    mask: Any = None
    debug_mask: bool = False  # the node returns its attention weights (return_debug_mask)


_INT32_HALF = (2**31 - 1) // 2  # _cuda_backend.forward_unserved's size bound


def forward_eligible(call: AttentionForwardCall, *, cpu_route: bool = False) -> Decision:
    """Whether ``torch_sm90_sdpa::sdpa_forward`` can serve this forward node: the CPU path (the
    stock CPU kernel behind the op's layouts) when cpu_route, else the SM90 forward kernel
    (``_cuda_backend.forward_unserved``'s rules on metadata). What only the data pointers
    tell (a TMA-unreadable address) is left to the op, which then runs the stock forward."""
    backend, device = call.backend, call.device
    why = _route_reason(backend, STOCK_FORWARD_OPS, device, cpu_route)
    if why is not None:
        return why
    if not (isinstance(call.dropout_p, (int, float)) and call.dropout_p == 0):
        return _no(R_DROPOUT, f"dropout_p = {call.dropout_p}")
    if call.debug_mask:
        return _no(R_DEBUG_MASK, "return_debug_mask=True")
    q, k, v = call.q, call.k, call.v
    named = {"query": q, "key": k, "value": v}
    if not all(t is not None and hasattr(t, "dim") and t.dim() == 4 for t in named.values()):
        return _no(R_SHAPES, "q/k/v are not all 4-D tensors")
    if any(t.device != device for t in named.values()):
        return _no(R_DEVICE, "tensors on different devices")
    b, hq, hkv, sk = q.size(0), q.size(1), k.size(1), k.size(2)
    if not (_known(k.size(0) == b) and _known(v.size(0) == b) and _known(v.size(1) == hkv)
            and _known(v.size(2) == sk) and _known(k.size(3) == q.size(3))):
        return _no(R_SHAPES, f"q {_dims(q)}, k {_dims(k)}, v {_dims(v)}")
    if resolved_scale(call) is None:
        return _no(R_SCALE, f"scale {call.scale!r}")
    why = _mask_reason(call)
    if why is not None:
        return why
    if not _known(v.size(-1) == q.size(-1)):
        return _no(R_DV, f"D = {q.size(-1)}, Dv = {v.size(-1)}")
    if not (_known(hkv > 0) and _known(hq % hkv == 0)):
        return _no(R_HEADS, f"Hq = {hq}, Hkv = {hkv}")
    for name, t in named.items():
        if not _last_dim_contiguous(t):
            return _no(R_LAST_DIM, f"{name} has strides {tuple(t.stride())}")
    dtypes = [t.dtype for t in named.values()]
    if backend == "cpu_flash":
        if q.dtype not in CPU_DTYPES or any(d != q.dtype for d in dtypes):
            return _no(R_DTYPE, f"dtypes {[str(d) for d in dtypes]}")
        return ROUTE
    if q.dtype not in _extension.KERNEL_DTYPES or any(d != q.dtype for d in dtypes):
        return _no(R_DTYPE, f"dtypes {[str(d) for d in dtypes]}: the SM90 forward serves "
                            "float16 and bfloat16")
    head_dim = q.size(-1)
    if not isinstance(head_dim, int):
        return _no(R_HEAD_DIM_SYMBOLIC, f"head dim {head_dim}")
    capability = device_capability(device)
    if capability != (9, 0):
        return _no(R_NOT_SM90, f"compute capability {capability}")
    C = _extension.load()
    if C is None:
        return _no(R_NOT_BUILT, str(_extension.unavailable_reason()))
    has = getattr(C, "has_fwd_variant", None)
    if has is None or not has(head_dim, _extension.dtype_code(q.dtype)):
        return _no(R_VARIANT, f"no forward kernel for head dim {head_dim}, {q.dtype}")
    if not all(_known(x <= _INT32_HALF) for x in (b, hq, q.size(2), sk)):
        return _no(R_TOO_LARGE, f"q {_dims(q)}, k {_dims(k)}")
    return ROUTE
