"""Kernel-level breakdown of torch.ops.torch_sm90_sdpa.sdpa_backward calls (GPU machine): the
device time of every kernel per call, for is_causal and for a causal mask passed as a bias
(so the cost of the mask path shows kernel by kernel), or for no mask and an all-zero bias
(--mask zeros: every tile full, the masked kernel's cost where it has no mask work):
    python benchmarks/profile_bwd.py [--b 2 --h 16 --kv-heads 4 --s 16384 --d 128] [--mask zeros]
                                     [--deterministic]
--deterministic runs every mode in the deterministic mode (docs/DETERMINISM.md).
--once calls each mode once, unprofiled (for Nsight Compute: tools/gpu.sh ncu).
Per mode it also prints where a call's time goes when it is timed as bench_bwd / bench_masks
time it (CUDA events around one call on an idle GPU, median): event wall, the GPU span from the
first kernel's start to the last one's end, the kernels' own time, so wall - span is the host's
time before the first launch (and event overhead), span - kernels the gaps between kernels.
"""
import statistics
import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

import torch_sm90_sdpa  # noqa: F401


def kernel_ms(fn, reps, launches=False):
    """{kernel name: device ms per call}, from the profiler's CUDA kernel events; with
    launches, {kernel name: (device ms per call, launches per call)}."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per_kernel = collections.defaultdict(float)
    count = collections.Counter()
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[e.name] += e.device_time / 1e3 / reps
            count[e.name] += 1
    if launches:
        return {k: (ms, count[k] // reps) for k, ms in per_kernel.items()}
    return dict(per_kernel)


def call_spans(fn, reps):
    """(event wall, GPU span, kernel sum) ms per call, medians over reps calls each timed alone
    with CUDA events (as the benchmarks time them), kernels from the profiler's events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    walls = []
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(reps):
            st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            st.record()
            fn()
            en.record()
            torch.cuda.synchronize()
            walls.append(st.elapsed_time(en))
    kernels = sorted((e.time_range.start, e.time_range.end) for e in p.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    if not kernels or len(kernels) % reps:
        return statistics.median(walls), float("nan"), float("nan")
    per = len(kernels) // reps
    calls = [kernels[i * per:(i + 1) * per] for i in range(reps)]
    spans = [(c[-1][1] - c[0][0]) / 1e3 for c in calls]
    sums = [sum(e - b for b, e in c) / 1e3 for c in calls]
    return statistics.median(walls), statistics.median(spans), statistics.median(sums)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--b", type=int, default=2)
    ap.add_argument("--h", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--s", type=int, default=16384)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--fill", choices=["inf", "cudnn"], default="cudnn",
                    help="masked bias entries: -inf, or -65504 as torch hands cuDNN a bool mask")
    ap.add_argument("--mask", choices=["causal", "zeros"], default="causal",
                    help="causal: is_causal vs a causal bias; zeros: no mask vs an all-zero bias")
    ap.add_argument("--deterministic", action="store_true",
                    help="every mode in the kernel's deterministic mode")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--once", action="store_true", help="one call per mode, no profiler (for ncu)")
    return ap.parse_args(argv)


def main():
    args = parse_args()
    b, h, s, d = args.b, args.h, args.s, args.d
    hkv = args.kv_heads or h
    scale = d ** -0.5
    q, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    i = torch.arange(s, device="cuda")
    fill = float("-inf") if args.fill == "inf" else -65504.0
    causal = args.mask == "causal"
    bias = torch.zeros(s, s, device="cuda", dtype=torch.bfloat16)
    if causal:
        bias = bias.masked_fill(i[None, :] > i[:, None], fill)
    bias = bias[None, None].expand(b, 1, s, s)  # [B, 1, S, S], as transformers passes it
    o, lse = torch.ops.torch_sm90_sdpa.sdpa(q, k, v, causal, scale, hkv != h)

    ops = torch.ops.torch_sm90_sdpa
    det = args.deterministic
    modes = {
        ("is_causal" if causal else "no mask"):
            lambda: ops.sdpa_backward(do, q, k, v, o, lse, causal, scale, det),
        ("causal bias" if causal else "zero bias"):
            lambda: ops.sdpa_backward(do, q, k, v, o, lse, False, scale, det, bias),
    }
    if args.once:
        for fn in modes.values():
            fn()
        torch.cuda.synchronize()
        return
    print(f"{torch.cuda.get_device_name()}, b{b} h{h}/{hkv} s{s} d{d}, {args.mask} bias, fill {args.fill}"
          f"{', deterministic' if det else ''}; "
          f"device ms per call (mean of {args.reps})")
    for name, fn in modes.items():
        per_kernel = kernel_ms(fn, args.reps)
        print(f"-- {name}: total {sum(per_kernel.values()):.3f} ms")
        for kname, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1]):
            print(f"   {ms:8.3f}  {kname[:110]}")
    print(f"one call at a time (median of {max(args.reps, 10)}): event wall / GPU span / kernels ms")
    for name, fn in modes.items():
        wall, span, kern = call_spans(fn, max(args.reps, 10))
        print(f"   {wall:8.3f} / {span:8.3f} / {kern:8.3f}  {name}")


if __name__ == "__main__":
    main()
