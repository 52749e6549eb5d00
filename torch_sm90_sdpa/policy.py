"""The routing policy: which SDPA calls the torch.compile rewrites hand to our ops.

The rewrite (:mod:`torch_sm90_sdpa.compile_pass`) describes each stock backward node of a
compiled graph as an :class:`AttentionBackwardCall` and asks :func:`decide`, which combines

* eligibility (:mod:`torch_sm90_sdpa.eligibility`): what the kernels (or, with the CPU route
  on, the CPU reference) serve, asked of the C++ contract with the call's metadata;
* the speed gate (:mod:`torch_sm90_sdpa.speed_gate`, ``only_faster``, on by default): a CUDA
  call is routed only where our kernel measured faster than the stock backward it replaces,
  on the call's GPU model.

The joint-graph rewrite (:mod:`torch_sm90_sdpa.forward_pass`, ``enable()``'s ``forward``) asks
:func:`decide_forward` of each stock forward node (an :class:`AttentionForwardCall`):
``eligibility.forward_eligible``, then ``speed_gate.forward_faster_than_stock``.

This module re-exports the names of both that the package, the tests and the tools use. The
device queries that tests replace live in their own modules: ``eligibility.device_capability``
and ``speed_gate.device_name``.

Reasons are short stable strings (the keys of ``routing_stats()["not_routed"]``); the
details (which tensor, which stride) go to the log.
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import _extension, eligibility, speed_gate
from .eligibility import (  # noqa: F401  (re-exported)
    CPU_DTYPES, CUDA_BACKENDS, MASK_KIND_CODES, R_CAUSAL_ALIGN, R_CPU_ROUTE_OFF, R_DEVICE,
    R_DROPOUT, R_DTYPE, R_DV, R_HEAD_DIM_SYMBOLIC, R_HEADS, R_LAST_DIM, R_LAYOUT, R_LSE, R_MASK,
    R_MASK_GRAD, R_NESTED, R_NOT_BUILT, R_NOT_SM90, R_OUTPUTS, R_SCALE, R_SHAPES, R_TOO_LARGE,
    R_VARIANT, ROUTE, STOCK_BACKWARD_OPS, AttentionBackwardCall, Decision, TensorSpec, describe,
    eligible, gqa_heads_per_cta, kernel_decision, kernel_verdict, lse_shape_ok, resolved_scale,
    R_BACKWARD_KEPT, R_DEBUG_MASK, STOCK_FORWARD_OPS, AttentionForwardCall, forward_eligible)
from .speed_gate import (  # noqa: F401  (re-exported)
    FASTER_THAN_CUDNN_LENGTHS, MASKED_FASTER_LENGTHS, MEASURED_DEVICES,
    MHA_FASTER_THAN_CUDNN_LENGTHS, MIN_SPEEDUP, PATH_GQA_ACCUM, PATH_MHA, R_SLOWER,
    UNMASKED_CASES, WALKED_GROUPS, GateTables, describe_lengths, faster_than_stock, gate_device,
    gate_tables, in_routed_lengths, path_gqa_walked, routed_lengths_from_table, row_path,
    walked_gqa_faster_than_cudnn_lengths, R_SLOWER_FORWARD, FORWARD_MEASURED_DEVICES,
    forward_faster_than_stock, forward_gate_lengths)

# The kernels have a deterministic mode (dQ, and GQA dK / dV, added in a fixed order), so
# calls under torch.use_deterministic_algorithms(True) are served. Part of the routing
# fingerprint.
CUDA_DETERMINISTIC_SUPPORTED = True

# The reasons an ineligible call can have, for documentation and the `info` command.
ALL_REASONS = (
    R_CPU_ROUTE_OFF, R_DEVICE, R_NOT_SM90, R_NESTED, R_DROPOUT, R_MASK, R_MASK_GRAD, R_SHAPES,
    R_DTYPE,
    R_HEAD_DIM_SYMBOLIC, R_DV, R_HEADS, R_NOT_BUILT, R_VARIANT,
    R_CAUSAL_ALIGN, R_LAST_DIM, R_TOO_LARGE, R_LSE, R_SCALE, R_OUTPUTS, R_LAYOUT, R_SLOWER,
)
# ... and a forward node (the joint-graph rewrite, forward_pass.py), besides those it shares.
FORWARD_REASONS = (R_DEBUG_MASK, R_BACKWARD_KEPT, R_SLOWER_FORWARD)


def decide(call: AttentionBackwardCall, *, cpu_route: bool = False,
           only_faster: bool = True) -> Decision:
    """Whether the rewrite replaces this call by ``torch_sm90_sdpa::sdpa_backward``.

    only_faster: also require that our kernel measured faster than the stock backward this
    node would run (:func:`faster_than_stock`); the CPU route has no such gate."""
    return _gated(eligible(call, cpu_route=cpu_route), call, only_faster, faster_than_stock)


def _gated(verdict: Decision, call, only_faster: bool, gate) -> Decision:
    """An eligible CUDA call's verdict after the speed gate `gate` (when only_faster); the
    CPU route has no gate."""
    if not verdict.routed or call.backend == "cpu_flash" or not only_faster:
        return verdict
    passed = gate(call)
    return verdict if passed.routed else passed


def decide_forward(call: AttentionForwardCall, *, cpu_route: bool = False,
                   only_faster: bool = True) -> Decision:
    """Whether the joint-graph rewrite replaces this forward node by
    ``torch_sm90_sdpa::sdpa_forward`` (its backward, if the graph holds one, must be routed
    too: forward_pass.py asks :func:`decide` of it). only_faster: also require that our forward
    measured faster than the stock one (:func:`forward_faster_than_stock`); the CPU route has
    no such gate."""
    return _gated(forward_eligible(call, cpu_route=cpu_route), call, only_faster,
                  forward_faster_than_stock)


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
            caps = tuple(eligibility.device_capability(d) for d in devices)
            models = tuple(gate_device(d) for d in devices)  # the gate's rows follow the model
    except Exception:
        caps = ("unknown",)
    return (
        tuple(sorted((str(k), repr(v)) for k, v in info.items())),
        caps,
        CUDA_DETERMINISTIC_SUPPORTED,
        tuple(speed_gate.gate_fingerprint(m) for m in sorted(set(models) | {None}, key=str)),
        tuple(speed_gate.forward_gate_fingerprint(m)
              for m in sorted(set(models) | {None}, key=str)),
        # the GQA walk (and so the gate of GQA calls) follows this switch of the device layer
        _extension.switches().get("gqa_walk", ""),
    )
