"""An A/B of one of the kernel's per-call switches (GPU machine): each row run with the
variable unset (side A: the default rule) and set to --b-value (side B), in interleaved
rounds; the main kernel and every kernel of the backward (device ms from the profiler),
beside the split-tail plan (split tiles r of T).
    python tools/env_ab_probe.py [--env TORCH_SM90_SDPA_SPLIT_TAIL] [--b-value 0]
                                 [--rows 128:2:16:8192,256:2:8:8192:c,...] [--rounds 3] [--dtype bf16]
A row is D:B:H:S (MHA, full attention, Sq = Sk = S), or D:B:H:S:c (is_causal). --walls adds
each side's synchronized call as the benchmarks time it (CUDA events around one call, then a
sync; with the GPU span and the kernel sum: profile_bwd.call_spans), where host time and the
gaps between kernels show. Examples: the split tail (the default: split against whole tiles,
=0) and persistent CTAs (--env TORCH_SM90_SDPA_PERSISTENT: persistent against one CTA per
tile, =0).
"""
import argparse
import os
import statistics
import sys

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [os.path.join(ROOT, "benchmarks")]
from profile_bwd import call_spans, kernel_ms  # noqa: E402

import torch_sm90_sdpa  # noqa: E402,F401  (registers the ops)
from torch_sm90_sdpa import _cuda_backend as cb  # noqa: E402
from torch_sm90_sdpa import _extension  # noqa: E402

# the FA grid's full rows of d64 / d128 (b = 16384 / s, h = 2048 / d)
DEFAULT_ROWS = ",".join(f"{d}:{16384 // s}:{2048 // d}:{s}" for d in (64, 128)
                        for s in (1024, 2048, 4096, 8192, 16384))


def set_side(env, value):
    if value is None:
        os.environ.pop(env, None)
    else:
        os.environ[env] = value


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", default="TORCH_SM90_SDPA_SPLIT_TAIL")
    ap.add_argument("--b-value", default="0")
    ap.add_argument("--rows", default=DEFAULT_ROWS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--walls", action="store_true", help="also time synchronized calls (event wall)")
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ops = torch.ops.torch_sm90_sdpa
    print(f"{torch.cuda.get_device_name()}, {sms} SMs; {a.dtype} MHA; device ms per call "
          f"(profiler, mean of {a.reps}), median of {a.rounds} interleaved rounds; "
          f"A = {a.env} unset (the rule), B = {a.env}={a.b_value}", flush=True)
    sides = (("A", None), ("B", a.b_value))
    for row in a.rows.split(","):
        fields = row.split(":")
        d, b, h, s = (int(x) for x in fields[:4])
        causal = fields[4:] == ["c"]
        if not _extension.has_variant(d, dtype):
            print(f"d{d}: variant not built", flush=True)
            continue
        q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=dtype) for _ in range(4))
        scale = d ** -0.5
        o, lse = ops.sdpa(q, k, v, causal, scale, False)
        set_side(a.env, None)
        plan, _ = cb.make_params(do, q, k, v, o, lse, causal, scale, False)
        main_ms = {name: [] for name, _ in sides}
        total = {name: [] for name, _ in sides}
        walls = {name: [] for name, _ in sides}  # (event wall, GPU span, kernel sum) per round
        call = lambda: ops.sdpa_backward(do, q, k, v, o, lse, causal, scale, False)  # noqa: E731
        for _ in range(a.rounds):
            for name, value in sides:
                set_side(a.env, value)
                per = kernel_ms(call, a.reps)
                main_ms[name].append(sum(ms for n, ms in per.items() if "bwd_main_kernel" in n))
                total[name].append(sum(per.values()))
                if a.walls:
                    walls[name].append(call_spans(call, a.reps))
        set_side(a.env, None)
        med = {n: (statistics.median(main_ms[n]), statistics.median(total[n])) for n, _ in sides}
        (ms_a, tot_a), (ms_b, tot_b) = med["A"], med["B"]
        kind = "causal" if causal else "full"
        print(f"d{d} b{b} h{h} s{s} {kind}: split tiles {plan.split_tiles}; main A {ms_a:.3f} / B "
              f"{ms_b:.3f} ms ({ms_b / ms_a:.3f}x; rounds "
              + " ".join(f"{x:.3f}/{y:.3f}" for x, y in zip(main_ms['A'], main_ms['B']))
              + f"); all kernels {tot_a:.3f} / {tot_b:.3f} ms ({tot_b / tot_a:.3f}x)", flush=True)
        if a.walls:
            wa, wb = ([statistics.median(w[i] for w in walls[n]) for i in range(3)] for n in ("A", "B"))
            print(f"    synchronized call: event wall {wa[0]:.3f} / {wb[0]:.3f} ms ({wb[0] / wa[0]:.3f}x), "
                  f"GPU span {wa[1]:.3f} / {wb[1]:.3f}, kernel sum {wa[2]:.3f} / {wb[2]:.3f}", flush=True)
        del q, k, v, do, o, lse
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
