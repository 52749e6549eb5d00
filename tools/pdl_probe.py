"""Programmatic dependent launch (csrc/grid_dependency.h) on and off, interleaved in one process.

For each shape, torch.ops.torch_sm90_sdpa.sdpa_backward with TORCH_SM90_SDPA_PDL=1 and =0 (the
device layer reads it per call), alternating: the median ms of single calls timed with CUDA
events (as benchmarks/bench_bwd.py times them), and the mean ms per call of 20 calls issued back
to back between one pair of events (median of the rounds). Needs the GPU machine.

    python tools/pdl_probe.py [--rounds 15]
"""
import argparse
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import torch_sm90_sdpa  # noqa: E402,F401
from torch_sm90_sdpa import _extension  # noqa: E402
from bench_bwd import make  # noqa: E402

SHAPES = [  # (b, hq, hkv, s, d, causal): 16k tokens per batch, as bench_bwd's grid
    (32, 16, 16, 512, 128, True), (32, 16, 16, 512, 128, False), (8, 16, 16, 2048, 128, True),
    (32, 32, 32, 512, 64, True), (32, 8, 8, 512, 256, True), (8, 8, 8, 2048, 256, True),
    (8, 16, 4, 2048, 128, True)]


def timed(fn, calls):
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    st.record()
    for _ in range(calls):
        fn()
    en.record()
    torch.cuda.synchronize()
    return st.elapsed_time(en) / calls


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args()
    op = torch.ops.torch_sm90_sdpa.sdpa_backward
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; ms per call, PDL on / off "
          f"(single calls: median of {a.rounds}; back to back: 20 calls, median of {a.rounds})")
    for b, hq, hkv, s, d, causal in SHAPES:
        if not _extension.has_variant(d, torch.bfloat16):
            print(f"d{d}: not built, skipped", flush=True)
            continue
        q, k, v, dout = make(b, hq, hkv, s, d, torch.bfloat16)
        scale = 1 / math.sqrt(d)
        out, lse = torch.ops.torch_sm90_sdpa.sdpa(q, k, v, causal, scale, hq != hkv)

        def call():
            return op(dout, q, k, v, out, lse, causal, scale, False)
        single = {"1": [], "0": []}
        batch = {"1": [], "0": []}
        for flag in ("1", "0"):  # warm-up
            os.environ["TORCH_SM90_SDPA_PDL"] = flag
            timed(call, 3)
        for _ in range(a.rounds):
            for flag in ("1", "0"):
                os.environ["TORCH_SM90_SDPA_PDL"] = flag
                single[flag].append(timed(call, 1))
                batch[flag].append(timed(call, 20))
        m = {f: (statistics.median(single[f]), statistics.median(batch[f])) for f in ("1", "0")}
        label = f"d{d} {'causal' if causal else 'full'} s{s} b{b} h{hq}/{hkv}"
        print(f"{label:30s} single {m['1'][0]:.3f} / {m['0'][0]:.3f} ({m['0'][0] / m['1'][0]:.3f}x)"
              f"   back to back {m['1'][1]:.3f} / {m['0'][1]:.3f} ({m['0'][1] / m['1'][1]:.3f}x)",
              flush=True)
        del q, k, v, dout, out, lse
        torch.cuda.empty_cache()
    os.environ.pop("TORCH_SM90_SDPA_PDL", None)


if __name__ == "__main__":
    main()
