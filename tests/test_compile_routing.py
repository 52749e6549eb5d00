"""The torch.compile rewrite on CPU: enable(cpu=True) routes the CPU SDPA backward to the
op's CPU reference, so the whole route (pass, op, Inductor, caches) runs for real.

The CUDA rewrite (cuDNN / flash / efficient nodes) is checked on graphs of fake CUDA
tensors (no GPU needed): the policy, the logsumexp views, the layouts.

Every test that compiles gets a fresh TORCHINDUCTOR_CACHE_DIR and a Dynamo reset, and
checks the ops that actually ran (torch.profiler), not only the graph the pass saw: on an
FX graph cache hit the pass does not run at all.
"""
import collections
import math
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
import warnings
from unittest import mock

import expecttest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import torch_sm90_sdpa
from torch_sm90_sdpa import _extension, compile_pass, eligibility, policy, routing, speed_gate
from torch_sm90_sdpa import _generated_speed_table as speed_table
from torch_sm90_sdpa.testing import (AttentionOpRecorder, Block, TinyTransformer, compile_own_graphs,
                                     lm_loss)

aten = torch.ops.aten
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ran_attention_ops(fn):
    """Run fn() under torch.profiler; 'name xN' of the attention ops that ran, sorted."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = collections.Counter(
        e.name for e in prof.events()
        if "scaled_dot_product" in e.name or e.name.startswith("torch_sm90_sdpa::")
    )
    return "\n".join(f"{n} x{c}" for n, c in sorted(names.items()))


def backward_graph_ops(recorder):
    """The attention ops of the recorded graphs that hold a backward op, one graph a line."""
    lines = []
    for ops in recorder.graphs:
        if any("backward" in op for op in ops):
            lines.append(", ".join(op.replace(".default", "") for op in ops))
    return "\n".join(lines)


class CompileTestCase(expecttest.TestCase):
    """Fresh Inductor cache dir, Dynamo reset, counters cleared, routing off at start and end,
    and a recorder pass (the 'user's pass') set before routing is enabled."""

    def setUp(self):
        super().setUp()
        self._tmp = tempfile.mkdtemp(prefix="sm90_sdpa_inductor_")
        self._env = mock.patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": self._tmp})
        self._env.start()
        self._saved_pass = torch._inductor.config.post_grad_custom_post_pass
        routing.disable()
        self.recorder = AttentionOpRecorder()
        torch._inductor.config.post_grad_custom_post_pass = self.recorder
        torch._dynamo.reset()
        counters.clear()
        routing.reset_stats()

    def tearDown(self):
        routing.disable()
        torch._inductor.config.post_grad_custom_post_pass = self._saved_pass
        torch._dynamo.reset()
        self._env.stop()
        shutil.rmtree(self._tmp, ignore_errors=True)
        super().tearDown()

    def fx_cache(self):
        c = counters["inductor"]
        return (c["fxgraph_cache_miss"], c["fxgraph_cache_hit"], c["fxgraph_cache_bypass"])


def param_grads(model):
    return {n.replace("_orig_mod.", ""): p.grad.detach().clone()
            for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(test, got, want, rtol=1e-4, atol=1e-5):
    test.assertEqual(sorted(got), sorted(want))
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=name)


class MixedAttention(nn.Module):
    """Causal GQA self-attention, then full MHA self-attention plus causal cross-attention
    to a context of another length (Sq != Sk), all through F.scaled_dot_product_attention."""

    def __init__(self, dim=32, vocab=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.ctx = nn.Embedding(vocab, dim)
        self.blk0 = Block(dim, heads=4, kv_heads=2, causal=True)
        self.blk1 = Block(dim, heads=4, kv_heads=4, causal=False, cross=True, cross_causal=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens, context_tokens):
        ctx = self.ctx(context_tokens)
        return self.head(self.blk1(self.blk0(self.embed(tokens)), ctx))


def tiny_llama_padded(transformers):
    """A tiny transformers Llama (GQA, attn_implementation="sdpa"), a copy of it, and a batch
    whose second sequence is right-padded: (model, stock, ids, attention_mask, labels)."""
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(6)
    model = transformers.LlamaForCausalLM(cfg)
    stock = transformers.LlamaForCausalLM(cfg)
    stock.load_state_dict(model.state_dict())
    ids = torch.randint(0, 100, (2, 24))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 15:] = 0
    return model, stock, ids, attention_mask, ids.masked_fill(attention_mask == 0, -100)


class TestCpuRoute(CompileTestCase):
    def test_transformer_backward_runs_our_op(self):
        torch.manual_seed(0)
        model = MixedAttention()
        stock = MixedAttention()
        stock.load_state_dict(model.state_dict())
        tokens = torch.randint(0, 64, (2, 24))
        context = torch.randint(0, 64, (2, 40))

        torch_sm90_sdpa.enable(cpu=True, forward=False)  # (the backward route alone)
        compiled = torch.compile(model)
        with self.assertLogs("torch_sm90_sdpa", level="INFO") as logs:
            lm_loss(compiled(tokens, context), tokens).backward()
        # the graph after the rewrite, recorded by the user's pass (which still runs)
        self.assertExpectedInline(backward_graph_ops(self.recorder), """\
torch_sm90_sdpa.sdpa_backward, torch_sm90_sdpa.sdpa_backward, torch_sm90_sdpa.sdpa_backward""")
        self.assertEqual(sum("routed aten._scaled_dot_product_flash_attention_for_cpu_backward"
                             in m for m in logs.output), 3, logs.output)
        # gradients equal to stock (uncompiled, stock backward)
        lm_loss(stock(tokens, context), tokens).backward()
        assert_grads_close(self, param_grads(model), param_grads(stock))
        # the ops that actually run in a step
        model.zero_grad()
        self.assertExpectedInline(
            ran_attention_ops(lambda: lm_loss(compiled(tokens, context), tokens).backward()), """\
aten::_scaled_dot_product_flash_attention_for_cpu x3
torch_sm90_sdpa::sdpa_backward x3""")
        stats = torch_sm90_sdpa.routing_stats()
        self.assertEqual(stats["routed_calls"], 6)
        self.assertEqual(stats["routed_nodes"], {"cpu": 3})
        self.assertEqual(stats["not_routed"], {})
        self.assertEqual(self.fx_cache(), (2, 0, 0))

    def test_two_compiles_of_one_class_share_graphs_unless_compiled_apart(self):
        """Dynamo's in-memory graphs are per code object: a copy of a model compiled after
        disable() runs the routed graph of the copy compiled under enable() (what ROUTING.md
        warns of; the demo's stock model did so). compile_own_graphs keeps them apart, in
        either order of calls."""
        import copy
        torch.manual_seed(0)
        base = TinyTransformer(vocab=64, dim=32, heads=4, kv_heads=2, layers=1)
        tokens = torch.randint(0, 64, (2, 16))

        def ops_of(model):  # a first step compiles (and traces ops); the second is profiled
            lm_loss(model(tokens), tokens).backward()
            return ran_attention_ops(lambda: lm_loss(model(tokens), tokens).backward())

        routed_ops = "aten::_scaled_dot_product_flash_attention_for_cpu x1\ntorch_sm90_sdpa::sdpa_backward x1"
        stock_ops = ("aten::_scaled_dot_product_flash_attention_for_cpu x1\n"
                     "aten::_scaled_dot_product_flash_attention_for_cpu_backward x1")
        with routing.enable(cpu=True, only_faster=False, forward=False):
            shared_routed = torch.compile(copy.deepcopy(base))
            self.assertEqual(ops_of(shared_routed), routed_ops)
        self.assertEqual(ops_of(torch.compile(copy.deepcopy(base))), routed_ops)  # the trap

        # the demo's check before it times the two models
        from torch_sm90_sdpa.demo import _stock_step_runs_stock
        self.assertFalse(_stock_step_runs_stock(torch.compile(copy.deepcopy(base)), tokens,
                                                None, "cpu"))

        torch._dynamo.reset()
        with routing.enable(cpu=True, only_faster=False, forward=False):
            routed = compile_own_graphs(copy.deepcopy(base), "routed")
            self.assertEqual(ops_of(routed), routed_ops)
        stock = compile_own_graphs(copy.deepcopy(base), "stock")
        self.assertTrue(_stock_step_runs_stock(stock, tokens, None, "cpu"))
        self.assertEqual(ops_of(stock), stock_ops)
        self.assertEqual(ops_of(routed), routed_ops)
        self.assertEqual(ops_of(stock), stock_ops)

    def test_masked_calls_are_routed_with_their_mask(self):
        """A padding + causal bool mask (SDPA's CPU kernel gets it as a float bias), an additive
        key-padding bias [B, 1, 1, Sk], and an unmasked causal call: all three backward nodes
        become our op, the masked ones with the mask; gradients equal stock's. (Dropout takes
        SDPA's math path on CPU: no fused node to route.)"""
        class Net(nn.Module):
            def forward(self, q, k, v, mask, bias):
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                b = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
                c = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                return a + 2 * b + 3 * c

        torch.manual_seed(1)
        q, k, v = (torch.randn(2, 2, 16, 8, requires_grad=True) for _ in range(3))
        mask = torch.ones(16, 16, dtype=torch.bool).tril()[None, None].repeat(2, 1, 1, 1)
        mask[1, :, :, 11:] = False  # the second sequence is padded after 11 tokens
        bias = torch.zeros(2, 1, 1, 16)
        bias[0, ..., :3] = float("-inf")  # left padding of the first sequence
        bias[1] = torch.randn(16) * 0.1  # and a small additive term
        torch_sm90_sdpa.enable(cpu=True)
        compiled = torch.compile(Net())
        compiled(q, k, v, mask, bias).sum().backward()
        self.assertExpectedInline(backward_graph_ops(self.recorder), """\
torch_sm90_sdpa.sdpa_backward, torch_sm90_sdpa.sdpa_backward, torch_sm90_sdpa.sdpa_backward""")
        stats = torch_sm90_sdpa.routing_stats()
        self.assertEqual(stats["routed_nodes"], {"cpu": 3})
        self.assertEqual(stats["not_routed"], {})
        grads = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        Net()(q, k, v, mask, bias).sum().backward()
        for g, t in zip(grads, (q, k, v)):
            torch.testing.assert_close(g, t.grad, rtol=1e-4, atol=1e-5)

    def test_transformers_llama_on_cpu(self):
        """A tiny transformers Llama (GQA), unpatched, compiled with the CPU route. With a
        padded batch its SDPA calls carry the padding mask, a graph input: the backward nodes
        are routed with it. Without padding the routed backward is the causal one with no
        mask, reached one of two ways. transformers materializes the causal mask while tracing
        (4.x always; 5.x where torch.compiler.is_exporting() is True under torch.compile, as
        on torch 2.9): our pass proves it causal and drops it. transformers 5.x on torch 2.13
        hands SDPA is_causal=True and no mask while compiling (its
        masking_utils._ignore_causal_mask_sdpa declines only while exporting or when it would
        read a traced padding mask): there is no mask for the pass to see. Training matches
        stock either way."""
        try:
            import transformers
        except ImportError:
            self.skipTest("transformers is not installed")
        from torch.fx.operator_schemas import normalize_function

        class FlagsRecorder(AttentionOpRecorder):
            """also (is_causal, has a mask) of each routed backward node"""
            def __init__(self):
                super().__init__()
                self.flags = []

            def __call__(self, graph):
                super().__call__(graph)
                for n in graph.nodes:
                    if n.op == "call_function" and \
                            n.target is torch.ops.torch_sm90_sdpa.sdpa_backward.default:
                        kw = normalize_function(n.target, n.args, n.kwargs,
                                                normalize_to_only_use_kwargs=True).kwargs
                        self.flags.append((kw["is_causal"], kw["attn_mask"] is not None))

        self.recorder = FlagsRecorder()
        torch._inductor.config.post_grad_custom_post_pass = self.recorder
        model, stock, ids, attention_mask, labels = tiny_llama_padded(transformers)
        torch_sm90_sdpa.enable(cpu=True)
        compiled = torch.compile(model)
        compiled(input_ids=ids, attention_mask=attention_mask, labels=labels).loss.backward()
        self.assertExpectedInline(backward_graph_ops(self.recorder), """\
torch_sm90_sdpa.sdpa_backward, torch_sm90_sdpa.sdpa_backward""")
        stats = torch_sm90_sdpa.routing_stats(reset=True)
        self.assertEqual((stats["routed_nodes"], stats["not_routed"]), ({"cpu": 2}, {}))
        # the padding mask is a graph input: no causal proof, the mask stays
        self.assertEqual(list(stats["causal_masks"]), ["kept: depends on graph inputs"])
        stock(input_ids=ids, attention_mask=attention_mask, labels=labels).loss.backward()
        assert_grads_close(self, param_grads(model), param_grads(stock), rtol=1e-4, atol=1e-5)
        # no attention_mask: transformers' causal mask is a function of sizes: dropped
        torch._dynamo.reset()
        model.zero_grad()
        stock.zero_grad()
        self.recorder.flags.clear()
        compiled = torch.compile(model)
        compiled(input_ids=ids, labels=ids).loss.backward()
        stats = torch_sm90_sdpa.routing_stats()
        # the mask transformers materialized was dropped, or there was none to drop
        self.assertIn(list(stats["causal_masks"]), (["dropped"], []))
        self.assertEqual(stats["routed_nodes"], {"cpu": 2})
        self.assertEqual(self.recorder.flags, [(True, False)] * 2)  # causal, no mask
        stock(input_ids=ids, labels=ids).loss.backward()
        assert_grads_close(self, param_grads(model), param_grads(stock), rtol=1e-4, atol=1e-5)

    def test_provably_causal_masks_are_dropped(self):
        """Masks built from sizes alone (as transformers builds them under tracing) and equal to
        the causal mask are dropped at compile time: both SDPA nodes become is_causal=True and
        the mask is gone from the graph. Other masks are kept, with the reason."""
        class Net(nn.Module):
            def __init__(self, kind):
                super().__init__()
                self.kind = kind

            def forward(self, q, k, v, pad):
                s = q.size(2)
                i = torch.arange(s, device=q.device)
                keep = i[None, :] <= i[:, None]  # [S, S], key <= query
                if self.kind == "sliding window":
                    keep = keep & (i[None, :] > i[:, None] - 4)
                if self.kind == "padding input":
                    keep = keep & pad[:, None, None, :]
                keep = keep.expand(q.size(0), 1, s, s)
                if self.kind == "float causal":
                    keep = torch.where(keep, 0.0, float("-inf"))
                return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

        class Args(torch._inductor.custom_graph_pass.CustomGraphPass):
            """Records (is_causal, has a mask) of the CPU SDPA forward nodes."""

            def __init__(self):
                self.seen = []

            def __call__(self, graph):
                for n in graph.nodes:
                    if n.target is aten._scaled_dot_product_flash_attention_for_cpu.default:
                        causal = n.args[4] if len(n.args) > 4 else n.kwargs.get("is_causal", False)
                        self.seen.append((bool(causal), n.kwargs.get("attn_mask") is not None))

            def uuid(self):
                return "test-args"

        outcomes = {}
        for kind in ("causal", "float causal", "sliding window", "padding input"):
            torch._dynamo.reset()
            routing.reset_stats()
            recorder = Args()
            torch._inductor.config.post_grad_custom_post_pass = recorder
            torch.manual_seed(3)
            q, k, v = (torch.randn(2, 2, 12, 8, requires_grad=True) for _ in range(3))
            pad = torch.ones(2, 12, dtype=torch.bool)
            pad[1, 9:] = False
            # no cache: two kinds compile to the same graph once their mask is dropped
            # (forward=False: the recorder reads the stock forward nodes the proofs rewrote)
            with torch_sm90_sdpa.enable(cpu=True, forward=False), \
                    torch._inductor.config.patch(fx_graph_cache=False), \
                    torch._functorch.config.patch(enable_autograd_cache=False):
                torch.compile(Net(kind))(q, k, v, pad).sum().backward()
            grads = [t.grad.clone() for t in (q, k, v)]
            for t in (q, k, v):
                t.grad = None
            Net(kind)(q, k, v, pad).sum().backward()
            for g, t in zip(grads, (q, k, v)):
                torch.testing.assert_close(g, t.grad, rtol=1e-4, atol=1e-5)
            # (the outcomes, not their counts: torch versions run the joint pass once or twice)
            outcomes[kind] = (sorted(torch_sm90_sdpa.routing_stats()["causal_masks"]),
                              recorder.seen)
        self.assertExpectedInline("\n".join(f"{k}: {v}" for k, v in outcomes.items()), """\
causal: (['dropped'], [(True, False)])
float causal: (['dropped'], [(True, False)])
sliding window: (['kept: not the causal mask'], [(False, True)])
padding input: (['kept: depends on graph inputs'], [(False, True)])""")

    def test_cudnn_graph_with_torchs_bool_mask_fill(self):
        """The joint graph of a compiled model on CUDA as torch 2.11 builds it: the causal mask
        reaches the cuDNN forward and backward as where(mask, 0, -65536) (bf16). The pass drops
        it (both nodes is_causal=True, no bias); the same bias feeding memory-efficient nodes
        is kept (only -inf counts as masked there)."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.proxy_tensor import make_fx

        from torch_sm90_sdpa import causal_masks

        b, h, s, d = 2, 4, 24, 64

        def fn(q, k, v, go, backend):
            i = torch.arange(s, device=q.device)
            keep = i.unsqueeze(0) <= i.unsqueeze(1)  # (indexing with None needs a real CUDA here)
            zero = torch.full([], 0.0, dtype=torch.bfloat16, device=q.device)
            fill = torch.full([], -65504.0, dtype=torch.bfloat16, device=q.device)
            bias = torch.where(keep, zero, fill).unsqueeze(0).unsqueeze(0).expand(b, h, s, s)
            if backend == "cudnn":
                o, lse, cq, ck, mq, mk, seed, off, _ = aten._scaled_dot_product_cudnn_attention(
                    q, k, v, bias, True, 0.0, False, False)
                return aten._scaled_dot_product_cudnn_attention_backward(
                    go, q, k, v, o, lse, seed, off, bias, cq, ck, mq, mk, 0.0, False)
            o, lse, seed, off = aten._scaled_dot_product_efficient_attention(
                q, k, v, bias, True, 0.0, False)
            return aten._scaled_dot_product_efficient_attention_backward(
                go, q, k, v, bias, o, lse, seed, off, 0.0, [True, True, True, False], False)

        outcomes = {}
        for backend in ("cudnn", "efficient"):
            mode = FakeTensorMode()
            with mode:
                q, k, v, go = (torch.empty(b, h, s, d, dtype=torch.bfloat16, device="cuda")
                               for _ in range(4))
                gm = make_fx(lambda *a: fn(*a, backend))(q, k, v, go)
            outcomes[backend] = sorted({o for _, o in causal_masks.drop_causal_masks(gm.graph)})
            attention = [n for n in gm.graph.nodes if n.op == "call_function"
                         and "attention" in str(n.target)]
            self.assertEqual(len(attention), 2)
            if backend == "cudnn":
                for n in attention:
                    a = compile_pass.bind_args(n)
                    self.assertIs(a.get("is_causal"), True)
                    self.assertIsNone(a.get("attn_bias"))
                self.assertFalse(any("where" in str(n.target) for n in gm.graph.nodes))
        self.assertEqual(outcomes, {"cudnn": ["dropped"], "efficient": ["kept: not the causal mask"]})

    def test_mask_expanded_over_heads_counts_its_stored_elements(self):
        """The memory-efficient nodes get the mask expanded over heads (stride 0): the size limit
        of the evaluation counts what evaluating it stores (S x S here), not its numel
        (B x H x S x S). torch 2.11 under deterministic algorithms, Llama d128 b2 s8192: the
        numel rule kept the mask ("too large to evaluate") and stock ran its masked kernels."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.proxy_tensor import make_fx

        from torch_sm90_sdpa import causal_masks

        b, h, s, d = 2, 4, 24, 64

        def fn(q, k, v, go):
            i = torch.arange(s, device=q.device)
            keep = i.unsqueeze(0) <= i.unsqueeze(1)
            zero = torch.full([], 0.0, dtype=torch.bfloat16, device=q.device)
            fill = torch.full([], float("-inf"), dtype=torch.bfloat16, device=q.device)
            bias = torch.where(keep, zero, fill).unsqueeze(0).unsqueeze(0).expand(b, h, s, s)
            o, lse, seed, off = aten._scaled_dot_product_efficient_attention(
                q, k, v, bias, True, 0.0, False)
            return aten._scaled_dot_product_efficient_attention_backward(
                go, q, k, v, bias, o, lse, seed, off, 0.0, [True, True, True, False], False)

        outcomes = {}
        for limit in (s * s, s * s - 1):  # b * h * s * s elements is far above both
            with FakeTensorMode():
                q, k, v, go = (torch.empty(b, h, s, d, dtype=torch.bfloat16, device="cuda")
                               for _ in range(4))
                gm = make_fx(fn)(q, k, v, go)
            with mock.patch.object(causal_masks, "MAX_EVAL_ELEMENTS", limit):
                outcomes[limit] = sorted({o for _, o in causal_masks.drop_causal_masks(gm.graph)})
        self.assertEqual(outcomes, {s * s: ["dropped"], s * s - 1: ["kept: too large to evaluate"]})

    def test_cudnn_bool_mask_fill_counts_as_masked_for_cudnn_nodes_only(self):
        """torch hands cuDNN a boolean mask as a 0 / -65504 bias (-65536 in bf16): for masks
        whose users are all cuDNN nodes that fill counts as masked, elsewhere only -inf does."""
        from torch_sm90_sdpa import causal_masks

        keep = torch.ones(6, 6, dtype=torch.bool).tril()
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            bias = torch.zeros(2, 1, 6, 6, dtype=dtype).masked_fill(~keep, -65504.0)
            self.assertEqual(causal_masks._is_causal_mask(bias, 6, 6, cudnn_fill=True), (True, ""))
            self.assertFalse(causal_masks._is_causal_mask(bias, 6, 6)[0])
            other = bias.masked_fill(~keep, -60000.0)  # another finite value: kept
            self.assertFalse(causal_masks._is_causal_mask(other, 6, 6, cudnn_fill=True)[0])
            shifted = torch.zeros(2, 1, 6, 6, dtype=dtype).masked_fill(
                ~torch.ones(6, 6, dtype=torch.bool).tril(-1), -65504.0)  # not causal
            self.assertFalse(causal_masks._is_causal_mask(shifted, 6, 6, cudnn_fill=True)[0])

    def test_dynamic_sequence_length(self):
        torch.manual_seed(2)
        model = TinyTransformer(vocab=64, dim=32, heads=4, kv_heads=2, layers=1)
        stock = TinyTransformer(vocab=64, dim=32, heads=4, kv_heads=2, layers=1)
        stock.load_state_dict(model.state_dict())
        torch_sm90_sdpa.enable(cpu=True)
        compiled = torch.compile(model)
        for seqlen in (20, 33):
            tokens = torch.randint(0, 64, (2, seqlen))
            torch._dynamo.mark_dynamic(tokens, 1)
            model.zero_grad()
            stock.zero_grad()
            lm_loss(compiled(tokens), tokens).backward()
            lm_loss(stock(tokens), tokens).backward()
            assert_grads_close(self, param_grads(model), param_grads(stock))
        # one forward and one backward graph served both lengths
        self.assertEqual(len(self.recorder.graphs), 2)
        self.assertExpectedInline(backward_graph_ops(self.recorder),
                                  """torch_sm90_sdpa.sdpa_backward""")
        self.assertEqual(torch_sm90_sdpa.routing_stats()["routed_calls"], 2)

    def test_enable_disable_between_compilations_cold_and_warm_cache(self):
        """Routing follows enable/disable on a cold FX graph cache and on a warm one
        (the cache key includes the pass's uuid); the cache is never bypassed."""
        torch.manual_seed(3)
        q, k, v = (torch.randn(2, 4, 12, 16, dtype=torch.bfloat16) for _ in range(3))
        grad = torch.randn(2, 4, 12, 16, dtype=torch.bfloat16)

        def f(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def compile_and_run():
            torch._dynamo.reset()
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            fn = torch.compile(f)
            fn(qq, kk, vv).backward(grad)  # compiles forward and backward
            ran = ran_attention_ops(lambda: fn(qq, kk, vv).backward(grad))
            return ran, qq.grad

        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        f(qs, ks, vs).backward(grad)
        # (our CPU forward runs the stock CPU kernel: sdpa_forward x1 calls it)
        ours = ("aten::_scaled_dot_product_flash_attention_for_cpu x1\n"
                "torch_sm90_sdpa::sdpa_backward x1\n"
                "torch_sm90_sdpa::sdpa_forward x1")
        stock = ("aten::_scaled_dot_product_flash_attention_for_cpu x1\n"
                 "aten::_scaled_dot_product_flash_attention_for_cpu_backward x1")
        expected_cache = []
        for enabled, cache in [(True, "cold"), (False, "cold"), (True, "warm"), (False, "warm")]:
            if enabled:
                torch_sm90_sdpa.enable(cpu=True)
            else:
                torch_sm90_sdpa.disable()
            ran, dq = compile_and_run()
            self.assertEqual(ran, ours if enabled else stock, (enabled, cache))
            # the graph runs with qq's grad accumulated twice (two backward calls)
            torch.testing.assert_close(dq, 2 * qs.grad, rtol=2e-2, atol=2e-2)
            expected_cache.append(cache)
            miss, hit, bypass = self.fx_cache()
            self.assertEqual(bypass, 0)
            self.assertEqual((miss, hit), (2 * expected_cache.count("cold"),
                                           2 * expected_cache.count("warm")), (enabled, cache))
        # the warm enabled run counted its calls although the pass did not run
        stats = torch_sm90_sdpa.routing_stats()
        self.assertEqual(stats["routed_calls"], 4)
        self.assertEqual(stats["routed_nodes"], {"cpu": 1})

    def test_layout_copy_when_strides_differ(self):
        """The CPU stock backward returns [B, S, H, D] memory; for a [B, H, S, D]-contiguous
        query our empty_like outputs differ, so the pass copies them into that layout."""
        torch.manual_seed(4)
        seen = {}

        def record(graph):
            seen["ops"] = [str(n.target).replace(".default", "") for n in graph.nodes
                           if n.op == "call_function" and "getitem" not in str(n.target)]
            seen["strides"] = [tuple(n.meta["val"].stride()) for n in graph.nodes
                               if n.op == "output" for n in n.args[0] if n is not None]

        class Rec(torch._inductor.custom_graph_pass.CustomGraphPass):
            def __call__(self, graph):
                if any("backward" in str(n.target) for n in graph.nodes):
                    record(graph)

            def uuid(self):
                return "layout-recorder"

        torch._inductor.config.post_grad_custom_post_pass = Rec()
        torch_sm90_sdpa.enable(cpu=True)
        q = torch.randn(1, 2, 8, 4, requires_grad=True)
        k = torch.randn(1, 2, 8, 4, requires_grad=True)
        v = torch.randn(1, 2, 8, 4, requires_grad=True)
        out = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v))(q, k, v)
        out.backward(torch.ones_like(out))
        self.assertExpectedInline("\n".join(seen["ops"]), """\
torch_sm90_sdpa.sdpa_backward
aten.permute
aten.clone
aten.permute
aten.permute
aten.clone
aten.permute
aten.permute
aten.clone
aten.permute""")
        # the stock op's layout: [B, S, H, D] memory
        self.assertEqual(seen["strides"], [(64, 4, 8, 1)] * 3)
        grads = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        F.scaled_dot_product_attention(q, k, v).backward(torch.ones_like(out))
        for g, t in zip(grads, (q, k, v)):
            torch.testing.assert_close(g, t.grad, rtol=1e-4, atol=1e-5)


    def test_op_gets_the_layouts_the_policy_checked(self):
        """At run time the op receives exactly the strides its node's fake tensors had at
        compile time (eager_input_vals), also for a non-dense grad_out (slice of a cat)."""
        compiled_strides, runtime_strides = [], []

        class Rec(torch._inductor.custom_graph_pass.CustomGraphPass):
            def __call__(self, graph):
                for n in graph.nodes:
                    if n.target is compile_pass.OUR_OP:
                        compiled_strides.append(
                            [tuple(a.meta["val"].stride()) for a in n.args[:6]])

            def uuid(self):
                return "stride-recorder"

        reference = torch_sm90_sdpa.ops.attention_backward_reference

        def recording(grad_out, q, k, v, out, lse, *args):
            runtime_strides.append([tuple(t.stride()) for t in (grad_out, q, k, v, out, lse)])
            return reference(grad_out, q, k, v, out, lse, *args)

        def f(x, w):
            b, s, _ = x.shape
            q, k, v = (x @ w).view(b, s, 3, 4, 8).permute(2, 0, 3, 1, 4)
            o1 = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            o2 = F.scaled_dot_product_attention(k, q, v)
            return torch.cat([o1, o2], dim=-1).sin().sum()

        torch._inductor.config.post_grad_custom_post_pass = Rec()
        torch_sm90_sdpa.enable(cpu=True)
        torch.manual_seed(5)
        x, w = torch.randn(2, 16, 32), (0.2 * torch.randn(32, 96)).requires_grad_()
        with mock.patch.object(torch_sm90_sdpa.ops, "attention_backward_reference", recording):
            torch.compile(f)(x, w).backward()
        (gw,) = torch.autograd.grad(f(x, w), w)
        torch.testing.assert_close(w.grad, gw, rtol=1e-4, atol=1e-5)
        self.assertEqual(len(compiled_strides), 2)
        self.assertEqual(runtime_strides, compiled_strides)
        self.assertNotEqual(compiled_strides[0][0], (512, 128, 8, 1))  # grad_out: not dense


