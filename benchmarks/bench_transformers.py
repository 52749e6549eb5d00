"""Whole training steps of compiled transformers models, stock against torch_sm90_sdpa's routes.

Unpatched transformers with attn_implementation="sdpa": under torch.compile it materializes its
causal mask, so SDPA runs cuDNN's masked kernels; with enable(forward=False) the masked backward
nodes run our op, which skips the masked tiles ("routed"); with --forward, enable() (the
default: forward nodes too) is timed as well ("routed+forward"). A step is forward + backward + SGD update of a bf16 model, no
attention_mask passed (or, with --padded, half of the batch right-padded to half its length; with
--ones, an attention_mask of ones: a graph input, so no mask can be proved causal).
Both variants are compiled in the same process (caches off); their steps are interleaved and the
median step time is reported.

--interface adds the attention interface (torch_sm90_sdpa.transformers_attention.register(),
attn_implementation="sm90_sdpa"), which needs no routing switch: "eager sdpa" against "eager
sm90_sdpa" (unmodified eager training), and "compiled sm90_sdpa" against the compiled stock step.

Configurations (4 layers, hidden 2048, vocab 32000, intermediate 5632, Llama):
  d64   32 q / 8 kv heads of 64,  batch 4, 4096 tokens
  d128  16 q / 4 kv heads of 128, batch 2, 8192 tokens

    python benchmarks/bench_transformers.py [--configs d64,d128] [--steps 10] [--padded | --ones]
                                            [--interface] [--forward] [--force] [--profile]

--force routes with only_faster=False (masked calls too); --forward adds the variant
"routed+forward", enable() with its default forward=True: forward nodes routed with their backward
(torch_sm90_sdpa/forward_pass.py); --profile prints, per variant, the CUDA kernels of one step
that took the most time (torch.profiler).
"""
import argparse
import copy
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")

import torch  # noqa: E402

import torch_sm90_sdpa  # noqa: E402
from bench_bwd import time_interleaved  # noqa: E402  (the interleaved CUDA-event timer)

CONFIGS = {
    "d64": dict(heads=32, kv_heads=8, head_dim=64, batch=4, seq=4096),
    "d128": dict(heads=16, kv_heads=4, head_dim=128, batch=2, seq=8192),
}


def build(transformers, c, attn_implementation="sdpa"):
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
        num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"],
        head_dim=c["head_dim"], max_position_embeddings=c["seq"])
    config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).cuda().to(torch.bfloat16)


def _loss(model, ids, attention_mask, labels):
    return model(input_ids=ids, attention_mask=attention_mask, labels=labels).loss


def compiled_loss(variant: str, fn=_loss):
    """torch.compile of a loss function (`fn`) with a code object of its own per variant:
    Dynamo caches compiled graphs per code object, and both variants' models share
    LlamaForCausalLM.forward's (the second compile would reuse the first graph)."""
    from torch_sm90_sdpa.testing import with_own_code

    return torch.compile(with_own_code(fn, variant))


