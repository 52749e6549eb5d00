"""The torch.compile rewrite: stock SDPA backward nodes -> ``torch_sm90_sdpa::sdpa_backward``.

:class:`SdpaBackwardRewrite` is an Inductor ``CustomGraphPass``; :mod:`torch_sm90_sdpa.routing`
installs it as ``torch._inductor.config.post_grad_custom_post_pass``, chained with the
pass the user had there (which still runs, after ours, on the rewritten graph).

In each post-grad graph it finds the nodes of
``aten._scaled_dot_product_{cudnn,flash,efficient}_attention_backward.default`` (and, with
the CPU route on, ``aten._scaled_dot_product_flash_attention_for_cpu_backward.default``),
describes each from its arguments' fake tensors (``node.meta["val"]``), asks
:func:`torch_sm90_sdpa.policy.decide`, and replaces the eligible ones:

* the logsumexp becomes the op's [B, H, Sq] view: cuDNN's [B, H, Sq, 1] is selected at
  index 0 of its last dim, the efficient op's [B, H, pad32(Sq)] is sliced to Sq;
* ``scale=None`` becomes 1/sqrt(D); ``deterministic`` is
  ``torch.are_deterministic_algorithms_enabled()`` at compile time (Dynamo guards on it);
* each output keeps the shape and strides of the stock node's output: where our op's
  ``empty_like`` strides differ (e.g. the CPU op returns [B, S, H, D] memory for a
  [B, H, S, D]-contiguous query), the output is copied into the stock layout
  (permute -> contiguous clone -> inverse permute);
* the stock node's other outputs (the efficient op's grad_bias) must be unused; the
  forward node and its extra outputs (philox seed / offset, debug mask) are not touched;
* the new node carries ``meta["eager_input_vals"]``: without it Inductor applies no layout
  constraint to a custom op inserted by a pass, and could feed it layouts other than the
  ones the policy checked (alignment, contiguous last dim).

Decisions are counted (:data:`decision_counts`) and logged on the ``torch_sm90_sdpa``
logger: routed at INFO, not routed at INFO (CUDA) or DEBUG (a CPU node with the CPU route
off). These are compile-time counts: on an FX graph cache hit the pass does not run.

``uuid()`` hashes everything that decides what the pass does: its sources and the op's
(ops.py, policy.py, eligibility.py, speed_gate.py, _problem.py, _validation.py, this file),
the routing options, the compiled variants (``build_info()``), the GPUs' compute
capabilities, the deterministic flag, torch's version and the chained user pass's uuid. It is None (no FX graph caching, as
Inductor does for any pass without a uuid) only if the user's chained pass has none.
"""
from __future__ import annotations

import collections
import hashlib
import logging
import operator
import os
from typing import Any, Callable, Optional

import torch
import torch.fx
from torch._inductor import custom_graph_pass as _cgp
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import ops as _ops  # noqa: F401  (the op must be registered before we insert it)
from . import policy

log = logging.getLogger("torch_sm90_sdpa")

aten = torch.ops.aten
OUR_OP = torch.ops.torch_sm90_sdpa.sdpa_backward.default
_BACKEND_BY_TARGET = {op: name for name, op in policy.STOCK_BACKWARD_OPS.items()}

# Bump when the rewrite's output changes in a way the source hash would not see.
_REWRITE_VERSION = 1
_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_SOURCE_FILES = tuple(
    os.path.join(_PKG_DIR, f)
    for f in ("compile_pass.py", "policy.py", "eligibility.py", "speed_gate.py", "_problem.py",
              "ops.py", "_validation.py")
)

# Compile-time decisions in this process: ("routed", backend) and ("not routed", reason).
decision_counts: collections.Counter = collections.Counter()
# The last decisions, newest last: (backend, Decision, description).
recent_decisions: collections.deque = collections.deque(maxlen=256)
# Graphs the pass ran on in this process (routing_stats()["graphs_compiled"]).
graphs_examined = 0

_Base = getattr(_cgp, "CustomInferenceAwareGraphPass", _cgp.CustomGraphPass)


# ---------------------------------------------------------------------------------------
# the pass
# ---------------------------------------------------------------------------------------


def _as_pass_list(p) -> tuple:
    if p is None:
        return ()
    if isinstance(p, (list, tuple)):
        return tuple(p)
    return (p,)