class TestSwitch(unittest.TestCase):
    def setUp(self):
        self._saved = torch._inductor.config.post_grad_custom_post_pass
        routing.disable()

    def tearDown(self):
        routing.disable()
        torch._inductor.config.post_grad_custom_post_pass = self._saved

    def test_enable_disable_idempotent_and_chained(self):
        user = AttentionOpRecorder()
        torch._inductor.config.post_grad_custom_post_pass = user
        state = torch_sm90_sdpa.enable()
        ours = torch._inductor.config.post_grad_custom_post_pass
        self.assertIsInstance(ours, compile_pass.SdpaBackwardRewrite)
        self.assertIs(ours.user_pass, user)
        torch_sm90_sdpa.enable()
        self.assertIs(torch._inductor.config.post_grad_custom_post_pass, ours)  # idempotent
        torch_sm90_sdpa.enable(cpu=True)
        cpu_pass = torch._inductor.config.post_grad_custom_post_pass
        self.assertTrue(cpu_pass.cpu)
        self.assertIs(cpu_pass.user_pass, user)  # not chained twice
        self.assertNotEqual(cpu_pass.uuid(), ours.uuid())
        torch_sm90_sdpa.disable()
        self.assertIs(torch._inductor.config.post_grad_custom_post_pass, user)
        torch_sm90_sdpa.disable()
        self.assertIs(torch._inductor.config.post_grad_custom_post_pass, user)
        self.assertIsNotNone(state)

    def test_toggling_after_a_compile_warns(self):
        """enable() / disable() after torch.compile ran warn that the graphs already compiled
        (and new instances of their classes) keep their routing; not before, nor after a
        Dynamo reset, nor for a call that changes nothing."""
        torch._dynamo.reset()
        with self.assertNoLogs("torch_sm90_sdpa", level="WARNING"):
            torch_sm90_sdpa.enable(cpu=True)
            torch_sm90_sdpa.disable()
        double = torch.compile(lambda x: x * 2)  # (kept alive: Dynamo tracks code weakly)
        double(torch.ones(3))
        with self.assertLogs("torch_sm90_sdpa", level="WARNING") as logs:
            torch_sm90_sdpa.enable(cpu=True)
        self.assertEqual(len(logs.output), 1, logs.output)
        self.assertIn("routing enabled after torch.compile already ran", logs.output[0])
        self.assertIn("torch._dynamo.reset()", logs.output[0])
        with self.assertNoLogs("torch_sm90_sdpa", level="WARNING"):
            torch_sm90_sdpa.enable(cpu=True)  # idempotent: nothing changed
        with self.assertLogs("torch_sm90_sdpa", level="WARNING") as logs:
            torch_sm90_sdpa.disable()
        self.assertIn("routing disabled after torch.compile", logs.output[0])
        torch._dynamo.reset()
        with self.assertNoLogs("torch_sm90_sdpa", level="WARNING"):
            torch_sm90_sdpa.enable(cpu=True)
            torch_sm90_sdpa.disable()
        self.assertEqual(double(torch.ones(3)).tolist(), [2.0, 2.0, 2.0])

    def test_enable_as_context_manager_restores(self):
        self.assertFalse(routing.is_enabled())
        on = dict(enabled=True, only_faster=True, causal_masks=True, forward=True)
        with torch_sm90_sdpa.enable(cpu=True):
            self.assertEqual(routing.routing_options(), dict(on, cpu=True))
            with torch_sm90_sdpa.enable(causal_masks=False, forward=False):
                self.assertEqual(routing.routing_options(),
                                 dict(on, cpu=False, causal_masks=False, forward=False))
                self.assertIsNone(torch._inductor.config.joint_custom_pre_pass)
            self.assertEqual(routing.routing_options(), dict(on, cpu=True))
        self.assertEqual(routing.routing_options(), dict(enabled=False, cpu=False, only_faster=True,
                                                         causal_masks=False, forward=False))
        self.assertIsNone(torch._inductor.config.joint_custom_pre_pass)

    def test_user_pass_still_runs(self):
        calls = []

        class User(torch._inductor.custom_graph_pass.CustomGraphPass):
            def __call__(self, graph):
                calls.append(graph)

            def uuid(self):
                return "user"

        torch._inductor.config.post_grad_custom_post_pass = User()
        torch_sm90_sdpa.enable()
        g = torch.fx.Graph()
        g.output(g.placeholder("x"))
        torch._inductor.config.post_grad_custom_post_pass(g)
        self.assertEqual(calls, [g])

    def test_uuid_none_for_a_user_pass_without_uuid(self):
        """Inductor bypasses the FX graph cache for a plain callable pass; chained, so do we."""
        torch._inductor.config.post_grad_custom_post_pass = lambda graph: None
        torch_sm90_sdpa.enable()
        self.assertIsNone(torch._inductor.config.post_grad_custom_post_pass.uuid())

    def test_uuid_tracks_everything_that_decides_routing(self):
        base = compile_pass.SdpaBackwardRewrite(cpu=False).uuid()
        self.assertEqual(base, compile_pass.SdpaBackwardRewrite(cpu=False).uuid())
        self.assertNotEqual(base, compile_pass.SdpaBackwardRewrite(cpu=True).uuid())
        info = dict(_extension.build_info())
        info["variants"] = list(info["variants"]) + [("bf16", 1000)]
        with mock.patch.object(_extension, "build_info", lambda: info):
            self.assertNotEqual(base, compile_pass.SdpaBackwardRewrite().uuid())
        with mock.patch.object(torch, "__version__", "9.9.9"):
            self.assertNotEqual(base, compile_pass.SdpaBackwardRewrite().uuid())
        with mock.patch.object(policy, "CUDA_DETERMINISTIC_SUPPORTED", False):
            self.assertNotEqual(base, compile_pass.SdpaBackwardRewrite().uuid())
        with mock.patch.object(eligibility, "device_capability", lambda dev: (7, 5)), \
                mock.patch.object(torch.cuda, "is_available", lambda: True), \
                mock.patch.object(torch.cuda, "is_initialized", lambda: True), \
                mock.patch.object(torch.cuda, "device_count", lambda: 1):
            self.assertNotEqual(base, compile_pass.SdpaBackwardRewrite().uuid())
        with tempfile.TemporaryDirectory() as d:  # a source edit
            copies = []
            for src in compile_pass._SOURCE_FILES:
                dst = os.path.join(d, os.path.basename(src))
                shutil.copy(src, dst)
                copies.append(dst)
            with mock.patch.object(compile_pass, "_SOURCE_FILES", tuple(copies)):
                same = compile_pass.SdpaBackwardRewrite().uuid()
                with open(copies[1], "a") as f:
                    f.write("\n# edited\n")
                edited = compile_pass.SdpaBackwardRewrite().uuid()
            self.assertEqual(same, base)
            self.assertNotEqual(edited, base)
        user = AttentionOpRecorder()
        self.assertNotEqual(base, compile_pass.SdpaBackwardRewrite(user_pass=user).uuid())

    def test_routing_stats_reset(self):
        routing.reset_stats()
        compile_pass.decision_counts[("not routed", "x")] += 1
        torch_sm90_sdpa.ops._python_calls["cpu"] += 2
        stats = torch_sm90_sdpa.routing_stats(reset=True)
        self.assertEqual(stats["not_routed"], {"x": 1})
        self.assertEqual(stats["routed_calls"], 2)
        after = torch_sm90_sdpa.routing_stats()
        self.assertEqual((after["routed_calls"], after["not_routed"]), (0, {}))

    def test_env_var(self):
        self.assertIsNone(routing.apply_env("0"))
        self.assertFalse(routing.is_enabled())
        on = dict(enabled=True, causal_masks=True, forward=True)
        routing.apply_env("cpu")
        self.assertEqual(routing.routing_options(), dict(on, cpu=True, only_faster=True))
        routing.disable()
        routing.apply_env("1")
        self.assertEqual(routing.routing_options(), dict(on, cpu=False, only_faster=True))
        routing.disable()
        routing.apply_env("all")  # every eligible backward; forward nodes stay (forward=None)
        self.assertEqual(routing.routing_options(),
                         dict(on, cpu=False, only_faster=False, forward=False))
        routing.disable()
        # (not assertWarns: it walks every module's __warningregistry__, which imports lazy
        # submodules of an installed transformers)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            routing.apply_env("maybe")
        self.assertTrue(any(issubclass(w.category, UserWarning) for w in caught))
        self.assertFalse(routing.is_enabled())

    def test_env_var_at_import(self):
        code = ("import torch, torch_sm90_sdpa; "
                "p = torch._inductor.config.post_grad_custom_post_pass; "
                "print(type(p).__name__, p.cpu)")
        env = dict(os.environ, TORCH_SM90_SDPA="cpu",
                   PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=300)
        self.assertEqual(out.stdout.strip(), "SdpaBackwardRewrite True", out.stderr)


