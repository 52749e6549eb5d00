"""Small models and graph recorders for tests, the demo and benchmarks (torch only).

    TinyTransformer, Block, Attention     modules calling F.scaled_dot_product_attention
    lm_loss(logits, tokens)               next-token cross entropy
    AttentionOpRecorder                   a post-grad pass recording the attention ops of
                                          every graph Inductor compiles
    with_own_code(fn, variant)            fn with a code object of its own (Dynamo's cache key)
    compile_own_graphs(model, variant)    torch.compile(model) that shares no compiled graph
                                          with another compile of the same class
"""
from __future__ import annotations

import functools
import types
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import policy


# ---------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Multi-head attention through F.scaled_dot_product_attention; GQA when
    kv_heads < heads; cross-attention when called with a context."""

    def __init__(self, dim: int, heads: int, kv_heads: Optional[int] = None,
                 causal: bool = False, dropout: float = 0.0):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads or heads
        self.head_dim = dim // heads
        self.causal, self.dropout = causal, dropout
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, self.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, self.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x, context=None, attn_mask=None):
        b, s, _ = x.shape
        src = x if context is None else context
        sk = src.shape[1]
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(src).view(b, sk, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(src).view(b, sk, self.kv_heads, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=self.causal,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.heads != self.kv_heads,
        )
        return self.wo(o.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: Optional[int] = None,
                 causal: bool = True, cross: bool = False, cross_causal: bool = False):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, kv_heads, causal=causal)
        self.cross = None
        if cross:
            self.norm_c = nn.LayerNorm(dim)
            self.cross = Attention(dim, heads, kv_heads, causal=cross_causal)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, context=None):
        x = x + self.attn(self.norm1(x))
        if self.cross is not None:
            x = x + self.cross(self.norm_c(x), context)
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """A token language model: embedding, `layers` blocks (causal self-attention; with
    `cross`, the odd blocks also attend to a separate context of another length), head."""

    def __init__(self, vocab: int = 256, dim: int = 64, heads: int = 4,
                 kv_heads: Optional[int] = None, layers: int = 2, cross: bool = False,
                 causal: bool = True):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            Block(dim, heads, kv_heads, causal=causal, cross=cross and i % 2 == 1)
            for i in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, context=None):
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, context)
        return self.head(self.norm(x))


def lm_loss(logits, tokens):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


# ---------------------------------------------------------------------------------------
# compiling two variants of one model in one process
# ---------------------------------------------------------------------------------------

def with_own_code(fn: Callable, variant: str) -> Callable:
    """`fn` with a code object of its own, named after `variant`. Dynamo keeps compiled graphs
    per code object, and with nn modules inlined (torch's default) its guards do not tell two
    instances of one class apart."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{variant}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _call_model(model, *args, **kwargs):
    return model(*args, **kwargs)


def compile_own_graphs(model: nn.Module, variant: str) -> Callable:
    """``torch.compile`` of calls of `model` (same arguments) through a function of its own.
    Two ``torch.compile(model)`` of one class in one process share Dynamo's compiled graphs:
    a copy compiled after ``disable()`` runs the routed graph of one compiled under
    ``enable()``, and the reverse (the demo's stock model did so before commit 1d94611). Each
    `variant` compiled here has graphs of its own, compiled when first called."""
    return functools.partial(torch.compile(with_own_code(_call_model, variant)), model)


# ---------------------------------------------------------------------------------------
# recording the backward graphs' attention ops
# ---------------------------------------------------------------------------------------

ATTENTION_BACKWARD_TARGETS = {str(op) for op in policy.STOCK_BACKWARD_OPS.values()} | {
    "torch_sm90_sdpa.sdpa_backward.default"
}


class AttentionOpRecorder(CustomGraphPass):
    """A post-grad pass (set it before ``enable()``: it then runs after the rewrite) that
    records the attention ops of each graph Inductor compiles. Nothing on a cache hit."""

    def __init__(self):
        self.graphs: list = []

    def __call__(self, graph):
        self.graphs.append([
            str(n.target) for n in graph.nodes
            if n.op == "call_function"
            and ("attention" in str(n.target) or str(n.target).startswith("torch_sm90_sdpa."))
        ])

    def uuid(self):
        return "torch_sm90_sdpa.testing.AttentionOpRecorder"

    def backward_ops(self) -> list:
        return [op for g in self.graphs for op in g if op in ATTENTION_BACKWARD_TARGETS]
