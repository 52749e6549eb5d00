"""The one Python constructor of the device layer's ``_C.BwdProblem``.

Both Python callers describe a backward call to the device layer (registration/bwd_device.h)
through :func:`bwd_problem`: the CUDA op body in Python and the tests of the kernels
(:mod:`torch_sm90_sdpa._cuda_backend`, real tensors) and the compile-time eligibility
(:mod:`torch_sm90_sdpa.eligibility`, metadata that may be symbolic). They differ only in how
they describe each operand's layout, which they pass in. (The C++ op,
registration/torch_op.cpp, builds its own from the stable-ABI tensor handles.)

    bwd_problem(C, q, k, v, layouts, *, is_causal, deterministic, capability, num_sms=0,
                mask=None, size=int) -> _C.BwdProblem
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional, Tuple

from . import _extension

# The operands of a BwdProblem, by the name of its attribute (the order of the op's schema).
OPERANDS = ("q", "k", "v", "out", "dout", "lse", "dq", "dk", "dv", "mask")


def dense_layout(C):
    """The layout of an output the op allocates itself (``empty_like``): dense, 16-byte
    aligned (any strides that are multiples of 16 bytes describe it to the contract)."""
    return C.OperandLayout(batch_stride=8, head_stride=8, row_stride=8)


def bwd_problem(C, q, k, v, layouts: Mapping[str, object], *, is_causal: bool,
                deterministic: bool, capability: Optional[Tuple[int, int]], num_sms: int = 0,
                mask=None, size: Callable = int):
    """_C.BwdProblem of a call with q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv]
    (tensors, fake tensors or TensorSpecs; the head dims must be ints).

    layouts: {operand name (OPERANDS): _C.OperandLayout}; an operand left out keeps
    BwdProblem's default layout. mask: the attn_mask (its dtype gives the mask kind; -1, not
    served, for a dtype the kernels cannot read), whose [B, Hq, Sq, Sk] view is
    ``layouts["mask"]``. capability: the device's (major, minor), None for (0, 0) (unknown).
    num_sms: the device's multiprocessors (0: unknown, no split tail planned). size: how a
    batch, head count or sequence length becomes an int (e.g. a symbolic size's hint)."""
    major, minor = capability if capability is not None else (0, 0)
    problem = C.BwdProblem(
        batch=size(q.size(0)), heads_q=size(q.size(1)), heads_kv=size(k.size(1)),
        seqlen_q=size(q.size(2)), seqlen_k=size(k.size(2)), head_dim=q.size(-1),
        head_dim_v=v.size(-1), dtype=_extension.dtype_code(q.dtype, -1),
        is_causal=bool(is_causal), deterministic=bool(deterministic), cc_major=major,
        cc_minor=minor, num_sms=num_sms)
    for name, layout in layouts.items():
        if name not in OPERANDS:
            raise KeyError(f"bwd_problem: unknown operand {name!r}")
        setattr(problem, name, layout)
    if mask is not None:
        problem.mask_kind = _extension.MASK_KIND_CODES.get(mask.dtype, -1)
    return problem