def sgd_step(model, loss_of):
    """A training step: loss_of() (the loss), backward, SGD update."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step():
        loss = loss_of()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def step_fn(loss_fn, model, ids, attention_mask):
    labels = ids if attention_mask is None else ids.masked_fill(attention_mask == 0, -100)
    return sgd_step(model, lambda: loss_fn(model, ids, attention_mask, labels))


def profile_step(variant, fn, top=12):
    """The CUDA kernels of one step of `fn` that took the most time, with their call counts."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events)
    print(f"  {variant}: {total / 1e3:.1f} ms of kernels; top {top}:")
    for e in events[:top]:
        print(f"    {e.device_time_total / 1e3:8.2f} ms  x{e.count:<4d} {e.key[:110]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="d64,d128")
    ap.add_argument("--steps", type=int, default=10)
    masks = ap.add_mutually_exclusive_group()
    masks.add_argument("--padded", action="store_true")
    masks.add_argument("--ones", action="store_true", help="an attention_mask of ones")
    ap.add_argument("--json")
    ap.add_argument("--interface", action="store_true",
                    help='also attn_implementation="sm90_sdpa", eager and compiled')
    ap.add_argument("--force", action="store_true", help="route with only_faster=False")
    ap.add_argument("--forward", action="store_true",
                    help='also "routed+forward": enable(), forward nodes too')
    ap.add_argument("--profile", action="store_true", help="top CUDA kernels of one step")
    args = ap.parse_args()
    import transformers

    if args.interface:
        from torch_sm90_sdpa import transformers_attention
        transformers_attention.register()
    results = []
    for name in args.configs.split(","):
        c = CONFIGS[name]
        base = build(transformers, c)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 32000, (c["batch"], c["seq"]), generator=g).cuda()
        attention_mask = None
        if args.padded or args.ones:
            attention_mask = torch.ones_like(ids)
        if args.padded:
            attention_mask[1::2, c["seq"] // 2:] = 0
        steps = {}
        t0 = time.time()
        torch._dynamo.reset()
        torch_sm90_sdpa.disable()
        steps["stock"] = step_fn(compiled_loss("stock"), copy.deepcopy(base), ids,
                                 attention_mask)
        steps["stock"]()  # compile
        with torch_sm90_sdpa.enable(only_faster=not args.force, forward=False):
            steps["routed"] = step_fn(compiled_loss("routed"), copy.deepcopy(base), ids,
                                      attention_mask)
            steps["routed"]()
        stats = torch_sm90_sdpa.routing_stats(reset=True)
        forward_stats = None
        if args.forward:
            with torch_sm90_sdpa.enable(only_faster=not args.force, forward=True):
                steps["routed+forward"] = step_fn(compiled_loss("routed+forward"),
                                                  copy.deepcopy(base), ids, attention_mask)
                steps["routed+forward"]()
            forward_stats = torch_sm90_sdpa.routing_stats(reset=True)
        if args.interface:  # the attention interface: no routing switch, eager and compiled
            ours = copy.deepcopy(base)
            ours.config._attn_implementation = "sm90_sdpa"
            steps["eager sdpa"] = step_fn(_loss, copy.deepcopy(base), ids, attention_mask)
            steps["eager sm90_sdpa"] = step_fn(_loss, ours, ids, attention_mask)
            ours_compiled = copy.deepcopy(base)
            ours_compiled.config._attn_implementation = "sm90_sdpa"
            steps["compiled sm90_sdpa"] = step_fn(compiled_loss("interface"), ours_compiled,
                                                  ids, attention_mask)
            steps["compiled sm90_sdpa"]()
        compile_s = time.time() - t0
        med = time_interleaved(steps, args.steps, warmup=1)
        row = dict(config=name, **c, padded=args.padded, ones=args.ones, stock_ms=med["stock"],
                   routed_ms=med["routed"], speedup=med["stock"] / med["routed"],
                   routed_nodes=stats["routed_nodes"], not_routed=stats["not_routed"],
                   causal_masks=stats.get("causal_masks"),
                   compile_s=compile_s)
        if forward_stats is not None:
            row.update(forward_ms=med["routed+forward"],
                       forward_speedup=med["stock"] / med["routed+forward"],
                       routed_forward_nodes=forward_stats["routed_forward_nodes"],
                       forward_not_routed=forward_stats["forward_not_routed"],
                       forward_routed_nodes=forward_stats["routed_nodes"])
        if args.interface:
            row.update(eager_sdpa_ms=med["eager sdpa"], eager_sm90_sdpa_ms=med["eager sm90_sdpa"],
                       eager_speedup=med["eager sdpa"] / med["eager sm90_sdpa"],
                       compiled_sm90_sdpa_ms=med["compiled sm90_sdpa"],
                       interface_speedup=med["stock"] / med["compiled sm90_sdpa"])
        results.append(row)
        print(f"{name}: {c}, padded={args.padded}, ones={args.ones}: step stock "
              f"{med['stock']:.1f} ms, routed {med['routed']:.1f} ms, speedup "
              f"{row['speedup']:.3f}x; routed nodes "
              f"{stats['routed_nodes']}, not routed {stats['not_routed']}, causal masks "
              f"{stats.get('causal_masks')} (compile {compile_s:.0f} s)", flush=True)
        if forward_stats is not None:
            print(f"  enable() (forward nodes too): {row['forward_ms']:.1f} ms, "
                  f"{row['forward_speedup']:.3f}x stock; forward nodes routed "
                  f"{row['routed_forward_nodes']}, kept {row['forward_not_routed']}", flush=True)
        if args.interface:
            print(f"  attn_implementation=\"sm90_sdpa\": eager {row['eager_sm90_sdpa_ms']:.1f} ms "
                  f"against eager sdpa {row['eager_sdpa_ms']:.1f} ms ({row['eager_speedup']:.3f}x); "
                  f"compiled {row['compiled_sm90_sdpa_ms']:.1f} ms against the compiled stock "
                  f"step ({row['interface_speedup']:.3f}x)", flush=True)
        if args.profile:
            for variant, fn in steps.items():
                profile_step(variant, fn)
        del steps, base
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            commit = os.environ.get("GIT_COMMIT") or subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
            json.dump({"rows": results, "device": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "transformers": transformers.__version__,
                       "meta": {"device": torch.cuda.get_device_name(), "commit": commit,
                                "command": " ".join(sys.argv)}},
                      f, indent=1)


if __name__ == "__main__":
    main()
