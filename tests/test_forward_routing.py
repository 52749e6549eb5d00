"""The joint-graph rewrite of SDPA forward nodes (torch_sm90_sdpa/forward_pass.py,
enable(forward=True)).

On CPU the whole route runs for real: enable(cpu=True, forward=True) replaces the CPU flash
forward and backward nodes by our ops, in training and in forward-only compiles; losses and
gradients are compared with stock, and the ops that ran are read from the profiler. The CUDA
rules (cuDNN / flash / memory-efficient nodes, the boolean mask behind SDPA's bias, the forward
speed gate) are checked on graphs of fake CUDA tensors, as tests/test_compile_routing.py does
for the backward.
"""
import math
import operator

import expecttest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import torch_sm90_sdpa
from torch_sm90_sdpa import forward_pass, policy, routing, speed_gate
from test_compile_routing import (CompileTestCase, D, UNCOMPILED_D, _fake_sm90, graph_ops,
                                  output_layouts, param_grads, assert_grads_close,
                                  ran_attention_ops, tiny_llama_padded)

aten = torch.ops.aten
FWD = torch.ops.torch_sm90_sdpa.sdpa_forward.default
BWD = torch.ops.torch_sm90_sdpa.sdpa_backward.default


# ---------------------------------------------------------------------------------------
# graphs of fake CUDA tensors, as the joint graph holds them
# ---------------------------------------------------------------------------------------


def sdpa_bias(mask, dtype, fill):
    """SDPA's conversion of a bool mask (torch's convert_boolean_attn_mask[_cudnn])."""
    return aten.where.self(aten.logical_not.default(mask),
                           aten.scalar_tensor.default(fill, dtype=dtype, device=mask.device),
                           aten.scalar_tensor.default(0.0, dtype=dtype, device=mask.device))


def trace_joint(backend, b=2, hq=4, hkv=4, sq=17, sk=17, d=D, dtype=torch.bfloat16,
                causal=False, mask="bool", layout="bshd", backward=True, fill=None,
                mask_shape=None, bias_grad=False):
    """make_fx graph of a stock forward (+ backward) node with fake CUDA tensors.
    mask: None; "bool" (a bool graph input converted as SDPA does: -65504 for cuDNN, else
    -inf, padded and sliced back and expanded for the memory-efficient node); "float" (an
    additive graph input)."""
    mode = FakeTensorMode()
    with mode:
        def make(h, s):
            if layout == "bshd":
                return torch.empty(b, s, h, d, dtype=dtype, device="cuda").transpose(1, 2)
            return torch.empty(b, h, s, d, dtype=dtype, device="cuda")

        q, k, v, go = make(hq, sq), make(hkv, sk), make(hkv, sk), make(hq, sq)
        shape = mask_shape or (b, 1, sq, sk)
        m = (torch.empty(shape, dtype=torch.bool, device="cuda") if mask == "bool" else
             torch.empty(shape, dtype=dtype, device="cuda") if mask == "float" else None)
    if fill is None:
        fill = -65504.0 if backend == "cudnn" else -math.inf

    def fn(q, k, v, go, m):
        bias = None
        if mask == "bool":
            bias = sdpa_bias(m, dtype, fill)
        elif mask == "float":
            bias = m
        if backend == "cudnn":
            o, lse, cq, ck, mq, mk, seed, off, _ = aten._scaled_dot_product_cudnn_attention(
                q, k, v, bias, True, 0.0, causal, False)
            if not backward:
                return (o,)
            return aten._scaled_dot_product_cudnn_attention_backward(
                go, q, k, v, o, lse, seed, off, bias, cq, ck, mq, mk, 0.0, causal)
        if backend == "flash":
            o, lse, cq, ck, mq, mk, seed, off, _ = aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, causal, False)
            if not backward:
                return (o,)
            return aten._scaled_dot_product_flash_attention_backward(
                go, q, k, v, o, lse, cq, ck, mq, mk, 0.0, causal, seed, off)
        if bias is not None:  # the memory-efficient kernel's padded, expanded bias
            pad = (-sk) % 16
            bias = aten.slice.Tensor(aten.constant_pad_nd.default(bias, [0, pad]), -1, 0, sk)
            bias = aten.expand.default(bias, [b, hq, sq, sk])
        o, lse, seed, off = aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, 0.0, causal)
        if not backward:
            return (o,)
        return aten._scaled_dot_product_efficient_attention_backward(
            go, q, k, v, bias, o, lse, seed, off, 0.0, [True, True, True, bias_grad], causal)

    with mode:
        gm = make_fx(fn)(q, k, v, go, m)
    return gm


