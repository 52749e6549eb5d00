"""The torch.compile rewrite on an SM90 GPU: compiled transformers train with our backward in
place of the stock one (cuDNN by default on torch >= 2.11, flash when pinned), with losses
and gradients matching stock; also under CUDA graphs (mode="reduce-overhead") and with a
transformers Llama model built from a small random config (no download).

Skips (whole module) without an SM90 GPU and a compiled bf16 kernel for head dim 128 or 64.
Run on the GPU machine:  python -m pytest -q tests/test_cuda_compile.py -rs
"""
import contextlib
import copy
import shutil
import tempfile

import pytest
import torch
import torch.nn as nn

import torch_sm90_sdpa
from torch_sm90_sdpa import _extension, policy, routing
from torch_sm90_sdpa.testing import AttentionOpRecorder, Block, lm_loss


def _sm90() -> bool:
    try:
        return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    except Exception:
        return False


def _head_dim():
    for d in (128, 64):
        if _extension.has_variant(d, torch.bfloat16):
            return d
    return None


HEAD_DIM = _head_dim() if _sm90() else None
_WHY_NO_KERNEL = (_extension.unavailable_reason()
                  or f"variants: {_extension.build_info()['variants']}")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _sm90(), reason="needs an SM90 (Hopper) GPU"),
    pytest.mark.skipif(HEAD_DIM is None, reason="no compiled SM90 bf16 kernel for head dim 128 "
                       f"or 64 ({_WHY_NO_KERNEL})"),
]

STOCK_BACKWARD = (
    "aten._scaled_dot_product_cudnn_attention_backward.default",
    "aten._scaled_dot_product_flash_attention_backward.default",
    "aten._scaled_dot_product_efficient_attention_backward.default",
)
OURS = "torch_sm90_sdpa.sdpa_backward.default"


@pytest.fixture
def compile_env(monkeypatch):
    """A fresh Inductor cache dir, Dynamo reset, routing off around the test, and a
    recorder pass (set first, so it sees the graphs after the rewrite)."""
    tmp = tempfile.mkdtemp(prefix="sm90_sdpa_inductor_")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", tmp)
    saved = torch._inductor.config.post_grad_custom_post_pass
    routing.disable()
    recorder = AttentionOpRecorder()
    torch._inductor.config.post_grad_custom_post_pass = recorder
    torch._dynamo.reset()
    routing.reset_stats()
    yield recorder
    routing.disable()
    torch._inductor.config.post_grad_custom_post_pass = saved
    torch._dynamo.reset()
    shutil.rmtree(tmp, ignore_errors=True)


class Net(nn.Module):
    """Causal GQA self-attention blocks; the second adds cross-attention to a context of
    another length (causal or not)."""

    def __init__(self, head_dim, heads=4, kv_heads=2, vocab=512, cross_causal=True):
        super().__init__()
        dim = heads * head_dim
        self.embed = nn.Embedding(vocab, dim)
        self.ctx = nn.Embedding(vocab, dim)
        self.blk0 = Block(dim, heads, kv_heads, causal=True)
        self.blk1 = Block(dim, heads, kv_heads, causal=True, cross=True, cross_causal=cross_causal)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, context_tokens):
        return self.head(self.blk1(self.blk0(self.embed(tokens)), self.ctx(context_tokens)))


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def grads_of(model):
    return {n.replace("_orig_mod.", ""): p.grad.detach().float().clone()
            for n, p in model.named_parameters() if p.grad is not None}


