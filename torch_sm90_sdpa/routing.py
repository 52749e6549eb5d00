"""Public switch of the torch.compile rewrite: enable / disable / routing_stats.

    torch_sm90_sdpa.enable()            # route the CUDA SDPA calls we serve (backward; forward
                                        #   nodes with a boolean mask, with their backward)
    torch_sm90_sdpa.enable(cpu=True)    # ... and CPU ones, to the CPU reference (tests, CI)
    torch_sm90_sdpa.disable()
    with torch_sm90_sdpa.enable(): ...  # restores the previous state on exit
    torch_sm90_sdpa.routing_stats()     # what was routed, what was not and why

Or, with no code change, the environment variable ``TORCH_SM90_SDPA``: ``1`` / ``on`` /
``true`` / ``cuda`` enable the CUDA route, ``cpu`` enables the CPU route too, ``all`` routes
every eligible CUDA backward (also where the stock backward measured faster:
``enable(only_faster=False)``, forward nodes staying stock), ``backward`` routes backward
nodes only (``enable(forward=False)``; ``forward``, the default, is accepted as ``1``),
``0`` / ``off`` / empty do nothing. It is applied when the
package is imported, and, where the package is installed with its entry point, at
``import torch`` (``torch_sm90_sdpa_autoload``: ``TORCH_SM90_SDPA=1 python train.py``
routes a script that never imports the package).

Importing the package does not import ``torch._inductor``: Inductor's config and the passes
are imported by the first :func:`enable`.

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
import sys
import warnings
from typing import TYPE_CHECKING, Any, Optional

from . import ops

if TYPE_CHECKING:
    from . import compile_pass, forward_pass

log = logging.getLogger("torch_sm90_sdpa")

ENV_VAR = "TORCH_SM90_SDPA"
_ENV_OFF = ("", "0", "off", "false", "no")
_ENV_CUDA = ("1", "on", "true", "yes", "cuda")
_ENV_CPU = ("cpu",)
_ENV_ALL = ("all",)
_ENV_FORWARD = ("forward",)  # (forward routing is enable()'s default)
_ENV_BACKWARD = ("backward",)

# Importing the package must not import torch._inductor (about a second): the passes and
# Inductor's config are imported on the first enable(). Until then no pass of ours can be
# installed, so the readers below answer without importing them.
_PASS_MODULE = __package__ + ".compile_pass"
_MASK_MODULE = __package__ + ".causal_masks"
_JOINT_MODULE = __package__ + ".forward_pass"


def _inductor_config():
    import torch._inductor.config as inductor_config

    return inductor_config


def _passes():
    """(compile_pass, forward_pass), importing them (and Inductor) if needed."""
    from . import compile_pass, forward_pass

    return compile_pass, forward_pass


class _RoutingState:
    """What ``enable()`` returns: routing is already on; as a context manager, the state
    before the call comes back on exit."""

    def __init__(self, previous: Any, previous_joint: Any):
        self._previous = previous
        self._previous_joint = previous_joint

    def __enter__(self) -> "_RoutingState":
        return self

    def __exit__(self, *exc) -> None:
        inductor_config = _inductor_config()
        inductor_config.post_grad_custom_post_pass = self._previous
        inductor_config.joint_custom_pre_pass = self._previous_joint

    def __repr__(self) -> str:
        return f"<torch_sm90_sdpa routing: {routing_options()}>"


def _current_pass() -> Optional["compile_pass.SdpaBackwardRewrite"]:
    compile_pass = sys.modules.get(_PASS_MODULE)
    if compile_pass is None:  # never imported: none of our passes can be installed
        return None
    p = _inductor_config().post_grad_custom_post_pass
    return p if isinstance(p, compile_pass.SdpaBackwardRewrite) else None


def _current_joint_pass() -> Optional["forward_pass.JointGraphRewrite"]:
    forward_pass = sys.modules.get(_JOINT_MODULE)
    if forward_pass is None:
        return None
    p = _inductor_config().joint_custom_pre_pass
    return p if isinstance(p, forward_pass.JointGraphRewrite) else None


def _set_joint_pass(causal_masks: bool, forward: bool, cpu: bool, only_faster: bool) -> None:
    """Install (or, with neither causal_masks nor forward, remove) our joint-graph pass, keeping
    the user's pass inside it."""
    ours = _current_joint_pass()
    if not (causal_masks or forward):
        if ours is not None:  # (None: nothing to undo, and no Inductor import)
            _inductor_config().joint_custom_pre_pass = ours.user_pass
        return
    user_pass = ours.user_pass if ours is not None else _inductor_config().joint_custom_pre_pass
    options = dict(causal_masks=bool(causal_masks), forward=bool(forward), cpu=bool(cpu),
                   only_faster=bool(only_faster))
    if ours is not None and all(getattr(ours, k) == v for k, v in options.items()):
        return
    _inductor_config().joint_custom_pre_pass = _passes()[1].JointGraphRewrite(
        user_pass=user_pass, **options)


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
           causal_masks: bool = True, forward: Optional[bool] = None) -> _RoutingState:
    """Route the SDPA backward of every later ``torch.compile`` compilation to our op where
    eligible (see :mod:`torch_sm90_sdpa.policy`). ``cpu=True`` also routes CPU calls to the
    op's CPU reference (for tests and CI). ``only_faster=True`` (the default) routes a CUDA
    call only where our kernel measured faster than the stock backward it replaces
    (``policy.faster_than_stock``); ``False`` routes every eligible call. ``causal_masks=True``
    (the default) also drops masks that are provably causal at compile time from both SDPA
    nodes (:mod:`torch_sm90_sdpa.causal_masks`): they become ``is_causal=True`` calls.
    ``forward=True`` also replaces SDPA forward nodes by ``sdpa_forward`` together with their
    backward (:mod:`torch_sm90_sdpa.forward_pass`), where both are routed (on CUDA with
    ``only_faster``: cuDNN forwards with a boolean mask, or a bf16 / fp32 additive one
    broadcast over heads, where cuDNN's masked forward measured
    slower than ours), in training and in forward-only graphs; ``forward=False`` keeps every
    forward node on stock and routes backward nodes only. ``forward=None`` (the default) is
    ``only_faster``: forward nodes are routed where the forward's speed gate passes, and
    ``only_faster=False`` alone does not put every forward on our kernel (unmasked, ours runs
    0.76-1.16x of cuDNN's forward, below it on 13 of 20 measured rows).
    Idempotent; passes the user set as ``post_grad_custom_post_pass`` /
    ``joint_custom_pre_pass`` before keep running after ours. Call it before the first
    ``torch.compile``: a warning is logged when Dynamo already compiled code in this process,
    whose graphs keep the routing they were compiled with (also for new instances of the same
    model classes) until ``torch._dynamo.reset()``."""
    if forward is None:
        forward = only_faster
    compile_pass, _ = _passes()
    inductor_config = _inductor_config()
    previous = inductor_config.post_grad_custom_post_pass
    state = _RoutingState(previous, inductor_config.joint_custom_pre_pass)
    joint_before = inductor_config.joint_custom_pre_pass
    _set_joint_pass(causal_masks, forward, cpu, only_faster)
    ours = _current_pass()
    if ours is not None and ours.cpu == bool(cpu) and ours.only_faster == bool(only_faster):
        if inductor_config.joint_custom_pre_pass is not joint_before:
            log.info("routing options changed (causal_masks=%s, forward=%s)", bool(causal_masks),
                     bool(forward))
            _warn_if_compiled_before("options changed")
        return state
    user_pass = ours.user_pass if ours is not None else previous
    inductor_config.post_grad_custom_post_pass = compile_pass.SdpaBackwardRewrite(
        cpu=cpu, user_pass=user_pass, only_faster=only_faster
    )
    log.info("routing enabled (cpu=%s, only_faster=%s, forward=%s)%s", bool(cpu),
             bool(only_faster), bool(forward),
             f"; chained with the user's pass {user_pass!r}" if user_pass is not None else "")
    _warn_if_compiled_before("enabled" if ours is None else "options changed")
    return state


