"""The CUDA op body in Python, over the typed binding of the device layer (``_C``).

The CUDA kernel of ``sdpa_backward`` is normally C++ (registration/torch_op.cpp, registered
through torch's stable ABI). This module does the same steps in Python: it is the fallback
registration where the C++ one is not possible, the "lean Python path" that
``benchmarks/host_overhead.py`` measures against it, and the helpers of the tests of the
pre/post kernels.

    sdpa_backward_python(grad_out, q, k, v, out, lse, is_causal, scale, deterministic)
        -> (dq, dk, dv)
    problem_of(grad_out, q, k, v, out, lse, is_causal, deterministic, dq, dk, dv) -> _C.BwdProblem
    make_params(grad_out, q, k, v, out, lse, is_causal=False, scale=1.0, deterministic=False,
                dq=None, dk=None, dv=None, gqa_accum=None) -> (params, Workspace)
    run_preprocess(params) / run_postprocess(params) / run_backward(params)   current stream
    forward_unserved(q, k, v, is_causal, attn_mask) -> None, or why the SM90 forward kernel
        does not serve the call
    sdpa_forward_cuda(q, k, v, is_causal, scale, attn_mask) -> (out, lse)   the SM90 forward
        kernel

Shapes: q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv], out / grad_out
[B, Hq, Sq, Dv], lse fp32 [B, Hq, Sq]; any strides with a contiguous last dim.
"""
from __future__ import annotations

import functools
import logging
import math
import os
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from . import _extension, eligibility
from ._problem import bwd_problem, dense_layout
from .reference import expand_mask


class Workspace(NamedTuple):
    """The fp32 workspaces of csrc/bwd_params.h, views of one allocation laid out by the
    device layer (_C.workspace_layout)."""

    dpsum: Tensor  # [B, Hq, Sq_rounded]
    lse_log2: Tensor  # [B, Hq, Sq_rounded]
    dq_accum: Tensor  # [B, Hq, Sq_rounded, D]
    dk_accum: Optional[Tensor]  # [B, Hkv, Sk_rounded, D] (GQA with one q head per CTA only)
    dv_accum: Optional[Tensor]  # [B, Hkv, Sk_rounded, Dv] (same)
    buffer: Tensor  # the allocation they live in


def _module():
    mod = _extension.load()
    if mod is None:
        raise RuntimeError(
            "torch_sm90_sdpa: the SM90 CUDA kernels are not available: "
            f"{_extension.unavailable_reason()}"
        )
    return mod


def _round(n: int, r: int) -> int:
    return (n + r - 1) // r * r


def _layout(C, t: Optional[Tensor]):
    if t is None:
        return dense_layout(C)
    return C.OperandLayout.of(t.stride(), t.data_ptr())


def mask_view(attn_mask: Tensor, q: Tensor, k: Tensor) -> Tensor:
    """attn_mask as the [B, Hq, Sq, Sk] view the kernels read (stride 0 on broadcast dims)."""
    return expand_mask(attn_mask, q.size(0), q.size(1), q.size(2), k.size(2))


def problem_of(grad_out, q, k, v, out, lse, is_causal=False, deterministic=False, dq=None,
               dk=None, dv=None, attn_mask=None):
    """The device layer's _C.BwdProblem of these tensors (with the device's capability)."""
    C = _module()
    cc = torch.cuda.get_device_capability(q.device) if q.is_cuda else (9, 0)
    # (the SM count plans the split tail: the persistent grid; 0 off the GPU plans none)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 0
    layouts = {name: _layout(C, t) for name, t in (
        ("q", q), ("k", k), ("v", v), ("out", out), ("dout", grad_out), ("lse", lse),
        ("dq", dq), ("dk", dk), ("dv", dv))}
    if attn_mask is not None:
        view = mask_view(attn_mask, q, k)
        layouts["mask"] = C.OperandLayout.of(view.stride(), view.data_ptr())
    return bwd_problem(C, q, k, v, layouts, is_causal=is_causal, deterministic=deterministic,
                       capability=cc, num_sms=sms, mask=attn_mask)


