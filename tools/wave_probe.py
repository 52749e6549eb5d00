"""Wave quantization of full attention (GPU machine): the main kernel's time against the tile
count, at a fixed sequence length and a varying number of heads (b = 1).

Full attention's tiles all cost the same, so with persistent CTAs (one per SM) a grid of T
tiles should take ceil(T / SMs) tile times: 2048 tiles on 132 SMs (every d128 row of the
FA grid) 16 tile times for 15.5 tiles of work per SM. The probe prints, per head count, the
main kernel (profiler, median of the rounds), the tile count, T / SMs and ms per wave of work.
    python tools/wave_probe.py [--rows 128:8192:28-34,64:8192:30-34] [--rounds 3]
A row is D:S:H0-H1 (bf16, MHA, full attention, Sq = Sk = S, heads H0..H1, batch 1).
"""
import argparse
import math
import os
import statistics
import sys

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "csrc")]
from profile_bwd import kernel_ms  # noqa: E402
from generate_instantiations import dense_tile  # noqa: E402

import torch_sm90_sdpa  # noqa: E402,F401  (registers the ops)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="128:8192:28-34,64:8192:60-68")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--causal", action="store_true")
    a = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ops = torch.ops.torch_sm90_sdpa
    print(f"{torch.cuda.get_device_name()}, {sms} SMs; bf16 MHA {'is_causal' if a.causal else 'full'}, b1; "
          f"main-kernel ms (profiler, mean of {a.reps}; median of {a.rounds} interleaved rounds)", flush=True)
    for row in a.rows.split(","):
        d, s, span = row.split(":")
        d, s = int(d), int(s)
        h0, h1 = (int(x) for x in span.split("-"))
        tile = dense_tile(d, s)
        n_blocks = -(-s // tile.block_n)
        calls = {}
        for h in range(h0, h1 + 1):
            q, k, v, do = (torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            o, lse = ops.sdpa(q, k, v, a.causal, d ** -0.5, False)
            calls[h] = (do, q, k, v, o, lse)
        times = {h: [] for h in calls}
        for _ in range(a.rounds):
            for h, args in calls.items():
                per = kernel_ms(lambda: ops.sdpa_backward(*args, a.causal, d ** -0.5, False), a.reps)
                times[h].append(sum(ms for name, ms in per.items() if "bwd_main_kernel" in name))
        for h, ts in times.items():
            tiles = n_blocks * h
            med = statistics.median(ts)
            print(f"d{d} s{s} h{h}: {tiles} tiles = {tiles / sms:.2f} waves (ceil {math.ceil(tiles / sms)}); "
                  f"main {med:.3f} ms ({' '.join(f'{t:.3f}' for t in ts)}); "
                  f"{med / (tiles / sms):.4f} ms per wave of work, "
                  f"{med / math.ceil(tiles / sms):.4f} per quantized wave", flush=True)
        del calls
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
