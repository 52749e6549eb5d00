"""Eligibility: which SDPA backward calls the torch.compile rewrite hands to our op.

The rewrite (:mod:`torch_sm90_sdpa.compile_pass`) describes each stock backward node of a
compiled graph as an :class:`AttentionBackwardCall` (from the nodes' fake tensors) and asks
:func:`decide`. Everything here runs at compile time and sees only metadata: shapes,
strides, dtypes, devices (fake tensors, meta tensors, real tensors or :class:`TensorSpec`
all work, symbolic sizes too). Nothing installs a shape guard: a property that cannot be
proved for every size the graph serves (e.g. a symbolic stride that may be misaligned)
counts as not met.

What we serve on CUDA is the kernels' contract, stated once in C++
(``registration/bwd_device.cpp``, ``can_implement``) and asked here through ``_C`` with the
call's metadata (:func:`kernel_decision`): an SM90 GPU, fp16 / bf16, a compiled head dim,
Dv == D, Hq a multiple of Hkv, a contiguous last dim; under deterministic algorithms the
kernels' deterministic mode serves the call. Layouts its TMA cannot read (misaligned views, broadcast heads, padded rows) are
served too: the op copies those operands. The rest is about the stock node, not the kernel:

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

After the eligibility rules, :func:`decide` applies the speed gate (``only_faster``, on by
default): a CUDA call is routed only where our kernel measured faster than the stock
backward it replaces, on the call's GPU model (:func:`faster_than_stock`, :func:`gate_tables`).

Reasons are short stable strings (the keys of ``routing_stats()["not_routed"]``); the
details (which tensor, which stride) go to the log.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Sequence

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import _extension, _validation, _generated_speed_table as speed_table

# The kernels have a deterministic mode (dQ, and GQA dK / dV, added in a fixed order), so
# calls under torch.use_deterministic_algorithms(True) are served. Part of the routing
# fingerprint.
CUDA_DETERMINISTIC_SUPPORTED = True
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
R_SLOWER = "stock backward is faster here"

# The reasons an ineligible call can have, for documentation and the `info` command.
ALL_REASONS = (
    R_CPU_ROUTE_OFF, R_DEVICE, R_NOT_SM90, R_NESTED, R_DROPOUT, R_MASK, R_MASK_GRAD, R_SHAPES,
    R_DTYPE,
    R_HEAD_DIM_SYMBOLIC, R_DV, R_HEADS, R_NOT_BUILT, R_VARIANT,
    R_CAUSAL_ALIGN, R_LAST_DIM, R_TOO_LARGE, R_LSE, R_SCALE, R_OUTPUTS, R_LAYOUT, R_SLOWER,
)


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


@dataclass
class AttentionBackwardCall:
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

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def has_mask(self) -> bool:
        return self.mask is not None


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
    return statically_known_true(cond)


def _dims(t) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


@functools.lru_cache(maxsize=None)
def _capability_cached(index: int):
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def _name_cached(index: int) -> str:
    return torch.cuda.get_device_name(index)


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


def device_name(device: torch.device) -> Optional[str]:
    """The GPU model of a CUDA device (``torch.cuda.get_device_name``, e.g. "NVIDIA H200"), or
    None if there is no such device here. The speed gate picks its rows by it.

    Tests replace this function to describe a GPU this machine does not have."""
    return _query_cuda_device(device, _name_cached)


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
    major, minor = capability if capability is not None else (0, 0)
    problem = C.BwdProblem(
        batch=_hint(q.size(0)), heads_q=_hint(q.size(1)), heads_kv=_hint(k.size(1)),
        seqlen_q=_hint(q.size(2)), seqlen_k=_hint(k.size(2)), head_dim=q.size(-1),
        head_dim_v=v.size(-1), dtype=_extension.dtype_code(q.dtype, -1), is_causal=bool(is_causal),
        deterministic=bool(deterministic), cc_major=major, cc_minor=minor)
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", grad_out)):
        setattr(problem, name, _operand_layout(C, t, elem_bytes))
    # dq / dk / dv: what the op allocates (empty_like): dense, 16-byte aligned
    for name, t in (("dq", q), ("dk", k), ("dv", v)):
        setattr(problem, name, C.OperandLayout(batch_stride=8, head_stride=8, row_stride=8))
    if mask is not None:
        problem.mask_kind = MASK_KIND_CODES.get(mask.dtype, -1)
        problem.mask = _mask_view_layout(C, mask)
    return problem


def gqa_heads_per_cta(q, k, v, out, grad_out, *, is_causal: bool, deterministic: bool,
                      mask=None) -> int:
    """The q heads one main-kernel CTA walks for this call (the C++ rule, ``_C.workspace_layout``:
    the whole GQA group, of at most 4 q heads, when its kv heads' key blocks make enough CTAs,
    unmasked, not deterministic, ``TORCH_SM90_SDPA_GQA_WALK`` as read now (=1: any group); else
    1). 1 when ``_C`` is not built, and when the batch, head counts or key length are symbolic:
    the count is then not known for every size the graph serves. Shapes as
    :func:`kernel_decision`'s."""
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


