"""Kernel-level breakdown of one torch.ops.torch_sm90_sdpa.sdpa_backward call (GPU machine):
    python benchmarks/profile_bwd.py [B H S D]
"""
import math
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import torch_sm90_sdpa  # noqa: F401

b, h, s, d = (int(x) for x in (sys.argv[1:5] if len(sys.argv) > 4 else (4, 16, 4096, 128)))
causal = True
q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(4))
o, lse = torch.ops.torch_sm90_sdpa.sdpa(q, k, v, causal, 1 / math.sqrt(d), False)


def f():
    return torch.ops.torch_sm90_sdpa.sdpa_backward(do, q, k, v, o, lse, causal, 1 / math.sqrt(d), False)


for _ in range(3):
    f()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
    for _ in range(5):
        f()
    torch.cuda.synchronize()
print(p.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=70))
