"""The split tail's A/B (GPU machine): full attention with the last partial wave of tiles dealt
as one piece of m-blocks per SM (TORCH_SM90_SDPA_SPLIT_TAIL unset: the rule) against whole
tiles (=0), in interleaved rounds: the main kernel and every kernel of the backward (device
ms from the profiler), beside the plan (split tiles r of T, T / SMs waves).
    python tools/split_probe.py [--rows 128:2:16:8192,...] [--rounds 3] [--dtype bf16]
A row is D:B:H:S (MHA, full attention, Sq = Sk = S).
"""
import argparse
import os
import statistics
import sys

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [os.path.join(ROOT, "benchmarks")]
from profile_bwd import kernel_ms  # noqa: E402

import torch_sm90_sdpa  # noqa: E402,F401  (registers the ops)
from torch_sm90_sdpa import _cuda_backend as cb  # noqa: E402
from torch_sm90_sdpa import _extension  # noqa: E402

ENV = "TORCH_SM90_SDPA_SPLIT_TAIL"
# the FA grid's full rows of the persistent head dims (b = 16384 / s, h = 2048 / d)
DEFAULT_ROWS = ",".join(f"{d}:{16384 // s}:{2048 // d}:{s}" for d in (64, 128)
                        for s in (1024, 2048, 4096, 8192, 16384))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=DEFAULT_ROWS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ops = torch.ops.torch_sm90_sdpa
    print(f"{torch.cuda.get_device_name()}, {sms} SMs; {a.dtype} MHA full; device ms per call "
          f"(profiler, mean of {a.reps}), median of {a.rounds} interleaved rounds; "
          f"split = {ENV} unset (the rule), whole = {ENV}=0", flush=True)
    sides = (("split", None), ("whole", "0"))
    for row in a.rows.split(","):
        d, b, h, s = (int(x) for x in row.split(":"))
        if not _extension.has_variant(d, dtype):
            print(f"d{d}: variant not built", flush=True)
            continue
        q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=dtype) for _ in range(4))
        scale = d ** -0.5
        o, lse = ops.sdpa(q, k, v, False, scale, False)
        os.environ.pop(ENV, None)
        plan, _ = cb.make_params(do, q, k, v, o, lse, False, scale, False)
        main = {name: [] for name, _ in sides}
        total = {name: [] for name, _ in sides}
        for _ in range(a.rounds):
            for name, value in sides:
                if value is None:
                    os.environ.pop(ENV, None)
                else:
                    os.environ[ENV] = value
                per = kernel_ms(lambda: ops.sdpa_backward(do, q, k, v, o, lse, False, scale, False), a.reps)
                main[name].append(sum(ms for n, ms in per.items() if "bwd_main_kernel" in n))
                total[name].append(sum(per.values()))
        os.environ.pop(ENV, None)
        med = {n: (statistics.median(main[n]), statistics.median(total[n])) for n, _ in sides}
        (ms_s, tot_s), (ms_w, tot_w) = med["split"], med["whole"]
        print(f"d{d} b{b} h{h} s{s}: split tiles {plan.split_tiles}; main split {ms_s:.3f} / whole "
              f"{ms_w:.3f} ms ({ms_w / ms_s:.3f}x; rounds "
              + " ".join(f"{x:.3f}/{y:.3f}" for x, y in zip(main['split'], main['whole']))
              + f"); all kernels {tot_s:.3f} / {tot_w:.3f} ms ({tot_w / tot_s:.3f}x)", flush=True)
        del q, k, v, do, o, lse
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
