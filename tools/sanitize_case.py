"""One small backward per case, for compute-sanitizer (memcheck / racecheck) on the GPU machine:
    compute-sanitizer --tool racecheck python3 tools/sanitize_case.py
"""
import torch

import torch_sm90_sdpa  # noqa: F401

CASES = [  # (B, Hq, Hkv, Sq, Sk, D, causal): MHA and GQA epilogues, both tile families
    (1, 2, 2, 200, 200, 128, True),
    (1, 4, 2, 130, 77, 64, False),
    (1, 4, 2, 150, 150, 256, True),
    (1, 2, 2, 100, 190, 192, False),
]
for b, hq, hkv, sq, sk, d, causal in CASES:
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, hkv, sk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out, lse = torch.ops.torch_sm90_sdpa.sdpa(q, k, v, causal, d ** -0.5, True)
    grads = torch.ops.torch_sm90_sdpa.sdpa_backward(torch.randn_like(out), q, k, v, out, lse, causal, d ** -0.5, False)
    torch.cuda.synchronize()
    print("case", (b, hq, hkv, sq, sk, d, causal), "finite:", all(g.isfinite().all().item() for g in grads))
