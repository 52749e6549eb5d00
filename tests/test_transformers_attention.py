"""transformers' attention interface (CPU): attn_implementation="sm90_sdpa" after
torch_sm90_sdpa.transformers_attention.register().

A small Llama (GQA) built from a random config (no download) trains alike with "sm90_sdpa"
and "sdpa" (loss and every parameter gradient), with and without a padded batch, eager and
compiled, and its backward runs our op. The forward function itself matches transformers'
"sdpa" one call by call. Skipped without transformers (the test extra installs it).
"""
import collections
import os
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters

import torch_sm90_sdpa
from torch_sm90_sdpa import api, routing
from torch_sm90_sdpa import transformers_attention as sm90_attention

OUR_BACKWARD = "torch_sm90_sdpa::sdpa_backward"
VOCAB, LAYERS = 128, 2


@pytest.fixture
def transformers():
    mod = pytest.importorskip(
        "transformers", reason="transformers is not installed (pip install '.[test]' brings it)")
    sm90_attention.register()  # (raises on transformers < 4.48)
    return mod


def _llama(transformers, name, seed=0):
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=128)
    config = transformers.LlamaConfig(attn_implementation=name, **kwargs)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    assert model.config._attn_implementation == name
    return model


def _pair(transformers):
    """(stock "sdpa" model, "sm90_sdpa" model with the same weights)."""
    stock = _llama(transformers, "sdpa")
    ours = _llama(transformers, "sm90_sdpa", seed=1)
    ours.load_state_dict(stock.state_dict())
    return stock, ours


def _batch(padded):
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    if not padded:
        return ids, None, ids
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 15:] = 0  # the second sequence is right-padded
    return ids, attention_mask, ids.masked_fill(attention_mask == 0, -100)


def _loss_and_grads(model, ids, attention_mask, labels):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, attention_mask=attention_mask, labels=labels).loss
    loss.backward()
    return loss.detach(), {n.replace("_orig_mod.", ""): p.grad.clone()
                           for n, p in model.named_parameters() if p.grad is not None}


def _attention_ops_run(fn):
    """fn()'s result and {op name: calls} of the attention ops that ran (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = fn()
    names = collections.Counter(
        e.name for e in prof.events()
        if "scaled_dot_product" in e.name or e.name.startswith("torch_sm90_sdpa::"))
    return result, names


def _assert_same_training(got, want):
    (loss, grads), (ref_loss, ref_grads) = got, want
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
    assert sorted(grads) == sorted(ref_grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-5, msg=name)


# ---------------------------------------------------------------------------------------
# register()
# ---------------------------------------------------------------------------------------

def test_register_is_idempotent_and_reuses_the_sdpa_masks(transformers):
    # (an AttentionInterface from 4.51, a dict before: both map names to functions)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as attention

    assert sm90_attention.register() == "sm90_sdpa"
    assert sm90_attention.register("sm90_sdpa") == "sm90_sdpa"
    assert attention["sm90_sdpa"] is sm90_attention.sdpa_attention_forward
    assert "sm90_sdpa" in list(attention.keys())
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS as masks
    except ImportError:
        return  # transformers < 4.53: no mask interface
    assert masks["sm90_sdpa"] is masks["sdpa"]


def test_register_refuses_names_taken_by_others(transformers):
    with pytest.raises(ValueError, match="already has an attention implementation named 'sdpa'"):
        sm90_attention.register("sdpa")
    for bad in ("", "eager", None):
        with pytest.raises(ValueError, match="name: expected"):
            sm90_attention.register(bad)


def test_register_without_transformers_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    with pytest.raises(ImportError, match=r"needs transformers >= 4\.48.*pip install"):
        sm90_attention.register()


def test_importing_does_not_import_transformers():
    code = ("import sys, torch_sm90_sdpa, torch_sm90_sdpa.transformers_attention; "
            "print('transformers' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(torch_sm90_sdpa.__file__)))]
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "False"


# ---------------------------------------------------------------------------------------
# the forward function against transformers' "sdpa" one
# ---------------------------------------------------------------------------------------

class _Attention(torch.nn.Module):
    def __init__(self, groups, is_causal=True):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = is_causal


def _mask(kind, b, sq, sk):
    if kind is None:
        return None
    keep = torch.ones(b, 1, sq, sk, dtype=torch.bool).tril(sk - sq)
    keep[-1, :, :, sk - 3:] = False  # padding of the last sequence
    if kind == "bool":
        return keep
    return torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
@pytest.mark.parametrize("sq,sk,grad", [(12, 12, True), (12, 12, False), (1, 9, False)])
def test_forward_matches_transformers_sdpa(transformers, monkeypatch, groups, mask, sq, sk, grad):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward as stock_fwd

    g = torch.Generator().manual_seed(sq * 7 + groups)
    b, hkv, d = 2, 2, 8
    q = torch.randn(b, hkv * groups, sq, d, generator=g).requires_grad_(grad)
    k = torch.randn(b, hkv, sk, d, generator=g).requires_grad_(grad)
    v = torch.randn(b, hkv, sk, d, generator=g).requires_grad_(grad)
    attn_mask = _mask(mask, b, sq, sk)
    module = _Attention(groups)
    calls = []

    run_decided = api._run_decided

    def drop_in(reason, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        # every drop-in call ends here, decided by the drop-in or (grouped heads) by the
        # interface, which must have come to the drop-in's own answer
        unserved = api._unservable_reason(query, key, value, attn_mask, dropout_p, enable_gqa,
                                          is_causal, scale)
        assert reason == unserved
        calls.append((key.size(1), enable_gqa, is_causal, unserved))
        return run_decided(reason, query, key, value, attn_mask, dropout_p, is_causal, scale,
                           enable_gqa)

    monkeypatch.setattr(api, "_run_decided", drop_in)
    out, weights = sm90_attention.sdpa_attention_forward(module, q, k, v, attn_mask,
                                                         scaling=0.3)
    ref, _ = stock_fwd(module, q, k, v, attn_mask, scaling=0.3)
    assert weights is None and out.shape == (b, sq, hkv * groups, d) and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    [(key_heads, enable_gqa, is_causal, unserved)] = calls
    assert is_causal == (mask is None and sq > 1)
    if grad:
        # served by our op, grouped heads as they are
        assert unserved is None and key_heads == hkv and enable_gqa == (groups > 1)
        go = torch.randn(out.shape, generator=g)
        got = torch.autograd.grad(out, (q, k, v), go)
        want = torch.autograd.grad(ref, (q, k, v), go)
        for a, w in zip(got, want):
            torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-6)
    else:
        assert unserved == "no gradient is needed"


def test_forward_compiles_in_one_graph(transformers, monkeypatch, tmp_path):
    """fullgraph=True: nothing in the forward or the drop-in breaks the graph (a logging call
    did); the compiled backward calls our op."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 10, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 10, 8, generator=g, requires_grad=True) for _ in range(2))
    module = _Attention(groups=2)
    torch._dynamo.reset()
    routing.reset_stats()
    try:
        for mask in (None, _mask("bool", 2, 10, 10)):
            fn = torch.compile(lambda q, k, v, m: sm90_attention.sdpa_attention_forward(
                module, q, k, v, m)[0], fullgraph=True)
            fn(q, k, v, mask).sum().backward()
        assert torch_sm90_sdpa.routing_stats()["routed_calls"] == 2
    finally:
        torch._dynamo.reset()