def source_hash(paths=None) -> str:
    """sha256 of these files (names and contents; default _SOURCE_FILES): part of our passes'
    cache keys."""
    h = hashlib.sha256()
    for path in _SOURCE_FILES if paths is None else paths:
        h.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def run_user_passes(user_pass, graph: torch.fx.Graph, is_inference: Optional[bool] = None) -> None:
    """Run the pass(es) the user had installed before ours (a pass or a list of them)."""
    for p in _as_pass_list(user_pass):
        if is_inference is not None and isinstance(
            p, getattr(_cgp, "CustomInferenceAwareGraphPass", ())
        ):
            p(graph, is_inference=is_inference)
        else:
            p(graph)


def user_passes_uuid(user_pass) -> tuple[Optional[tuple], bool]:
    """(the uuids of the user's pass(es), cacheable): not cacheable when one has no uuid."""
    uuids = []
    for p in _as_pass_list(user_pass):
        u = p.uuid() if isinstance(p, _cgp.CustomGraphPass) else None
        if u is None:
            return None, False
        uuids.append(u)
    return tuple(uuids), True


class SdpaBackwardRewrite(_Base):
    """Inductor post-grad pass: routes eligible SDPA backward nodes to our op, then runs
    the user's pass(es) that were set before (``user_pass``) on the result."""

    def __init__(self, cpu: bool = False, user_pass: Any = None, only_faster: bool = True):
        self.cpu = bool(cpu)
        self.only_faster = bool(only_faster)
        self.user_pass = user_pass

    def __call__(self, graph: torch.fx.Graph, is_inference: Optional[bool] = None) -> None:
        global graphs_examined
        graphs_examined += 1
        rewrite_graph(graph, cpu_route=self.cpu, only_faster=self.only_faster)
        run_user_passes(self.user_pass, graph, is_inference)

    def uuid(self) -> Optional[str]:
        user, cacheable = user_passes_uuid(self.user_pass)
        if not cacheable:
            # Inductor bypasses the FX graph cache for a pass without uuid; so do we.
            return None
        h = hashlib.sha256()
        h.update(source_hash().encode())
        h.update(repr((
            _REWRITE_VERSION,
            self.cpu,
            self.only_faster,
            torch.__version__,
            torch.are_deterministic_algorithms_enabled(),
            policy.policy_fingerprint(),
            user,
        )).encode())
        return "torch_sm90_sdpa-" + h.hexdigest()

    def __repr__(self) -> str:
        return (f"SdpaBackwardRewrite(cpu={self.cpu}, only_faster={self.only_faster}, "
                f"user_pass={self.user_pass!r})")


# ---------------------------------------------------------------------------------------
# reading a stock backward node
# ---------------------------------------------------------------------------------------


def bind_args(node: torch.fx.Node) -> dict:
    """Argument name -> value (fx Nodes or constants) of an aten node, from its schema
    (defaults filled in)."""
    schema = node.target._schema
    bound = {}
    positional = [a for a in schema.arguments if not a.kwarg_only]
    for a, v in zip(positional, node.args):
        bound[a.name] = v
    bound.update(node.kwargs)
    for a in schema.arguments:
        if a.name not in bound:
            bound[a.name] = a.default_value if a.has_default_value() else None
    return bound


def _val(x):
    return x.meta.get("val") if isinstance(x, torch.fx.Node) else x