def sgd_steps(model, loss_of_step, steps, lr=1e-3, mark_step=False):
    """Losses of `steps` SGD steps (loss_of_step(i) under bf16 autocast) and the gradients
    of the first step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, first = [], None
    for i in range(steps):
        if mark_step:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of_step(i)
        loss.backward()
        losses.append(loss.detach().float().item())
        if i == 0:
            first = grads_of(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, first


def train(model, batches, steps, lr=1e-3, mark_step=False):
    """sgd_steps of the language-model loss over `batches` (cycled)."""
    def loss_of_step(i):
        tokens, context = batches[i % len(batches)]
        return lm_loss(model(tokens, context), tokens)
    return sgd_steps(model, loss_of_step, steps, lr=lr, mark_step=mark_step)


def check_against_stock(losses, grads, ref_losses, ref_grads, tol=5e-2):
    assert sorted(grads) == sorted(ref_grads)
    errs = {n: rel_err(grads[n], ref_grads[n]) for n in ref_grads}
    worst = max(errs, key=errs.get)
    assert errs[worst] < tol, f"gradient of {worst}: relative error {errs[worst]:.3e}; {errs}"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=2e-2)


def backward_ops(recorder):
    """The attention backward ops of every graph compiled in the test (after the rewrite)."""
    return recorder.backward_ops()


def make_batches(n, b, sq, sk, vocab=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (b, sq), generator=g).cuda(),
             torch.randint(0, vocab, (b, sk), generator=g).cuda()) for _ in range(n)]


@pytest.mark.parametrize("backend", ["default", "flash"])
def test_own_block_trains_like_stock(compile_env, backend):
    """cuDNN (default on torch >= 2.11 + Hopper) or flash (pinned): every attention backward
    of the compiled backward graph is ours; losses / gradients match uncompiled stock."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    recorder = compile_env
    # flash refuses is_causal with Sq != Sk: its cross-attention is not causal
    torch.manual_seed(0)
    model = Net(HEAD_DIM, cross_causal=backend == "default").cuda()
    stock = copy.deepcopy(model)
    batches = make_batches(2, b=2, sq=200, sk=136)  # lengths that are not tile multiples
    pin = (sdpa_kernel(SDPBackend.FLASH_ATTENTION) if backend == "flash"
           else contextlib.nullcontext())
    with pin:
        ref_losses, ref_grads = train(stock, batches, steps=3)
        with torch_sm90_sdpa.enable(only_faster=False):
            losses, grads = train(torch.compile(model), batches, steps=3)
    ops = backward_ops(recorder)
    stats = torch_sm90_sdpa.routing_stats()
    assert ops and all(op == OURS for op in ops), (ops, stats)
    assert ops.count(OURS) >= 3, (ops, stats)  # 3 per backward graph (more if recompiled)
    expected = "flash" if backend == "flash" else "cudnn"
    assert expected in stats["routed_nodes"] and not stats["not_routed"], stats
    assert stats["routed_calls_by_device"].get("cuda", 0) == 3 * 3, stats
    check_against_stock(losses, grads, ref_losses, ref_grads)


def test_disabled_keeps_stock(compile_env):
    recorder = compile_env
    torch.manual_seed(0)
    model = Net(HEAD_DIM).cuda()
    batches = make_batches(1, b=2, sq=128, sk=64)
    train(torch.compile(model), batches, steps=1)
    ops = backward_ops(recorder)
    assert ops and all(op in STOCK_BACKWARD for op in ops), ops
    assert torch_sm90_sdpa.routing_stats()["routed_calls"] == 0


@pytest.mark.skipif(HEAD_DIM != 128, reason="the speed gate keeps cuDNN at head dim 128")
def test_default_enable_keeps_faster_cudnn(compile_env):
    """enable() routes only where ours measured faster: at d128 and short sequences cuDNN
    stays, and routing_stats says why."""
    from torch_sm90_sdpa import policy

    recorder = compile_env
    torch.manual_seed(0)
    model = Net(HEAD_DIM).cuda()
    with torch_sm90_sdpa.enable():
        train(torch.compile(model), make_batches(1, b=2, sq=128, sk=64), steps=1)
    ops = backward_ops(recorder)
    assert ops and all(op in STOCK_BACKWARD for op in ops), ops
    stats = torch_sm90_sdpa.routing_stats()
    assert stats["routed_calls"] == 0 and policy.R_SLOWER in stats["not_routed"], stats


def _table_routed_full_cases():
    """[(head dim, key length)]: built head dims that the speed table routes without a mask
    (MHA, non-causal) on this machine's GPU model, each at the shortest key length it routes:
    d128 (routed in full attention on the H200) and the largest."""
    if not torch.cuda.is_available():
        return []
    model = policy.gate_device(torch.device("cuda", torch.cuda.current_device()))
    built = {d: ranges[0][0] for d, ranges in policy.gate_tables(model).mha["full"].items()
             if _extension.has_variant(d, torch.bfloat16)}
    return sorted({(d, built[d]) for d in {128, max(built, default=None)} if d in built})


@pytest.mark.parametrize("d, s", _table_routed_full_cases() or
                         [pytest.param(0, 0, marks=pytest.mark.skip(
                             reason="no built head dim that the speed table routes without a mask"))])
