"""Public switch of the torch.compile rewrite: enable / disable / routing_stats.

    torch_sm90_sdpa.enable()            # route CUDA SDPA backward calls we serve
    torch_sm90_sdpa.enable(cpu=True)    # ... and CPU ones, to the CPU reference (tests, CI)
    torch_sm90_sdpa.disable()
    with torch_sm90_sdpa.enable(): ...  # restores the previous state on exit
    torch_sm90_sdpa.routing_stats()     # what was routed, what was not and why

Or, with no code change beyond importing the package, the environment variable
``TORCH_SM90_SDPA``: ``1`` / ``on`` / ``true`` / ``cuda`` enable the CUDA route at import,
``cpu`` enables the CPU route too, ``all`` routes every eligible CUDA call (also where the
stock backward measured faster: ``enable(only_faster=False)``), ``0`` / ``off`` / empty do
nothing.

The state lives in one place: ``torch._inductor.config.post_grad_custom_post_pass``.
Routing is on iff that holds our :class:`~torch_sm90_sdpa.compile_pass.SdpaBackwardRewrite`;
the pass the user had set there is kept inside it (and runs after ours) and comes back on
``disable()``. Routing is decided when a graph is compiled: enabling or disabling affects
the next compilations, not the graphs already compiled.

Decisions are logged on the logger ``torch_sm90_sdpa`` (routed: INFO; not routed: INFO,
or DEBUG for CPU calls while the CPU route is off).
"""
from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Optional

import torch._inductor.config as inductor_config

from . import causal_masks, compile_pass, ops

log = logging.getLogger("torch_sm90_sdpa")

ENV_VAR = "TORCH_SM90_SDPA"
_ENV_OFF = ("", "0", "off", "false", "no")
_ENV_CUDA = ("1", "on", "true", "yes", "cuda")
_ENV_CPU = ("cpu",)
_ENV_ALL = ("all",)


class _RoutingState:
    """What ``enable()`` returns: routing is already on; as a context manager, the state
    before the call comes back on exit."""

    def __init__(self, previous: Any, previous_joint: Any):
        self._previous = previous
        self._previous_joint = previous_joint

    def __enter__(self) -> "_RoutingState":
        return self

    def __exit__(self, *exc) -> None:
        inductor_config.post_grad_custom_post_pass = self._previous
        inductor_config.joint_custom_pre_pass = self._previous_joint

    def __repr__(self) -> str:
        return f"<torch_sm90_sdpa routing: {routing_options()}>"


def _current_pass() -> Optional[compile_pass.SdpaBackwardRewrite]:
    p = inductor_config.post_grad_custom_post_pass
    return p if isinstance(p, compile_pass.SdpaBackwardRewrite) else None


def _current_joint_pass() -> Optional[causal_masks.CausalMaskPass]:
    p = inductor_config.joint_custom_pre_pass
    return p if isinstance(p, causal_masks.CausalMaskPass) else None


def _set_causal_masks(on: bool) -> None:
    ours = _current_joint_pass()
    if on and ours is None:
        inductor_config.joint_custom_pre_pass = causal_masks.CausalMaskPass(
            user_pass=inductor_config.joint_custom_pre_pass)
    elif not on and ours is not None:
        inductor_config.joint_custom_pre_pass = ours.user_pass


def _dynamo_has_compiled() -> bool:
    """Whether Dynamo has seen frames in this process since its last reset (its private
    tracker of input code objects; False if that is not there)."""
    try:
        from torch._dynamo import convert_frame
        return any(ref() is not None for ref in convert_frame.input_codes.seen)
    except Exception:  # a torch without the tracker: no warning, nothing else changes
        return False


def _warn_if_compiled_before(change: str) -> None:
    if _dynamo_has_compiled():
        log.warning(
            "routing %s after torch.compile already ran in this process: graphs compiled before "
            "keep the routing they were compiled with, and Dynamo also hands them to new "
            "instances of the same model classes (it shares graphs between instances); "
            "torch._dynamo.reset() makes later calls compile again with the routing now set",
            change)


