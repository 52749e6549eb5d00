"""The pre- and postprocess's HBM throughput against torch's own memory-bound kernels moving
the same bytes (GPU machine). Per row: each kernel of one sdpa_backward call (profiler, mean of
--reps), the bytes the preprocess moves (reads O and dO, writes dq_accum's zeros and the fp32
lse / dpsum rows) and the postprocess moves (reads dq_accum, writes dQ), their TB/s; then
torch's fill of a tensor of dq_accum's size (zero_), its fp32 -> 16-bit copy of that size (the
postprocess's traffic) and a sum over O's and dO's bytes (the preprocess's reads), each in TB/s.
    python tools/prepost_bandwidth_probe.py [--rows 128:32:16:512:c,...] [--reps 20]
A row is D:B:H:S (MHA, full attention) or D:B:H:S:c (is_causal)."""
import argparse
import os
import sys

import torch

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")]
from profile_bwd import kernel_ms  # noqa: E402

import torch_sm90_sdpa  # noqa: E402,F401  (registers the ops)


def tbs(nbytes, ms):
    return nbytes / (ms * 1e-3) / 1e12


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="64:32:32:512:c,128:32:16:512:c,128:32:16:512,256:32:8:512:c,128:2:16:8192")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    ops = torch.ops.torch_sm90_sdpa
    print(f"{torch.cuda.get_device_name()}; ms per call (profiler, mean of {a.reps}); TB/s = bytes / time")
    for row in a.rows.split(","):
        f = row.split(":")
        d, b, h, s = (int(x) for x in f[:4])
        causal = len(f) > 4 and f[4] == "c"
        q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        scale = d ** -0.5
        o, lse = ops.sdpa(q, k, v, causal, scale, False)
        per = kernel_ms(lambda: ops.sdpa_backward(do, q, k, v, o, lse, causal, scale, False), a.reps)
        n = b * h * s * d
        pre_bytes = 2 * n * 2 + n * 4 + b * h * s * 4 * 3  # O, dO; dq_accum zeros; lse in, lse_log2 / dpsum out
        post_bytes = n * 4 + n * 2
        print(f"d{d} b{b} h{h} s{s} {'causal' if causal else 'full'}:")
        for name, ms in sorted(per.items(), key=lambda kv: -kv[1]):
            extra = ""
            if "preprocess" in name:
                extra = f"  {pre_bytes / 1e6:.0f} MB, {tbs(pre_bytes, ms):.2f} TB/s"
            elif "postprocess" in name:
                extra = f"  {post_bytes / 1e6:.0f} MB, {tbs(post_bytes, ms):.2f} TB/s"
            print(f"    {ms:.4f} ms  {name[:70]}{extra}")
        acc = torch.empty(n, device="cuda", dtype=torch.float32)
        half = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        both = torch.empty(2 * n, device="cuda", dtype=torch.bfloat16)
        ref = {
            "zero_ of dq_accum": (lambda: acc.zero_(), n * 4),
            "fp32 -> bf16 copy (postprocess's bytes)": (lambda: half.copy_(acc), n * 6),
            "sum over O + dO's bytes": (lambda: both.sum(dtype=torch.float32), n * 4),
        }
        for label, (fn, nbytes) in ref.items():
            ms = sum(kernel_ms(fn, a.reps).values())
            print(f"    torch {label}: {ms:.4f} ms, {tbs(nbytes, ms):.2f} TB/s")
        del q, k, v, do, o, lse, acc, half, both
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