def test_default_enable_routes_where_the_table_says(compile_env, d, s):
    """enable()'s default replaces a non-causal cuDNN node whose head dim and key length the
    table has ours faster at on this GPU model; gradients match stock."""
    from torch_sm90_sdpa.testing import TinyTransformer

    recorder = compile_env
    torch.manual_seed(0)
    model = TinyTransformer(vocab=512, dim=2 * d, heads=2, layers=1, causal=False).cuda()
    stock = copy.deepcopy(model)
    tokens = make_batches(1, b=1, sq=s, sk=1)[0][0]

    def loss_of(m):
        return lambda i: lm_loss(m(tokens), tokens)

    ref_losses, ref_grads = sgd_steps(stock, loss_of(stock), steps=2)
    with torch_sm90_sdpa.enable():
        compiled = torch.compile(model)
        losses, grads = sgd_steps(model, loss_of(compiled), steps=2)
    ops = backward_ops(recorder)
    stats = torch_sm90_sdpa.routing_stats()
    assert ops and all(op == OURS for op in ops), (d, s, ops, stats)
    assert stats["routed_nodes"].get("cudnn", 0) >= 1 and not stats["not_routed"], stats
    check_against_stock(losses, grads, ref_losses, ref_grads)


def test_reduce_overhead_cuda_graphs(compile_env):
    recorder = compile_env
    torch.manual_seed(1)
    model = Net(HEAD_DIM).cuda()
    stock = copy.deepcopy(model)
    batches = make_batches(1, b=2, sq=256, sk=128, seed=1)
    ref_losses, ref_grads = train(stock, batches, steps=4)
    with torch_sm90_sdpa.enable(only_faster=False):
        compiled = torch.compile(model, mode="reduce-overhead")
        losses, grads = train(compiled, batches, steps=4, mark_step=True)
    ops = backward_ops(recorder)
    assert ops and all(op == OURS for op in ops), (ops, torch_sm90_sdpa.routing_stats())
    check_against_stock(losses, grads, ref_losses, ref_grads)


def test_deterministic_training_is_bitwise_repeatable(compile_env, monkeypatch):
    """Under torch.use_deterministic_algorithms(True) the compile route serves every attention
    backward with the kernel's deterministic mode: two trainings of a compiled GQA model from
    the same start give bitwise-identical losses and parameters (and match stock)."""
    recorder = compile_env
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    batches = make_batches(2, b=2, sq=1000, sk=700, seed=2)  # many key blocks per dQ tile
    torch.manual_seed(2)
    start = Net(HEAD_DIM, cross_causal=False).cuda()
    runs = []
    torch.use_deterministic_algorithms(True)
    try:
        ref_losses, ref_grads = train(copy.deepcopy(start), batches, steps=3)
        for _ in range(2):
            torch._dynamo.reset()
            model = copy.deepcopy(start)
            with torch_sm90_sdpa.enable():
                losses, grads = train(torch.compile(model), batches, steps=3)
            runs.append((losses, [p.detach().clone() for p in model.parameters()], grads))
    finally:
        torch.use_deterministic_algorithms(False)
    ops = backward_ops(recorder)
    stats = torch_sm90_sdpa.routing_stats()
    assert ops and all(op == OURS for op in ops), (ops, stats)
    (losses0, params0, grads0), (losses1, params1, _) = runs
    assert losses0 == losses1
    for a, b in zip(params0, params1):
        assert torch.equal(a, b)
    check_against_stock(losses0, grads0, ref_losses, ref_grads)


def _llama(transformers, seed, max_positions=1024):
    heads, kv_heads = 4, 2
    kwargs = dict(vocab_size=1000, hidden_size=heads * HEAD_DIM,
                  intermediate_size=2 * heads * HEAD_DIM, num_hidden_layers=2,
                  num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=max_positions, head_dim=HEAD_DIM)
    try:
        config = transformers.LlamaConfig(attn_implementation="sdpa", **kwargs)
    except TypeError:
        config = transformers.LlamaConfig(**kwargs)
    try:
        config._attn_implementation = "sdpa"
    except Exception:
        pass
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).cuda()


def _train_lm(m, ids, steps):
    return _train_lm_masked(m, ids, None, steps)


def _ids(vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (2, 300), generator=g).cuda()