# ---------------------------------------------------------------------------------------
# the CUDA rewrite on fake CUDA tensors
# ---------------------------------------------------------------------------------------

# The CUDA rules are the kernels' contract in _C (can_implement): these tests need _C with the
# head-dim-128 kernels (the CI build), and pretend this machine has an SM90 GPU.
D = 128
UNCOMPILED_D = 72  # a head dim with no tile: never compiled


def _fake_sm90(test):
    """Pretend this machine has an SM90 GPU (the contract itself is _C's, unpatched)."""
    if _extension.load() is None:
        test.skipTest(f"_C is not built: {_extension.unavailable_reason()}")
    missing = [dt for dt in (torch.bfloat16, torch.float16) if not _extension.has_variant(D, dt)]
    if missing:
        test.skipTest(f"the head-dim-{D} kernels are not compiled for {missing}")
    p = mock.patch.object(eligibility, "device_capability",
                          lambda dev: (9, 0) if dev.type == "cuda" else None)
    p.start()
    test.addCleanup(p.stop)
    # the speed gate's rows follow the GPU model: a model the table has no rows of (every
    # model's rows) unless a test names one, so the gate reads the same on an H200 as here
    p = mock.patch.object(speed_gate, "device_name", lambda dev: None)
    p.start()
    test.addCleanup(p.stop)