# The speed gate's key lengths come from measurements: speed_table.ROWS (generated by
# tools/speed_table.py from benchmarks/bench_bwd.py and benchmarks/bench_masks.py runs on H200s
# and, since the twenty-third session, an H100; the files in benchmarks/results/, figures in
# BENCHMARKS.md). Per stock backend and head
# dim (and, unmasked, causal or full), a measured key length "passes" when every measured row of
# that case there (MHA and GQA; masked: every mask kind) had ours faster by at least
# MIN_SPEEDUP. A call is routed when the measured lengths on both sides of its key length pass
# (from a passing length up to the next one), or when it is at or past the longest measured
# length and that one passes; shorter than every measured length, between a passing and a
# failing one, or an unmeasured head dim: stock keeps the call.
MIN_SPEEDUP = 1.01  # spread between runs: about 1% from 8k keys, up to 7-8% at d128 below
# (the table keeps each case's slower run)
UNMASKED_CASES = ("causal", "full")  # bench_bwd's cases: is_causal or no mask


# The kernels' code paths a bench_bwd row times (row_path): MHA; a GQA call with fp32 dK / dV
# accumulators and one CTA per tile (too few kv-head key blocks to walk: MQA, short or
# small-batch calls); a GQA call whose CTAs walk their kv head's whole group of G q heads (dK /
# dV summed in registers, persistent CTAs), one path per G: a scheduling section's Q / dO grow
# with G (GQA 32/4, G = 8, measured 0.89-0.91x of cuDNN on an H100, where G = 4 and G = 2 were
# faster than cuDNN on both GPUs).
PATH_MHA, PATH_GQA_ACCUM = "mha", "gqa accumulated"


def path_gqa_walked(group: int) -> str:
    return f"gqa walked by groups of {group}"


def row_path(row) -> str:
    if not row["gqa"]:
        return PATH_MHA
    group = row.get("walk", 1)
    return path_gqa_walked(group) if group > 1 else PATH_GQA_ACCUM


def routed_lengths_from_table(rows, stock: str, masked: bool, case: Optional[str] = None,
                              paths: Optional[Sequence[str]] = None) -> dict:
    """{head dim: ((first, last), ...)}: the key-length ranges where every measured row is
    MIN_SPEEDUP faster, each from a passing measured length through the following passing ones
    (last None: through every longer length; the longest measured one passed). Rows of one case
    only when `case` is given; only the rows of these code paths (:func:`row_path`) when `paths`
    is given (an MHA call's gate is not held back by GQA rows, which time other code). A head
    dim without a passing length is absent."""
    by_dim: dict = {}
    for r in rows:
        if (r["stock"] == stock and r["masked"] == masked and case in (None, r["case"])
                and (paths is None or row_path(r) in paths)):
            by_dim.setdefault(r["head_dim"], []).append(r)
    out = {}
    for head_dim, rs in sorted(by_dim.items()):
        lengths = sorted({r["seqlen"] for r in rs})
        passes = [all(r["speedup"] >= MIN_SPEEDUP for r in rs if r["seqlen"] == s) for s in lengths]
        ranges, first = [], None
        for i, (seqlen, ok) in enumerate(zip(lengths, passes)):
            if ok and first is None:
                first = seqlen
            if first is not None and (not ok or i == len(lengths) - 1):
                ranges.append((first, None if ok else lengths[i - 1]))
                first = None
        if ranges:
            out[head_dim] = tuple(ranges)
    return out


def in_routed_lengths(seqlen, ranges) -> bool:
    """Whether the key length (an int, or a symbolic one: its whole range) lies in one of the
    ranges of routed_lengths_from_table."""
    return any(_known(seqlen >= first) and (last is None or _known(seqlen <= last))
               for first, last in ranges)


