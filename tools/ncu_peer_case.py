"""One attention backward of ours or of FlashAttention-4 inside a CUDA profiler range, for
Nsight Compute with --profile-from-start off (tools/ncu_peer_call.sh): the same inputs as
benchmarks/bench_bwd.py (BSHD memory viewed as BHSD, bf16), two calls before the range (FA4
compiles its kernels on the first), one call inside it.
    python tools/ncu_peer_case.py --impl ours|fa4 --d 64 --b 2 --h 32 --s 8192 [--causal]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_bwd  # noqa: E402  (make() and the backends, as the benchmark times them)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", choices=("ours", "fa4"), required=True)
    ap.add_argument("--d", type=int, required=True)
    ap.add_argument("--b", type=int, required=True)
    ap.add_argument("--h", type=int, required=True)
    ap.add_argument("--s", type=int, required=True)
    ap.add_argument("--causal", action="store_true")
    a = ap.parse_args()
    sys.argv = sys.argv[:1]  # the CuTe DSL parses sys.argv on import: "--d" would abbreviate its "--diagnostic"
    q, k, v, dout = bench_bwd.make(a.b, a.h, a.h, a.s, a.d, torch.bfloat16)
    backend = bench_bwd.backend_ours if a.impl == "ours" else bench_bwd.backend_fa4
    run = backend(q, k, v, dout, a.causal, a.d ** -0.5)
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"ncu_peer_case: {a.impl} d{a.d} b{a.b} h{a.h} s{a.s} causal={a.causal}: one call profiled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