def trace_backward(backend, b=2, hq=4, hkv=4, sq=17, sk=17, d=D, dtype=torch.bfloat16,
                   causal=True, dropout=0.0, bias=False, layout="bshd", scale=None,
                   shape_env=None, bias_grad=False):
    """An FX graph (fake CUDA tensors in node.meta['val']) of a stock forward + backward op,
    as a post-grad graph holds them. Returns (graph module, fake mode)."""
    mode = FakeTensorMode(shape_env=shape_env)

    def make(h, s):
        with mode:
            if layout == "bshd":
                return torch.empty(b, s, h, d, dtype=dtype, device="cuda").transpose(1, 2)
            return torch.empty(b, h, s, d, dtype=dtype, device="cuda")

    q, k, v = make(hq, sq), make(hkv, sk), make(hkv, sk)
    go = make(hq, sq)
    attn_bias = None
    if bias:  # as SDPA hands a [B, 1, Sq, Sk] mask to the ops: expanded over the heads
        with mode:
            attn_bias = torch.empty(b, 1, sq, sk, dtype=dtype, device="cuda").expand(
                b, hq, sq, sk)

    def fn(q, k, v, go, attn_bias):
        if backend == "cudnn":
            o, lse, cq, ck, mq, mk, seed, off, _ = aten._scaled_dot_product_cudnn_attention(
                q, k, v, attn_bias, True, dropout, causal, False, scale=scale)
            return aten._scaled_dot_product_cudnn_attention_backward(
                go, q, k, v, o, lse, seed, off, attn_bias, cq, ck, mq, mk, dropout, causal,
                scale=scale)
        if backend == "flash":
            o, lse, cq, ck, mq, mk, seed, off, _ = aten._scaled_dot_product_flash_attention(
                q, k, v, dropout, causal, False, scale=scale)
            return aten._scaled_dot_product_flash_attention_backward(
                go, q, k, v, o, lse, cq, ck, mq, mk, dropout, causal, seed, off, scale=scale)
        o, lse, seed, off = aten._scaled_dot_product_efficient_attention(
            q, k, v, attn_bias, True, dropout, causal, scale=scale)
        return aten._scaled_dot_product_efficient_attention_backward(
            go, q, k, v, attn_bias, o, lse, seed, off, dropout,
            [True, True, True, bias_grad], causal, scale=scale)

    with mode:
        gm = make_fx(fn)(q, k, v, go, attn_bias)
    return gm, mode