def _describe_node(node: torch.fx.Node, backend: str) -> tuple[policy.AttentionBackwardCall, dict]:
    a = bind_args(node)
    # SDPA hands the cuDNN and memory-efficient ops its mask as an additive bias (a bool mask
    # converted to 0 / -inf), the CPU op as attn_mask
    mask_arg = {"cpu_flash": "attn_mask", "cudnn": "attn_bias",
                "efficient": "attn_bias"}.get(backend)
    mask_node = a.get(mask_arg) if mask_arg is not None else None
    mask_val = _val(mask_node)
    nested = any(_val(a.get(n)) is not None for n in ("cum_seq_q", "cum_seq_k"))
    needs_grad = False
    if backend == "efficient":
        wanted = a.get("grad_input_mask") or [True, True, True, False]
        needs_grad = bool(wanted[3]) and mask_val is not None
    call = policy.AttentionBackwardCall(
        backend=backend,
        grad_out=_val(a.get("grad_out", a.get("grad_out_"))),
        q=_val(a["query"]),
        k=_val(a["key"]),
        v=_val(a["value"]),
        out=_val(a["out"]),
        lse=_val(a["logsumexp"]),
        is_causal=bool(a.get("is_causal", False)),
        dropout_p=a.get("dropout_p", 0.0),
        scale=a.get("scale"),
        mask=mask_val,
        mask_needs_grad=needs_grad,
        nested=nested,
        deterministic=torch.are_deterministic_algorithms_enabled(),
    )
    nodes = {
        "grad_out": a.get("grad_out", a.get("grad_out_")),
        "q": a["query"], "k": a["key"], "v": a["value"], "out": a["out"],
        "lse": a["logsumexp"],
        "mask": mask_node if mask_val is not None else None,
    }
    return call, nodes


def _output_users(node: torch.fx.Node):
    """{index: [getitem nodes]} of the node's users, or None if a user is something else
    or uses an output we do not produce (the efficient op's grad_bias)."""
    by_index: dict = collections.defaultdict(list)
    for user in node.users:
        if user.op != "call_function" or user.target is not operator.getitem:
            return None
        idx = user.args[1]
        if not isinstance(idx, int):
            return None
        if idx >= 3 and user.users:
            return None
        by_index[idx].append(user)
    return by_index


# ---------------------------------------------------------------------------------------
# layouts
# ---------------------------------------------------------------------------------------


