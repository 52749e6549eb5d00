"""Attention backward: torch_sm90_sdpa next to the stock cuDNN / flash / memory-efficient backward.

All backends run in one process on the same inputs, interleaved (A, B, C, A, B, C, ...), and the
median of the repeats is reported. Only the backward is timed: the stock backends through their
aten backward ops called on saved forward outputs, ours through
torch.ops.torch_sm90_sdpa.sdpa_backward (preprocess + main kernel + postprocess + op overhead).

Grid of the FlashAttention papers: bf16, 16k tokens per batch (b = 16384 / s), hidden 2048
(h = 2048 / d), head dims 64 / 128 / 256, causal and full, s = 512 .. 16k; plus a GQA row
(d128 causal 8k, 32 q / 8 kv heads). FLOPs = 2.5 * 4 * b * h * s^2 * d, halved when causal.
--extra adds the rows issue 8 also asks for: GQA 32 q / 4 and 32 q / 1 kv heads (and 16 q / 8,
the compiled GPT's attention), head dims 96
and 192, fp16 at d128, and odd lengths (1000 and 4097 keys) at d128 (see extra_rows).
--dv-pairs 192x128 adds rows of a q / k head dim D with a v head dim Dv != D (the pairs of
TILES_DV, DeepSeek-style multi-head latent attention): bf16, full and causal, the grid's lengths,
b = 16384 / s, h = 2048 / D; FLOPs 2 * b * h * s^2 * (3 D + 2 Dv), halved when causal (S, dK and
dQ over D, dP and dV over Dv). Flash has no Dv != D (its column stays empty); the rows carry
head_dim_v, and the speed gate's table leaves them out (tools/speed_table.py: the gate keeps
Dv != D on stock).
Per row: TFLOP/s of every backend, ours over each stock backend and over the best of them; last,
the geometric means of those ratios.

    python benchmarks/bench_bwd.py [--quick] [--dims 64,128,256] [--seqs 512,...] [--reps 10]
                                   [--extra] [--no-gqa] [--fa4] [--dropin] [--batched N]
                                   [--dv-pairs 192x128]
                                   [--ab-env VAR=VALUE] [--json OUT]

--fa4 adds FlashAttention-4's SM90 backward (the flash-attn-4 package, flash_attn.cute, CuTe
DSL; tools/fetch_fa4.sh makes its wheels portable to the GPU machine) as a peer column: timed
interleaved with the others, with its own ratio column and geometric mean, but not counted
among the stock backends (the "best" column and the speed gate compare with stock only). FA4
compiles each new kernel configuration on its first call (outside the timing), so a whole grid
with --fa4 takes longer than the device call's 10 minutes may allow: pick --dims / --seqs.

--dropin adds two public-path columns, each timed like every column (one synchronized call per
sample: host time counts in full, as a training loop that runs ahead would hide part of):
"dropin", ours through the public drop-in (torch_sm90_sdpa.scaled_dot_product_attention, the
backward by torch.autograd.grad), and "cudnn_sdpa", stock cuDNN through its own public path
(F.scaled_dot_product_attention under sdpa_kernel(CUDNN_ATTENTION), torch.autograd.grad): both
pay torch's autograd engine. Ratio columns: "ours / dropin" (the op's speed over the drop-in's),
"public" (the drop-in over cuDNN's public path: ours / cuDNN as a model sees it) and "agree"
(public over the op-level ours / cudnn: issue 8's "the paths agree within 2%" is 0.98..1.02).

--batched N times N calls back to back per sample (every column alike), so the host runs ahead
of the GPU as in a training loop, and a path's host latency before its first kernel is hidden
where the GPU work is longer than it (the drop-in's autograd engine: 0.2-0.4 ms per call).

--ab-env VAR=VALUE adds a column "ours_env": ours with the environment variable VAR set to VALUE
around each call (the device layer reads its switches again on each change, e.g.
TORCH_SM90_SDPA_PERSISTENT=1), timed interleaved with every other column, so that one run
compares both sides of a switch on the whole grid ("/env" = ours / ours_env: under 1, the
switch makes ours faster).

--json writes the rows (TFLOP/s per backend) in the format tools/speed_table.py reads to
regenerate the speed gate's table (torch_sm90_sdpa/_generated_speed_table.py) and
tools/benchmarks_md.py reads to write BENCHMARKS.md's tables.
"""
import argparse
import math
import statistics
import sys