def describe_lengths(table: dict) -> str:
    """{64: ((512, None),), 128: ((1024, 2048), (4097, None))} -> 'd64 Sk >= 512; d128 Sk in
    1024..2048 or >= 4097' (the routed key lengths, for log lines and docs)."""
    def one(first, last):
        return f">= {first}" if last is None else f"in {first}..{last}"
    return "; ".join(f"d{d} Sk " + " or ".join(one(*r) for r in ranges)
                     for d, ranges in sorted(table.items())) or "no head dim"


# Per GPU model. The table's rows carry the GPU they were measured on (torch.cuda.get_device_name):
# H200 runs of the kernels that ship (bench_bwd.py --extra --dropin, synchronized and back to
# back, since 0769eb1) and two H100 runs of an older commit (7e8a75e, lower bounds there); the
# runs are listed in benchmarks/results/speed_table_runs.txt. A call is gated by the rows of its
# own GPU model; on a model the table has no rows of (say an H800, or an H100 PCIe), by every
# model's rows, so a length passes only where it passed on each. Each row keeps its slowest run.
# docs/ROUTING.md ("The speed gate") has what this routes on each GPU.
# FA2 (flash) and the memory-efficient backward were slower than ours on every row, so those
# nodes are always routed (also under deterministic algorithms, where they are torch's
# deterministic kernels, 1.5-3.4x slower than our deterministic mode).
MEASURED_DEVICES = tuple(sorted({r["device"] for r in speed_table.ROWS}))


def _family_rows(device: Optional[str], stock: str, masked: bool) -> list:
    """The rows of one stock backend, masked or not, that gate a call on GPU model `device`:
    those measured on it, or every model's where it has none (None: a model not measured)."""
    family = [r for r in speed_table.ROWS if r["stock"] == stock and r["masked"] == masked]
    return [r for r in family if r["device"] == device] or family


class GateTables(NamedTuple):
    """The routed key lengths of one GPU model ({head dim: ranges}, per case where unmasked)."""

    gqa: dict  # GQA calls with fp32 dK / dV accumulators (MQA, short or small-batch calls): every row
    mha: dict  # MHA calls (as many kv heads as q heads): the MHA rows
    masked: dict  # masked calls (mask broadcast over heads)


@functools.lru_cache(maxsize=None)
def gate_tables(device: Optional[str]) -> GateTables:
    """The speed gate of GPU model `device` (None: of a model the table has no rows of)."""
    rows = _family_rows(device, "cudnn", False)
    return GateTables(
        gqa={case: routed_lengths_from_table(rows, "cudnn", False, case) for case in UNMASKED_CASES},
        # MHA calls by the MHA rows alone: the GQA rows time other code paths (a CTA walking its
        # group, or fp32 dK / dV accumulators and one tile per CTA), and the MQA row at 8k keys
        # (0.98-0.99x in the twenty-second session's runs) kept d128 is_causal MHA calls at 8k
        # keys (1.04x or more in every run) on stock.
        mha={case: routed_lengths_from_table(rows, "cudnn", False, case, paths=(PATH_MHA,))
             for case in UNMASKED_CASES},
        masked=routed_lengths_from_table(_family_rows(device, "cudnn", True), "cudnn", True),
    )


# Every model's rows (what a GPU the table has no rows of gets; tests and docs read these).
FASTER_THAN_CUDNN_LENGTHS = gate_tables(None).gqa
MHA_FASTER_THAN_CUDNN_LENGTHS = gate_tables(None).mha
# the groups G of the table's walked GQA rows, any model's (walked_gqa_faster_than_cudnn_lengths)
WALKED_GROUPS = tuple(sorted({r["walk"] for r in speed_table.ROWS if r["gqa"] and r.get("walk", 1) > 1}))