def test_transformers_llama_is_causal(compile_env, monkeypatch):
    """A transformers Llama (GQA) from a small random config, attn_implementation="sdpa".

    While Dynamo traces, transformers materializes the causal mask
    (masking_utils._ignore_causal_mask_sdpa returns False when tracing), so its SDPA calls
    carry an attn_mask (routed with it: test_transformers_llama_default_mask). Without padding
    the mask is exactly is_causal=True: patch the check so SDPA gets is_causal."""
    transformers = pytest.importorskip("transformers")
    from transformers import masking_utils

    if not hasattr(masking_utils, "_ignore_causal_mask_sdpa"):
        pytest.skip(f"transformers {transformers.__version__}: no "
                    "masking_utils._ignore_causal_mask_sdpa to patch")
    def causal_skip(padding_mask, query_length, kv_length, *args, **kwargs):
        return padding_mask is None and (query_length == 1 or kv_length == query_length)

    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", causal_skip)
    recorder = compile_env
    model = _llama(transformers, seed=2)
    stock = copy.deepcopy(model)
    ids = _ids(model.config.vocab_size, seed=2)
    ref_losses, ref_grads = _train_lm(stock, ids, 3)
    with torch_sm90_sdpa.enable(only_faster=False):
        losses, grads = _train_lm(torch.compile(model), ids, 3)
    ops = backward_ops(recorder)
    stats = torch_sm90_sdpa.routing_stats()
    assert ops.count(OURS) >= model.config.num_hidden_layers, (ops, stats)
    assert not [op for op in ops if op in STOCK_BACKWARD], (ops, stats)
    check_against_stock(losses, grads, ref_losses, ref_grads)


def _train_lm_masked(m, ids, attention_mask, steps):
    labels = ids.masked_fill(attention_mask == 0, -100) if attention_mask is not None else ids
    return sgd_steps(
        m, lambda i: m(input_ids=ids, attention_mask=attention_mask, labels=labels).loss, steps)


def _masked_model_routes(compile_env, model, ids, attention_mask, steps=2):
    """Unpatched transformers: its SDPA calls carry the mask it materializes under tracing;
    with routing forced, the backward nodes (cuDNN's, with the mask as an additive bias) are
    routed to our op with that mask; losses and gradients match uncompiled stock."""
    recorder = compile_env
    stock = copy.deepcopy(model)
    ref_losses, ref_grads = _train_lm_masked(stock, ids, attention_mask, steps)
    # only_faster=False: the default gate keeps masked calls on stock for now (policy.py)
    with torch_sm90_sdpa.enable(only_faster=False):
        losses, grads = _train_lm_masked(torch.compile(model), ids, attention_mask, steps)
    ops = backward_ops(recorder)
    stats = torch_sm90_sdpa.routing_stats()
    assert ops.count(OURS) >= model.config.num_hidden_layers, (ops, stats)
    assert not [op for op in ops if op in STOCK_BACKWARD], (ops, stats)
    assert stats["not_routed"] == {} and stats["routed_calls"] >= steps, stats
    check_against_stock(losses, grads, ref_losses, ref_grads)


def test_transformers_llama_default_mask(compile_env):
    """A Llama (GQA) with no attention_mask: transformers builds a causal mask under tracing.
    The default enable() keeps these masked calls on stock, and says why."""
    transformers = pytest.importorskip("transformers")
    model = _llama(transformers, seed=3)
    _masked_model_routes(compile_env, model, _ids(model.config.vocab_size, seed=3), None)
    torch._dynamo.reset()
    compile_env.graphs.clear()
    torch_sm90_sdpa.routing_stats(reset=True)
    with torch_sm90_sdpa.enable():
        _train_lm_masked(torch.compile(model), _ids(model.config.vocab_size, seed=3), None, 1)
    stats = torch_sm90_sdpa.routing_stats()
    assert stats["routed_calls"] == 0, stats
    assert list(stats["not_routed"]) == [policy.R_SLOWER], stats


def test_transformers_llama_padded_batch(compile_env):
    """A padded batch: the second sequence is right-padded (attention_mask zeros)."""
    transformers = pytest.importorskip("transformers")
    model = _llama(transformers, seed=4)
    ids = _ids(model.config.vocab_size, seed=4)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 190:] = 0
    _masked_model_routes(compile_env, model, ids, attention_mask)