def disable() -> None:
    """Stop routing in later compilations; the user's own post-grad pass, if any, stays.
    Idempotent."""
    _set_joint_pass(False, False, False, True)
    ours = _current_pass()
    if ours is None:
        return
    _inductor_config().post_grad_custom_post_pass = ours.user_pass
    log.info("routing disabled")
    _warn_if_compiled_before("disabled")


def is_enabled() -> bool:
    return _current_pass() is not None


def routing_options() -> dict:
    """{"enabled": bool, "cpu": bool, "only_faster": bool, "causal_masks": bool,
    "forward": bool}."""
    ours = _current_pass()
    joint = _current_joint_pass()
    return {"enabled": ours is not None, "cpu": bool(ours is not None and ours.cpu),
            "only_faster": bool(ours is None or ours.only_faster),
            "causal_masks": bool(joint is not None and joint.causal_masks),
            "forward": bool(joint is not None and joint.forward)}


# The stock backward nodes, in routing_stats(): SDPA's backends as torch names them
# (torch.nn.attention.SDPBackend), "cpu" for the CPU flash kernel SDPA runs on the CPU.
BACKEND_KEYS = {"cudnn": "cudnn", "flash": "flash", "efficient": "efficient", "cpu_flash": "cpu"}
BACKEND_WORDS = {
    "cudnn": "cuDNN attention", "flash": "FlashAttention",
    "efficient": "memory-efficient attention",
    "cpu": "CPU flash attention",
}
# Hints for the reasons the summary mentions: what would route those calls.
_REASON_HINTS = {
    "CPU route off": "enable(cpu=True) routes CPU calls to the CPU reference",
    "stock backward is faster here": "enable(only_faster=False) routes them anyway",
    "not an SM90 GPU": "the kernels run on Hopper (compute capability 9.0) only",
    "SM90 kernels not built": "torch_sm90_sdpa._C was built without them: build_info() says why",
    "head dim not compiled": "build_info()['variants'] lists the compiled head dims",
    "stock forward is faster here": "enable(only_faster=False) routes them anyway",
    "its backward stays on stock": "a forward is routed only with its backward",
}
# torch.compile's cache hits (torch._dynamo.utils.counters) at the last reset_stats().
_cache_hits_at_reset = 0