# GQA calls whose CTAs walk groups of G q heads (gqa_heads_per_cta = G > 1) by the MHA rows and
# the rows walked by groups of G, where the table has such rows (d128 is_causal 8k: G = 2, GQA
# 16/8, 1.09x; G = 4, 32/8, 1.03-1.11x; G = 8, 32/4, 0.89-0.91x on an H100, walked by default
# until the twenty-fourth session, now only under TORCH_SM90_SDPA_GQA_WALK=1): the walk runs the
# MHA m-loop once per q head of the group with K / V loaded once, and stores dK / dV as MHA's.
# A group size the table has no row of keeps every row (as the GQA calls with accumulators,
# GateTables.gqa, the MQA row included). A model without rows of the group takes every model's
# rows of it beside its own MHA rows (the H100's runs have no group of 2: the compiled GPT's GQA
# 16/8 there is gated by the H200's walked rows and the H100's MHA rows).
@functools.lru_cache(maxsize=None)
def walked_gqa_faster_than_cudnn_lengths(group: int, device: Optional[str] = None) -> dict:
    """{case: {head dim: ranges}} of the GQA calls walked by groups of `group` q heads on GPU
    model `device` (None: a model the table has no rows of)."""
    if group not in WALKED_GROUPS:
        return gate_tables(device).gqa
    path = path_gqa_walked(group)
    rows = _family_rows(device, "cudnn", False)
    if not any(r["gqa"] and row_path(r) == path for r in rows):
        rows = rows + [r for r in _family_rows(None, "cudnn", False) if r["gqa"] and row_path(r) == path]
    return {case: routed_lengths_from_table(rows, "cudnn", False, case, paths=(PATH_MHA, path))
            for case in UNMASKED_CASES}


# Masked calls (bench_masks.py --fill cudnn: causal, padding, sliding-window and document masks
# broadcast over heads, as torch hands them to cuDNN): ours skips the tiles a mask hides (also
# under torch's finite -65504 fill, by score bounds), cuDNN's masked kernel applies it densely;
# at commit 906fb27 (partial tiles as bits) 1.59x and more from 1k keys at d64, 1.66x at d128,
# 1.83x at d256 -> {64: 1024, 128: 1024, 256: 1024} (before it, d64 was 0.70-0.89x at 1k).
# The memory-efficient masked backward is slower than cuDNN's (issue 7: 23.0 vs 9.6 ms at
# d128 s8192), so these thresholds serve its nodes too. A mask that hides
# nothing costs ours more than cuDNN's dense masked kernel (17.1 vs 9.2 ms in a d128 step when
# no tile could be skipped), and per-head biases (ALiBi, relative positions) are dense in
# practice: only masks broadcast over heads are routed.
MASKED_FASTER_LENGTHS = gate_tables(None).masked


def _broadcast_over_heads(mask) -> bool:
    """The mask's head dim ([B, H, Sq, Sk] broadcasting) has size 1 or stride 0 (or is absent)."""
    if mask.dim() < 3:
        return True
    d = mask.dim() - 3
    return _known(mask.size(d) == 1) or _known(mask.stride(d) == 0)


def gate_device(device: torch.device) -> Optional[str]:
    """The GPU model whose rows gate calls on `device`: its name when the table has rows of it,
    else None (every model's rows)."""
    name = device_name(device)
    return name if name in MEASURED_DEVICES else None


def _measured_on(model: Optional[str]) -> str:
    return f"on {model}" if model is not None else "on every GPU measured"


def _masked_faster_than_stock(call: AttentionBackwardCall, model: Optional[str]) -> Decision:
    head_dim, seqlen_k = call.q.size(-1), call.k.size(2)
    if not _broadcast_over_heads(call.mask):
        return _no(R_SLOWER, f"per-head attn_mask {_dims(call.mask)}: dense in practice (ALiBi, "
                             "relative positions), where the stock masked kernel is faster; "
                             "enable(only_faster=False) routes it anyway")
    lengths = gate_tables(model).masked
    if in_routed_lengths(seqlen_k, lengths.get(head_dim, ())):
        return ROUTE
    return _no(R_SLOWER, f"masked call with head dim {head_dim}, Sk = {seqlen_k}: ours measured "
                         f"faster {_measured_on(model)} only for {describe_lengths(lengths)}; "
                         "enable(only_faster=False) routes it anyway")