def _mistral_sliding_window(transformers, seed):
    """A Mistral-style model with a sliding window (96) shorter than _ids' sequences."""
    heads, kv_heads = 4, 2
    kwargs = dict(vocab_size=1000, hidden_size=heads * HEAD_DIM,
                  intermediate_size=2 * heads * HEAD_DIM, num_hidden_layers=2,
                  num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=1024, head_dim=HEAD_DIM, sliding_window=96)
    try:
        config = transformers.MistralConfig(attn_implementation="sdpa", **kwargs)
    except TypeError:
        config = transformers.MistralConfig(**kwargs)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return transformers.MistralForCausalLM(config).cuda()


def test_transformers_sliding_window(compile_env):
    """A Mistral-style config with a sliding window shorter than the sequence."""
    transformers = pytest.importorskip("transformers")
    model = _mistral_sliding_window(transformers, seed=5)
    _masked_model_routes(compile_env, model, _ids(model.config.vocab_size, seed=5), None)


# ---------------------------------------------------------------------------------------
# forward nodes (enable(forward=True), torch_sm90_sdpa/forward_pass.py)
# ---------------------------------------------------------------------------------------

OURS_FORWARD = "torch_sm90_sdpa.sdpa_forward.default"


def _forward_routes(compile_env, model, ids, attention_mask, steps=2, only_faster=False):
    """Unpatched transformers with its mask: the forward nodes go to our sdpa_forward with the
    boolean mask behind SDPA's bias, each with its backward; losses and gradients match
    uncompiled stock."""
    recorder = compile_env
    stock = copy.deepcopy(model)
    ref_losses, ref_grads = _train_lm_masked(stock, ids, attention_mask, steps)
    with torch_sm90_sdpa.enable(only_faster=only_faster, forward=True):
        losses, grads = _train_lm_masked(torch.compile(model), ids, attention_mask, steps)
    ops = [op for g in recorder.graphs for op in g]
    stats = torch_sm90_sdpa.routing_stats()
    layers = model.config.num_hidden_layers
    assert ops.count(OURS_FORWARD) >= layers and ops.count(OURS) >= layers, (ops, stats)
    assert not [op for op in ops if "_scaled_dot_product_" in op], (ops, stats)
    assert stats["forward_not_routed"] == {} and stats["not_routed"] == {}, stats
    assert sum(stats["routed_forward_nodes"].values()) >= layers, stats
    check_against_stock(losses, grads, ref_losses, ref_grads)
    return stats


def test_forward_routed_llama_padded_batch(compile_env):
    transformers = pytest.importorskip("transformers")
    model = _llama(transformers, seed=4)
    ids = _ids(model.config.vocab_size, seed=4)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 190:] = 0
    _forward_routes(compile_env, model, ids, attention_mask)


def test_forward_routed_sliding_window(compile_env):
    """Left padding: the pad rows see no key, and the last pad position predicts the first
    token, so the loss reads them; they must get cuDNN's answer (the opened rows of
    forward_pass._dead_rows_opened), not 0."""
    transformers = pytest.importorskip("transformers")
    model = _mistral_sliding_window(transformers, seed=5)
    ids = _ids(model.config.vocab_size, seed=5)
    attention_mask = torch.ones_like(ids)
    attention_mask[0, :40] = 0  # left padding
    _forward_routes(compile_env, model, ids, attention_mask)


def test_forward_routed_by_the_default_gate_and_inference(compile_env):
    """enable(forward=True)'s gate routes a masked cuDNN forward from 2048 keys; a forward-only
    compile (no_grad) of the same model runs our forward alone and matches stock."""
    transformers = pytest.importorskip("transformers")
    model = _llama(transformers, seed=6, max_positions=2048)
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, model.config.vocab_size, (1, 2048), generator=g).cuda()
    attention_mask = torch.ones_like(ids)
    attention_mask[0, 1800:] = 0
    stats = _forward_routes(compile_env, model, ids, attention_mask, steps=1, only_faster=True)
    assert "cudnn" in stats["routed_forward_nodes"], stats
    torch._dynamo.reset()
    torch_sm90_sdpa.routing_stats(reset=True)
    model.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        want = model(input_ids=ids, attention_mask=attention_mask).logits
        with torch_sm90_sdpa.enable(forward=True):
            got = torch.compile(model)(input_ids=ids, attention_mask=attention_mask).logits
    stats = torch_sm90_sdpa.routing_stats()
    assert stats["routed_forward_nodes"].get("cudnn", 0) >= model.config.num_hidden_layers, stats
    keep = attention_mask[0].bool()
    assert rel_err(got[0, keep], want[0, keep]) < 5e-2  # bf16 logits, as check_against_stock