def _workspace(C, problem, device, gqa_accum: Optional[bool]) -> Workspace:
    """The fp32 workspace of `problem` (uninitialized: the preprocess writes all of it), as
    laid out by the device layer. gqa_accum overrides whether dk_accum / dv_accum exist (tests
    of the postprocess): an MHA problem then gets them appended to the allocation."""
    B, Hq, Hkv = problem.batch, problem.heads_q, problem.heads_kv
    D, Dv = problem.head_dim, problem.head_dim_v
    Sqr, Skr = _round(problem.seqlen_q, C.SEQ_ROUND), _round(problem.seqlen_k, C.SEQ_ROUND)
    w = C.workspace_layout(problem)
    want = w.gqa if gqa_accum is None else bool(gqa_accum)
    kv_heads = Hq if (w.gqa and problem.deterministic) else Hkv  # per q head when deterministic
    nbytes, dk_off, dv_off = w.bytes, w.dk_accum, w.dv_accum
    if want and not w.gqa:
        dk_off, dv_off = nbytes, nbytes + 4 * B * Hkv * Skr * D
        nbytes = dv_off + 4 * B * Hkv * Skr * Dv
    buf = torch.empty(nbytes // 4, dtype=torch.float32, device=device)

    def view(off, *shape):
        n = 1
        for s in shape:
            n *= s
        return buf[off // 4: off // 4 + n].view(*shape)

    return Workspace(
        dpsum=view(w.dpsum, B, Hq, Sqr),
        lse_log2=view(w.lse_log2, B, Hq, Sqr),
        dq_accum=view(w.dq_accum, B, Hq, Sqr, D),
        dk_accum=view(dk_off, B, kv_heads, Skr, D) if want else None,
        dv_accum=view(dv_off, B, kv_heads, Skr, Dv) if want else None,
        buffer=buf,
    )


def make_params(grad_out, q, k, v, out, lse, is_causal=False, scale=1.0, deterministic=False,
                dq=None, dk=None, dv=None, gqa_accum: Optional[bool] = None):
    """A filled ``_C.BwdParams`` and its workspace (tests of the pre/post kernels).

    gqa_accum: use dk_accum and dv_accum (default: GQA whose CTAs take one q head each, i.e.
    the workspace layout's ``gqa``; a CTA that walks its group needs none). Outputs left None are null
    pointers. Keep the returned Workspace alive until the kernels ran."""
    C = _module()
    problem = problem_of(grad_out, q, k, v, out, lse, is_causal, deterministic, dq, dk, dv)
    ws = _workspace(C, problem, q.device, gqa_accum)
    ptrs = C.BwdPointers(
        q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), out=out.data_ptr(),
        dout=grad_out.data_ptr(), lse=lse.data_ptr(),
        dq=dq.data_ptr() if dq is not None else 0, dk=dk.data_ptr() if dk is not None else 0,
        dv=dv.data_ptr() if dv is not None else 0, workspace=ws.buffer.data_ptr())
    params = C.make_params(problem, ptrs, float(scale))
    params.dk_accum = ws.dk_accum.data_ptr() if ws.dk_accum is not None else 0
    params.dv_accum = ws.dv_accum.data_ptr() if ws.dv_accum is not None else 0
    return params, ws


def _stream(device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _run(fn_name: str, params, device) -> None:
    C = _module()
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    with torch.cuda.device(device):
        getattr(C, fn_name)(params, _stream(device))


def run_preprocess(params, device=None) -> None:
    _run("preprocess", params, device)


def run_postprocess(params, device=None) -> None:
    _run("postprocess", params, device)


def run_backward(params, device=None) -> None:
    _run("run", params, device)


def tile_classes(attn_mask, q, k, is_causal=False, lse=None, scale=1.0, ranges=False,
                 bounds=False, bits=False, lse_log2=False):
    """The mask classification kernel's verdict on this mask for q / k's problem (tests):
    uint8 [mask_batch, mask_heads, n_blocks, m_blocks], 0 empty, 1 partial (mask read per
    element), 2 full, 3 partial as bits (every entry hidden or a zero bias), 4 partial in an
    m-block that holds a row of the clamped fill only (bf16 / fp32 masks; see lse_log2).
    lse [B, Hq, Sq] (default zeros) and scale enter the score bounds of additive masks (the
    preprocess runs first, as in the backward). ranges=True: also the int32
    [mask_batch, mask_heads, n_blocks, 2] non-empty m-block ranges (BwdParams::tile_m_range).
    bounds=True (additive masks): also the score bounds (q_norm_max, lse_min, k_norm_max), each
    [mask_batch, mask_heads, m_blocks or n_blocks] float32. bits=True: also the visibility
    bits the classification wrote for the class-3 tiles, bool [mask_batch, mask_heads, n_blocks,
    m_blocks, tile_m, tile_n] (meaningful on class-3 tiles only: the rest is never written).
    lse_log2=True: also the int32 bits of the lse_log2 the main kernel would read, [B, Hq, Sq]:
    lse * log2(e) as the preprocess wrote it, or, for a row that sees only the clamped fill of
    a bf16 / fp32 mask, 0xFFC00000 | its fill's key count (csrc/numeric.h fill_row_lse_log2)."""
    C = _module()
    v, out = k, q
    lse = torch.zeros(q.shape[:3], device=q.device) if lse is None else lse
    problem = problem_of(q, q, k, v, out, lse, is_causal, attn_mask=attn_mask)
    layout = C.workspace_layout(problem)
    ws = torch.empty(layout.bytes, dtype=torch.uint8, device=q.device)
    ptrs = C.BwdPointers(q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), out=out.data_ptr(),
                         dout=q.data_ptr(), lse=lse.data_ptr(), mask=attn_mask.data_ptr(),
                         workspace=ws.data_ptr())
    params = C.make_params(problem, ptrs, float(scale))
    with torch.cuda.device(q.device):
        C.preprocess(params, _stream(q.device))
        C.classify(params, _stream(q.device))
    start = params.tile_class - ws.data_ptr()
    n = params.mask_batch * params.mask_heads * params.num_n_blocks * params.num_m_blocks
    classes = ws[start:start + n].view(params.mask_batch, params.mask_heads, params.num_n_blocks,
                                       params.num_m_blocks).clone()
    out = [classes]
    inst = (params.mask_batch, params.mask_heads)
    if ranges:
        count = 2 * params.mask_batch * params.mask_heads * params.num_n_blocks
        pairs = ws[layout.tile_m_range:layout.tile_m_range + 4 * count].view(torch.int32)
        out.append(pairs.view(*inst, params.num_n_blocks, 2).clone())
    if bounds:
        nm, nn = params.num_m_blocks, params.num_n_blocks
        n_inst = params.mask_batch * params.mask_heads
        f = ws[layout.score_bounds:layout.score_bounds + 4 * n_inst * (2 * nm + nn)].view(torch.float32)
        out.append((f[:n_inst * nm].view(*inst, nm).clone(),
                    f[n_inst * nm:2 * n_inst * nm].view(*inst, nm).clone(),
                    f[2 * n_inst * nm:].view(*inst, nn).clone()))
    if bits:
        tm, tn = params.tile_m, params.tile_n
        raw = ws[layout.tile_bits:layout.tile_bits + n * tm * tn // 8]
        shifts = torch.arange(8, device=ws.device, dtype=torch.uint8)
        unpacked = (raw[:, None] >> shifts) & 1  # byte i holds keys 8 (i % (tn / 8)) + 0..7
        out.append(unpacked.bool().view(*inst, params.num_n_blocks, params.num_m_blocks, tm, tn))
    if lse_log2:
        B, Hq, Sq = q.shape[:3]
        rows = _round(Sq, C.SEQ_ROUND)
        raw = ws[layout.lse_log2:layout.lse_log2 + 4 * B * Hq * rows].view(torch.int32)
        out.append(raw.view(B, Hq, rows)[..., :Sq].clone())
    return out[0] if len(out) == 1 else tuple(out)


def sdpa_backward_python(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                         lse: Tensor, is_causal: bool, scale: float, deterministic: bool,
                         attn_mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """The CUDA op body of registration/torch_op.cpp, in Python (the caller validated the
    arguments): ask the contract, allocate, copy what TMA cannot read, run."""
    C = _module()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    problem = problem_of(grad_out, q, k, v, out, lse, is_causal, deterministic, dq, dk, dv,
                         attn_mask)
    decision = C.can_implement(problem)
    if decision.verdict == "unsupported":
        raise RuntimeError(f"torch_sm90_sdpa::sdpa_backward on CUDA: {decision.reason}: "
                           f"{decision.detail}")
    if decision.verdict == "empty":
        return dq.zero_(), dk.zero_(), dv.zero_()
    operands = {"q": q, "k": k, "v": v, "dout": grad_out}
    for name in decision.copy:  # views TMA cannot address: a fresh dense copy
        operands[name] = operands[name].clone()
        setattr(problem, name, _layout(C, operands[name]))
    ws = torch.empty(C.workspace_layout(problem).bytes // 4, dtype=torch.float32,
                     device=q.device)
    ptrs = C.BwdPointers(
        q=operands["q"].data_ptr(), k=operands["k"].data_ptr(), v=operands["v"].data_ptr(),
        out=out.data_ptr(), dout=operands["dout"].data_ptr(), lse=lse.data_ptr(),
        dq=dq.data_ptr(), dk=dk.data_ptr(), dv=dv.data_ptr(),
        mask=attn_mask.data_ptr() if attn_mask is not None else 0, workspace=ws.data_ptr())
    with torch.cuda.device(q.device):
        C.run(C.make_params(problem, ptrs, float(scale)), _stream(q.device))
    # `ws` and the copies are freed here: the caching allocator reuses them only in stream
    # order, after the kernels just queued on this stream.
    return dq, dk, dv


# ---- the forward ---------------------------------------------------------------------------

_LOG2E = 1.4426950408889634
_INT32_MAX = 2**31 - 1


def forward_unserved(q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False,
                     attn_mask: Optional[Tensor] = None) -> Optional[str]:
    """None when the SM90 forward kernel serves this call (q [B, Hq, Sq, D], k / v
    [B, Hkv, Sk, D], attn_mask broadcastable to [B, Hq, Sq, Sk]), else a short reason."""
    if attn_mask is not None:
        if attn_mask.dtype not in _extension.MASK_KIND_CODES:
            return f"attn_mask dtype {attn_mask.dtype}"
        if not attn_mask.is_cuda or attn_mask.device != q.device:
            return "attn_mask not on q's device"
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        return "not CUDA tensors"
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return "dtype"
    if v.size(-1) != q.size(-1):
        return "Dv != D"
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        return "an empty size"
    if q.size(1) % k.size(1) != 0:
        return "Hq not a multiple of Hkv"
    if eligibility.device_capability(q.device) != (9, 0):  # (cached per device)
        return "not an SM90 GPU"
    C = _extension.load()
    has = getattr(C, "has_fwd_variant", None)  # (None: no _C, or one built before the forward)
    if has is None or not has(q.size(-1), _extension.dtype_code(q.dtype)):
        return "head dim not compiled"
    if max(q.size(0), q.size(1), q.size(2), k.size(2)) > _INT32_MAX // 2:
        return "sizes exceed the kernel's int32 indexing"
    elem = q.element_size()
    for name, t, heads, rows in (("q", q, q.size(1), q.size(2)), ("k", k, k.size(1), k.size(2)),
                                 ("v", v, v.size(1), v.size(2))):
        if t.stride(-1) != 1:
            return f"{name}: last dim not contiguous"
        if not C.tma_addressable(C.OperandLayout.of(t.stride(), t.data_ptr()), elem, q.size(0),
                                 heads, rows):
            return f"{name}: strides or address TMA cannot read"
    return None


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# 0 by default: with a slack the block max's own P is 2^(up to slack) instead of exactly 1, and
# its bf16 rounding (2^-9 relative) lands on the row's heaviest weight. With slack 8 a test case
# (d192, 333 queries, 200 keys) has 2.7x stock's error of float64 (5.7e-3 against 2.1e-3);
# docs/FORWARD.md has the precision and speed of each (slack 0: 0.96-1.05x slack 8's at d128).
_DEFAULT_RESCALE_SLACK = 0.0


@functools.lru_cache(maxsize=8)
def rescale_slack(value: Optional[str]) -> float:
    """FwdParams::rescale_slack from TORCH_SM90_SDPA_FWD_RESCALE_SLACK (read per call, an A/B
    switch): a row's reference max moves when a block passes it by more than this many log2
    units, so P stays below 2^slack, which fp16's P holds up to 8. Unset: 0; a number is clamped
    to [0, 8]; anything else (nan included) gives 0 with a warning (once per value)."""
    if value is None:
        return _DEFAULT_RESCALE_SLACK
    try:
        slack = float(value)
    except ValueError:
        slack = math.nan
    if math.isnan(slack):
        logging.getLogger("torch_sm90_sdpa").warning(
            "TORCH_SM90_SDPA_FWD_RESCALE_SLACK=%r is not a number: the forward uses %g",
            value, _DEFAULT_RESCALE_SLACK)
        return _DEFAULT_RESCALE_SLACK
    return min(max(slack, 0.0), 8.0)


def sdpa_forward_cuda(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float,
                      attn_mask: Optional[Tensor] = None):
    """(out, lse) of a call forward_unserved() accepts, from the SM90 forward kernel: out like
    torch.empty_like(q), lse [B, Hq, Sq] fp32 (natural log; -inf and out 0 for a row that sees
    no key). With a mask, the mask classification runs first (FwdParams' mask fields)."""
    C = _module()
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    if not scale > 0:
        # the kernel takes scale > 0 (it folds the scale into the exponent after the row max):
        # scale * q k = (-scale) * (-q) k, and scale 0 gives what zero scores give (both exact)
        q, scale = (-q, -scale) if scale < 0 else (torch.zeros_like(q), 1.0)
    p = C.FwdParams()
    p.batch, p.heads_q, p.seqlen_q, p.head_dim = q.size(0), q.size(1), q.size(2), q.size(3)
    p.heads_kv, p.seqlen_k = k.size(1), k.size(2)
    p.dtype = _extension.dtype_code(q.dtype)
    p.scale_log2 = float(scale) * _LOG2E
    p.is_causal = bool(is_causal)
    # (read per call: an A/B switch of the two kernels, FwdParams::overlap). The overlapping
    # kernel by default: in bench_fwd (d64-d256, 2k / 8k keys; H100, 2eb58ab / 50b2d61) it was
    # level with the in-turn one at d64 2k and 3-18% faster on every other row
    p.overlap = os.environ.get("TORCH_SM90_SDPA_FWD_OVERLAP", "1") != "0"
    # persistent CTAs, one per SM (FwdParams::persistent; read per call, an A/B switch too)
    p.persistent = os.environ.get("TORCH_SM90_SDPA_FWD_PERSISTENT", "1") != "0"
    p.rescale_slack = rescale_slack(os.environ.get("TORCH_SM90_SDPA_FWD_RESCALE_SLACK"))
    p.num_sms = _num_sms(q.device)
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        setattr(p, name, t.data_ptr())
        setattr(p, f"{name}_batch_stride", t.stride(0))
        setattr(p, f"{name}_head_stride", t.stride(1))
        setattr(p, f"{name}_row_stride", t.stride(2))
    p.lse = lse.data_ptr()
    p.lse_batch_stride, p.lse_head_stride = lse.stride(0), lse.stride(1)
    workspace = None
    if attn_mask is not None:
        view = mask_view(attn_mask, q, k)  # [B, Hq, Sq, Sk], stride 0 on broadcast dims
        p.mask_kind = _extension.MASK_KIND_CODES[attn_mask.dtype]
        p.mask = view.data_ptr()
        (p.mask_batch_stride, p.mask_head_stride, p.mask_row_stride,
         p.mask_col_stride) = view.stride()
        p.mask_batch = q.size(0) if view.stride(0) != 0 else 1
        p.mask_heads = q.size(1) if view.stride(1) != 0 else 1
        nbytes = C.fwd_mask_workspace_bytes(p.mask_batch, p.mask_heads, q.size(2), k.size(2))
        workspace = torch.empty(nbytes, dtype=torch.uint8, device=q.device)
        p.mask_workspace = workspace.data_ptr()
    with torch.cuda.device(q.device):
        C.run_fwd(p, _stream(q.device))
    # (`workspace` is freed here: the caching allocator reuses it only in stream order)
    return out, lse