def graph_ops(gm):
    return "\n".join(
        str(n.target).replace(".default", "") for n in gm.graph.nodes
        if n.op == "call_function" and "getitem" not in str(n.target)
    )


def output_layouts(gm):
    (outs,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
    return [None if o is None else (tuple(o.meta["val"].shape), tuple(o.meta["val"].stride()))
            for o in outs]


class TestCudaRewriteOnFakeTensors(expecttest.TestCase):
    def setUp(self):
        super().setUp()
        _fake_sm90(self)
        routing.reset_stats()

    def rewrite(self, gm):
        before = output_layouts(gm)
        # Eligibility alone here; the speed gate has its own tests (TestSpeedGate).
        results = compile_pass.rewrite_graph(gm.graph, only_faster=False)
        gm.graph.lint()
        gm.recompile()
        self.assertEqual(output_layouts(gm), before)  # every output keeps shape and strides
        for node in gm.graph.nodes:
            if node.target is compile_pass.OUR_OP:  # Inductor pins exactly these layouts
                args, kwargs = node.meta["eager_input_vals"]
                self.assertEqual(kwargs, {})
                for a, v in zip(node.args, args):
                    if isinstance(a, torch.fx.Node):
                        self.assertIs(v, a.meta["val"])
        return [(b, d.reason or "routed") for b, d in results]

    def test_cudnn(self):
        gm, _ = trace_backward("cudnn", hq=8, hkv=2)  # GQA
        self.assertEqual(self.rewrite(gm), [("cudnn", "routed")])
        self.assertExpectedInline(graph_ops(gm), """\
aten._scaled_dot_product_cudnn_attention
aten.select.int
torch_sm90_sdpa.sdpa_backward""")
        (node,) = [n for n in gm.graph.nodes if n.target is compile_pass.OUR_OP]
        lse = node.args[5]
        self.assertEqual(tuple(lse.meta["val"].shape), (2, 8, 17))
        self.assertEqual(node.args[6:], (True, 1 / math.sqrt(D), False))

    def test_flash(self):
        gm, _ = trace_backward("flash", d=128, causal=False, scale=0.3, sq=33, sk=65)
        self.assertEqual(self.rewrite(gm), [("flash", "routed")])
        self.assertExpectedInline(graph_ops(gm), """\
aten._scaled_dot_product_flash_attention
torch_sm90_sdpa.sdpa_backward""")
        (node,) = [n for n in gm.graph.nodes if n.target is compile_pass.OUR_OP]
        self.assertEqual(node.args[6:8], (False, 0.3))

    def test_efficient_lse_sliced_and_layout_kept(self):
        # efficient's grads are [B, S, H, D] memory; a [B, H, S, D] query needs copies
        gm, _ = trace_backward("efficient", dtype=torch.float16, layout="bhsd", sq=17)
        self.assertEqual(self.rewrite(gm), [("efficient", "routed")])
        self.assertExpectedInline(graph_ops(gm), """\
aten._scaled_dot_product_efficient_attention
aten.slice.Tensor
torch_sm90_sdpa.sdpa_backward
aten.permute
aten.clone
aten.permute
aten.permute
aten.clone
aten.permute
aten.permute
aten.clone
aten.permute""")
        (sl,) = [n for n in gm.graph.nodes if n.target is aten.slice.Tensor]
        self.assertEqual(tuple(sl.args[0].meta["val"].shape), (2, 4, 32))  # padded
        self.assertEqual(tuple(sl.meta["val"].shape), (2, 4, 17))

    def test_dynamic_shapes(self):
        """Symbolic batch and sequence lengths: the lse slice takes a sym_size node."""
        from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

        env = ShapeEnv()
        mode = FakeTensorMode(shape_env=env)
        ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.DYNAMIC,
                                                      DimDynamic.STATIC, DimDynamic.STATIC])
        base = mode.from_tensor(torch.empty(2, 40, 4, D), symbolic_context=ctx)
        with mode:
            x = torch.empty(base.shape, device="cuda", dtype=torch.bfloat16)
            q = x.transpose(1, 2)
            go = torch.empty_like(q)

        def fn(q, go):
            o, lse, seed, off = aten._scaled_dot_product_efficient_attention(
                q, q, q, None, True, 0.0, True)
            return aten._scaled_dot_product_efficient_attention_backward(
                go, q, q, q, None, o, lse, seed, off, 0.0, [True, True, True, False], True)

        with mode:
            gm = make_fx(fn)(q, go)
        self.assertEqual(self.rewrite(gm), [("efficient", "routed")])
        self.assertIn("aten.sym_size.int", graph_ops(gm))
        (node,) = [n for n in gm.graph.nodes if n.target is compile_pass.OUR_OP]
        self.assertEqual(str(node.args[5].meta["val"].shape), str(q.shape[:3]))

    def test_ineligible(self):
        cases = {
            "dropout": dict(backend="flash", dropout=0.1),
            "efficient bias with its gradient": dict(backend="efficient", bias=True,
                                                     bias_grad=True),
            "head dim not compiled": dict(backend="cudnn", d=UNCOMPILED_D),
            "fp32": dict(backend="efficient", dtype=torch.float32),
            "flash causal Sq != Sk": dict(backend="flash", sq=16, sk=32, causal=True),
        }
        got = {}
        for name, kw in cases.items():
            gm, _ = trace_backward(**kw)
            before = graph_ops(gm)
            got[name] = self.rewrite(gm)[0][1]
            self.assertEqual(graph_ops(gm), before, name)  # untouched
        self.assertExpectedInline("\n".join(f"{k}: {v}" for k, v in got.items()), """\
dropout: dropout_p > 0
efficient bias with its gradient: attn_mask needs a gradient
head dim not compiled: head dim not compiled
fp32: dtype
flash causal Sq != Sk: causal with Sq != Sk (flash aligns bottom-right)""")
        self.assertEqual(sum(torch_sm90_sdpa.routing_stats()["not_routed"].values()), len(cases))

    def test_not_sm90(self):
        with mock.patch.object(eligibility, "device_capability", lambda dev: (8, 0)):
            gm, _ = trace_backward("cudnn")
            self.assertEqual(self.rewrite(gm), [("cudnn", policy.R_NOT_SM90)])

    def test_masked_nodes_are_routed_with_their_bias(self):
        """cuDNN and memory-efficient nodes with SDPA's additive bias ([B, 1, Sq, Sk] expanded
        over the heads): our op gets the bias as its attn_mask."""
        for backend in ("cudnn", "efficient"):
            gm, _ = trace_backward(backend, bias=True, hq=8, hkv=8 if backend == "efficient" else 2)
            self.assertEqual(self.rewrite(gm), [(backend, "routed")])
            (node,) = [n for n in gm.graph.nodes if n.target is compile_pass.OUR_OP]
            mask = node.args[9]
            self.assertEqual(tuple(mask.meta["val"].shape), (2, 8, 17, 17))
            self.assertEqual(mask.meta["val"].stride()[1], 0)
        self.assertExpectedInline(graph_ops(gm), """\
aten._scaled_dot_product_efficient_attention
aten.slice.Tensor
torch_sm90_sdpa.sdpa_backward""")

    def test_deterministic(self):
        """Under deterministic algorithms the node is routed and the op is told so (its
        deterministic argument), at compile time."""
        gm, _ = trace_backward("flash")
        torch.use_deterministic_algorithms(True)
        try:
            self.assertEqual(self.rewrite(gm), [("flash", "routed")])
        finally:
            torch.use_deterministic_algorithms(False)
        (node,) = [n for n in gm.graph.nodes if n.target is compile_pass.OUR_OP]
        self.assertIs(node.args[8], True)
        gm, _ = trace_backward("flash")
        self.rewrite(gm)
        (node,) = [n for n in gm.graph.nodes if n.target is compile_pass.OUR_OP]
        self.assertIs(node.args[8], False)

    def test_cpu_node_needs_the_cpu_route(self):
        def fn(q):
            o, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0, True)
            return aten._scaled_dot_product_flash_attention_for_cpu_backward(
                o, q, q, q, o, lse, 0.0, True)

        gm = make_fx(fn, tracing_mode="fake")(torch.randn(1, 2, 8, 4))
        results = compile_pass.rewrite_graph(gm.graph, cpu_route=False)
        self.assertEqual([d.reason for _, d in results], [policy.R_CPU_ROUTE_OFF])
        results = compile_pass.rewrite_graph(gm.graph, cpu_route=True)
        self.assertTrue(results[0][1].routed)


def _decide_eligible(call, **kw):
    """policy.decide without the speed gate: the eligibility rules alone."""
    return policy.decide(call, only_faster=False, **kw)


