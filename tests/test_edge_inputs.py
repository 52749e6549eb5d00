"""Every public entry point against stock SDPA on a seeded generator of calls (CPU): empty and
size-1 batch, heads, query / key lengths and head dims, GQA ratios, Sq != Sk, is_causal,
dtypes, layouts and masks (tests/sdpa_cases.py). Same result as stock within 2x stock's error
against float64, or a refusal where stock refuses too; the drop-in gives stock's answer with
and without grad."""
import pytest
import torch
import torch.nn.functional as F

import torch_sm90_sdpa
from sdpa_cases import check_case, random_cases

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
CHUNKS, PER_CHUNK = 8, 50


@pytest.mark.parametrize("chunk", range(CHUNKS))
@pytest.mark.parametrize("grad_mode", [True, False], ids=["grad", "no_grad"])
def test_entry_points_match_stock_on_random_calls(chunk, grad_mode):
    failures = []
    for case in random_cases(PER_CHUNK, seed=chunk, dtypes=DTYPES, head_dims=(1, 4, 8, 16)):
        problems = check_case(case, "cpu", grad_mode=grad_mode)
        if problems:
            failures.append(f"{case}: {'; '.join(problems)}")
    assert not failures, "\n".join(failures)


EMPTY_SHAPES = {  # (B, Hq, Hkv, Sq, Sk, D)
    "no query": (2, 4, 2, 0, 5, 8),
    "no key": (2, 4, 2, 5, 0, 8),
    "no query, no key": (2, 4, 2, 0, 0, 8),
    "no batch": (0, 4, 2, 5, 5, 8),
    "no head": (2, 0, 0, 5, 5, 8),
    "no kv head": (2, 4, 0, 5, 5, 8),
    "one query, one key": (1, 1, 1, 1, 1, 8),
}


@pytest.mark.parametrize("masked", [False, True], ids=["no mask", "bool mask"])
@pytest.mark.parametrize("name", list(EMPTY_SHAPES))
def test_empty_sizes_give_stocks_result(name, masked):
    """The shapes that ended the interpreter (a private CPU kernel fed no key): every entry
    point returns stock's result, forward and backward."""
    b, hq, hkv, sq, sk, d = EMPTY_SHAPES[name]
    q, k, v = (torch.randn(b, h, s, d) for h, s in ((hq, sq), (hkv, sk), (hkv, sk)))
    mask = torch.rand(sq, sk) > 0.5 if masked else None
    ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
    if hkv == 0:  # stock before torch 2.13 ends the process here; 2.13 gives zeros
        ref = torch.zeros(b, hq, sq, d)
        for t in (ql, kl, vl):
            t.grad = torch.zeros_like(t)
    else:
        ref = F.scaled_dot_product_attention(ql, kl, vl, attn_mask=mask, enable_gqa=True)
        ref.backward(torch.ones_like(ref))
    for fn in (torch_sm90_sdpa.scaled_dot_product_attention,
               lambda q, k, v, **kw: torch.ops.torch_sm90_sdpa.sdpa(
                   q, k, v, False, None, True, kw["attn_mask"])[0]):
        qo, ko, vo = (t.clone().requires_grad_() for t in (q, k, v))
        out = fn(qo, ko, vo, attn_mask=mask, enable_gqa=True)
        out.backward(torch.ones_like(out))
        torch.testing.assert_close(out, ref)
        for ours, stock in zip((qo, ko, vo), (ql, kl, vl)):
            torch.testing.assert_close(ours.grad, stock.grad)


@pytest.mark.parametrize("name", ["no query", "no key", "no batch", "one query, one key"])
def test_compile_route_with_empty_sizes(name):
    """torch.compile with the CPU route on: stock's result and gradients. Stock's forward makes
    no fused node for an empty size (nothing to route); a 1 x 1 call is routed to our op.
    (No key head is left out: the compiled graph keeps stock's forward, which ends the process
    there before torch 2.13.)"""
    b, hq, hkv, sq, sk, d = EMPTY_SHAPES[name]
    q, k, v = (torch.randn(b, h, s, d) for h, s in ((hq, sq), (hkv, sk), (hkv, sk)))
    weight = torch.randn(b, hq, sq, d)  # (a sum's expanded gradient is not routed)

    def f(q, k, v):
        return (F.scaled_dot_product_attention(q, k, v, enable_gqa=True) * weight).sum()

    grads = []
    for compiled in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if compiled:
            torch._dynamo.reset()
            torch_sm90_sdpa.routing.reset_stats()
            with torch_sm90_sdpa.enable(cpu=True):
                loss = torch.compile(f, dynamic=False)(*leaves)
                loss.backward()
            routed = torch_sm90_sdpa.routing_stats()["routed_calls"]
            assert routed == (1 if name == "one query, one key" else 0)
        else:
            loss = f(*leaves)
            loss.backward()
        grads.append([loss.detach()] + [t.grad for t in leaves])
    for ours, stock in zip(grads[1], grads[0]):
        torch.testing.assert_close(ours, stock)