def placeholders(gm):
    return {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}


class TestBoolMaskBehindTheBias(expecttest.TestCase):
    """forward_pass.bool_mask_of: the user's bool mask behind SDPA's additive bias."""

    def bias_of(self, gm):
        (node,) = [n for n in gm.graph.nodes if n.target in forward_pass._BACKEND_BY_TARGET]
        backend = forward_pass._BACKEND_BY_TARGET[node.target]
        return forward_pass.bool_mask_of(
            torch.fx.node.map_arg(node.args[3], lambda n: n), backend)

    def test_found_through_sdpas_conversions(self):
        for backend in ("cudnn", "efficient"):
            gm = trace_joint(backend, backward=False)
            self.assertIs(self.bias_of(gm), placeholders(gm)["m_1"], backend)

    def test_cudnn_fill_counts_for_cudnn_nodes_only(self):
        self.assertIsNotNone(self.bias_of(trace_joint("cudnn", fill=-65504.0, backward=False)))
        self.assertIsNone(self.bias_of(trace_joint("efficient", fill=-65504.0, backward=False)))
        self.assertIsNone(self.bias_of(trace_joint("cudnn", fill=-1e4, backward=False)))

    def test_not_found(self):
        self.assertIsNone(self.bias_of(trace_joint("cudnn", mask="float", backward=False)))

        def taken_apart(m):  # a window of a larger converted mask is not that mask
            bias = sdpa_bias(m, torch.bfloat16, -math.inf)
            return aten.slice.Tensor(aten.slice.Tensor(bias, 2, 0, 17), 3, 0, 17)

        with FakeTensorMode():
            m = torch.empty(2, 1, 20, 20, dtype=torch.bool, device="cuda")
            gm = make_fx(taken_apart)(m)
        (out,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
        self.assertIsNone(forward_pass.bool_mask_of(out, "cudnn"))


class TestForwardRewriteOnFakeCuda(expecttest.TestCase):
    def setUp(self):
        super().setUp()
        _fake_sm90(self)
        routing.reset_stats()

    def rewrite(self, gm, only_faster=False):
        before = output_layouts(gm)
        results = forward_pass.route_forward_nodes(gm.graph, only_faster=only_faster)
        gm.graph.lint()
        gm.recompile()
        self.assertEqual(output_layouts(gm), before)  # every output keeps shape and strides
        for node in gm.graph.nodes:
            if node.target in (FWD, BWD):  # Inductor pins exactly these layouts
                args, kwargs = node.meta["eager_input_vals"]
                for a, v in zip(node.args, args):
                    if isinstance(a, torch.fx.Node):
                        self.assertIs(v, a.meta["val"])
        return [(b, d.reason or "routed") for b, d in results]

    def assert_dead_rows_opened(self, opened, m):
        """`opened` is m | ~m.any(-1, keepdim=True), the cuDNN fill's semantics."""
        self.assertIs(opened.target, aten.logical_or.default)
        self.assertIs(opened.args[0], m)
        dead = opened.args[1]
        self.assertIs(dead.target, aten.logical_not.default)
        self.assertEqual((dead.args[0].target, dead.args[0].args), (aten.any.dim, (m, -1, True)))
        self.assertEqual(opened.meta["val"].shape, m.meta["val"].shape)

    def test_cudnn_forward_and_backward_take_the_bool_mask(self):
        gm = trace_joint("cudnn", hq=8, hkv=2)  # GQA
        self.assertEqual(self.rewrite(gm), [("cudnn", "routed")])
        self.assertExpectedInline(graph_ops(gm), """\
aten.any.dim
aten.logical_not
aten.logical_or
torch_sm90_sdpa.sdpa_forward
torch_sm90_sdpa.sdpa_backward""")
        m = placeholders(gm)["m_1"]
        (fwd,) = [n for n in gm.graph.nodes if n.target is FWD]
        (bwd,) = [n for n in gm.graph.nodes if n.target is BWD]
        # causal, scale, gqa, then the bool mask with its hidden rows opened (cuDNN's fill)
        self.assertEqual(fwd.args[3:6], (False, 1 / math.sqrt(D), True))
        self.assert_dead_rows_opened(fwd.args[6], m)
        lse = [u for u in fwd.users if u.args[1] == 1]
        self.assertEqual(bwd.args[5], lse[0])  # our lse, as it is
        self.assertEqual(tuple(lse[0].meta["val"].shape), (2, 8, 17))
        self.assertIs(bwd.args[9], fwd.args[6])
        stats = torch_sm90_sdpa.routing_stats()
        self.assertEqual((stats["routed_forward_nodes"], stats["routed_nodes"]),
                         ({"cudnn": 1}, {"cudnn": 1}))

    def test_forward_nodes_of_one_mask_share_its_opened_rows(self):
        """Two cuDNN forward nodes (two layers) of one mask: one mask | ~mask.any(-1) node,
        which both forwards and both backwards read."""
        mode = FakeTensorMode()
        with mode:
            q, k, v, go = (torch.empty(2, 4, 17, D, dtype=torch.bfloat16, device="cuda")
                           for _ in range(4))
            m = torch.empty(2, 1, 17, 17, dtype=torch.bool, device="cuda")

        def layer(q, k, v, go, bias):
            o, lse, cq, ck, mq, mk, seed, off, _ = aten._scaled_dot_product_cudnn_attention(
                q, k, v, bias, True, 0.0, False, False)
            return o, aten._scaled_dot_product_cudnn_attention_backward(
                go, q, k, v, o, lse, seed, off, bias, cq, ck, mq, mk, 0.0, False)

        def fn(q, k, v, go, m):
            bias = sdpa_bias(m, torch.bfloat16, -65504.0)
            o1, g1 = layer(q, k, v, go, bias)
            o2, g2 = layer(o1, k, v, go, bias)
            return (o2,) + tuple(g1) + tuple(g2)

        with mode:
            gm = make_fx(fn)(q, k, v, go, m)
        self.assertEqual(self.rewrite(gm), [("cudnn", "routed")] * 2)
        (opened,) = [n for n in gm.graph.nodes if n.target is aten.logical_or.default]
        self.assert_dead_rows_opened(opened, placeholders(gm)["m_1"])
        self.assertEqual([n.args[6] for n in gm.graph.nodes if n.target is FWD], [opened] * 2)
        self.assertEqual([n.args[9] for n in gm.graph.nodes if n.target is BWD], [opened] * 2)

    def test_efficient_bias_padded_and_expanded(self):
        gm = trace_joint("efficient", layout="bhsd", dtype=torch.float16, causal=True)
        self.assertEqual(self.rewrite(gm), [("efficient", "routed")])
        # out and the gradients come back in the stock [B, S, H, D] memory: copies
        self.assertExpectedInline(graph_ops(gm), """\
torch_sm90_sdpa.sdpa_forward
aten.permute
aten.clone
aten.permute
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
        (bwd,) = [n for n in gm.graph.nodes if n.target is BWD]
        self.assertIs(bwd.args[9], placeholders(gm)["m_1"])

    def test_forward_only_graph(self):
        gm = trace_joint("cudnn", backward=False)
        self.assertEqual(self.rewrite(gm), [("cudnn", "routed")])
        self.assertExpectedInline(graph_ops(gm), """\
aten.any.dim
aten.logical_not
aten.logical_or
torch_sm90_sdpa.sdpa_forward""")
        self.assertEqual(torch_sm90_sdpa.routing_stats()["routed_nodes"], {})

    def test_unmasked_and_flash(self):
        gm = trace_joint("flash", mask=None, causal=True, layout="bhsd")
        self.assertEqual(self.rewrite(gm), [("flash", "routed")])
        self.assertIn("torch_sm90_sdpa.sdpa_backward", graph_ops(gm))

    def test_kept_with_its_backward(self):
        cases = {
            # the backward is not served (the bias's gradient): both stay
            "bias gradient": dict(backend="efficient", mask="float", bias_grad=True),
            "head dim": dict(backend="cudnn", d=UNCOMPILED_D),
            "fp32": dict(backend="efficient", dtype=torch.float32),
            "flash causal Sq != Sk": dict(backend="flash", mask=None, causal=True, sq=16, sk=32),
        }
        got = {}
        for name, kw in cases.items():
            gm = trace_joint(**kw)
            before = graph_ops(gm)
            got[name] = self.rewrite(gm)[0][1]
            self.assertEqual(graph_ops(gm), before, name)  # untouched
        self.assertExpectedInline("\n".join(f"{k}: {v}" for k, v in got.items()), """\
bias gradient: its backward stays on stock
head dim: head dim not compiled
fp32: dtype
flash causal Sq != Sk: its backward stays on stock""")
        self.assertEqual(torch_sm90_sdpa.routing_stats()["routed_nodes"], {})

    def test_a_node_it_cannot_read_stays(self):
        from unittest import mock

        gm = trace_joint("cudnn")
        before = graph_ops(gm)
        with mock.patch.object(forward_pass, "_describe", side_effect=KeyError("query")):
            self.assertEqual(self.rewrite(gm), [("cudnn", policy.R_SHAPES)])
        self.assertEqual(graph_ops(gm), before)

    def test_not_sm90(self):
        from unittest import mock

        from torch_sm90_sdpa import eligibility
        with mock.patch.object(eligibility, "device_capability", lambda dev: (8, 0)):
            gm = trace_joint("cudnn")
            self.assertEqual(self.rewrite(gm), [("cudnn", policy.R_NOT_SM90)])

    def test_speed_gate(self):
        """Routed: cuDNN nodes with a boolean mask or a bf16 / fp32 additive one broadcast over
        heads, from the measured key lengths; stock: other lengths, unmasked nodes, fp16 and
        per-head additive masks, the other backends."""
        def decide(**kw):
            gm = trace_joint(**kw)
            return self.rewrite(gm, only_faster=True)[0][1]

        long = dict(sq=2048, sk=2048, b=1, hq=2, hkv=2)
        self.assertEqual(decide(backend="cudnn", **long), "routed")
        self.assertEqual(decide(backend="cudnn", backward=False, **long), "routed")
        gate = speed_gate.forward_gate_lengths(None)
        self.assertEqual(gate[D], ((2048, None),))  # the H100's rows (none of another GPU)
        self.assertEqual(decide(backend="cudnn", sq=1024, sk=1024), policy.R_SLOWER_FORWARD)
        # measured with Sq = Sk: a short query block against long keys (decoding) stays
        self.assertEqual(decide(backend="cudnn", sq=16, sk=4096, b=1, hq=2, hkv=2),
                         policy.R_SLOWER_FORWARD)
        self.assertEqual(decide(backend="cudnn", sq=4096, sk=2048, b=1, hq=2, hkv=2), "routed")
        self.assertEqual(decide(backend="cudnn", mask=None, **long), policy.R_SLOWER_FORWARD)
        # an additive mask broadcast over heads, bf16 (its minimum, transformers' fill, counts
        # as hidden): the boolean rows; fp16 (-65504 hides nothing) and per-head biases: stock
        self.assertEqual(decide(backend="cudnn", mask="float", **long), "routed")
        self.assertEqual(decide(backend="cudnn", mask="float", dtype=torch.float16, **long),
                         policy.R_SLOWER_FORWARD)
        self.assertEqual(decide(backend="cudnn", mask="float", mask_shape=(1, 2, 2048, 2048),
                                **long), policy.R_SLOWER_FORWARD)
        self.assertEqual(decide(backend="efficient", **long), policy.R_SLOWER_FORWARD)


# ---------------------------------------------------------------------------------------
# the whole route on CPU
# ---------------------------------------------------------------------------------------


class Masked(nn.Module):
    """A padded causal bool mask, an additive key bias, and an unmasked causal call."""

    def forward(self, q, k, v, mask, bias):
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        b = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        c = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return a + 2 * b + 3 * c


def masked_inputs():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 16, 2, 8, generator=g).transpose(1, 2).requires_grad_()
               for _ in range(3))
    mask = torch.ones(16, 16, dtype=torch.bool).tril()[None, None].repeat(2, 1, 1, 1)
    mask[1, :, :, 11:] = False  # the second sequence is padded after 11 tokens
    mask[1, :, 12:, :] = True  # (padded queries see every key: no row without keys)
    bias = torch.zeros(2, 1, 1, 16)
    bias[0, ..., :3] = float("-inf")
    bias[1] = torch.randn(16, generator=g) * 0.1
    return q, k, v, mask, bias


class TestCpuForwardRoute(CompileTestCase):
    def test_training_runs_our_forward_and_backward(self):
        q, k, v, mask, bias = masked_inputs()
        torch_sm90_sdpa.enable(cpu=True, forward=True)
        compiled = torch.compile(Masked())
        compiled(q, k, v, mask, bias).square().sum().backward()
        got = [t.grad.clone() for t in (q, k, v)]
        # the compiled graphs hold our ops only; on CPU our forward runs the stock CPU kernel
        # inside (the op's CPU path), our backward the fp32 reference
        self.assertEqual(self.recorder.graphs, [["torch_sm90_sdpa.sdpa_forward.default"] * 3,
                                                ["torch_sm90_sdpa.sdpa_backward.default"] * 3])
        self.assertExpectedInline(ran_attention_ops(
            lambda: compiled(q, k, v, mask, bias).square().sum().backward()), """\
aten::_scaled_dot_product_flash_attention_for_cpu x3
torch_sm90_sdpa::sdpa_backward x3
torch_sm90_sdpa::sdpa_forward x3""")
        stats = torch_sm90_sdpa.routing_stats()
        self.assertEqual(stats["routed_forward_nodes"], {"cpu": 3})
        self.assertEqual(stats["routed_nodes"], {"cpu": 3})
        self.assertEqual((stats["forward_not_routed"], stats["not_routed"]), ({}, {}))
        # the bool mask reached our ops as it is (the recorder saw the post-grad graphs)
        for t in (q, k, v):
            t.grad = None
        want = Masked()(q, k, v, mask, bias)
        want.square().sum().backward()
        for g, t in zip(got, (q, k, v)):
            torch.testing.assert_close(g, t.grad, rtol=1e-4, atol=1e-5)
        text = torch_sm90_sdpa.routing_stats(summary=True)
        self.assertIn("Forward nodes: 3 stock attention forwards (3 CPU flash attention) routed to "
                      "torch_sm90_sdpa, each with its backward", text)

    def test_forward_only_compile(self):
        q, k, v, mask, bias = masked_inputs()
        torch_sm90_sdpa.enable(cpu=True, forward=True)
        compiled = torch.compile(Masked())
        with torch.no_grad():
            out = compiled(q, k, v, mask, bias)
            self.assertEqual(self.recorder.graphs, [["torch_sm90_sdpa.sdpa_forward.default"] * 3])
            self.assertExpectedInline(ran_attention_ops(lambda: compiled(q, k, v, mask, bias)),
                                      """\
aten::_scaled_dot_product_flash_attention_for_cpu x3
torch_sm90_sdpa::sdpa_forward x3""")
            torch.testing.assert_close(out, Masked()(q, k, v, mask, bias), rtol=1e-5, atol=1e-6)
        stats = torch_sm90_sdpa.routing_stats()
        self.assertEqual((stats["routed_forward_nodes"], stats["routed_nodes"]), ({"cpu": 3}, {}))

    def test_forward_false_keeps_the_stock_forward(self):
        q, k, v, mask, bias = masked_inputs()
        torch_sm90_sdpa.enable(cpu=True, forward=False)
        compiled = torch.compile(Masked())
        compiled(q, k, v, mask, bias).sum().backward()
        self.assertExpectedInline(ran_attention_ops(
            lambda: compiled(q, k, v, mask, bias).sum().backward()), """\
aten::_scaled_dot_product_flash_attention_for_cpu x3
torch_sm90_sdpa::sdpa_backward x3""")
        self.assertEqual(torch_sm90_sdpa.routing_stats()["routed_forward_nodes"], {})

    def test_transformers_llama_padded(self):
        """A tiny transformers Llama, unpatched, with a padded batch: its bool mask (a graph
        input) reaches our forward and backward; loss and gradients equal stock's."""
        try:
            import transformers
        except ImportError:
            self.skipTest("transformers is not installed")
        model, stock, ids, attention_mask, labels = tiny_llama_padded(transformers)
        torch_sm90_sdpa.enable(cpu=True, forward=True)
        compiled = torch.compile(model)
        loss = compiled(input_ids=ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        stats = torch_sm90_sdpa.routing_stats()
        self.assertEqual((stats["routed_forward_nodes"], stats["routed_nodes"]),
                         ({"cpu": 2}, {"cpu": 2}))
        want = stock(input_ids=ids, attention_mask=attention_mask, labels=labels).loss
        want.backward()
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
        assert_grads_close(self, param_grads(model), param_grads(stock), rtol=1e-4, atol=1e-5)


class TestSwitch(CompileTestCase):
    def test_options_and_uuid(self):
        torch_sm90_sdpa.enable(cpu=True, forward=False)
        off = torch._inductor.config.joint_custom_pre_pass
        self.assertFalse(routing.routing_options()["forward"])
        with torch_sm90_sdpa.enable(cpu=True):  # (forward=True is the default)
            on = torch._inductor.config.joint_custom_pre_pass
            self.assertIsInstance(on, forward_pass.JointGraphRewrite)
            self.assertTrue(on.forward and on.causal_masks and on.cpu)
            self.assertTrue(routing.routing_options()["forward"])
            self.assertNotEqual(on.uuid(), off.uuid())
            with torch_sm90_sdpa.enable(cpu=True, forward=True, causal_masks=False):
                self.assertFalse(torch._inductor.config.joint_custom_pre_pass.causal_masks)
        self.assertIs(torch._inductor.config.joint_custom_pre_pass, off)
        torch_sm90_sdpa.disable()
        self.assertIsNone(torch._inductor.config.joint_custom_pre_pass)

    def test_env_var(self):
        on = dict(enabled=True, cpu=False, only_faster=True, causal_masks=True)
        routing.apply_env("forward")
        self.assertEqual(routing.routing_options(), dict(on, forward=True))
        routing.apply_env("backward")
        self.assertEqual(routing.routing_options(), dict(on, forward=False))
        routing.apply_env("1")
        self.assertEqual(routing.routing_options(), dict(on, forward=True))
        # forward=None follows only_faster: past the speed gates, forward nodes stay stock
        # unless asked for
        torch_sm90_sdpa.enable(only_faster=False)
        self.assertEqual(routing.routing_options(), dict(on, only_faster=False, forward=False))
        torch_sm90_sdpa.enable(only_faster=False, forward=True)
        self.assertEqual(routing.routing_options(), dict(on, only_faster=False, forward=True))


def _generated_cases(n=10, seed=0):
    """Seeded calls over what the forward route meets: GQA ratios, Sq != Sk, causal, boolean
    masks of every broadcast shape (with rows that see no key), additive masks, BSHD / BHSD
    layouts, fp32 / bf16."""
    g = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    cases = []
    for i in range(n):
        hkv = pick([1, 2, 4])
        case = dict(b=pick([1, 2]), hkv=hkv, hq=hkv * pick([1, 2]), sq=pick([5, 16, 33]),
                    d=pick([8, 16]), layout=pick(["bshd", "bhsd"]),
                    dtype=pick([torch.float32, torch.float32, torch.bfloat16]))
        case["sk"] = pick([case["sq"], 7, 40])
        case["mask"] = pick(["none", "causal", "bool [B,1,Sq,Sk]", "bool [Sq,Sk]",
                             "bool [B,Hq,Sq,Sk]", "bool [B,1,1,Sk]", "additive [B,1,Sq,Sk]"])
        cases.append(case)
    return cases


def _inputs_of(case, g):
    b, hq, hkv, sq, sk, d = (case[k] for k in ("b", "hq", "hkv", "sq", "sk", "d"))

    def make(h, s):
        t = torch.randn(b, s, h, d, generator=g).to(case["dtype"])
        t = t.transpose(1, 2) if case["layout"] == "bshd" else t.transpose(1, 2).contiguous()
        return t.requires_grad_()

    q, k, v = make(hq, sq), make(hkv, sk), make(hkv, sk)
    shape = {"bool [B,1,Sq,Sk]": (b, 1, sq, sk), "bool [Sq,Sk]": (sq, sk),
             "bool [B,Hq,Sq,Sk]": (b, hq, sq, sk), "bool [B,1,1,Sk]": (b, 1, 1, sk),
             "additive [B,1,Sq,Sk]": (b, 1, sq, sk)}.get(case["mask"])
    mask = None
    if shape is not None and case["mask"].startswith("bool"):
        mask = torch.rand(shape, generator=g) > 0.3
        mask[..., 0, :] = False  # a query row (or every row of a [.., 1, Sk] mask) sees no key
        if shape[-2] == 1:
            mask[..., 0, 0] = True
    elif shape is not None:
        mask = (torch.randn(shape, generator=g) * 0.5).to(case["dtype"])
        mask[..., 1] = float("-inf")
    return q, k, v, mask


class TestCpuForwardRouteGenerated(CompileTestCase):
    def test_compiled_route_matches_stock(self):
        """Every generated call, compiled with enable(cpu=True, forward=True), gives stock
        SDPA's out and gradients (uncompiled; rows without a visible key: stock's fused CPU
        kernel gives 0 there, as ours do)."""
        g = torch.Generator().manual_seed(1)
        routed = 0
        for case in _generated_cases():
            q, k, v, mask = _inputs_of(case, g)
            causal = case["mask"] == "causal"
            gqa = case["hq"] != case["hkv"]

            def attention(q, k, v, mask):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                      enable_gqa=gqa)

            torch._dynamo.reset()
            with torch_sm90_sdpa.enable(cpu=True, forward=True):
                out = torch.compile(attention)(q, k, v, mask)
            grad = torch.randn(out.shape, generator=g).to(out.dtype)
            got = (out, *torch.autograd.grad(out, (q, k, v), grad))
            ref_out = attention(q, k, v, mask)
            want = (ref_out, *torch.autograd.grad(ref_out, (q, k, v), grad))
            tol = dict(rtol=2e-2, atol=2e-2) if case["dtype"] == torch.bfloat16 else \
                dict(rtol=1e-4, atol=1e-5)
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
                torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{case} {name}: {m}")
            routed += sum(torch_sm90_sdpa.routing_stats(reset=True)["routed_forward_nodes"]
                          .values())
        # (a call stock runs on its math path has no node to route; torch 2.9 and 2.13 run
        # every generated call on the CPU flash kernel)
        self.assertEqual(routed, len(_generated_cases()))


class TestDeadRowsOpenedAsCudnnFills(expecttest.TestCase):
    """The rewrite hands our ops mask | ~mask.any(-1) for cuDNN nodes (forward_pass.
    _dead_rows_opened): a row the mask hides entirely gets what torch's -65504 fill gives it
    in cuDNN, a softmax over every key, and every other row is unchanged."""

    def test_matches_the_fill_out_and_gradients(self):
        g = torch.Generator().manual_seed(0)
        q, k, v, go = (torch.randn(2, 3, 40, 16, generator=g, dtype=torch.float64)
                       for _ in range(4))
        mask = torch.rand(2, 1, 40, 40, generator=g) < 0.3
        mask[0, :, :7] = False  # left padding: rows without a visible key
        mask[1, :, 20] = False
        opened = aten.logical_or.default(mask, aten.logical_not.default(
            aten.any.dim(mask, -1, True)))

        def run(m):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = F.scaled_dot_product_attention(*leaves, attn_mask=m)
            return (out,) + torch.autograd.grad(out, leaves, go)

        fill = run(torch.where(mask, 0.0, -65504.0).to(torch.float64))
        ours = run(opened)
        for a, b in zip(ours, fill):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
        # the plain mask gives those rows out 0 and no gradient: the opening is what matches
        plain = run(mask)
        self.assertEqual(plain[0][0, :, :7].abs().max().item(), 0.0)
        self.assertGreater((plain[0] - fill[0]).abs().max().item(), 0.1)
        torch.testing.assert_close(plain[0][0, :, 7:], fill[0][0, :, 7:])  # rows with a key