def _cache_hits() -> int:
    """Graphs (forward, backward) torch.compile served from its caches in this process, from
    torch's counters (0 when Dynamo never ran): Inductor's FX graph cache hits, one per graph,
    which an AOTAutograd cache hit also makes for the graphs it loads; AOTAutograd's own hits
    (one per forward-backward pair) where those are fewer (bundled entries)."""
    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None)
    if counters is None:
        return 0
    try:
        return max(int(counters["inductor"].get("fxgraph_cache_hit", 0)),
                   int(counters["aot_autograd"].get("autograd_cache_hit", 0)))
    except Exception:
        return 0


def routing_stats(reset: bool = False, summary: bool = False):
    """What the rewrite did in this process::

        {
          "enabled": bool, "cpu": bool,        # the current options (see enable())
          "only_faster": bool,
          "routed_calls": int,                 # RUN TIME: calls of our backward op made by
          "routed_calls_by_device": {...},     #   compiled graphs (also after a cache hit)
          "routed_nodes": {backend: int},      # COMPILE TIME: stock backward nodes replaced,
                                               #   by SDPA backend: "cudnn", "flash",
                                               #   "efficient" (CUDA) or "cpu"
          "not_routed": {reason: int},         # COMPILE TIME: stock backward nodes kept, by reason
          "routed_forward_nodes": {backend: int},  # COMPILE TIME: stock forward nodes replaced
                                               #   (enable()'s forward=True), by SDPA backend
          "forward_not_routed": {reason: int},  # COMPILE TIME: stock forward nodes kept, by reason
          "causal_masks": {outcome: int},      # COMPILE TIME: SDPA nodes whose mask was
                                               #   dropped (proved causal) or kept, and why
          "graphs_compiled": int,              # COMPILE TIME: graphs Inductor compiled with
                                               #   routing on (each examined by the rewrite)
          "graphs_from_cache": int,            # graphs torch.compile served from its caches
                                               #   (FX graph / AOTAutograd): not examined again
          "note": str,                         # why routed_calls and routed_nodes disagree, if
        }                                      #   they do ("" otherwise)

    Compile-time counts only grow when Inductor actually compiles a graph: a graph served
    by the FX graph cache (or by AOTAutograd's cache) is not re-examined (its routing was
    decided when it was first compiled: the routing options are part of the cache key), so
    ``routed_nodes`` stays ``{}`` for it while ``routed_calls`` counts every call whatever
    compiled the graph; ``graphs_from_cache`` counts those graphs and ``note`` says so. A
    graph replayed as a CUDA graph (``mode="reduce-overhead"``) does not run Python, so its
    replays are not in ``routed_calls`` either. ``reset=True`` zeroes every count after
    reading them. ``summary=True`` returns the same as one paragraph of text
    (:func:`routing_summary`) instead of the dict.

    Reading the counts never imports ``torch._inductor``.
    """
    compile_pass = sys.modules.get(_PASS_MODULE)
    causal_masks = sys.modules.get(_MASK_MODULE)
    forward_pass = sys.modules.get(_JOINT_MODULE)
    counts = compile_pass.decision_counts if compile_pass is not None else {}
    forward_counts = forward_pass.decision_counts if forward_pass is not None else {}
    calls = ops.routed_calls()
    routed_nodes = _by_backend(counts)
    graphs_compiled = compile_pass.graphs_examined if compile_pass is not None else 0
    from_cache = max(0, _cache_hits() - _cache_hits_at_reset)
    stats = {
        **routing_options(),
        "routed_calls": sum(calls.values()),
        "routed_calls_by_device": dict(calls),
        "routed_nodes": routed_nodes,
        "not_routed": {k[1]: n for k, n in sorted(counts.items()) if k[0] == "not routed"},
        "routed_forward_nodes": _by_backend(forward_counts),
        "forward_not_routed": {k[1]: n for k, n in sorted(forward_counts.items())
                               if k[0] == "not routed"},
        "causal_masks": (dict(sorted(causal_masks.decision_counts.items()))
                         if causal_masks is not None else {}),
        "graphs_compiled": graphs_compiled,
        "graphs_from_cache": from_cache,
    }
    stats["note"] = _note(stats)
    if reset:
        reset_stats()
    return _summary_text(stats) if summary else stats


