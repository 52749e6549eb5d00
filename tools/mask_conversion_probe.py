"""What torch 2.11 hands cuDNN for a boolean SDPA mask (eager result and compiled graph)."""
import torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
torch.manual_seed(0)
q, k, v = (torch.randn(1, 2, 256, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
m = torch.ones(256, 256, dtype=torch.bool, device="cuda").tril()
m[5] = False  # a row with no visible key
with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
for fill in (float("-inf"), -65504.0):
    bias = torch.zeros(256, 256, device="cuda", dtype=torch.bfloat16).masked_fill(~m, fill)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        ob = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    print(f"eager cuDNN, bool mask vs a {fill} bias: max diff {(o.float() - ob.float()).abs().max().item():.3e}")
seen = []
def spy(graph):
    for n in graph.nodes:
        if n.op == "call_function" and "where" in str(n.target):
            seen.append((str(n.target), [a if not isinstance(a, torch.fx.Node) else
                                         (a.name, str(a.target), a.args) for a in n.args]))
        if n.op == "call_function" and "cudnn" in str(n.target):
            seen.append((str(n.target), None))
torch._inductor.config.post_grad_custom_post_pass = spy
torch._inductor.config.joint_custom_pre_pass = None
qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
mask = torch.ones(256, 256, dtype=torch.bool, device="cuda").tril()
def f(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
out = torch.compile(f)(qq, kk, vv, mask)
out.sum().backward()
for s in seen: print(s)