class TestDropInUnderCompile(unittest.TestCase):
    def test_kernel_verdict_is_a_trace_time_constant(self):
        """The drop-in's CUDA eligibility runs the device layer (pybind objects Dynamo cannot
        trace): under torch.compile it is a constant of the trace, not a graph break at every
        attention call. A verdict that builds such an object must compile with fullgraph."""
        from torch_sm90_sdpa import api

        asked = []

        def verdict(*facts):
            asked.append(facts)
            torch._C.Generator()  # (untraceable, as the device layer's objects)
            return None

        def f(q, k, v):
            return q * 2 if api._cuda_unservable_reason(q, k, v) is None else q

        torch._dynamo.reset()
        q = torch.randn(1, 2, 4, 8)
        with mock.patch.object(eligibility, "kernel_verdict", verdict):
            out = torch.compile(f, fullgraph=True, backend="eager")(q, q, q)
        torch.testing.assert_close(out, q * 2)
        self.assertEqual(asked, [(torch.float32, 8, 8, 2, 2, None, False)])


class TestPolicy(unittest.TestCase):
    """decide() on plain descriptions (TensorSpec): the CUDA rules without a GPU."""

    def setUp(self):
        _fake_sm90(self)

    def call(self, d=D, dtype=torch.bfloat16, device="cuda:0", backend="cudnn", **kw):
        b, h, s = 2, 4, 33
        t = policy.TensorSpec((b, h, s, d), dtype, device, strides=(s * h * d, d, h * d, 1))
        lse_shape = {"cudnn": (b, h, s, 1), "efficient": (b, h, 64)}.get(backend, (b, h, s))
        lse = policy.TensorSpec(lse_shape, torch.float32, device)
        fields = dict(backend=backend, grad_out=t, q=t, k=t, v=t, out=t, lse=lse, is_causal=True)
        fields.update(kw)
        return policy.AttentionBackwardCall(**fields)

    def test_eligible(self):
        for backend in policy.CUDA_BACKENDS:
            self.assertTrue(_decide_eligible(self.call(backend=backend)), backend)
            self.assertTrue(_decide_eligible(self.call(backend=backend, deterministic=True)),
                            backend)

    def test_reasons(self):
        col_major = policy.TensorSpec((2, 4, 33, D), torch.bfloat16, "cuda:0",
                                      strides=(4 * 33 * D, 33 * D, 1, 33))
        cases = [
            (self.call(d=UNCOMPILED_D), policy.R_VARIANT),
            (self.call(dtype=torch.float32), policy.R_DTYPE),
            (self.call(device="cpu"), policy.R_DEVICE),
            (self.call(dropout_p=0.5), policy.R_DROPOUT),
            (self.call(mask=policy.TensorSpec((2, 1, 33, 33), torch.int32, "cuda:0")),
             policy.R_MASK),
            (self.call(mask=policy.TensorSpec((2, 3, 33, 33), torch.bool, "cuda:0")),
             policy.R_MASK),
            (self.call(mask=policy.TensorSpec((2, 1, 33, 33), torch.bool, "cuda:0"),
                       mask_needs_grad=True), policy.R_MASK_GRAD),
            (self.call(nested=True), policy.R_NESTED),
            (self.call(grad_out=col_major), policy.R_LAST_DIM),
            (self.call(backend="cpu_flash"), policy.R_CPU_ROUTE_OFF),
        ]
        for call, reason in cases:
            self.assertEqual(_decide_eligible(call).reason, reason)
        with mock.patch.object(_extension, "load", lambda: None), \
                mock.patch.object(_extension, "unavailable_reason", lambda: "not built"):
            self.assertEqual(_decide_eligible(self.call()).reason, policy.R_NOT_BUILT)
        with mock.patch.object(eligibility, "device_capability", lambda dev: (10, 0)):
            self.assertEqual(_decide_eligible(self.call()).reason, policy.R_NOT_SM90)

    def test_layouts_tma_cannot_read_are_routed_with_copies(self):
        """Misaligned, padded and broadcast operands: the op copies them, so they are served."""
        bad_stride = policy.TensorSpec((2, 4, 33, D), torch.bfloat16, "cuda:0",
                                       strides=(33 * 4 * (D + 4), (D + 4) * 33, D + 4, 1))
        odd_offset = policy.TensorSpec((2, 4, 33, D), torch.bfloat16, "cuda:0", offset=4)
        expanded = policy.TensorSpec((2, 4, 33, D), torch.bfloat16, "cuda:0",
                                     strides=(33 * D, 0, D, 1))  # heads broadcast
        for call, copied in ((self.call(q=bad_stride), "q"), (self.call(k=odd_offset), "k"),
                             (self.call(v=expanded), "v")):
            decision = _decide_eligible(call)
            self.assertTrue(decision.routed, decision)
            self.assertEqual(decision.detail,
                             f"copies {copied} (TMA cannot read them as they are)")

    def test_cpu_route_any_dtype_and_head_dim(self):
        for dtype in policy.CPU_DTYPES:
            lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
            t = policy.TensorSpec((1, 2, 5, 12), dtype, "cpu")
            lse = policy.TensorSpec((1, 2, 5), lse_dtype, "cpu")
            call = policy.AttentionBackwardCall("cpu_flash", t, t, t, t, t, lse, is_causal=False)
            self.assertTrue(_decide_eligible(call, cpu_route=True), dtype)



