"""Dropping masks that are provably causal, at compile time (Inductor's joint-graph pass).

Under torch.compile transformers materializes its causal mask instead of passing
``is_causal=True`` to SDPA, so the stock forward and backward run their masked kernels
(cuDNN's masked forward measured 3.7x its causal one, the backward 3.2x) and the mask is saved
for the backward. Where the mask is a pure function of sizes (no graph input feeds it: no
padding mask) it can be evaluated at compile time; if it is exactly SDPA's causal mask for
these sizes, both SDPA nodes (forward and backward, which the joint graph holds together,
before partitioning) become their ``is_causal=True`` forms without the mask. The result is
the stock causal kernels (or, after the post-grad rewrite, ours): the same function.

"Proven" means evaluated, never guessed: the mask's whole producer subgraph consists of pure
ops of an allow-list (iota, arange, comparisons, logical and arithmetic ops, views, where,
full, ...), every size is a static int (with symbolic sizes the mask is kept: the runtime tile
classification serves it), the mask is evaluated on the CPU at the actual sizes (up to
MAX_EVAL_ELEMENTS stored elements per node: broadcast dims count once) and compared, element by
element over every batch and head, with the top-left causal mask (bool masks: equal; float masks: 0 where causal keeps, -inf where it
masks). Only square attention (Sq == Sk) is rewritten, where every backend agrees on causal
alignment.

cuDNN nodes: torch hands them a boolean mask as a bias of 0 / -65504 (its
``convert_boolean_attn_mask_cudnn``, a workaround for a cuDNN issue with -inf; -65536 in bf16),
not 0 / -inf: measured on the H200, torch 2.11, with the probe of commit 2823953. Where every
user of the mask is a cuDNN node, that exact fill also counts as masked. What the user's program
asked for is a boolean causal mask, whose SDPA semantics are those of ``is_causal=True``
exactly; stock cuDNN's result with the -65504 fill equals that in fp32 (every row of a causal
mask keeps a key, and exp(s - 65504 - rowmax) is 0) unless the scores of a row spread over
more than about 65400, where cuDNN's fill itself departs from SDPA's semantics and from the
other backends.

    drop_causal_masks(graph) -> [(node name, "dropped" | reason)]: what the joint-graph pass
        (forward_pass.JointGraphRewrite, which routing.enable() installs as
        torch._inductor.config.joint_custom_pre_pass) runs first
"""
from __future__ import annotations

import collections
import logging
import operator
from typing import Optional

import torch
import torch.fx

from .compile_pass import bind_args
from .reference import causal_mask

log = logging.getLogger("torch_sm90_sdpa")
aten = torch.ops.aten
prims = torch.ops.prims

MAX_EVAL_ELEMENTS = 1 << 27  # a bigger mask is kept (the runtime classification serves it)

# SDPA nodes with a mask argument: target -> (mask argument name, is the backward)
SDPA_MASKED_NODES = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: ("attn_mask", False),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: ("attn_mask", True),
    aten._scaled_dot_product_cudnn_attention.default: ("attn_bias", False),
    aten._scaled_dot_product_cudnn_attention_backward.default: ("attn_bias", True),
    aten._scaled_dot_product_efficient_attention.default: ("attn_bias", False),
    aten._scaled_dot_product_efficient_attention_backward.default: ("attn_bias", True),
}

_CUDNN_NODES = (aten._scaled_dot_product_cudnn_attention.default,
                aten._scaled_dot_product_cudnn_attention_backward.default)

# Pure ops a mask may be built from (by their overload packets): no randomness, no state,
# no graph input. Anything else in the mask's producer subgraph keeps the mask.
_PURE_PACKETS = {
    prims.iota, aten.arange, aten.full, aten.ones, aten.zeros, aten.scalar_tensor,
    aten.empty_like, aten.full_like, aten.ones_like, aten.zeros_like,
    aten.add, aten.sub, aten.mul, aten.neg, aten.remainder, aten.floor_divide, aten.div,
    aten.le, aten.lt, aten.ge, aten.gt, aten.eq, aten.ne,
    aten.bitwise_and, aten.bitwise_or, aten.bitwise_not, aten.bitwise_xor,
    aten.logical_and, aten.logical_or, aten.logical_not, aten.logical_xor,
    aten.where, aten.masked_fill, aten.minimum, aten.maximum, aten.abs,
    aten.unsqueeze, aten.squeeze, aten.expand, aten.view, aten.reshape, aten._unsafe_view,
    aten.permute, aten.transpose, aten.slice, aten.select, aten.index_select, aten.clone,
    aten.contiguous, aten._to_copy, aten.to, aten.alias, aten.lift_fresh_copy,
    aten.tril, aten.triu, aten.repeat, aten.cat, aten.stack,
    prims.convert_element_type, prims.broadcast_in_dim,
}