def enable(cpu: bool = False, only_faster: bool = True,
           causal_masks: bool = True) -> _RoutingState:
    """Route the SDPA backward of every later ``torch.compile`` compilation to our op where
    eligible (see :mod:`torch_sm90_sdpa.policy`). ``cpu=True`` also routes CPU calls to the
    op's CPU reference (for tests and CI). ``only_faster=True`` (the default) routes a CUDA
    call only where our kernel measured faster than the stock backward it replaces
    (``policy.faster_than_stock``); ``False`` routes every eligible call. ``causal_masks=True``
    (the default) also drops masks that are provably causal at compile time from both SDPA
    nodes (:mod:`torch_sm90_sdpa.causal_masks`): they become ``is_causal=True`` calls.
    Idempotent; passes the user set as ``post_grad_custom_post_pass`` /
    ``joint_custom_pre_pass`` before keep running after ours. Call it before the first
    ``torch.compile``: a warning is logged when Dynamo already compiled code in this process,
    whose graphs keep the routing they were compiled with (also for new instances of the same
    model classes) until ``torch._dynamo.reset()``."""
    previous = inductor_config.post_grad_custom_post_pass
    state = _RoutingState(previous, inductor_config.joint_custom_pre_pass)
    _set_causal_masks(causal_masks)
    ours = _current_pass()
    if ours is not None and ours.cpu == bool(cpu) and ours.only_faster == bool(only_faster):
        return state
    user_pass = ours.user_pass if ours is not None else previous
    inductor_config.post_grad_custom_post_pass = compile_pass.SdpaBackwardRewrite(
        cpu=cpu, user_pass=user_pass, only_faster=only_faster
    )
    log.info("routing enabled (cpu=%s, only_faster=%s)%s", bool(cpu), bool(only_faster),
             f"; chained with the user's pass {user_pass!r}" if user_pass is not None else "")
    _warn_if_compiled_before("enabled" if ours is None else "options changed")
    return state


def disable() -> None:
    """Stop routing in later compilations; the user's own post-grad pass, if any, stays.
    Idempotent."""
    _set_causal_masks(False)
    ours = _current_pass()
    if ours is None:
        return
    inductor_config.post_grad_custom_post_pass = ours.user_pass
    log.info("routing disabled")
    _warn_if_compiled_before("disabled")


def is_enabled() -> bool:
    return _current_pass() is not None


def routing_options() -> dict:
    """{"enabled": bool, "cpu": bool, "only_faster": bool, "causal_masks": bool}."""
    ours = _current_pass()
    return {"enabled": ours is not None, "cpu": bool(ours is not None and ours.cpu),
            "only_faster": bool(ours is None or ours.only_faster),
            "causal_masks": _current_joint_pass() is not None}


def routing_stats(reset: bool = False) -> dict:
    """What the rewrite did in this process::

        {
          "enabled": bool, "cpu": bool, "only_faster": bool,  # the current options
          "routed_calls": int,                 # RUN TIME: calls of our backward op made by
          "routed_calls_by_device": {...},     #   compiled graphs (also after a cache hit)
          "routed_nodes": {backend: int},      # COMPILE TIME: stock backward nodes replaced
          "not_routed": {reason: int},         # COMPILE TIME: nodes kept, by reason
          "causal_masks": {outcome: int},      # COMPILE TIME: SDPA nodes whose mask was
        }                                      #   dropped (proved causal) or kept, and why

    Compile-time counts only grow when Inductor actually compiles a graph: a graph served
    by the FX graph cache (or by AOTAutograd's cache) is not re-examined, so they stay zero
    for it, while ``routed_calls`` counts every call whatever compiled the graph. A graph
    replayed as a CUDA graph (``mode="reduce-overhead"``) does not run Python, so its
    replays are not in ``routed_calls`` either. ``reset=True`` zeroes every count after
    reading them.
    """
    counts = compile_pass.decision_counts
    calls = ops.routed_calls()
    stats = {
        **routing_options(),
        "routed_calls": sum(calls.values()),
        "routed_calls_by_device": dict(calls),
        "routed_nodes": {k[1]: n for k, n in sorted(counts.items()) if k[0] == "routed"},
        "not_routed": {k[1]: n for k, n in sorted(counts.items()) if k[0] == "not routed"},
        "causal_masks": dict(sorted(causal_masks.decision_counts.items())),
    }
    if reset:
        reset_stats()
    return stats


def reset_stats() -> None:
    """Zero the counts of :func:`routing_stats`."""
    ops.reset_routed_calls()
    compile_pass.decision_counts.clear()
    causal_masks.decision_counts.clear()
    compile_pass.recent_decisions.clear()


def apply_env(value: Optional[str] = None) -> Optional[_RoutingState]:
    """Apply ``TORCH_SM90_SDPA`` (or `value`): see the module docstring. Called at import."""
    if value is None:
        value = os.environ.get(ENV_VAR)
    if value is None:
        return None
    v = value.strip().lower()
    if v in _ENV_OFF:
        return None
    if v in _ENV_CUDA:
        return enable()
    if v in _ENV_CPU:
        return enable(cpu=True)
    if v in _ENV_ALL:
        return enable(only_faster=False)
    msg = (f"{ENV_VAR}={value!r} is not understood (expected 1 / on / cuda, cpu, all, or "
           "0 / off); routing stays off")
    warnings.warn(msg, stacklevel=2)
    log.warning(msg)
    return None