import torch

import torch_sm90_sdpa  # registers the ops; the drop-in of --dropin
from torch_sm90_sdpa import policy


def make(b, hq, hkv, s, d, dtype, seed=0, dv=None):
    """q, k [.., d], v and dout [.., dv] (default d)."""
    dv = d if dv is None else dv
    g = torch.Generator(device="cuda").manual_seed(seed)
    # BSHD memory viewed as BHSD, as attention modules produce
    q = torch.randn(b, s, hq, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
    k = torch.randn(b, s, hkv, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
    v = torch.randn(b, s, hkv, dv, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
    dout = torch.randn(b, s, hq, dv, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
    return q, k, v, dout


def backend_cudnn(q, k, v, dout, causal, scale):
    aten = torch.ops.aten
    out = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    o, lse, cq, ck, mq, mk, seed, off = out[:8]

    def run():
        return aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, o, lse, seed, off, None, cq, ck, mq, mk, 0.0, causal, scale=scale)
    return run


def backend_flash(q, k, v, dout, causal, scale):
    aten = torch.ops.aten
    o, lse, cq, ck, mq, mk, seed, off, _ = aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale)

    def run():
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, o, lse, cq, ck, mq, mk, 0.0, causal, seed, off, scale=scale)
    return run


def backend_efficient(q, k, v, dout, causal, scale):
    aten = torch.ops.aten
    if q.shape[1] != k.shape[1]:
        raise RuntimeError("memory-efficient attention has no GQA")
    o, lse, seed, off = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)

    def run():
        return aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, o, lse, seed, off, 0.0, [True, True, True, False], causal, scale=scale)
    return run


def backend_ours(q, k, v, dout, causal, scale):
    o, lse = torch.ops.torch_sm90_sdpa.sdpa(q, k, v, causal, scale, q.shape[1] != k.shape[1])
    op = torch.ops.torch_sm90_sdpa.sdpa_backward

    def run():
        return op(dout, q, k, v, o, lse, causal, scale, False)
    return run


def backend_fa4(q, k, v, dout, causal, scale):
    """FlashAttention-4's backward, called as its autograd function calls it
    (flash_attn.cute.interface._flash_attn_bwd, which picks its SM90 tile itself), on the
    (B, S, H, D) memory make() lays out; its own forward gives out and lse."""
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

    qb, kb, vb, dob = (t.transpose(1, 2) for t in (q, k, v, dout))  # contiguous (B, S, H, D)
    res = _flash_attn_fwd(qb, kb, vb, softmax_scale=scale, causal=causal, return_lse=True)
    o, lse = res[0], res[1]

    def run():
        return _flash_attn_bwd(qb, kb, vb, o, dob, lse, softmax_scale=scale, causal=causal)
    return run


def backend_ours_env(var, value):
    """Ours (backend_ours) with the environment variable var set to value around each call,
    restored after it: the other side of a switch of the device layer (which re-reads its
    switches on each change, _extension.switch_env)."""
    from torch_sm90_sdpa import _extension

    def make_fn(q, k, v, dout, causal, scale):
        run_ours = backend_ours(q, k, v, dout, causal, scale)

        def run():
            with _extension.switch_env(var, value):
                return run_ours()
        return run
    return make_fn