decision_counts: collections.Counter = collections.Counter()


def _set_args(node: torch.fx.Node, **values) -> None:
    """Replace named arguments of an aten node (positional or keyword)."""
    schema = node.target._schema
    args, kwargs = list(node.args), dict(node.kwargs)
    positional = [a.name for a in schema.arguments if not a.kwarg_only]
    for name, value in values.items():
        if name in positional and positional.index(name) < len(args):
            args[positional.index(name)] = value
        elif name in positional:
            # fill defaults up to this position
            for a in schema.arguments[len(args):positional.index(name)]:
                args.append(a.default_value)
            args.append(value)
        else:
            kwargs[name] = value
    node.args, node.kwargs = tuple(args), kwargs


def _static(x) -> bool:
    if isinstance(x, torch.SymInt) or isinstance(x, torch.SymFloat):
        return False
    if isinstance(x, (list, tuple)):
        return all(_static(y) for y in x)
    return True


def _static_layout(t: torch.Tensor) -> bool:
    """Sizes and strides are plain ints (counting on symbolic ones would add guards)."""
    return _static(tuple(t.shape)) and _static(tuple(t.stride()))


def _stored_elements(t: torch.Tensor) -> int:
    """Elements evaluating `t` stores: broadcast (stride-0) dims count once. The memory-efficient
    nodes get the mask expanded over heads ([B, Hq, S, S], stride 0 on Hq): its numel counts
    every head, its evaluation and comparison (_is_causal_mask) one."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= int(size)
    return n


def _producer_subgraph(mask: torch.fx.Node) -> tuple[Optional[list], str]:
    """The nodes that compute `mask` in graph order, or (None, why it cannot be evaluated)."""
    seen, stack = set(), [mask]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    if any(n.op != "call_function" for n in seen):
        return None, "depends on graph inputs"
    for n in seen:
        packet = getattr(n.target, "overloadpacket", None)
        if packet not in _PURE_PACKETS and n.target is not operator.getitem:
            return None, f"built with {n.target}"
        for x in list(n.args) + list(n.kwargs.values()):
            if not _static(x):
                return None, "symbolic sizes"
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and not _static(tuple(val.shape)):
            return None, "symbolic sizes"
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__), ""


def _evaluate(nodes: list) -> torch.Tensor:
    """Run the producer subgraph on the CPU (device arguments replaced) and return the mask."""
    env: dict = {}

    def arg(x):
        if isinstance(x, torch.fx.Node):
            return env[x]
        if isinstance(x, torch.device):
            return torch.device("cpu")
        if isinstance(x, (list, tuple)):
            return type(x)(arg(y) for y in x)
        return x

    for n in nodes:
        kwargs = {k: arg(v) for k, v in n.kwargs.items()}
        if "device" in kwargs:
            kwargs["device"] = torch.device("cpu")
        env[n] = n.target(*(arg(a) for a in n.args), **kwargs)
    return env[nodes[-1]]


def _no_fake_mode():
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


# The fill of masked positions in the bias torch makes of a boolean mask for cuDNN.
CUDNN_BOOL_MASK_FILL = -65504.0


def _is_causal_mask(mask: torch.Tensor, sq: int, sk: int,
                    cudnn_fill: bool = False) -> tuple[bool, str]:
    """Is `mask` (broadcastable to [..., Sq, Sk]) exactly the top-left causal mask?
    cudnn_fill: a float mask may also hold torch's cuDNN fill (CUDNN_BOOL_MASK_FILL rounded to
    the mask's dtype) where it masks."""
    if mask.dim() < 2 or tuple(mask.shape[-2:]) not in ((sq, sk), (1, sk), (sq, 1), (1, 1)):
        return False, f"mask shape {tuple(mask.shape)}"
    keep = causal_mask(sq, sk, "cpu")
    for d in range(mask.dim() - 2):  # broadcast (stride-0) batch / head dims: one instance
        if mask.size(d) > 1 and mask.stride(d) == 0:
            mask = mask.narrow(d, 0, 1)
    mask = mask.expand(*mask.shape[:-2], sq, sk)
    if mask.dtype == torch.bool:
        same = bool((mask == keep).all())
    elif mask.is_floating_point():
        masked = mask[..., ~keep]
        is_masked = masked == float("-inf")
        if cudnn_fill:
            fill = torch.tensor(CUDNN_BOOL_MASK_FILL, dtype=mask.dtype).item()
            is_masked |= masked == fill
        same = bool(((mask == 0) == keep).all()) and bool(is_masked.all())
    else:
        return False, f"mask dtype {mask.dtype}"
    return same, "" if same else "not the causal mask"