def faster_than_stock(call: AttentionBackwardCall) -> Decision:
    """The speed gate: route only where our kernel measured faster than the stock one, on the
    call's GPU model (:func:`gate_tables`)."""
    model = gate_device(call.device)
    if call.has_mask:
        return _masked_faster_than_stock(call, model)
    if call.backend != "cudnn":
        return ROUTE  # flash / efficient: see the comment above MEASURED_DEVICES
    head_dim = call.q.size(-1)
    case = "causal" if call.is_causal else "full"
    seqlen_k = call.k.size(2)
    mha = _known(call.q.size(1) == call.k.size(1))  # (symbolic head counts: GQA's gate)
    group = 1 if mha else gqa_heads_per_cta(
        call.q, call.k, call.v, call.out, call.grad_out, is_causal=call.is_causal,
        deterministic=call.deterministic)
    if mha:
        kind, lengths = "MHA", gate_tables(model).mha[case]
    elif group > 1:
        kind, lengths = (f"GQA walked by groups of {group}",
                         walked_gqa_faster_than_cudnn_lengths(group, model)[case])
    else:
        kind, lengths = "GQA", gate_tables(model).gqa[case]
    if in_routed_lengths(seqlen_k, lengths.get(head_dim, ())):
        return ROUTE
    return _no(R_SLOWER, f"cuDNN measured faster {_measured_on(model)} for head dim {head_dim}, "
                         f"{case}, {kind}, Sk = {seqlen_k} (ours is faster only for {case} {kind}: "
                         f"{describe_lengths(lengths)}); enable(only_faster=False) routes it anyway")


def decide(call: AttentionBackwardCall, *, cpu_route: bool = False,
           only_faster: bool = True) -> Decision:
    """Whether the rewrite replaces this call by ``torch_sm90_sdpa::sdpa_backward``.

    only_faster: also require that our kernel measured faster than the stock backward this
    node would run (:func:`faster_than_stock`); the CPU route has no such gate."""
    backend = call.backend
    if backend not in STOCK_BACKWARD_OPS:
        return _no(R_DEVICE, f"unknown backend {backend!r}")
    device = call.device
    if backend == "cpu_flash":
        if not cpu_route:
            return _no(R_CPU_ROUTE_OFF, "CPU route off (enable(cpu=True) serves CPU calls)")
        if device.type != "cpu":
            return _no(R_DEVICE, f"CPU op on device {device}")
    elif device.type != "cuda":
        return _no(R_DEVICE, f"device {device} is not served")
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
    verdict = kernel_decision(q, k, v, out, go, is_causal=call.is_causal,
                              deterministic=call.deterministic,
                              capability=device_capability(device), mask=call.mask)
    if not verdict.routed:
        return verdict
    if only_faster:
        gate = faster_than_stock(call)
        if not gate.routed:
            return gate
    return verdict


def describe(call: AttentionBackwardCall) -> str:
    """A one-line description for the log: shapes, dtype, device, causal, mask."""
    q, k = call.q, call.k
    gqa = "" if _known(q.size(1) == k.size(1)) else f", GQA {q.size(1)}/{k.size(1)}"
    mask = ""
    if call.mask is not None and hasattr(call.mask, "shape"):
        mask = f", mask {_dims(call.mask)} {str(call.mask.dtype).replace('torch.', '')}"
    return (f"q {_dims(q)} k {_dims(k)} {str(q.dtype).replace('torch.', '')} on {q.device}"
            f"{', causal' if call.is_causal else ''}{gqa}{mask}")


def policy_fingerprint() -> tuple:
    """What, besides this package's sources, decides routing: part of the pass's uuid()."""
    info = _extension.build_info()
    caps: Sequence = ()
    models: Sequence = ()
    try:
        # Only once CUDA is initialized (never initialize it here): a CUDA graph cannot be
        # compiled before, since Dynamo traces real CUDA tensors.
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
            caps = tuple(device_capability(d) for d in devices)
            models = tuple(gate_device(d) for d in devices)  # the gate's rows follow the model
    except Exception:
        caps = ("unknown",)
    return (
        tuple(sorted((str(k), repr(v)) for k, v in info.items())),
        caps,
        CUDA_DETERMINISTIC_SUPPORTED,
        tuple(_gate_fingerprint(m) for m in sorted(set(models) | {None}, key=str)),
        # the GQA walk (and so the gate of GQA calls) follows this switch, read at compile time
        os.environ.get("TORCH_SM90_SDPA_GQA_WALK", ""),
    )


def _gate_fingerprint(model: Optional[str]) -> tuple:
    tables = gate_tables(model)
    return (
        model,
        sorted((case, sorted(t.items())) for case, t in tables.gqa.items()),
        sorted((case, sorted(t.items())) for case, t in tables.mha.items()),
        [(g, sorted((case, sorted(t.items()))
                    for case, t in walked_gqa_faster_than_cudnn_lengths(g, model).items()))
         for g in WALKED_GROUPS],
        sorted(tables.masked.items()),
    )