def test_forward_refuses_softcap(transformers):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="softcap"):
        sm90_attention.sdpa_attention_forward(_Attention(1), q, q, q, None, softcap=30.0)


# ---------------------------------------------------------------------------------------
# a Llama trained with "sm90_sdpa" against "sdpa"
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("padded", [False, True], ids=["no padding", "padded batch"])
def test_eager_llama_matches_sdpa(transformers, padded):
    stock, ours = _pair(transformers)
    batch = _batch(padded)
    want, stock_ops = _attention_ops_run(lambda: _loss_and_grads(stock, *batch))
    got, our_ops = _attention_ops_run(lambda: _loss_and_grads(ours, *batch))
    _assert_same_training(got, want)
    assert stock_ops[OUR_BACKWARD] == 0, stock_ops
    assert our_ops[OUR_BACKWARD] == LAYERS, our_ops  # one backward per attention layer


def test_compiled_llama_matches_sdpa(transformers, monkeypatch, tmp_path):
    """Compiled (with the CPU route on, as a user who also enables routing has it): the
    custom op is in the graph, and the backward graph calls ours at run time."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    stock, ours = _pair(transformers)
    torch._dynamo.reset()
    counters.clear()
    try:
        with torch_sm90_sdpa.enable(cpu=True):
            compiled = torch.compile(ours)
            for padded in (False, True):
                batch = _batch(padded)
                want = _loss_and_grads(stock, *batch)
                routing.reset_stats()
                _assert_same_training(_loss_and_grads(compiled, *batch), want)  # compiles
                stats = torch_sm90_sdpa.routing_stats()
                assert stats["routed_calls"] == LAYERS, (padded, stats)
                # once compiled (the profile of the compilation holds the tracing's calls)
                got, ops_run = _attention_ops_run(lambda: _loss_and_grads(compiled, *batch))
                _assert_same_training(got, want)
                assert ops_run[OUR_BACKWARD] == LAYERS, (padded, ops_run)
                assert not [op for op in ops_run if "backward" in op and op != OUR_BACKWARD]
        # routed_calls counts the backward calls of compiled graphs only: a graph break in
        # the attention would run the drop-in eagerly, outside the graph
        assert not counters["graph_break"], dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