def _by_backend(counts) -> dict:
    """{backend key: n} of the ("routed", backend) counts."""
    out: dict = {}
    for (kind, what), n in sorted(counts.items()):
        if kind == "routed":
            key = BACKEND_KEYS.get(what, what)
            out[key] = out.get(key, 0) + n
    return out


def routing_summary(reset: bool = False) -> str:
    """:func:`routing_stats` as one paragraph: what was routed, what was not and why, and
    what the compile cache served."""
    return routing_stats(reset=reset, summary=True)


def _note(stats: dict) -> str:
    nodes = sum(stats["routed_nodes"].values())
    if stats["routed_calls"] and not nodes:
        if stats["graphs_from_cache"]:
            return ("routed_calls come from graphs served by torch.compile's cache "
                    f"({stats['graphs_from_cache']} graph(s)): their nodes were routed when "
                    "they were first compiled and are not counted in routed_nodes")
        return ("routed_calls come from graphs compiled before the last reset_stats() or "
                "served by a cache: their nodes are not counted in routed_nodes")
    if stats["graphs_from_cache"]:
        return (f"{stats['graphs_from_cache']} graph(s) came from torch.compile's cache: "
                "routed_nodes / not_routed count only the graphs compiled in this process")
    return ""


def _plural(n: int, one: str, many: Optional[str] = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def _because(reason: str, n: int) -> str:
    """'n because reason (what would route them)' for the summary."""
    hint = _REASON_HINTS.get(reason)
    return f"{n} because {reason}" + (f" ({hint})" if hint else "")


def _summary_text(stats: dict) -> str:
    parts = []
    if stats["enabled"]:
        parts.append("Routing is on ("
                     + ("CUDA and CPU calls; CPU calls go to the CPU reference"
                        if stats["cpu"] else "CUDA calls only: enable(cpu=True) adds CPU calls")
                     + ("; CUDA calls only where our kernel measured faster than stock"
                        if stats["only_faster"] else "; every eligible CUDA call") + ").")
    else:
        parts.append("Routing is off: torch_sm90_sdpa.enable() (or TORCH_SM90_SDPA=1) before "
                     "torch.compile routes the attention backward of compiled graphs.")
    routed = stats["routed_nodes"]
    kept = stats["not_routed"]
    n_routed, n_kept = sum(routed.values()), sum(kept.values())
    g = stats["graphs_compiled"]
    if g or n_routed or n_kept:
        text = (f"When compiling {_plural(g, 'graph')} in this process the rewrite routed "
                f"{_plural(n_routed, 'stock attention backward')} to torch_sm90_sdpa")
        if routed:
            text += " (" + ", ".join(f"{n} {BACKEND_WORDS.get(b, b)}"
                                     for b, n in routed.items()) + ")"
        if kept:
            text += f" and kept {n_kept} on stock: " + "; ".join(
                _because(reason, n) for reason, n in kept.items())
        else:
            text += " and kept none on stock"
        parts.append(text + ".")
    elif stats["enabled"] and not stats["graphs_from_cache"]:
        parts.append("No graph was compiled with routing on in this process (eager calls are "
                     "not routed: only torch.compile'd graphs are).")
    c = stats["graphs_from_cache"]
    if c:
        parts.append(f"{_plural(c, 'graph')} came from torch.compile's cache and "
                     f"{'was' if c == 1 else 'were'} not examined again: the routing of "
                     f"{'its' if c == 1 else 'their'} attention backwards was decided when "
                     f"{'it was' if c == 1 else 'they were'} first compiled (with the same "
                     "routing options: they are part of the cache key), so those count in "
                     "the calls below but not as routed or kept nodes.")
    calls = stats["routed_calls"]
    if calls:
        by_dev = ", ".join(f"{n} on {d}" for d, n in stats["routed_calls_by_device"].items())
        parts.append(f"At run time compiled graphs called the torch_sm90_sdpa backward "
                     f"{_plural(calls, 'time')} ({by_dev}).")
    elif n_routed:
        parts.append("At run time no compiled graph has called the torch_sm90_sdpa backward "
                     "yet (no backward ran, or CUDA graphs replayed it without Python).")
    fwd, fwd_kept = stats.get("routed_forward_nodes", {}), stats.get("forward_not_routed", {})
    if fwd or fwd_kept:
        text = f"Forward nodes: {_plural(sum(fwd.values()), 'stock attention forward')}"
        if fwd:
            text += " (" + ", ".join(f"{n} {BACKEND_WORDS.get(b, b)}" for b, n in fwd.items()) + ")"
        text += (" routed to torch_sm90_sdpa, each with its backward where the graph held it"
                 if fwd else " routed")
        if fwd_kept:
            text += f"; {sum(fwd_kept.values())} kept on stock: " + "; ".join(
                _because(reason, n) for reason, n in fwd_kept.items())
        parts.append(text + ".")
    elif stats.get("forward") is False and stats["enabled"]:
        parts.append("Forward nodes stay on stock (enable(forward=False); enable() routes "
                     "masked ones).")
    masks = stats["causal_masks"]
    if masks:
        parts.append("Masks: " + "; ".join(f"{n} {outcome}" for outcome, n in masks.items())
                     + " (a dropped mask was proved causal and became is_causal=True).")
    return " ".join(parts)


def reset_stats() -> None:
    """Zero the counts of :func:`routing_stats`."""
    global _cache_hits_at_reset
    ops.reset_routed_calls()
    _cache_hits_at_reset = _cache_hits()
    compile_pass = sys.modules.get(_PASS_MODULE)
    if compile_pass is not None:
        compile_pass.decision_counts.clear()
        compile_pass.recent_decisions.clear()
        compile_pass.graphs_examined = 0
    causal_masks = sys.modules.get(_MASK_MODULE)
    if causal_masks is not None:
        causal_masks.decision_counts.clear()
    forward_pass = sys.modules.get(_JOINT_MODULE)
    if forward_pass is not None:
        forward_pass.decision_counts.clear()


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
    if v in _ENV_FORWARD:
        return enable(forward=True)
    if v in _ENV_BACKWARD:
        return enable(forward=False)
    msg = (f"{ENV_VAR}={value!r} is not understood (expected 1 / on / cuda, cpu, all, backward, "
           "forward, or 0 / off); routing stays off")
    warnings.warn(msg, stacklevel=2)
    log.warning(msg)
    return None