class TestSpeedGate(unittest.TestCase):
    """enable()'s default routes a CUDA call only where our kernel measured faster."""

    def setUp(self):
        _fake_sm90(self)

    def call(self, d, s, backend, causal=True, kv_heads=4, b=1, h=4):
        t = policy.TensorSpec((b, h, s, d), torch.bfloat16, "cuda:0", strides=(s * h * d, d, h * d, 1))
        kv = policy.TensorSpec((b, kv_heads, s, d), torch.bfloat16, "cuda:0",
                               strides=(s * kv_heads * d, d, kv_heads * d, 1))
        lse_shape = {"cudnn": (b, h, s, 1), "efficient": (b, h, (s + 31) // 32 * 32)}.get(backend, (b, h, s))
        lse = policy.TensorSpec(lse_shape, torch.float32, "cuda:0")
        return policy.AttentionBackwardCall(backend=backend, grad_out=t, q=t, k=kv, v=kv, out=t,
                                            lse=lse, is_causal=causal)

    def test_dv_pair_gated_by_its_own_rows(self):
        # (192, 128) by the pair's rows alone (an H100's bench_bwd --dv-pairs, 2k / 8k keys, MHA,
        # unmasked; every GPU model takes them): cuDNN's full calls from 2048 keys (1.31x /
        # 1.40x) and the memory-efficient backward's from 2048 (about 10x); causal calls against
        # cuDNN (0.81-0.86x), shorter calls, GQA, masks and FA2 (no Dv != D kernel, no rows)
        # stay on stock. d192's own rows (Dv == D: 1024 keys full kept on stock) are untouched.
        def call(backend, s, causal, kv_heads=4, mask=None, d=192, dv=128):
            q = policy.TensorSpec((1, 4, s, d), torch.bfloat16, "cuda:0")
            k = policy.TensorSpec((1, kv_heads, s, d), torch.bfloat16, "cuda:0")
            v = policy.TensorSpec((1, kv_heads, s, dv), torch.bfloat16, "cuda:0")
            o = policy.TensorSpec((1, 4, s, dv), torch.bfloat16, "cuda:0")
            lse_shape = {"cudnn": (1, 4, s, 1), "efficient": (1, 4, s)}.get(backend, (1, 4, s))
            lse = policy.TensorSpec(lse_shape, torch.float32, "cuda:0")
            return policy.AttentionBackwardCall(backend=backend, grad_out=o, q=q, k=k, v=v, out=o,
                                                lse=lse, is_causal=causal, mask=mask)

        for name in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA H800"):
            with mock.patch.object(speed_gate, "device_name", lambda device, n=name: n):
                for backend, s, causal in (("cudnn", 2048, False), ("cudnn", 8192, False),
                                           ("cudnn", 32768, False), ("efficient", 2048, True),
                                           ("efficient", 16384, False)):
                    self.assertTrue(policy.faster_than_stock(call(backend, s, causal)).routed,
                                    (name, backend, s, causal))
                mask = policy.TensorSpec((1, 1, 8192, 8192), torch.bool, "cuda:0")
                for c in (call("cudnn", 2048, True), call("cudnn", 16384, True),
                          call("cudnn", 1024, False), call("efficient", 1024, False),
                          call("flash", 8192, False), call("cudnn", 8192, False, kv_heads=2),
                          call("cudnn", 8192, False, mask=mask), call("cudnn", 8192, False, dv=64)):
                    decision = policy.faster_than_stock(c)
                    self.assertEqual(decision.reason, policy.R_SLOWER, (name, c))
                    self.assertIn("Dv != D", decision.detail)
                self.assertFalse(policy.faster_than_stock(call("cudnn", 1024, False, dv=192)).routed)

    def test_cudnn_kept_where_it_is_faster(self):
        # (the shipped table: bench_bwd --extra runs of fourteen commits on H200s and an H100, each
        # row's slowest: d128 full under 1.01x of cuDNN at every length (0.97-1.008x on the
        # H100), d128 is_causal at 512-4096 keys, so for these MHA calls only is_causal from
        # 4097 passes; d256 is_causal nowhere (the H100's 0.95-0.98x), d96 / d192 were measured
        # from 2k keys only)
        for d, s, causal in [(128, 512, False), (128, 4097, False), (128, 6000, False),
                             (128, 2048, False), (128, 8192, False), (128, 4096, True),
                             (128, 1024, False), (128, 4096, False), (128, 16384, False),
                             (128, 32768, False),
                             (128, 1000, True), (128, 512, True), (128, 3000, True),
                             (128, 2048, True), (256, 8192, True), (256, 1024, True),
                             (256, 16384, True), (256, 2048, True), (256, 512, True),
                             (96, 1024, True), (192, 1024, False), (64, 256, True)]:
            decision = policy.faster_than_stock(self.call(d, s, "cudnn", causal))
            self.assertEqual(decision.reason, policy.R_SLOWER, (d, s, causal))
            self.assertIn("causal" if causal else "full", decision.detail)
        for s in (4096, 1000):
            call = self.call(128, s, "cudnn", causal=True)
            self.assertEqual(policy.decide(call).reason, policy.R_SLOWER)
            self.assertTrue(policy.decide(call, only_faster=False))

    def test_gqa_calls_keep_the_gqa_rows_mha_calls_do_not(self):
        # d128 is_causal at 8k keys: the MHA row passes in every run, the GQA rows (the MQA one
        # at 0.98-0.99x) do not, so an MHA call there is routed and a GQA call is not; at 16k
        # (no GQA row) both follow the MHA row
        self.assertTrue(policy.faster_than_stock(self.call(128, 8192, "cudnn", True, kv_heads=4)))
        for kv_heads in (2, 1):
            decision = policy.faster_than_stock(self.call(128, 8192, "cudnn", True, kv_heads=kv_heads))
            self.assertEqual(decision.reason, policy.R_SLOWER, kv_heads)
            self.assertIn("GQA", decision.detail)
            self.assertTrue(policy.faster_than_stock(self.call(128, 16384, "cudnn", True, kv_heads=kv_heads)))
        self.assertIn("MHA", policy.faster_than_stock(self.call(128, 512, "cudnn", True)).detail)
        for case in ("causal", "full"):
            self.assertEqual(policy.MHA_FASTER_THAN_CUDNN_LENGTHS[case],
                             policy.routed_lengths_from_table(speed_table.ROWS, "cudnn", False, case,
                                                              paths=(policy.PATH_MHA,)))
            for group in policy.WALKED_GROUPS:
                self.assertEqual(policy.walked_gqa_faster_than_cudnn_lengths(group)[case],
                                 policy.routed_lengths_from_table(
                                     speed_table.ROWS, "cudnn", False, case,
                                     paths=(policy.PATH_MHA, policy.path_gqa_walked(group))))
        # a group the table has no row of keeps every row
        self.assertNotIn(16, policy.WALKED_GROUPS)
        self.assertIs(policy.walked_gqa_faster_than_cudnn_lengths(16), policy.FASTER_THAN_CUDNN_LENGTHS)

    def test_gqa_calls_whose_ctas_walk_their_group_keep_the_walked_rows(self):
        """A GQA call whose CTAs walk groups of G q heads (the C++ rule: enough kv-head
        key-block CTAs) is gated by the MHA rows and the rows walked by groups of G: at d128
        is_causal 8k keys G = 2 (the compiled GPT's 16/8, 1.09x) is routed, G = 8 (32/4:
        0.89x on the H100; walked only when forced since groups of 8 measured slower walked) is
        not, nor a call of too few CTAs (the MQA row's path), nor a group the table has no row
        of (every row gates it)."""
        if _extension.load() is None:
            self.skipTest(f"_C is not built: {_extension.unavailable_reason()}")
        # the compiled GPT of issue 8: b2, GQA 16/8 (2 * 8 * 64 = 1024 kv-head key-block CTAs)
        gpt = self.call(128, 8192, "cudnn", True, kv_heads=8, b=2, h=16)
        few = self.call(128, 8192, "cudnn", True, kv_heads=1, b=2, h=16)  # 128 CTAs: accumulators
        eight = self.call(128, 8192, "cudnn", True, kv_heads=4, b=2, h=32)  # 512 CTAs
        sixteen = self.call(128, 8192, "cudnn", True, kv_heads=2, b=4, h=32)  # 512 CTAs
        walks = lambda c: policy.gqa_heads_per_cta(c.q, c.k, c.v, c.out, c.grad_out,
                                                   is_causal=c.is_causal, deterministic=c.deterministic)
        # groups of more than 4 heads walk only when forced (kMaxWalkGroup)
        self.assertEqual([walks(c) for c in (gpt, few, eight, sixteen)], [2, 1, 1, 1])
        self.assertTrue(policy.faster_than_stock(gpt))
        for call in (few, eight, sixteen):
            decision = policy.faster_than_stock(call)
            self.assertEqual(decision.reason, policy.R_SLOWER, call.k.shape)
            self.assertIn("GQA", decision.detail)
        with _extension.switch_env("TORCH_SM90_SDPA_GQA_WALK", "1"):
            self.assertEqual([walks(c) for c in (eight, sixteen)], [8, 16])
            self.assertIn("groups of 8", policy.faster_than_stock(eight).detail)
            self.assertEqual(policy.faster_than_stock(eight).reason, policy.R_SLOWER)
        # what the kernel does decides it: no walk under deterministic algorithms unless
        # forced, nor with the walk switched off (read at compile time, part of the pass's
        # cache key)
        gpt.deterministic = True
        self.assertEqual(walks(gpt), 1)
        self.assertEqual(policy.faster_than_stock(gpt).reason, policy.R_SLOWER)
        with _extension.switch_env("TORCH_SM90_SDPA_GQA_WALK", "1"):
            self.assertEqual(walks(gpt), 2)
        gpt.deterministic = False
        with _extension.switch_env("TORCH_SM90_SDPA_GQA_WALK", "0"):
            self.assertEqual(walks(gpt), 1)
            self.assertEqual(policy.faster_than_stock(gpt).reason, policy.R_SLOWER)
            off = policy.policy_fingerprint()
        self.assertNotEqual(off, policy.policy_fingerprint())
        self.assertTrue(policy.faster_than_stock(gpt))
        # a symbolic batch: the CTA count is not known for every size, so no walk is assumed
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        sym = ShapeEnv().create_unbacked_symint()
        torch._check(sym >= 2)
        torch._check(sym <= 64)
        q = policy.TensorSpec((sym, 16, 8192, 128), torch.bfloat16, "cuda:0",
                              strides=(8192 * 16 * 128, 128, 16 * 128, 1))
        kv = policy.TensorSpec((sym, 8, 8192, 128), torch.bfloat16, "cuda:0",
                               strides=(8192 * 8 * 128, 128, 8 * 128, 1))
        self.assertEqual(policy.gqa_heads_per_cta(q, kv, kv, q, q, is_causal=True,
                                                  deterministic=False), 1)

    def test_cudnn_routed_where_ours_is_faster(self):
        # the gate alone (d64 may not be compiled here), MHA calls; lengths between two
        # measured ones that both passed are routed (d64 is_causal 3000, d128 is_causal 6000)
        for d, s, causal in [(64, 512, True), (64, 2048, False), (64, 3000, True), (64, 16384, True),
                             (96, 2048, False), (192, 8192, True), (256, 8192, False),
                             (256, 16384, False),
                             (128, 16384, True), (128, 4097, True), (128, 32768, True),
                             (128, 6000, True), (128, 8192, True)]:
            self.assertTrue(policy.faster_than_stock(self.call(d, s, "cudnn", causal)),
                            (d, s, causal))

    def masked(self, d, s, backend, mask_shape, strides=None):
        call = self.call(d, s, backend)
        call.mask = policy.TensorSpec(mask_shape, torch.bfloat16, "cuda:0", strides=strides)
        return call

    def test_masked_calls_routed_where_measured_faster(self):
        for backend in ("cudnn", "efficient"):
            for d, s in [(128, 1024), (128, 8192), (64, 2048), (256, 1024)]:
                for shape, strides in [((1, 1, s, s), None), ((1, 4, s, s), (s * s, 0, s, 1)),
                                       ((s, s), None), ((1, 1, 1, s), None)]:
                    self.assertTrue(policy.faster_than_stock(
                        self.masked(d, s, backend, shape, strides)), (backend, d, s, shape))

    def test_rank3_masks_broadcast_from_the_right(self):
        """A [X, Sq, Sk] mask broadcasts X against the heads: routed only when X is 1."""
        s = 4096
        self.assertTrue(policy.faster_than_stock(self.masked(128, s, "cudnn", (1, s, s))))
        self.assertEqual(policy.faster_than_stock(self.masked(128, s, "cudnn", (4, s, s))).reason,
                         policy.R_SLOWER)

    def test_symbolic_key_length_uses_its_range(self):
        """Sk symbolic (dynamic shapes): routed only if every value it may take is long enough."""
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        env = ShapeEnv()
        for low, routed in ((2048, True), (2, False)):
            sym = env.create_unbacked_symint()
            torch._check(sym >= low)
            torch._check(sym <= 1 << 20)
            call = self.masked(128, 4096, "cudnn", (1, 1, 4096, 4096))
            call.k = policy.TensorSpec((1, 4, sym, 128), torch.bfloat16, "cuda:0",
                                       strides=(4 * 4096 * 128, 128, 4 * 128, 1))
            self.assertEqual(bool(policy.faster_than_stock(call)), routed, low)

    def test_masked_calls_kept_on_stock_elsewhere(self):
        for backend in ("cudnn", "efficient"):
            per_head = self.masked(128, 8192, backend, (1, 4, 8192, 8192))  # ALiBi-like bias
            short = self.masked(64, 512, backend, (1, 1, 512, 512))  # shorter than any measured row
            unmeasured_dim = self.masked(96, 8192, backend, (1, 1, 8192, 8192))
            for call in (per_head, short, unmeasured_dim):
                self.assertEqual(policy.faster_than_stock(call).reason, policy.R_SLOWER, backend)
            self.assertIn("per-head", policy.faster_than_stock(per_head).detail)

    def test_flash_and_efficient_always_routed(self):
        for backend in ("flash", "efficient"):
            for d, s in [(128, 1024), (128, 8192), (128, 512)]:
                self.assertTrue(policy.decide(self.call(d, s, backend)), (backend, d, s))

    def test_gate_follows_the_gpu_model(self):
        """A call is gated by the rows measured on its GPU model; a model the table has no rows
        of takes every model's rows (a length passes only where it passed on each)."""
        h200, h100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"
        self.assertEqual(policy.MEASURED_DEVICES, (h100, h200))
        for model in policy.MEASURED_DEVICES:
            own = [r for r in speed_table.ROWS if r["device"] == model and not r["masked"]]
            self.assertEqual(policy.gate_tables(model).mha,
                             {case: policy.routed_lengths_from_table(own, "cudnn", False, case,
                                                                     paths=(policy.PATH_MHA,))
                              for case in ("causal", "full")})
        # the H100 has no masked rows: its masked gate is every model's
        self.assertEqual(policy.gate_tables(h100).masked, policy.MASKED_FASTER_LENGTHS)

        def gate(model, d, s, causal):
            with mock.patch.object(speed_gate, "device_name", lambda dev: model):
                return policy.faster_than_stock(self.call(d, s, "cudnn", causal))

        # d128 full at 2k keys: 1.02-1.08x in every H200 run of the shipped kernel, 0.97-1.01x in
        # the H100's runs of an older one; d256 is_causal at 512 keys: 1.07x and more in the
        # H200's runs of its shipped kernel (26-27), 0.96x in the H100's
        self.assertTrue(gate(h200, 128, 2048, False))
        self.assertTrue(gate(h200, 128, 1024, True))
        for model in (h100, "NVIDIA H800", None):
            decision = gate(model, 128, 2048, False)
            self.assertEqual(decision.reason, policy.R_SLOWER, model)
            self.assertIn(f"on {model}" if model == h100 else "on every GPU measured", decision.detail)
        self.assertTrue(gate(h100, 256, 512, False))
        # a walked group the model has no rows of takes every model's rows of it: the H100's
        # runs have no group of 2, so the compiled GPT's GQA 16/8 at 8k keys is gated there by
        # the H100's MHA rows and the H200's walked rows (routed), not by the H100's MQA row
        for model in (h100, h200):
            lengths = policy.walked_gqa_faster_than_cudnn_lengths(2, model)["causal"][128]
            self.assertTrue(policy.in_routed_lengths(8192, lengths), model)
        self.assertFalse(policy.in_routed_lengths(8192, policy.gate_tables(h100).gqa["causal"][128]))
        self.assertTrue(gate(h200, 256, 512, True))
        self.assertTrue(gate(h200, 256, 512, False))
        for model in (h100, "NVIDIA H800", None):
            self.assertEqual(gate(model, 256, 512, True).reason, policy.R_SLOWER, model)
        self.assertIsNone(policy.gate_device(torch.device("cpu")))

    def test_family_rows_fall_back_to_every_model(self):
        rows = [dict(device="A", stock="cudnn", masked=False, head_dim=64, seqlen=1024,
                     case="full", gqa=False, walk=1, speedup=1.1, source=0),
                dict(device="B", stock="cudnn", masked=False, head_dim=64, seqlen=1024,
                     case="full", gqa=False, walk=1, speedup=0.9, source=1),
                dict(device="B", stock="cudnn", masked=True, head_dim=64, seqlen=1024,
                     case="causal", gqa=False, walk=1, speedup=1.5, source=2)]
        with mock.patch.object(speed_table, "ROWS", rows):
            self.assertEqual(speed_gate._family_rows("A", "cudnn", False), rows[:1])
            self.assertEqual(speed_gate._family_rows("B", "cudnn", False), rows[1:2])
            self.assertEqual(speed_gate._family_rows("C", "cudnn", False), rows[:2])
            self.assertEqual(speed_gate._family_rows(None, "cudnn", False), rows[:2])
            self.assertEqual(speed_gate._family_rows("A", "cudnn", True), rows[2:])  # none of A's

    def test_routed_lengths_come_from_the_measured_table(self):
        rows = [dict(stock="cudnn", masked=False, head_dim=64, seqlen=s, case=c, gqa=False,
                     speedup=x, source=0)
                for s, c, x in [(1024, "full", 1.005), (1024, "causal", 1.03), (4096, "full", 1.04),
                                (4096, "causal", 1.08), (16384, "full", 1.02)]]
        rows += [dict(rows[0], head_dim=128, seqlen=s, speedup=x)
                 for s, x in [(512, 1.1), (1024, 1.2), (4096, 0.99), (8192, 1.05), (16384, 1.1)]]
        rows += [dict(rows[0], head_dim=256, seqlen=16384, speedup=0.9)]
        rows += [dict(rows[0], head_dim=96, seqlen=s, speedup=x)  # passes only at one length
                 for s, x in [(1024, 0.9), (2048, 1.1), (4096, 0.95)]]
        # a GQA row slower at the same length fails that length for the whole case
        rows += [dict(rows[0], head_dim=192, seqlen=2048, speedup=1.2),
                 dict(rows[0], head_dim=192, seqlen=2048, gqa=True, speedup=1.0)]
        full = {64: ((4096, None),), 128: ((512, 1024), (8192, None)), 96: ((2048, 2048),)}
        self.assertEqual(policy.routed_lengths_from_table(rows, "cudnn", False, "full"), full)
        self.assertEqual(policy.routed_lengths_from_table(rows, "cudnn", False, "causal"),
                         {64: ((1024, None),)})  # (the other head dims' rows are all "full")
        # both cases together: d64's 1024 fails on its full row although its causal one passes
        self.assertEqual(policy.routed_lengths_from_table(rows, "cudnn", False), full)
        # the MHA rows alone: d192's slower GQA row no longer fails 2048
        mha, walked = (policy.PATH_MHA,), (policy.PATH_MHA, policy.path_gqa_walked(4))
        self.assertEqual(policy.routed_lengths_from_table(rows, "cudnn", False, "full", paths=mha),
                         {**full, 192: ((2048, None),)})
        self.assertEqual(policy.routed_lengths_from_table(
            rows, "cudnn", False, "full", paths=(policy.PATH_GQA_ACCUM,)), {})
        # the slower GQA row ran with accumulators: a gate of calls walked by groups of 4 passes
        # 2048; a slower row walked by groups of 4 fails it again, one walked by groups of 8 not
        self.assertEqual(policy.routed_lengths_from_table(rows, "cudnn", False, "full", paths=walked),
                         {**full, 192: ((2048, None),)})
        by8 = dict(rows[0], head_dim=192, seqlen=2048, gqa=True, walk=8, speedup=0.95)
        self.assertIn(192, policy.routed_lengths_from_table(rows + [by8], "cudnn", False, "full",
                                                            paths=walked))
        self.assertNotIn(192, policy.routed_lengths_from_table(rows + [dict(by8, walk=4)], "cudnn",
                                                               False, "full", paths=walked))
        self.assertEqual(policy.routed_lengths_from_table(rows, "cudnn", True), {})
        ranges = full[128]
        for seqlen, routed in [(256, False), (512, True), (800, True), (1024, True),
                               (1025, False), (4096, False), (8191, False), (8192, True),
                               (1 << 20, True)]:
            self.assertEqual(policy.in_routed_lengths(seqlen, ranges), routed, seqlen)
        self.assertEqual(policy.describe_lengths(full),
                         "d64 Sk >= 4096; d96 Sk in 2048..2048; d128 Sk in 512..1024 or >= 8192")
        self.assertEqual(policy.describe_lengths({}), "no head dim")
        for case in ("causal", "full"):
            self.assertEqual(policy.FASTER_THAN_CUDNN_LENGTHS[case],
                             policy.routed_lengths_from_table(speed_table.ROWS, "cudnn", False, case))

    def test_symbolic_key_length_must_fit_one_routed_range(self):
        """Sk symbolic with a range across a length that is not routed: stock keeps the call."""
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        env = ShapeEnv()
        ranges = ((512, 1024), (8192, None))
        for low, high, routed in ((600, 1000, True), (600, 2000, False), (9000, 1 << 20, True),
                                  (100, 600, False)):
            sym = env.create_unbacked_symint()
            torch._check(sym >= low)
            torch._check(sym <= high)
            self.assertEqual(policy.in_routed_lengths(sym, ranges), routed, (low, high))

    def test_shipped_table_is_generated_from_the_results(self):
        """torch_sm90_sdpa/_generated_speed_table.py, as imported (in place or from an installed
        wheel), is what tools/speed_table.py makes of the files its SOURCES name
        (benchmarks/results/): nobody edited the numbers by hand."""
        import importlib.util

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        spec = importlib.util.spec_from_file_location(
            "speed_table_generator", os.path.join(root, "tools", "speed_table.py"))
        generator = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(generator)
        runs = generator.read_runs()  # the runs its list names, with their head-dim restrictions
        self.assertEqual([src["file"] for src in speed_table.SOURCES], [f for f, _ in runs])
        self.assertEqual([tuple(src.get("head_dims", ())) or None for src in speed_table.SOURCES],
                         [dims for _, dims in runs])
        cwd = os.getcwd()
        os.chdir(root)
        try:
            text = generator.render(*generator.build(runs))
        finally:
            os.chdir(cwd)
        with open(speed_table.__file__) as f:  # the imported table: installed or in place
            self.assertEqual(f.read(), text)

    def test_the_gate_is_in_the_cache_key(self):
        self.assertNotEqual(compile_pass.SdpaBackwardRewrite(only_faster=True).uuid(),
                            compile_pass.SdpaBackwardRewrite(only_faster=False).uuid())

class TestCommandLine(unittest.TestCase):
    def run_cli(self, *args, timeout=600):
        env = dict(os.environ,
                   PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
        with tempfile.TemporaryDirectory() as d:
            env["TORCHINDUCTOR_CACHE_DIR"] = d
            return subprocess.run([sys.executable, "-m", "torch_sm90_sdpa", *args], env=env,
                                  capture_output=True, text=True, timeout=timeout)

    def test_info(self):
        out = self.run_cli("info", "--build-info")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("build_info():", out.stdout)
        self.assertIn("What would be routed", out.stdout)

    def test_demo_cpu(self):
        out = self.run_cli("demo", "--device", "cpu", "--steps", "2", "--seq-len", "16",
                           "--dim", "32", "--layers", "1")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn("CPU route", out.stdout)
        self.assertIn("replaced: 1 x aten._scaled_dot_product_flash_attention_for_cpu_backward",
                      out.stdout)
        self.assertIn("step 2/2", out.stderr)
        self.assertIn("OK", out.stdout)
        # the demo compares backwards: its forward stays stock unless --only-faster
        self.assertIn("Forward nodes stay on stock", out.stdout)

    def test_demo_cpu_bidirectional(self):
        out = self.run_cli("demo", "--device", "cpu", "--steps", "1", "--seq-len", "16",
                           "--dim", "32", "--layers", "1", "--no-causal")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn("bidirectional (is_causal=False)", out.stdout)
        self.assertIn("replaced: 1 x aten._scaled_dot_product_flash_attention_for_cpu_backward",
                      out.stdout)
        self.assertIn("OK", out.stdout)


if __name__ == "__main__":
    expecttest.run_tests() if hasattr(expecttest, "run_tests") else unittest.main()