def drop_causal_masks(graph: torch.fx.Graph) -> list:
    """Rewrite the SDPA nodes whose mask is provably causal; returns [(node, outcome)]."""
    by_mask: dict = collections.defaultdict(list)
    for node in graph.nodes:
        if node.op == "call_function" and node.target in SDPA_MASKED_NODES:
            name, _ = SDPA_MASKED_NODES[node.target]
            mask = bind_args(node).get(name)
            if isinstance(mask, torch.fx.Node):
                by_mask[mask].append(node)
    results = []
    for mask, users in by_mask.items():
        outcome = _prove(mask, users)
        if outcome == "dropped":
            for node in users:
                name, backward = SDPA_MASKED_NODES[node.target]
                changes = {name: None, "is_causal": True}
                if node.target is aten._scaled_dot_product_efficient_attention_backward.default:
                    wanted = list(bind_args(node).get("grad_input_mask") or [True] * 4)
                    changes["grad_input_mask"] = wanted[:3] + [False]
                _set_args(node, **changes)
        for node in users:
            results.append((node.name, outcome))
            decision_counts[outcome] += 1
            log.info("causal mask %s for %s: %s", mask.name, node.target, outcome)
    if any(outcome == "dropped" for _, outcome in results):
        graph.eliminate_dead_code()
        graph.lint()
    return results


def _prove(mask: torch.fx.Node, users: list) -> str:
    """'dropped' when the mask is the causal mask for every user, else why it is kept."""
    for node in users:
        a = bind_args(node)
        if a.get("is_causal") or (a.get("dropout_p") or 0.0) != 0.0:
            return "kept: is_causal or dropout already set"
        if node.target is aten._scaled_dot_product_efficient_attention_backward.default:
            wanted = a.get("grad_input_mask") or [True] * 4
            if wanted[3]:
                return "kept: the mask's gradient is needed"
        q, k = a["query"].meta.get("val"), a["key"].meta.get("val")
        if q is None or k is None or not _static(tuple(q.shape)) or not _static(tuple(k.shape)):
            return "kept: symbolic sizes"
        if q.size(2) != k.size(2):
            return "kept: Sq != Sk"
    val = mask.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return "kept: no tensor metadata"
    if not _static_layout(val):
        return "kept: symbolic sizes"
    sq = bind_args(users[0])["query"].meta["val"].size(2)
    leading = 1  # stored instances of the mask over its leading (batch / head) dims
    for size, stride in list(zip(val.shape, val.stride()))[:-2]:
        leading *= int(size) if stride != 0 else 1
    # the comparison (_is_causal_mask) expands the mask to [..., Sq, Sk] per stored instance
    if _stored_elements(val) > MAX_EVAL_ELEMENTS or leading * sq * sq > MAX_EVAL_ELEMENTS:
        return "kept: too large to evaluate"
    nodes, why = _producer_subgraph(mask)
    if nodes is None:
        return f"kept: {why}"
    vals = [n.meta["val"] for n in nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    if not all(_static_layout(v) for v in vals):
        return "kept: symbolic sizes"
    if any(_stored_elements(v) > MAX_EVAL_ELEMENTS for v in vals):
        return "kept: too large to evaluate"
    q = bind_args(users[0])["query"].meta["val"]
    try:
        # real tensors on the CPU: outside the fake mode Inductor's passes run under
        with _no_fake_mode():
            value = _evaluate(nodes)
            cudnn_only = all(n.target in _CUDNN_NODES for n in users)
            same, why = _is_causal_mask(value, q.size(2), q.size(2), cudnn_fill=cudnn_only)
    except Exception as exc:  # a plugin must never break a compile
        return f"kept: could not evaluate ({type(exc).__name__})"
    return "dropped" if same else f"kept: {why}"
