"""CUDA implementation of ``sdpa_backward``: fills ``_C.BwdParams`` and launches the SM90
kernels of ``_C`` on the current stream of the inputs' device.

    sdpa_backward_cuda(grad_out, q, k, v, out, lse, is_causal, scale, deterministic)
        -> (dq, dk, dv)

Helpers for tests and benchmarks that exercise the pre/post kernels alone:

    tma_compatible(t) -> bool              can the main kernel's TMA read t as it is

    make_params(grad_out, q, k, v, out, lse, is_causal=False, scale=1.0, deterministic=False,
                dq=None, dk=None, dv=None, gqa_accum=None) -> (params, Workspace)
    run_preprocess(params, device=None)    _C.preprocess on the current stream
    run_postprocess(params, device=None)   _C.postprocess on the current stream
    run_backward(params, device=None)      _C.backward on the current stream

Shapes: q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv], out / grad_out
[B, Hq, Sq, Dv], lse fp32 [B, Hq, Sq]; any strides with a contiguous last dim (the caller
validated them). No synchronization, no per-call imports.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from . import _extension

LOG2E = math.log2(math.e)
_DTYPE_CODE = _extension._CODE_BY_DTYPE  # one table: the integer codes of _C.BwdParams.dtype


class Workspace(NamedTuple):
    """The fp32 workspaces of csrc/bwd_params.h, views of one allocation."""

    dsum: Tensor  # [B, Hq, Sq_rounded]
    lse_log2: Tensor  # [B, Hq, Sq_rounded]
    dq_accum: Tensor  # [B, Hq, Sq_rounded, D]
    dk_accum: Optional[Tensor]  # [B, Hkv, Sk_rounded, D] (GQA only)
    dv_accum: Optional[Tensor]  # [B, Hkv, Sk_rounded, Dv] (GQA only)
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


def tma_compatible(t: Tensor) -> bool:
    """Whether the main kernel's TMA can address t [B, H, S, D] (2-byte elements) as it is:
    a 16-byte aligned base, and every batch/head/row mode of more than one element with a
    positive stride that is a multiple of 8 elements."""
    if t.data_ptr() % 16:
        return False
    st, sz = t.stride(), t.shape
    for i in (0, 1, 2):
        if sz[i] > 1 and (st[i] <= 0 or st[i] % 8):
            return False
    return True


def _fast_ok(ptr: int, st) -> bool:
    # sufficient for tma_compatible, cheap: aligned base, all three strides positive
    # multiples of 8
    return not (ptr & 15) and not ((st[0] | st[1] | st[2]) & 7) and min(st[0], st[1], st[2]) > 0


def _operand(t: Tensor):
    """(tensor, data_ptr, strides) of t, or of a TMA-compatible copy of it."""
    ptr, st = t.data_ptr(), t.stride()
    if _fast_ok(ptr, st) or tma_compatible(t):
        return t, ptr, st
    # a fresh allocation (clone, not contiguous(): a contiguous tensor may be misaligned)
    c = t.clone(memory_format=torch.contiguous_format)
    return c, c.data_ptr(), c.stride()


def _workspace_sizes(B, Hq, Hkv, Sq, Sk, D, Dv, gqa, seq_round):
    Sqr, Skr = _round(Sq, seq_round), _round(Sk, seq_round)
    n_dq = B * Hq * Sqr * D
    n_dk = B * Hkv * Skr * D if gqa else 0
    n_dv = B * Hkv * Skr * Dv if gqa else 0
    n_row = B * Hq * Sqr
    # every piece starts at a multiple of seq_round floats (512 bytes): 16-byte aligned
    return Sqr, Skr, n_dq, n_dk, n_dv, n_row


def alloc_workspace(B, Hq, Hkv, Sq, Sk, D, Dv, gqa: bool, device) -> Workspace:
    """Allocate the fp32 workspaces (uninitialized: the preprocess writes all of them)."""
    C = _module()
    Sqr, Skr, n_dq, n_dk, n_dv, n_row = _workspace_sizes(
        B, Hq, Hkv, Sq, Sk, D, Dv, gqa, C.SEQ_ROUND)
    buf = torch.empty(n_dq + n_dk + n_dv + 2 * n_row, dtype=torch.float32, device=device)
    o = 0
    dq_accum = buf[o:o + n_dq].view(B, Hq, Sqr, D)
    o += n_dq
    dk_accum = dv_accum = None
    if gqa:
        dk_accum = buf[o:o + n_dk].view(B, Hkv, Skr, D)
        o += n_dk
        dv_accum = buf[o:o + n_dv].view(B, Hkv, Skr, Dv)
        o += n_dv
    dsum = buf[o:o + n_row].view(B, Hq, Sqr)
    o += n_row
    lse_log2 = buf[o:o + n_row].view(B, Hq, Sqr)
    return Workspace(dsum, lse_log2, dq_accum, dk_accum, dv_accum, buf)


def make_params(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    is_causal: bool = False,
    scale: float = 1.0,
    deterministic: bool = False,
    dq: Optional[Tensor] = None,
    dk: Optional[Tensor] = None,
    dv: Optional[Tensor] = None,
    gqa_accum: Optional[bool] = None,
    workspace: Optional[Workspace] = None,
):
    """A filled ``_C.BwdParams`` and its workspaces (allocated unless given).

    gqa_accum: allocate / use dk_accum and dv_accum (default: Hq != Hkv). Outputs left None
    are null pointers. Keep the returned Workspace alive until the kernels ran."""
    C = _module()
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    Dv = v.shape[3]
    if gqa_accum is None:
        gqa_accum = Hq != Hkv
    if workspace is None:
        workspace = alloc_workspace(B, Hq, Hkv, Sq, Sk, D, Dv, gqa_accum, q.device)

    def tp(t):
        return (0, (0, 0, 0)) if t is None else (t.data_ptr(), t.stride())

    ws = workspace
    p = C.BwdParams()
    p.assign(
        B, Hq, Hkv, Sq, Sk, D, Dv, _DTYPE_CODE[q.dtype], float(scale), bool(is_causal),
        bool(deterministic),
        *tp(q), *tp(k), *tp(v), *tp(out), *tp(grad_out), *tp(lse), *tp(dq), *tp(dk), *tp(dv),
        ws.dsum.data_ptr(), ws.lse_log2.data_ptr(), ws.dq_accum.data_ptr(),
        ws.dk_accum.data_ptr() if ws.dk_accum is not None else 0,
        ws.dv_accum.data_ptr() if ws.dv_accum is not None else 0,
    )
    return p, workspace


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
    _run("backward", params, device)


def sdpa_backward_cuda(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    is_causal: bool,
    scale: float,
    deterministic: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    Dv = v.shape[3]
    if B == 0 or Hq == 0 or Hkv == 0 or Sq == 0 or Sk == 0:
        # nothing to launch: no queries -> dk = dv = 0; no keys -> dq = 0 (dk, dv are empty)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if D == 0 or Dv == 0:
        raise ValueError("torch_sm90_sdpa: head dim 0 is not supported by the CUDA kernels")
    C = _C if _C is not None else _init()
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    gqa = Hq != Hkv
    # The main kernel reads q, k, v, grad_out (and, without GQA, writes dk, dv) through TMA;
    # views it cannot address (odd offsets or strides, expanded heads) go through copies.
    q_, qp, qs = _operand(q)
    k_, kp, ks = _operand(k)
    v_, vp, vs = _operand(v)
    do_, dop, dos = _operand(grad_out)
    dk_, dkp, dks = dk, dk.data_ptr(), dk.stride()
    dv_, dvp, dvs = dv, dv.data_ptr(), dv.stride()
    if not gqa:
        if not _fast_ok(dkp, dks) and not tma_compatible(dk):
            dk_ = torch.empty(dk.shape, dtype=dk.dtype, device=dk.device)
            dkp, dks = dk_.data_ptr(), dk_.stride()
        if not _fast_ok(dvp, dvs) and not tma_compatible(dv):
            dv_ = torch.empty(dv.shape, dtype=dv.dtype, device=dv.device)
            dvp, dvs = dv_.data_ptr(), dv_.stride()
    seq_round = C.SEQ_ROUND
    Sqr, Skr, n_dq, n_dk, n_dv, n_row = _workspace_sizes(B, Hq, Hkv, Sq, Sk, D, Dv, gqa,
                                                         seq_round)
    device = q.device
    buf = torch.empty(n_dq + n_dk + n_dv + 2 * n_row, dtype=torch.float32, device=device)
    base = buf.data_ptr()

    # workspace layout: dq_accum | dk_accum | dv_accum | dsum | lse_log2 (fp32)
    rows = base + 4 * (n_dq + n_dk + n_dv)
    p = C.BwdParams()
    p.assign(
        B, Hq, Hkv, Sq, Sk, D, Dv, _DTYPE_CODE[q.dtype], scale, is_causal, deterministic,
        qp, qs, kp, ks, vp, vs, out.data_ptr(), out.stride(), dop, dos,
        lse.data_ptr(), lse.stride(), dq.data_ptr(), dq.stride(), dkp, dks, dvp, dvs,
        rows, rows + 4 * n_row, base,
        base + 4 * n_dq if gqa else 0, base + 4 * (n_dq + n_dk) if gqa else 0,
    )

    idx = device.index
    if idx is None or idx == torch.cuda.current_device():
        C.backward(p, torch.cuda.current_stream(device).cuda_stream)
    else:
        with torch.cuda.device(device):
            C.backward(p, torch.cuda.current_stream(device).cuda_stream)
    if dk_ is not dk:
        dk.copy_(dk_)
    if dv_ is not dv:
        dv.copy_(dv_)
    # `buf` (and any copies) are freed here; the caching allocator reuses them only in stream
    # order, after the kernels just queued on this stream.
    return dq, dk, dv


_C = None


def _init():
    global _C
    _C = _module()
    return _C
