"""Deterministic attention backward through the public paths, under
torch.use_deterministic_algorithms(True), against what stock SDPA runs there.

1. Drop-in rows: the backward of torch_sm90_sdpa.scaled_dot_product_attention ("drop-in") next to
   the backward of F.scaled_dot_product_attention ("stock": FlashAttention-2's deterministic
   kernel on Hopper) and our op called directly with deterministic=True ("op"), interleaved,
   median backward time (torch.autograd.grad of one forward, retain_graph). Every call is
   synchronized, so "op/in-1" (the op's rate over the drop-in's) is mostly the drop-in's host
   latency before its kernels start (autograd engine, custom-op wrapper), which training hides
   by running ahead; benchmarks/bench_bwd.py --dropin --batched times the two back to back. Each
   row also checks that two drop-in backwards are bitwise identical.
2. Compiled model steps: a GPT stack (RMSNorm, GQA attention with is_causal=True, SwiGLU MLP;
   hidden 2048, d128, 16 q / 4 kv heads, batch 2 x 8192 tokens), forward + backward + SGD,
   compiled twice (stock; torch_sm90_sdpa.enable()), both under determinism, steps interleaved.
   With --llama also the transformers Llama of bench_transformers.py (d128 config), whose
   compiled graph passes SDPA a materialized causal mask.

    python benchmarks/bench_deterministic_paths.py [--quick] [--layers 4] [--steps 10] [--llama]
                                                   [--no-drop-in | --no-models]
"""
import argparse
import copy
import math
import os
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS refuses determinism without it
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import torch_sm90_sdpa  # noqa: E402
from bench_bwd import make, time_interleaved  # noqa: E402
from bench_transformers import CONFIGS, build, compiled_loss, sgd_step  # noqa: E402


def grad_fn(sdpa, q, k, v, dout, causal, scale):
    """Backward of one forward of `sdpa` (the public function under test), repeatable."""
    qs, ks, vs = (t.detach().requires_grad_(True) for t in (q, k, v))
    o = sdpa(qs, ks, vs, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])

    def run():
        return torch.autograd.grad(o, (qs, ks, vs), dout, retain_graph=True)
    return run


def op_fn(q, k, v, dout, causal, scale):
    o, lse = torch.ops.torch_sm90_sdpa.sdpa(q, k, v, causal, scale, q.shape[1] != k.shape[1])

    def run():
        return torch.ops.torch_sm90_sdpa.sdpa_backward(dout, q, k, v, o, lse, causal, scale, True)
    return run


def drop_in_row(b, hq, hkv, s, d, causal, reps):
    q, k, v, dout = make(b, hq, hkv, s, d, torch.bfloat16)
    scale = 1.0 / math.sqrt(d)
    fns = {"drop-in": grad_fn(torch_sm90_sdpa.scaled_dot_product_attention, q, k, v, dout, causal, scale),
           "op": op_fn(q, k, v, dout, causal, scale),
           "stock": grad_fn(F.scaled_dot_product_attention, q, k, v, dout, causal, scale)}
    first, second = fns["drop-in"](), fns["drop-in"]()
    same = all(torch.equal(x, y) for x, y in zip(first, second))
    ms = time_interleaved(fns, reps)
    flops = 2.5 * 4 * b * hq * s * s * d / (2 if causal else 1)
    tf = {n: flops / (t * 1e-3) / 1e12 for n, t in ms.items()}
    label = f"d={d} {'causal' if causal else 'full  '} s={s:<5d} b={b} h={hq}/{hkv}"
    ratio, overhead = tf["drop-in"] / tf["stock"], tf["op"] / tf["drop-in"] - 1
    print(f"{label:36s} {tf['drop-in']:8.0f} {tf['op']:6.0f} {tf['stock']:6.0f}   {ratio:6.2f} "
          f"{100 * overhead:+7.1f}%   repeat: {'ok' if same else 'DIFFERS'}", flush=True)
    del q, k, v, dout, fns
    torch.cuda.empty_cache()
    return ratio, overhead, same


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * self.weight


