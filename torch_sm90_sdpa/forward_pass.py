"""The joint-graph rewrite: SDPA forward nodes -> ``torch_sm90_sdpa::sdpa_forward``, together with
the backward nodes that read them.

:class:`JointGraphRewrite` is the pass :mod:`torch_sm90_sdpa.routing` installs as
``torch._inductor.config.joint_custom_pre_pass`` (chained with the user's pass there). Inductor
runs it on the joint forward + backward graph of a training compile, before the partitioner
splits it, and on the forward graph of an inference compile (no grad: evaluation, prefill). It

1. drops masks that are provably causal (:mod:`torch_sm90_sdpa.causal_masks`, ``causal_masks``);
2. routes forward nodes (``forward``): each node of
   ``aten._scaled_dot_product_{cudnn,flash,efficient}_attention`` (and, with the CPU route on,
   ``_scaled_dot_product_flash_attention_for_cpu``) is described from its fake tensors and asked
   :func:`torch_sm90_sdpa.policy.decide_forward` (what the forward kernel serves, then the
   forward's speed gate). Where the graph also holds the node's backward, that is asked
   :func:`torch_sm90_sdpa.policy.decide` as the post-grad rewrite would; the forward is routed
   only with it, so our backward reads our forward's out and lse directly and no stock backward
   ever reads our lse. Both are replaced in one step; a forward without a backward (inference,
   or inputs that need no gradient) is replaced alone. A backward whose forward stays on stock
   is left to the post-grad rewrite (:mod:`torch_sm90_sdpa.compile_pass`).

**The mask.** SDPA hands the fused ops a boolean mask as an additive bias it makes at trace
time: ``where(logical_not(mask), fill, 0)`` with fill -inf (memory-efficient, CPU) or -65504
(cuDNN, torch's workaround for a cuDNN issue), possibly padded, sliced back and expanded over the
heads for the memory-efficient kernel. :func:`bool_mask_of` finds the boolean mask behind that
bias and the rewrite hands it to our ops: the forward kernel's tile classification reads a
boolean mask as bits, where a finite fill would leave every tile partial. For a cuDNN node the
ops get ``mask | ~mask.any(-1, keepdim=True)`` (:func:`_dead_rows_opened`, one per mask): a row
the mask hides entirely (left padding) then attends to every key, which is what stock cuDNN's
-65504 fill gives it, and the results are stock's on every row (with the plain mask such a row
would get 0, lse -inf and no gradient, as in SDPA's other fused kernels, and a loss that reads
it, such as a pad position predicting the first token, would differ). A bias found nowhere
behind a bool mask is handed over as it is.

**What replaces what.** ``sdpa_forward(q, k, v, is_causal, scale, enable_gqa, attn_mask)``
gives out (copied into the stock node's strides where ``empty_like(q)``'s differ) and lse
[B, Hq, Sq] fp32; ``sdpa_backward(grad_out, q, k, v, out, lse, is_causal, scale, deterministic,
attn_mask)`` replaces the backward with its outputs in the stock strides
(``compile_pass._plan``). The forward node's other outputs (cuDNN's cum_seq / max / philox
outputs, the lse) may be read by its backward only. The new nodes carry
``meta["eager_input_vals"]`` (Inductor then keeps the layouts the policy checked). Our forward
op checks its call again at run time and runs the stock forward (in the same layouts) where the
kernel cannot take it after all (a TMA-unreadable address).

Decisions are counted (:data:`decision_counts`: ``routing_stats()["routed_forward_nodes"]``
and ``["forward_not_routed"]``) and logged on the ``torch_sm90_sdpa`` logger; a backward
replaced here counts in the backward's counts (``routed_nodes``) as well.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import math
import operator
import os
from typing import Any, Optional

import torch
import torch.fx
from torch._inductor import custom_graph_pass as _cgp

from . import causal_masks, compile_pass, policy
from .compile_pass import _val, bind_args, run_user_passes, source_hash, user_passes_uuid

log = logging.getLogger("torch_sm90_sdpa")
aten = torch.ops.aten
prims = torch.ops.prims

FORWARD_OP = torch.ops.torch_sm90_sdpa.sdpa_forward.default
_BACKEND_BY_TARGET = {op: name for name, op in policy.STOCK_FORWARD_OPS.items()}
# The forward node's argument that holds SDPA's mask (its additive form), per backend.
_MASK_ARG = {"cudnn": "attn_bias", "efficient": "attn_bias", "cpu_flash": "attn_mask"}
_OUT, _LSE = 0, 1  # the forward nodes' outputs we produce

# Compile-time forward decisions in this process: ("routed", backend) / ("not routed", reason).
decision_counts: collections.Counter = collections.Counter()


# ---------------------------------------------------------------------------------------
# the boolean mask behind SDPA's bias
# ---------------------------------------------------------------------------------------

# The fills SDPA gives masked positions when it converts a boolean mask: -inf, and for cuDNN
# nodes -65504 (fp16's lowest; -65536 once rounded to bf16).
_CUDNN_FILLS = (-65504.0, -65536.0)


def _constant(x, graph_module) -> Optional[float]:
    """The value of a scalar argument: a number, or a 0-d constant node (scalar_tensor, full,
    a 0-d get_attr constant, possibly cast), else None."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    if not isinstance(x, torch.fx.Node):
        return None
    val = x.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dim() != 0:
        return None
    if x.op == "get_attr" and graph_module is not None:
        t = getattr(graph_module, x.target, None)
        return float(t.item()) if isinstance(t, torch.Tensor) and t.numel() == 1 else None
    packet = getattr(x.target, "overloadpacket", None)
    if packet is aten.scalar_tensor:
        return _constant(x.args[0], graph_module)
    if packet is aten.full and not x.args[0]:
        return _constant(x.args[1], graph_module)
    if packet in (aten._to_copy, aten.lift_fresh_copy, aten.clone, prims.convert_element_type):
        return _constant(x.args[0], graph_module)
    return None


