"""Host-side cost of one torch.ops.torch_sm90_sdpa.sdpa_backward call, split by layer.

A tiny problem (its kernels take a few microseconds) called back to back: the wall time per
call is then the host path. Layers: the whole op (dispatcher + checks + backend), the CUDA
backend function alone, and _C.backward alone with prefilled params.

    python benchmarks/host_overhead.py
"""
import time

import torch

import torch_sm90_sdpa  # noqa: F401
from torch_sm90_sdpa import _cuda_backend, _validation


def per_call_us(fn, n=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main():
    q, k, v, do = (torch.randn(1, 2, 128, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = torch.ops.torch_sm90_sdpa.sdpa(q, k, v, True, 0.088, False)
    args = (do, q, k, v, out, lse, True, 0.088, False)
    params, ws = _cuda_backend.make_params(*args[:6], is_causal=True, scale=0.088,
                                           dq=torch.empty_like(q), dk=torch.empty_like(k),
                                           dv=torch.empty_like(v))
    C = _cuda_backend._module()
    stream = torch.cuda.current_stream().cuda_stream
    rows = [
        ("torch.ops.torch_sm90_sdpa.sdpa_backward", lambda: torch.ops.torch_sm90_sdpa.sdpa_backward(*args)),
        ("input checks (_validation)", lambda: _validation.check_backward_inputs(*args[:6], 0.088)),
        ("_cuda_backend.sdpa_backward_cuda", lambda: _cuda_backend.sdpa_backward_cuda(*args)),
        ("_C.backward (params prefilled)", lambda: C.backward(params, stream)),
        ("aten cudnn backward (reference point)", None),
    ]
    o = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=0.088)
    rows[-1] = (rows[-1][0], lambda: torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        do, q, k, v, o[0], o[1], o[6], o[7], None, o[2], o[3], o[4], o[5], 0.0, True, scale=0.088))
    print("host cost per call (B=1, H=2, S=128, D=128, bf16; kernels take a few us):")
    for name, fn in rows:
        print(f"  {per_call_us(fn):8.1f} us  {name}")


if __name__ == "__main__":
    main()