class GPTBlock(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.up = nn.Linear(dim, 2 * 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):  # x: [B, S, dim]
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, -1, self.head_dim).transpose(1, 2).split(
            [self.heads, self.kv_heads, self.kv_heads], dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class GPT(nn.Module):
    def __init__(self, layers, dim=2048, heads=16, kv_heads=4, vocab=32000):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(GPTBlock(dim, heads, kv_heads) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def gpt_loss(model, ids):
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())


def llama_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def step_fn(loss_fn, model, ids):
    return sgd_step(model, lambda: loss_fn(model, ids))


def model_row(name, base, loss_fn, ids, steps):
    t0 = time.time()
    torch._dynamo.reset()
    torch_sm90_sdpa.disable()
    torch_sm90_sdpa.routing_stats(reset=True)
    fns = {"stock": step_fn(compiled_loss("stock", loss_fn), copy.deepcopy(base), ids)}
    fns["stock"]()
    with torch_sm90_sdpa.enable():
        fns["routed"] = step_fn(compiled_loss("routed", loss_fn), copy.deepcopy(base), ids)
        fns["routed"]()
    stats = torch_sm90_sdpa.routing_stats(reset=True)
    med = time_interleaved(fns, steps, warmup=1)
    print(f"{name}: step stock {med['stock']:.1f} ms, routed {med['routed']:.1f} ms, speedup "
          f"{med['stock'] / med['routed']:.3f}x; routed nodes {stats['routed_nodes']}, not routed "
          f"{stats['not_routed']}, causal masks {stats.get('causal_masks')} "
          f"(compile {time.time() - t0:.0f} s)", flush=True)
    del fns
    torch.cuda.empty_cache()


def drop_in_rows(a):
    print(f"{'row':36s} {'drop-in':>8s} {'op':>6s} {'stock':>6s}   {'in/stk':>6s} {'op/in-1':>8s}")
    seqs = (2048, 8192) if a.quick else (1024, 2048, 4096, 8192, 16384)
    rows = [drop_in_row(max(1, 16384 // s), 2048 // d, 2048 // d, s, d, causal, a.reps)
            for d in (64, 128, 256) for causal in (False, True) for s in seqs]
    rows.append(drop_in_row(2, 32, 8, 8192, 128, True, a.reps))
    ratios = [r[0] for r in rows]
    print(f"drop-in / stock deterministic: min {min(ratios):.2f}, geometric mean "
          f"{math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f} over {len(rows)} rows; "
          f"op over drop-in: max {100 * max(r[1] for r in rows):+.1f}%; bitwise repeatable on "
          f"{sum(r[2] for r in rows)} of {len(rows)} rows", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="drop-in rows at s = 2k and 8k only")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--llama", action="store_true", help="also the transformers Llama (d128)")
    ap.add_argument("--no-models", action="store_true", help="the drop-in rows only")
    ap.add_argument("--no-drop-in", action="store_true", help="the model steps only")
    a = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs an SM90 GPU")
        return 1
    torch.use_deterministic_algorithms(True)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; deterministic algorithms on; "
          f"backward TFLOP/s, median of {a.reps}, interleaved; bf16, b = 16384/s, h = 2048/d")
    if not a.no_drop_in:
        drop_in_rows(a)
    if a.no_models:
        return 0
    torch.manual_seed(0)
    ids = torch.randint(0, 32000, (2, 8193), device="cuda")
    gpt = GPT(a.layers).cuda().to(torch.bfloat16)
    model_row(f"GPT {a.layers} layers, hidden 2048, 16/4 heads d128, b2 s8192, causal", gpt,
              gpt_loss, ids, a.steps)
    del gpt
    if a.llama:
        import transformers

        c = CONFIGS["d128"]
        llama = build(transformers, c)
        model_row(f"transformers Llama {c}", llama, llama_loss, ids[:, :c["seq"]], a.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