def _hint(x) -> Optional[int]:
    if isinstance(x, torch.SymInt):
        return x.node.hint
    return int(x)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and the same strides in every dim of size != 1."""
    if a.dim() != b.dim():
        return False
    for sa, sb, ta, tb in zip(a.shape, b.shape, a.stride(), b.stride()):
        if not statically_known_true(sa == sb):
            return False
        if statically_known_true(sa <= 1):
            continue
        if not statically_known_true(ta == tb):
            return False
    return True


def _outer_to_inner(t: torch.Tensor) -> Optional[list]:
    """The permutation that makes t contiguous (dims by decreasing stride)."""
    hints = [_hint(s) for s in t.stride()]
    sizes = [_hint(s) for s in t.shape]
    if any(h is None for h in hints + sizes):
        return None
    # size-1 dims can go anywhere; keep them in their original place among equals
    return sorted(range(t.dim()), key=lambda i: (-hints[i], sizes[i] != 1, i))


# ---------------------------------------------------------------------------------------
# the rewrite
# ---------------------------------------------------------------------------------------


class _Plan:
    """New nodes computed on fake tensors before the graph is touched: each step's target,
    arguments (("ref", key) for a step of this plan, ("node", n) for a graph node, constants),
    value, and the node it is inserted before (`anchor`, set by the caller per group of steps)."""

    def __init__(self, fake_mode, anchor: torch.fx.Node):
        self.fake_mode = fake_mode
        self.anchor = anchor
        # (key, target, args, kwargs, val, input vals, anchor)
        self.steps: list = []
        self.vals: dict = {}
        self.outputs: dict = {}  # backward output index -> key of the step that replaces it

    def val_of(self, x):
        if isinstance(x, tuple) and len(x) == 2 and x[0] == "ref":
            return self.vals[x[1]]
        if isinstance(x, tuple) and len(x) == 2 and x[0] == "node":
            return x[1].meta["val"]
        return x

    def add(self, key, target, args, kwargs=None) -> tuple:
        kwargs = kwargs or {}
        arg_vals = [self.val_of(x) for x in args]
        kwarg_vals = {k: self.val_of(x) for k, x in kwargs.items()}
        v = _run_fake(self.fake_mode, target, arg_vals, kwarg_vals)
        self.vals[key] = v
        self.steps.append((key, target, args, kwargs, v, (tuple(arg_vals), kwarg_vals),
                           self.anchor))
        return ("ref", key)

    def keep_layout(self, key: str, want, prefix: str) -> tuple[Optional[str], str]:
        """(the key of a step giving `key`'s value in `want`'s shape and strides, "") or (None,
        why not): `key` itself, or a copy (permute -> contiguous clone -> inverse permute)."""
        if want is None or _same_layout(self.vals[key], want):
            return key, ""
        perm = _outer_to_inner(want)
        if perm is None:
            return None, f"{prefix} layout {tuple(want.stride())} is not static"
        inverse = [perm.index(d) for d in range(len(perm))]
        p = self.add(f"{prefix} perm", aten.permute.default, [("ref", key), perm])
        c = self.add(f"{prefix} clone", aten.clone.default, [p],
                     {"memory_format": torch.contiguous_format})
        self.add(f"{prefix} fixed", aten.permute.default, [c, inverse])
        got = self.vals[f"{prefix} fixed"]
        if not _same_layout(got, want):
            return None, (f"{prefix}: cannot rebuild the stock layout {tuple(want.stride())} "
                          f"(got {tuple(got.stride())})")
        return f"{prefix} fixed", ""


def _run_fake(fake_mode, target, args, kwargs):
    if fake_mode is None:
        return target(*args, **kwargs)
    with fake_mode:
        return target(*args, **kwargs)


def _as_arg(x):
    """A plan argument: a step reference or ("node", n) as it is, a graph node as ("node", n)."""
    if isinstance(x, tuple) and len(x) == 2 and x[0] in ("ref", "node"):
        return x
    return ("node", x)


def _plan(node, backend, call, nodes, scale, fake_mode, plan: Optional[_Plan] = None,
          lse_ready: bool = False) -> tuple[Optional[_Plan], str]:
    """The steps replacing backward node `node` by our op (added to `plan` if given). nodes:
    its inputs by name (graph nodes, or references to steps of `plan`). lse_ready: nodes["lse"]
    is already our [B, H, Sq] logsumexp (the forward rewrite's), not the backend's."""
    if plan is None:
        plan = _Plan(fake_mode, node)
    plan.anchor = node
    lse = _as_arg(nodes["lse"])
    if not lse_ready and backend == "cudnn":
        lse = plan.add("lse", aten.select.int, [lse, 3, 0])
    elif not lse_ready and backend == "efficient":
        sq = call.q.size(2)
        if not statically_known_true(call.lse.size(2) == sq):
            if isinstance(sq, torch.SymInt):
                sq = plan.add("seqlen_q", aten.sym_size.int, [_as_arg(nodes["q"]), 2])
            lse = plan.add("lse", aten.slice.Tensor, [lse, 2, 0, sq])

    args = [_as_arg(nodes[n]) for n in ("grad_out", "q", "k", "v", "out")]
    args += [lse, call.is_causal, scale, call.deterministic]
    if nodes.get("mask") is not None:
        args.append(_as_arg(nodes["mask"]))
    op_ref = plan.add("op", OUR_OP, args)
    old_vals = node.meta.get("val")
    for i in range(3):
        plan.add(f"out{i}", operator.getitem, [op_ref, i])
        want = old_vals[i] if isinstance(old_vals, (tuple, list)) else None
        key, why = plan.keep_layout(f"out{i}", want, f"output {i}")
        if key is None:
            return None, why
        plan.outputs[i] = key
    return plan, ""


# Our ops: Inductor pins their inputs' layouts (eager_input_vals) when a pass inserts them.
_PINNED_OPS = (OUR_OP, torch.ops.torch_sm90_sdpa.sdpa_forward.default)


def insert_plan(graph: torch.fx.Graph, plan: _Plan) -> dict:
    """Insert the plan's steps, each before its anchor node (whose metadata it inherits);
    returns {key: new node}."""
    created: dict = {}

    def resolve(x):
        if isinstance(x, tuple) and len(x) == 2 and x[0] == "ref":
            return created[x[1]]
        if isinstance(x, tuple) and len(x) == 2 and x[0] == "node":
            return x[1]
        if isinstance(x, list):
            return [resolve(y) for y in x]
        return x

    for key, target, args, kwargs, val, input_vals, anchor in plan.steps:
        with graph.inserting_before(anchor):
            new = graph.call_function(target, tuple(resolve(a) for a in args),
                                      {k: resolve(v) for k, v in kwargs.items()})
        new.meta["val"] = val
        if target in _PINNED_OPS:
            # Inductor constrains a custom op's inputs to exact strides only when the node
            # has eager_input_vals (nodes inserted by a pass otherwise get whatever layout
            # Inductor picks): these are the layouts the policy checked.
            new.meta["eager_input_vals"] = input_vals
        for m in ("stack_trace", "nn_module_stack", "seq_nr", "from_node"):
            if m in anchor.meta:
                new.meta[m] = anchor.meta[m]
        created[key] = new
    return created


def replace_outputs(graph: torch.fx.Graph, node: torch.fx.Node, users: dict,
                    replacement: dict) -> None:
    """Point the users of `node`'s getitems ({index: [getitem]}) at replacement[index] (an
    index without replacement must be unused), then erase the getitems and `node`."""
    for idx, getitems in users.items():
        for g in getitems:
            if idx in replacement:
                g.replace_all_uses_with(replacement[idx])
            graph.erase_node(g)
    graph.erase_node(node)


def _apply(graph: torch.fx.Graph, node: torch.fx.Node, plan: _Plan, users: dict) -> torch.fx.Node:
    created = insert_plan(graph, plan)
    replace_outputs(graph, node, users, {i: created[k] for i, k in plan.outputs.items()})
    return created["op"]


def record_decision(counts: collections.Counter, stock_op, our_op: str, backend: str,
                    decision: policy.Decision, description: str, what: str = "") -> None:
    """Count a decision ({("routed", backend) | ("not routed", reason): n}) and log it: routed
    and not-routed CUDA nodes at INFO, CPU nodes with the CPU route off at DEBUG."""
    op_name = str(stock_op).replace(".default", "")
    if decision.routed:
        counts[("routed", backend)] += 1
        log.info("routed %s (%s) -> %s", op_name, description, our_op)
    else:
        counts[("not routed", decision.reason)] += 1
        level = logging.DEBUG if decision.reason == policy.R_CPU_ROUTE_OFF else logging.INFO
        log.log(level, "%snot routed: %s (%s): %s", what, op_name, description, decision.detail)


def _record(backend: str, decision: policy.Decision, description: str, cpu_route: bool) -> None:
    recent_decisions.append((backend, decision, description))
    record_decision(decision_counts, policy.STOCK_BACKWARD_OPS[backend],
                    "torch_sm90_sdpa.sdpa_backward", backend, decision, description)


def stock_nodes(graph: torch.fx.Graph, backend_by_target: dict) -> list:
    """[(node, backend)] of the graph's nodes whose target is a key of backend_by_target (a
    list: the caller may rewrite the graph while walking it)."""
    return [(n, backend_by_target[n.target]) for n in graph.nodes
            if n.op == "call_function" and n.target in backend_by_target]


def unreadable(exc: Exception) -> policy.Decision:
    """The decision for a node the pass could not read: it stays as it is."""
    return policy.Decision(False, policy.R_SHAPES,
                           f"could not read the node: {type(exc).__name__}: {exc}")


def rewrite_graph(graph: torch.fx.Graph, *, cpu_route: bool = False,
                  only_faster: bool = True) -> list:
    """Replace the eligible stock SDPA backward nodes of `graph` in place.

    Returns [(backend, Decision)] for every stock backward node seen."""
    results = []
    for node, backend in stock_nodes(graph, _BACKEND_BY_TARGET):
        try:
            call, nodes = _describe_node(node, backend)
            description = policy.describe(call) if call.q is not None else backend
            decision = policy.decide(call, cpu_route=cpu_route, only_faster=only_faster)
        except Exception as exc:  # a plugin must never break a compile
            call, decision, description = None, unreadable(exc), backend
        users = _output_users(node) if decision.routed else None
        if decision.routed and users is None:
            decision = policy.Decision(False, policy.R_OUTPUTS,
                                       "an output other than dq/dk/dv is used")
        if decision.routed:
            try:
                from torch._guards import detect_fake_mode

                fake_mode = detect_fake_mode([call.q])
                plan, why = _plan(node, backend, call, nodes, policy.resolved_scale(call),
                                  fake_mode)
            except Exception as exc:
                plan, why = None, f"{type(exc).__name__}: {exc}"
            if plan is None:
                decision = policy.Decision(False, policy.R_LAYOUT, why)
            else:
                _apply(graph, node, plan, users)
        _record(backend, decision, description, cpu_route)
        results.append((backend, decision))
    if any(d.routed for _, d in results):
        graph.lint()
    return results
