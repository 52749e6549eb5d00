"""Input checks shared by the ops and the public functions.

Every message names the argument and says what was expected, so a user who passes a
wrong tensor learns which one and why without reading our code.
"""
from __future__ import annotations

import math

import torch

from ._extension import KERNEL_DTYPES, MASK_KIND_CODES

# Floating dtypes the ops accept. The CUDA kernels serve KERNEL_DTYPES (fp16, bf16: the
# generator's table); fp32 and fp64 are served by the CPU reference (a clear error on CUDA).
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_tensor(name: str, t, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(
            f"{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}"
        )


def _check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    # (an empty tensor has no element to read: any strides do)
    if t.size(-1) > 1 and t.stride(-1) != 1 and t.numel() != 0:
        raise ValueError(
            f"{name}: expected a contiguous last dimension (stride(-1) == 1), "
            f"got strides {tuple(t.stride())}; call .contiguous() first"
        )


def _check_same_device(named: dict[str, torch.Tensor]) -> None:
    (first_name, first), *rest = named.items()
    for name, t in rest:
        if t.device != first.device:
            raise ValueError(
                f"{name}: expected a tensor on {first.device} (the device of "
                f"{first_name}), got one on {t.device}"
            )


def _check_dtypes(named: dict[str, torch.Tensor]) -> torch.dtype:
    (first_name, first), *rest = named.items()
    if first.dtype not in SUPPORTED_DTYPES:
        allowed = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"{first_name}: expected dtype in ({allowed}), got {first.dtype}")
    for name, t in rest:
        if t.dtype != first.dtype:
            raise TypeError(
                f"{name}: expected dtype {first.dtype} (the dtype of {first_name}), "
                f"got {t.dtype}"
            )
    return first.dtype


def _check_dim(name: str, t: torch.Tensor, dim: int, expected: int, what: str, source: str) -> None:
    if t.size(dim) != expected:
        raise ValueError(
            f"{name}: expected {what} {expected} (as {source}), got {t.size(dim)} "
            f"(shape {tuple(t.shape)})"
        )


def resolve_scale(scale, q: torch.Tensor) -> float:
    """The softmax scale of a call: ``scale``, or 1/sqrt(D) for None (1 for D = 0: the scores
    are empty dot products, 0 whatever the scale)."""
    if scale is not None:
        return scale
    head_dim = q.size(-1) if isinstance(q, torch.Tensor) and q.dim() > 0 else 0
    return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0


def check_scale(scale) -> None:
    """scale: None (1/sqrt(D)) or a finite number."""
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite float or None (1/sqrt(D)), got {scale!r}")


def check_attention_inputs(q, k, v) -> None:
    """q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv]; Hq % Hkv == 0."""
    _check_tensor("query", q, 4)
    _check_tensor("key", k, 4)
    _check_tensor("value", v, 4)
    named = {"query": q, "key": k, "value": v}
    _check_same_device(named)
    _check_dtypes(named)
    batch, heads_q, _, head_dim = q.shape
    heads_kv, seqlen_k = k.size(1), k.size(2)
    _check_dim("key", k, 0, batch, "batch size", "query.size(0)")
    _check_dim("value", v, 0, batch, "batch size", "query.size(0)")
    _check_dim("key", k, 3, head_dim, "head dim", "query.size(-1)")
    # Hkv = 0: no key at all (every query sees none), as stock SDPA takes it
    if heads_kv != 0 and heads_q % heads_kv != 0:
        raise ValueError(
            f"key: expected a number of heads that divides query's {heads_q} heads "
            f"(grouped-query attention), got {heads_kv}"
        )
    _check_dim("value", v, 1, heads_kv, "number of heads", "key.size(1)")
    _check_dim("value", v, 2, seqlen_k, "sequence length", "key.size(2)")
    for name, t in named.items():
        _check_last_dim_contiguous(name, t)


def check_backward_inputs(grad_out, q, k, v, out, lse, scale) -> None:
    """Checks the arguments of torch_sm90_sdpa::sdpa_backward.

    grad_out, out [B, Hq, Sq, Dv]; lse [B, Hq, Sq] float32 (float64 with float64 inputs).
    """
    check_attention_inputs(q, k, v)
    _check_tensor("grad_out", grad_out, 4)
    _check_tensor("out", out, 4)
    _check_tensor("lse", lse, 3)
    _check_same_device({"query": q, "grad_out": grad_out, "out": out, "lse": lse})
    _check_dtypes({"query": q, "grad_out": grad_out, "out": out})
    expected_out = (q.size(0), q.size(1), q.size(2), v.size(3))
    for name, t in (("out", out), ("grad_out", grad_out)):
        if tuple(t.shape) != expected_out:
            raise ValueError(
                f"{name}: expected shape {expected_out} ([B, Hq, Sq, Dv] from query and "
                f"value), got {tuple(t.shape)}"
            )
        _check_last_dim_contiguous(name, t)
    expected_lse = tuple(q.shape[:3])
    if tuple(lse.shape) != expected_lse:
        raise ValueError(
            f"lse: expected shape {expected_lse} ([B, Hq, Sq] from query), "
            f"got {tuple(lse.shape)}"
        )
    lse_dtypes = (torch.float32, torch.float64) if q.dtype == torch.float64 else (torch.float32,)
    if lse.dtype not in lse_dtypes:
        raise TypeError(
            f"lse: expected dtype {' or '.join(map(str, lse_dtypes))}, got {lse.dtype}"
        )
    check_scale(scale)


MASK_DTYPES = tuple(MASK_KIND_CODES)  # bool, fp32, fp16, bf16


def check_attn_mask(attn_mask, q: torch.Tensor, k: torch.Tensor) -> None:
    """attn_mask: None, or a bool mask (True = attend) or an additive float mask (fp32 / fp16 /
    bf16; fp64 too with fp64 inputs), broadcastable to [B, Hq, Sq, Sk], on q's device."""
    if attn_mask is None:
        return
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask: expected a torch.Tensor or None, got "
                        f"{type(attn_mask).__name__}")
    allowed = MASK_DTYPES + ((torch.float64,) if q.dtype == torch.float64 else ())
    if attn_mask.dtype not in allowed:
        raise TypeError(
            "attn_mask: expected dtype torch.bool (True = attend) or an additive float mask "
            f"({', '.join(str(d) for d in allowed[1:])}), got {attn_mask.dtype}"
        )
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask: expected a tensor on {q.device} (the device of query), "
                         f"got one on {attn_mask.device}")
    target = (q.size(0), q.size(1), q.size(2), k.size(2))
    shape = tuple(attn_mask.shape)
    if len(shape) > 4 or any(
        s not in (1, t) for s, t in zip(reversed(shape), reversed(target))
    ):
        raise ValueError(f"attn_mask: expected a shape broadcastable to [B, Hq, Sq, Sk] = "
                         f"{target}, got shape {shape}")


def check_mask_not_differentiable(attn_mask) -> None:
    """A mask whose gradient would be needed is not served (we compute no mask gradient)."""
    if attn_mask is not None and attn_mask.requires_grad:
        raise ValueError("attn_mask: a mask that requires grad is not served (torch_sm90_sdpa "
                         "computes no gradient for it); detach it, or use stock SDPA")


def check_cuda_kernel_dtype(q: torch.Tensor) -> None:
    if q.dtype not in KERNEL_DTYPES:
        raise TypeError(
            f"query: the SM90 CUDA kernel expects dtype "
            f"{' or '.join(str(d) for d in KERNEL_DTYPES)}, got {q.dtype}"
        )