def backend_dropin(q, k, v, dout, causal, scale):
    """Ours through the public drop-in: torch.autograd.grad of
    torch_sm90_sdpa.scaled_dot_product_attention (its forward run once), as an unmodified model's
    backward reaches our kernel; the gradient dO is make()'s, as for every column. Refuses a call
    the drop-in hands to stock SDPA (its output's grad_fn is then not our op's)."""
    qs, ks, vs = (t.detach().requires_grad_(True) for t in (q, k, v))
    o = torch_sm90_sdpa.scaled_dot_product_attention(
        qs, ks, vs, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    if not any(n in type(o.grad_fn).__name__ for n in ("EagerSdpa", "torch_sm90_sdpa_sdpa")):
        raise RuntimeError(f"the drop-in fell back to stock SDPA ({type(o.grad_fn).__name__})")

    def run():
        return torch.autograd.grad(o, (qs, ks, vs), dout, retain_graph=True)
    return run


def backend_cudnn_sdpa(q, k, v, dout, causal, scale):
    """Stock cuDNN through its public path: torch.autograd.grad of F.scaled_dot_product_attention
    under sdpa_kernel(CUDNN_ATTENTION) (its forward run once), the path an unmodified model's
    backward takes on stock; the counterpart of backend_dropin."""
    return backend_autograd("cudnn")(q, k, v, dout, causal, scale)


def backend_autograd(which):
    """Fallback when an aten backward op cannot be called from Python (schema differences between
    torch versions): time torch.autograd.grad of the stock SDPA output under one backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
          "efficient": SDPBackend.EFFICIENT_ATTENTION}[which]

    def make_fn(q, k, v, dout, causal, scale):
        qs, ks, vs = (t.detach().requires_grad_(True) for t in (q, k, v))
        with sdpa_kernel(be):
            o = torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])

        def run():
            return torch.autograd.grad(o, (qs, ks, vs), dout, retain_graph=True)
        return run
    return make_fn


BACKENDS = {"ours": backend_ours, "cudnn": backend_cudnn, "flash": backend_flash, "efficient": backend_efficient}
STOCK = ("cudnn", "flash", "efficient")
# Columns measured beside on request, each with its own ratio column, never counted as stock:
# other implementations (--fa4) and ours through the public drop-in (--dropin; "ours / dropin"
# above 1 is what the drop-in's path costs over the op's).
PEERS = {"fa4": backend_fa4, "dropin": backend_dropin, "cudnn_sdpa": backend_cudnn_sdpa,
         "ours_env": None}  # ours_env: backend_ours_env(--ab-env's VAR, VALUE)
# Ratios between two public-path columns (--dropin), not of the op: "public" = dropin over
# cudnn_sdpa; "agree" = public over the op-level ours / cudnn.
PUBLIC_KEYS = ("public", "agree")


def time_interleaved(fns, reps, warmup=2, calls=1):
    """{name: ms per call}, the median over reps samples taken in turn, the order rotated by one
    each round (A, B, C, B, C, A, C, A, B, ...: no column always follows the same one, e.g.
    the autograd engine's device thread is not always cold for one public-path column and warm
    for the next); a sample is one synchronized call, or with calls > 1 the mean of that many
    calls issued back to back between one pair of events."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times = {n: [] for n in fns}
    names = list(fns)
    for rep in range(reps):
        for n in names[rep % len(names):] + names[:rep % len(names)]:
            fn = fns[n]
            st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            st.record()
            for _ in range(calls):  # calls > 1: back to back, the host running ahead
                fn()
            en.record()
            torch.cuda.synchronize()
            times[n].append(st.elapsed_time(en) / calls)
    return {n: statistics.median(t) for n, t in times.items()}


ROWS = []  # every measured row, for --json


def run_row(label, b, hq, hkv, s, d, causal, dtype, reps, check, backends=None, calls=1, dv=None):
    """dv: v's head dim where it is not d (a pair of --dv-pairs)."""
    backends = BACKENDS if backends is None else backends
    dv = d if dv is None else dv
    q, k, v, dout = make(b, hq, hkv, s, d, dtype, dv=dv)
    scale = 1.0 / math.sqrt(d)
    fns, notes = {}, []
    for name, make_fn in backends.items():
        try:
            fn = make_fn(q, k, v, dout, causal, scale)
            fn()
            fns[name] = fn
        except Exception as exc:  # a backend that refuses this shape, or an op we cannot call
            if name in STOCK:
                try:
                    fn = backend_autograd(name)(q, k, v, dout, causal, scale)
                    fn()
                    fns[name] = fn
                    notes.append(f"{name} via autograd")
                    continue
                except Exception as exc2:
                    exc = exc2
            notes.append(f"{name}: {type(exc).__name__}")
    if check and "ours" in fns and "cudnn" in fns:
        a, c = fns["ours"](), fns["cudnn"]()
        for x, y, nm in zip(a, c, ("dq", "dk", "dv")):
            rel = ((x.float() - y.float()).norm() / y.float().norm()).item()
            if not rel < 2e-2:
                notes.append(f"{nm} differs from cudnn: {rel:.2e}")
    ms = time_interleaved(fns, reps, calls=calls)
    # five GEMMs of s x s: S, dK, dQ over d; dP, dV over dv (10 b h s^2 d where dv == d)
    flops = 2 * b * hq * s * s * (3 * d + 2 * dv) / (2 if causal else 1)
    tf = {n: flops / (t * 1e-3) / 1e12 for n, t in ms.items()}
    ratios = ours_over_stock(tf)
    cells = "  ".join(f"{tf[n]:6.0f}" if n in tf else f"{'-':>6}" for n in backends)
    rcells = "  ".join(f"{ratios[n]:5.2f}" if n in ratios else f"{'-':>5}"
                       for n in ratio_keys(backends))
    print(f"{label:40s} {cells}   {rcells}  {'; '.join(notes)}", flush=True)
    # the q heads one CTA walked (a GQA group, or 1): the code path the speed gate files the
    # row under (tools/speed_table.py)
    walk = policy.gqa_heads_per_cta(q, k, v, dout, dout, is_causal=causal, deterministic=False)
    ROWS.append(dict(head_dim=d, causal=causal, seqlen=s, batch=b, heads=hq, kv_heads=hkv,
                     masked=False, dtype=DTYPE_NAMES[dtype], heads_per_cta=walk, tflops=tf,
                     **({"head_dim_v": dv} if dv != d else {})))
    del q, k, v, dout, fns
    torch.cuda.empty_cache()
    return ratios


RATIO_KEYS = ("best",) + STOCK + tuple(PEERS) + PUBLIC_KEYS  # ours over the best stock, over
# each stock backend, over each peer; the public paths' ratio and its agreement with the op's
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
RATIO_LABELS = {"cudnn_sdpa": "/cpub", "public": "pub", "agree": "agr", "ours_env": "/env"}  # header cells


def ratio_keys(backends):
    """The ratio columns of a run with these backends (peers only when measured; the public
    paths' ratios only with both public columns and cudnn)."""
    public = all(n in backends for n in ("dropin", "cudnn_sdpa", "cudnn"))

    def shown(key):
        if key in PUBLIC_KEYS:
            return public
        return key not in PEERS or key in backends
    return tuple(k for k in RATIO_KEYS if shown(k))


def ours_over_stock(tf):
    """{"best" (over the stock backends only) and each stock backend and peer measured: ours'
    TFLOP/s over theirs} of one row's TFLOP/s per backend; empty without ours."""
    if not tf.get("ours", 0) > 0:
        return {}
    r = {n: tf["ours"] / tf[n] for n in STOCK + tuple(PEERS) if tf.get(n, 0) > 0}
    stock = [tf[n] for n in STOCK if tf.get(n, 0) > 0]
    if stock:
        r["best"] = tf["ours"] / max(stock)
    if tf.get("dropin", 0) > 0 and tf.get("cudnn_sdpa", 0) > 0:
        r["public"] = tf["dropin"] / tf["cudnn_sdpa"]
        if "cudnn" in r:
            r["agree"] = r["public"] / r["cudnn"]
    return r


def geomeans(ratios):
    """{key: (geometric mean, rows)} over a list of ours_over_stock dicts, per key."""
    out = {}
    for key in RATIO_KEYS:
        vals = [r[key] for r in ratios if key in r and r[key] > 0]
        if vals:
            out[key] = (math.exp(sum(map(math.log, vals)) / len(vals)), len(vals))
    return out


def extra_rows(quick=False, gqa=True):
    """The rows beyond the grid that issue 8 asks for, as (label, b, hq, hkv, s, d, causal,
    dtype): GQA d128 causal 8k with 32 q / 4 and 32 q / 1 kv heads; head dims 96 and 192 and
    fp16 at d128 (full and causal, 2k and 8k keys; 2k only with quick); d128 at 1000 and 4097
    keys (odd lengths: partial last blocks). 16k tokens per batch and hidden 2048 as the grid."""
    bf16, fp16 = torch.bfloat16, torch.float16
    rows = []
    if gqa:
        for hkv in (4, 1):
            rows.append((f"GQA d=128 causal s=8192 32q/{hkv}kv b=2", 2, 32, hkv, 8192, 128, True, bf16))
        # the attention of issue 8's compiled GPT (16 q / 8 kv heads of 128): a group of 2
        rows.append(("GQA d=128 causal s=8192 16q/8kv b=2", 2, 16, 8, 8192, 128, True, bf16))
    seqs = (2048,) if quick else (2048, 8192)
    cases = [(d, bf16, s) for d in (96, 192) for s in seqs] + [(128, fp16, s) for s in seqs]
    cases += [(128, bf16, s) for s in (1000, 4097)]
    for d, dtype, s in cases:
        for causal in (False, True):
            b, h = max(1, 16384 // s), 2048 // d
            rows.append((f"{DTYPE_NAMES[dtype]} d={d} {'causal' if causal else 'full  '} s={s:<5d} b={b} h={h}",
                         b, h, h, s, d, causal, dtype))
    return rows


def parse_dv_pairs(text):
    """'192x128' -> [(192, 128)] (pairs with Dv != D); '' -> []."""
    pairs = []
    for part in (text or "").replace(";", ",").split(","):
        part = part.strip().lower()
        if not part:
            continue
        d, sep, dv = part.partition("x")
        if not sep or not d.isdigit() or not dv.isdigit() or int(d) == int(dv):
            raise ValueError(f"expected DxDv with Dv != D, got {part!r}")
        pairs.append((int(d), int(dv)))
    return pairs


def dv_pair_rows(pairs, seqs):
    """Rows (label, b, hq, hkv, s, d, causal, dtype, dv) of --dv-pairs: bf16, full and causal,
    at these lengths, b = 16384 / s, h = 2048 / d (the grid's shapes at D)."""
    rows = []
    for d, dv in pairs:
        for causal in (False, True):
            for s in seqs:
                b, h = max(1, 16384 // s), 2048 // d
                rows.append((f"d={d}x{dv} {'causal' if causal else 'full  '} s={s:<5d} b={b} h={h}",
                             b, h, h, s, d, causal, torch.bfloat16, dv))
    return rows


def grid_parser(doc):
    """The command line of the grid benchmarks (this one, bench_deterministic.py)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--seqs", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="s = 1k, 4k, 16k only, 5 repeats")
    ap.add_argument("--no-gqa", action="store_true")
    return ap


def grid(a):
    """(repeats, [(label, b, h, s, d, causal), ...]) of the FlashAttention-paper grid, or None
    (after saying so) without an SM90 GPU."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs an SM90 GPU")
        return None
    dims = [int(x) for x in a.dims.split(",")]
    seqs = [1024, 4096, 16384] if a.quick else [int(x) for x in a.seqs.split(",")]
    reps = 5 if a.quick else a.reps
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; backward TFLOP/s, median of {reps}, "
          "interleaved; bf16, b = 16384/s, h = 2048/d")
    rows = []
    for d in dims:
        for causal in (False, True):
            for s in seqs:
                b, h = max(1, 16384 // s), 2048 // d
                rows.append((f"d={d} {'causal' if causal else 'full  '} s={s:<5d} b={b} h={h}",
                             b, h, s, d, causal))
    return reps, rows


def main():
    ap = grid_parser(__doc__)
    ap.add_argument("--check", action="store_true", help="also compare gradients with cuDNN's")
    ap.add_argument("--extra", action="store_true",
                    help="also GQA 32/4, 32/1 and 16/8, d96 / d192, fp16 and odd-length rows (extra_rows)")
    ap.add_argument("--json", help="write the rows here (input of tools/speed_table.py)")
    ap.add_argument("--fa4", action="store_true",
                    help="also FlashAttention-4's backward (flash_attn.cute), as a peer column")
    ap.add_argument("--dropin", action="store_true",
                    help="also ours through the public drop-in (torch.autograd.grad of "
                         "torch_sm90_sdpa.scaled_dot_product_attention), as a column of its own")
    ap.add_argument("--ab-env", metavar="VAR=VALUE",
                    help="also ours with the environment variable VAR=VALUE around each call, as "
                         "a column of its own (ours_env)")
    ap.add_argument("--dv-pairs", metavar="DxDv,...", default="",
                    help="also rows of these (q/k, v) head-dim pairs with Dv != D, e.g. 192x128 "
                         "(bf16, full and causal, the grid's lengths)")
    ap.add_argument("--batched", type=int, default=1, metavar="CALLS",
                    help="a sample is CALLS calls back to back between one pair of events (the "
                         "host running ahead, as in training), not one synchronized call")
    a = ap.parse_args()
    if a.batched < 1:
        ap.error(f"--batched: expected a number of calls >= 1, got {a.batched}")
    ab_env = None
    if a.ab_env is not None:
        var, sep, value = a.ab_env.partition("=")
        if not sep or not var:
            ap.error(f"--ab-env: expected VAR=VALUE, got {a.ab_env!r}")
        ab_env = (var, value)
    g = grid(a)
    if g is None:
        return 1
    reps, rows = g
    grid_seqs = sorted({s for _, _, _, s, _, _ in rows})
    bf16 = torch.bfloat16
    rows = [(label, b, h, h, s, d, causal, bf16) for label, b, h, s, d, causal in rows]
    if not a.no_gqa:
        rows.append(("GQA d=128 causal s=8192 32q/8kv b=2", 2, 32, 8, 8192, 128, True, bf16))
    if a.extra:
        rows += extra_rows(a.quick, gqa=not a.no_gqa)
    try:
        pairs = parse_dv_pairs(a.dv_pairs)
    except ValueError as exc:
        ap.error(f"--dv-pairs: {exc}")
    rows += dv_pair_rows(pairs, grid_seqs)
    backends = dict(BACKENDS)
    if a.fa4:
        try:
            import flash_attn.cute.interface  # noqa: F401
        except ImportError as exc:
            print(f"--fa4: flash_attn.cute does not import ({exc}); install flash-attn-4")
            return 1
        backends["fa4"] = PEERS["fa4"]
    if a.dropin:
        backends["dropin"] = PEERS["dropin"]
        backends["cudnn_sdpa"] = PEERS["cudnn_sdpa"]
    if ab_env is not None:
        backends["ours_env"] = backend_ours_env(*ab_env)
        print(f"ours_env: ours with {ab_env[0]}={ab_env[1]}")
    print(f"{'row':40s} " + "  ".join(f"{n:>6s}" for n in backends) + "   "
          + "  ".join(f"{RATIO_LABELS.get(n, '/' + n[:4]):>5s}" for n in ratio_keys(backends))
          + "  (ours over; pub = dropin / cudnn_sdpa, agr = pub / (ours / cudnn))")
    if a.batched > 1:
        print(f"each sample: {a.batched} calls back to back, ms per call")
    ratios = [run_row(label, b, hq, hkv, s, d, causal, dtype, reps, a.check, backends, a.batched,
                      dv=rest[0] if rest else None)
              for label, b, hq, hkv, s, d, causal, dtype, *rest in rows]
    names = {"best": "ours / best stock", "public": "dropin / cudnn_sdpa (public paths)",
             "agree": "public / (ours / cudnn) (paths agree)"}
    for key, (g_mean, n) in geomeans(ratios).items():
        print(f"geometric mean of {names.get(key, 'ours / ' + key)}: {g_mean:.3f} over {n} rows")
    if a.json:
        write_json(a.json, "bench_bwd", ROWS)
    return 0


def write_json(path, bench, rows):
    """The benchmark's rows with where they were measured (read by tools/speed_table.py). The
    commit is GIT_COMMIT when set, else git's HEAD, marked "-dirty" when the tree differs from it
    (a copy of a working tree on the GPU machine may carry other git metadata: pass
    GIT_COMMIT=$(git rev-parse --short HEAD) with the command there)."""
    import datetime
    import json
    import os
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=here).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=here).stdout.strip()
        if commit and dirty:
            commit += "-dirty"
    except OSError:
        commit = ""
    meta = dict(bench=bench, command=" ".join(sys.argv), device=torch.cuda.get_device_name(),
                torch=torch.__version__, date=datetime.date.today().isoformat(),
                commit=os.environ.get("GIT_COMMIT") or commit or "unknown")
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