def _strip_leading_ones(shape) -> tuple:
    shape = list(shape)
    while shape and compile_pass.statically_known_true(shape[0] == 1):
        shape.pop(0)
    return tuple(shape)


def _same_shape(a, b) -> bool:
    return len(a) == len(b) and all(compile_pass.statically_known_true(x == y)
                                    for x, y in zip(a, b))


def _through_layout_ops(n: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The node `n`'s value comes from by broadcasting, leading unit dims, copies, dtype casts,
    or padding sliced back off (the steps SDPA's frontend takes with a bias), or None."""
    while True:
        if n.op != "call_function":
            return None
        packet = getattr(n.target, "overloadpacket", None)
        if packet is aten.where:
            return n
        src = n.args[0] if n.args else None
        if not isinstance(src, torch.fx.Node):
            return None
        if packet in (aten.expand, aten.alias, aten.clone, aten.unsqueeze, aten._to_copy,
                      prims.convert_element_type):
            if packet is aten._to_copy and set(n.kwargs) - {"dtype", "layout", "memory_format"}:
                return None
            n = src
            continue
        if packet in (aten.view, aten._unsafe_view, aten.reshape):
            if not _same_shape(_strip_leading_ones(n.meta["val"].shape),
                               _strip_leading_ones(src.meta["val"].shape)):
                return None
            n = src
            continue
        if packet is aten.slice:
            # x[..., 0:size] of constant_pad_nd(y) padded at the end only: y itself
            dim, start, end, step = (list(n.args[1:]) + [0, 0, None, 1][len(n.args) - 1:])[:4]
            if src.target is not aten.constant_pad_nd.default or start != 0 or step != 1:
                return None
            pad = list(src.args[1])
            if any(p != 0 for p in pad[0::2]):  # the "before" amounts
                return None
            y = src.args[0]
            if not _same_shape(n.meta["val"].shape, y.meta["val"].shape):
                return None
            n = y
            continue
        return None


def bool_mask_of(bias: torch.fx.Node, backend: str) -> Optional[torch.fx.Node]:
    """The boolean mask (True = attend) whose conversion by SDPA the forward node's bias is,
    broadcast-equivalent to it, or None: the bias is where(~mask, fill, 0) (or
    where(mask, 0, fill)) with fill -inf (or, for cuDNN nodes, torch's -65504), reached through
    the steps of :func:`_through_layout_ops`."""
    found = _bool_mask_and_fill(bias, backend)
    return found[0] if found is not None else None


def _bool_mask_and_fill(bias: torch.fx.Node, backend: str) -> Optional[tuple[torch.fx.Node, float]]:
    """(the boolean mask of :func:`bool_mask_of`, the fill SDPA gave its hidden positions)."""
    where = _through_layout_ops(bias)
    if where is None or len(where.args) != 3:
        return None
    cond, a, b = where.args
    if not isinstance(cond, torch.fx.Node):
        return None
    gm = getattr(bias.graph, "owning_module", None)
    inverted = getattr(cond.target, "overloadpacket", None) in (aten.logical_not, aten.bitwise_not)
    mask = cond.args[0] if inverted else cond
    fill, zero = (a, b) if inverted else (b, a)
    if not isinstance(mask, torch.fx.Node):
        return None
    mval = mask.meta.get("val")
    if not isinstance(mval, torch.Tensor) or mval.dtype != torch.bool:
        return None
    if _constant(zero, gm) != 0.0:
        return None
    fill = _constant(fill, gm)
    if fill is None or not (fill == -math.inf or (backend == "cudnn" and fill in _CUDNN_FILLS)):
        return None
    wval = where.meta.get("val")
    if not isinstance(wval, torch.Tensor) or not _same_shape(wval.shape, mval.shape):
        return None  # (the mask broadcast by a fill or zero of more dims)
    return mask, fill


# ---------------------------------------------------------------------------------------
# reading a forward node and its backward
# ---------------------------------------------------------------------------------------


def _describe(node: torch.fx.Node, backend: str):
    """(AttentionForwardCall, {name: node}) of a stock forward node; nodes["mask"] is what our
    ops get (the boolean mask behind SDPA's bias where there is one)."""
    a = bind_args(node)
    bias = a.get(_MASK_ARG[backend]) if backend in _MASK_ARG else None
    mask, fill = bias, None
    if isinstance(bias, torch.fx.Node):
        mask, fill = _bool_mask_and_fill(bias, backend) or (bias, None)
    call = policy.AttentionForwardCall(
        backend=backend, q=_val(a["query"]), k=_val(a["key"]), v=_val(a["value"]),
        is_causal=bool(a.get("is_causal", False)), dropout_p=a.get("dropout_p", 0.0),
        scale=a.get("scale"), mask=_val(mask) if isinstance(mask, torch.fx.Node) else None,
        debug_mask=bool(a.get("return_debug_mask", False)),
    )
    nodes = {"q": a["query"], "k": a["key"], "v": a["value"], "bias": bias,
             "mask": mask if isinstance(mask, torch.fx.Node) else None,
             "opens_dead_rows": fill in _CUDNN_FILLS}
    return call, nodes


def _getitems(node: torch.fx.Node) -> Optional[dict]:
    """{index: [getitem nodes]} of a multi-output node's users, or None if one is not a
    getitem."""
    by_index: dict = collections.defaultdict(list)
    for user in node.users:
        if user.op != "call_function" or user.target is not operator.getitem:
            return None
        by_index[user.args[1]].append(user)
    return by_index


def _unaliased(n):
    """The node `n` aliases (through alias / detach nodes: the joint graph saves out that way)."""
    while (isinstance(n, torch.fx.Node) and n.op == "call_function"
           and getattr(n.target, "overloadpacket", None) in (aten.alias, aten.detach)):
        n = n.args[0]
    return n


def _backward_of(node, backend, getitems, nodes) -> tuple[Optional[torch.fx.Node], str]:
    """(the stock backward node that reads this forward's outputs, or None; "" or why the
    forward cannot be replaced: an output read elsewhere, a backward of other arguments)."""
    backward_op = policy.STOCK_BACKWARD_OPS[backend]
    readers = {u for idx, gs in getitems.items() if idx != _OUT for g in gs for u in g.users}
    if not readers:
        return None, ""
    if len(readers) != 1:
        return None, f"{len(readers)} nodes read the forward's extra outputs"
    (bwd,) = readers
    if bwd.target is not backward_op:
        return None, f"{bwd.target} reads the forward's extra outputs"
    b = bind_args(bwd)
    out_items, lse_items = getitems.get(_OUT, []), getitems.get(_LSE, [])
    same = (b["query"] is nodes["q"] and b["key"] is nodes["k"] and b["value"] is nodes["v"]
            and _unaliased(b["out"]) in out_items and b["logsumexp"] in lse_items
            and b.get(_MASK_ARG.get(backend, ""), None) is nodes["bias"])
    fwd_args = bind_args(node)
    for name in ("is_causal", "dropout_p", "scale"):
        same = same and b.get(name) == fwd_args.get(name)
    if not same:
        return None, "its backward node takes other arguments"
    return bwd, ""


# ---------------------------------------------------------------------------------------
# the rewrite
# ---------------------------------------------------------------------------------------


def _record(backend: str, decision: policy.Decision, description: str) -> None:
    compile_pass.record_decision(decision_counts, policy.STOCK_FORWARD_OPS[backend],
                                 "torch_sm90_sdpa.sdpa_forward", backend, decision, description,
                                 what="forward ")


def _dead_rows_opened(plan, mask: torch.fx.Node, opened: dict) -> tuple:
    """The plan argument of ``mask | ~mask.any(-1, keepdim=True)`` [..., Sq, Sk] bool: the
    boolean mask with every row it hides entirely opened to every key. That is what stock cuDNN
    computes from torch's -65504 fill: such a row's scores all carry the same offset, so its
    softmax runs over every key (the -inf of our kernels would give it out 0, lse -inf and no
    gradient). A row with one visible key is unchanged (exp(-65504) is 0 in fp32). `opened`
    ({mask node: opened node}, one graph's) lets the forward nodes of one mask share the node
    the first of them inserted."""
    if mask in opened:
        return ("node", opened[mask])
    visible = plan.add("mask any", aten.any.dim, [("node", mask), -1, True])
    dead = plan.add("mask dead rows", aten.logical_not.default, [visible])
    return plan.add("mask opened", aten.logical_or.default, [("node", mask), dead])


def _route_one(graph, node, backend, *, cpu_route, only_faster,
               opened: Optional[dict] = None) -> tuple[policy.Decision, str]:
    """Decide and, where routed, replace one forward node (and its backward). Returns the
    forward's decision and the description for the log. `opened`: see
    :func:`_dead_rows_opened`."""
    call, nodes = _describe(node, backend)
    description = policy.describe(call)
    decision = policy.decide_forward(call, cpu_route=cpu_route, only_faster=only_faster)
    if not decision.routed:
        return decision, description
    getitems = _getitems(node)
    if getitems is None:
        return policy.Decision(False, policy.R_OUTPUTS, "a user is not a getitem"), description
    bwd, why = _backward_of(node, backend, getitems, nodes)
    if why:
        return policy.Decision(False, policy.R_OUTPUTS, why), description
    bcall = bnodes = busers = None
    if bwd is not None:
        bcall, bnodes = compile_pass._describe_node(bwd, backend)
        bcall = dataclasses.replace(bcall, mask=call.mask)
        bdecision = policy.decide(bcall, cpu_route=cpu_route, only_faster=only_faster)
        busers = compile_pass._output_users(bwd) if bdecision.routed else None
        if bdecision.routed and busers is None:
            bdecision = policy.Decision(False, policy.R_OUTPUTS,
                                        "an output other than dq/dk/dv is used")
        if not bdecision.routed:
            return policy.Decision(False, policy.R_BACKWARD_KEPT,
                                   f"its backward is not routed ({bdecision.reason}: "
                                   f"{bdecision.detail})"), description

    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode([call.q])
    scale = policy.resolved_scale(call)
    plan = compile_pass._Plan(fake_mode, node)
    gqa = not compile_pass.statically_known_true(call.q.size(1) == call.k.size(1))
    args = [("node", nodes["q"]), ("node", nodes["k"]), ("node", nodes["v"]), call.is_causal,
            scale, gqa]
    mask_arg = None
    if nodes["mask"] is not None:
        mask_arg = ("node", nodes["mask"])
        if nodes["opens_dead_rows"]:
            mask_arg = _dead_rows_opened(plan, nodes["mask"], {} if opened is None else opened)
        args.append(mask_arg)
    fwd = plan.add("fwd", FORWARD_OP, args)
    plan.add("fwd out", operator.getitem, [fwd, 0])
    plan.add("fwd lse", operator.getitem, [fwd, 1])
    old = node.meta.get("val")
    out_key, why = plan.keep_layout("fwd out", old[_OUT] if isinstance(old, (tuple, list))
                                    else None, "forward out")
    if out_key is None:
        return policy.Decision(False, policy.R_LAYOUT, why), description
    if bwd is not None:
        bnodes = dict(bnodes, out=("ref", out_key), lse=("ref", "fwd lse"), mask=mask_arg)
        _, why = compile_pass._plan(bwd, backend, bcall, bnodes, scale, fake_mode, plan=plan,
                                    lse_ready=True)
        if why:
            return policy.Decision(False, policy.R_LAYOUT, why), description

    created = compile_pass.insert_plan(graph, plan)
    if "mask opened" in created and opened is not None:
        opened[nodes["mask"]] = created["mask opened"]
    if bwd is not None:
        compile_pass.replace_outputs(graph, bwd, busers,
                                     {i: created[k] for i, k in plan.outputs.items()})
        compile_pass._record(backend, policy.ROUTE, policy.describe(bcall), cpu_route)
    compile_pass.replace_outputs(graph, node, getitems, {_OUT: created[out_key]})
    return policy.ROUTE, description


def route_forward_nodes(graph: torch.fx.Graph, *, cpu_route: bool = False,
                        only_faster: bool = True) -> list:
    """Replace the eligible stock SDPA forward nodes of `graph` (and their backward nodes) in
    place. Returns [(backend, Decision)] for every stock forward node seen."""
    results = []
    opened: dict = {}
    for node, backend in compile_pass.stock_nodes(graph, _BACKEND_BY_TARGET):
        try:
            decision, description = _route_one(graph, node, backend, cpu_route=cpu_route,
                                               only_faster=only_faster, opened=opened)
        except Exception as exc:  # a plugin must never break a compile
            decision, description = compile_pass.unreadable(exc), backend
        _record(backend, decision, description)
        results.append((backend, decision))
    if any(d.routed for _, d in results):
        graph.eliminate_dead_code()
        graph.lint()
    return results


class JointGraphRewrite(_cgp.CustomGraphPass):
    """Inductor joint-graph pass: drops provably causal masks (``causal_masks``), routes forward
    nodes with their backward (``forward``), then runs the user's pass(es) set before."""

    def __init__(self, causal_masks: bool = True, forward: bool = True, cpu: bool = False,
                 only_faster: bool = True, user_pass: Any = None):
        self.causal_masks = bool(causal_masks)
        self.forward = bool(forward)
        self.cpu = bool(cpu)
        self.only_faster = bool(only_faster)
        self.user_pass = user_pass

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.causal_masks:
            try:  # (first: a dropped mask leaves an is_causal node, which routes unmasked)
                causal_masks.drop_causal_masks(graph)
            except Exception as exc:  # never break a compile
                log.warning("causal-mask pass skipped: %s: %s", type(exc).__name__, exc)
        if self.forward:
            route_forward_nodes(graph, cpu_route=self.cpu, only_faster=self.only_faster)
        run_user_passes(self.user_pass, graph)

    def uuid(self) -> Optional[str]:
        user_uuid, cacheable = user_passes_uuid(self.user_pass)
        if not cacheable:
            return None  # Inductor bypasses its cache for a pass without uuid; so do we
        here = os.path.dirname(os.path.abspath(__file__))
        return "torch_sm90_sdpa-joint-" + hashlib.sha256(repr((
            source_hash(), source_hash((os.path.join(here, "causal_masks.py"),
                                        os.path.abspath(__file__))),
            causal_masks.MAX_EVAL_ELEMENTS, self.causal_masks, self.forward, self.cpu,
            self.only_faster,
            torch.__version__, torch.are_deterministic_algorithms_enabled(),
            policy.policy_fingerprint(), user_uuid,
        )).encode()).hexdigest()

    def __repr__(self) -> str:
        return (f"JointGraphRewrite(causal_masks={self.causal_masks}, forward={self.forward}, "
                f"cpu={self.cpu}, only_faster={self.only_faster}, user_pass={self.user_pass!r})")
