"""Small backward and forward calls for compute-sanitizer (memcheck / racecheck) on the GPU machine:
    compute-sanitizer --tool racecheck python3 tools/sanitize_case.py
MHA and GQA epilogues, both tile families, masked calls (bool and additive masks, with
empty, partial and full tiles, broadcast over heads and batch), and the deterministic mode
(its dQ turn counters; GQA's per-q-head dK / dV; a mask) on three of them, a finite-fill
bias (the score-bound pass of the classification), a bias of bf16's minimum with rows that see
only that fill (their tagged lse_log2 and the weights of the fill rows), three calls of more tiles than SMs (with
TORCH_SM90_SDPA_PERSISTENT=1 in the environment, CTAs that take several tiles; d256's epilogue
stores through the dQ staging tile), and three full calls whose last partial wave is split
into pieces (TORCH_SM90_SDPA_SPLIT_TAIL=1, set here: fragments of tiles, their fp32 sums and
counts), and the forward kernel (sdpa_forward) on eighteen calls (three of more tiles than SMs:
persistent CTAs), two or more per head dim,
masked ones included (four with a bias of 0 / bf16's minimum and rows that see only that
fill: query blocks of the overlap and of the in-turn kernel in one call) (the masked backward cases of head dims with a forward kernel also run it,
through `sdpa`), each with both forward kernels (TORCH_SM90_SDPA_FWD_OVERLAP 0 and 1). The GQA
cases run twice: with one q head per CTA and with each CTA walking its group
(TORCH_SM90_SDPA_GQA_WALK=1, read per call). The (192, 128) pair (v head dim 128, D as a
tuple (D, Dv) below): MHA, GQA, a mask, deterministic, persistent and a split tail.
Cases of head dims that were not built (TORCH_SM90_SDPA_HEAD_DIMS) are skipped and counted; the
last line says how many ran (none ran: exit status 1, so an A/B build of other head dims cannot
pass for a checked one)."""
import os

import torch

import torch_sm90_sdpa  # noqa: F401
from torch_sm90_sdpa import _extension

CASES = [  # (B, Hq, Hkv, Sq, Sk, D or (D, Dv), causal, mask, deterministic)
    (1, 2, 2, 200, 200, 128, True, None, False),
    (1, 4, 2, 130, 77, 64, False, None, False),
    (1, 4, 2, 150, 150, 256, True, None, False),
    (1, 2, 2, 100, 190, 192, False, None, False),
    (1, 2, 2, 1000, 300, 128, False, None, False),  # the d128 full tile: 80-row blocks past 1024
    (2, 2, 2, 300, 300, 128, False, "padding bool [B,1,S,S]", False),
    (2, 4, 2, 260, 260, 64, False, "sliding-window bias [S,S]", False),
    (2, 2, 1, 200, 333, 256, True, "key padding bool [B,1,1,Sk]", False),
    (2, 2, 2, 300, 300, 128, False, "cudnn-fill causal bias [B,1,S,S]", False),
    # rows of bf16's minimum only: their lse_log2 tagged, the per-element step's second pass
    (2, 4, 2, 300, 300, 128, False, "transformers-fill bias [B,1,S,S]", False),
    (1, 2, 2, 200, 200, 128, True, None, True),
    (1, 4, 2, 130, 77, 64, False, None, True),
    (2, 4, 2, 260, 260, 64, False, "sliding-window bias [S,S]", True),
    # more tiles than SMs: persistent CTAs (TORCH_SM90_SDPA_PERSISTENT=1) take several, with
    # key blocks that see no query between them (causal, Sk > Sq)
    (2, 16, 16, 700, 1100, 128, True, None, False),
    (2, 16, 16, 1000, 1000, 64, False, "padding bool [B,1,S,S]", False),
    # d256's persistent epilogue: dK, then dV, through the dQ staging tile
    (2, 8, 8, 700, 1100, 256, True, None, False),
    # full attention, 320 tiles on 132 SMs: the last 56 split into 132 pieces (split tail)
    (1, 5, 5, 640, 8192, 128, False, None, False),
    (1, 5, 5, 512, 8192, 64, False, None, False),
    (1, 5, 5, 512, 8192, 256, False, None, False),  # 640 tiles: the last 112 split
    # Dv != D: the 192x128 pair (TILES_DV)
    (1, 2, 2, 100, 190, (192, 128), False, None, False),
    (1, 4, 2, 130, 77, (192, 128), True, None, False),
    (2, 4, 2, 300, 300, (192, 128), False, "padding bool [B,1,S,S]", False),
    (1, 4, 2, 130, 77, (192, 128), True, None, True),
    (2, 16, 16, 700, 1100, (192, 128), True, None, False),
    (1, 5, 5, 640, 8192, (192, 128), False, None, False),  # 640 tiles: the last 112 split
]
# (structural only: the other cases are causal, masked or too small to split)
os.environ["TORCH_SM90_SDPA_SPLIT_TAIL"] = "1"


def make_mask(kind, b, sq, sk):
    i = torch.arange(sq, device="cuda")[:, None]
    j = torch.arange(sk, device="cuda")[None, :]
    if kind.startswith("padding"):
        keep = (j <= i)[None, None].repeat(b, 1, 1, 1)
        keep[-1, ..., sk // 2:] = False
        return keep
    if kind.startswith("cudnn-fill"):  # torch 2.11's bool mask as cuDNN gets it: finite fill
        keep = (j <= i)[None, None].repeat(b, 1, 1, 1)
        return torch.zeros(b, 1, sq, sk, device="cuda", dtype=torch.bfloat16).masked_fill(~keep, -65504.0)
    if kind.startswith("transformers-fill"):  # causal, left padding, 0 / bf16's minimum
        keep = (j <= i)[None, None].repeat(b, 1, 1, 1)
        keep[-1, ..., : sk // 3] = False  # rows before the padding's end see only the fill
        return torch.zeros(b, 1, sq, sk, device="cuda", dtype=torch.bfloat16).masked_fill(
            ~keep, torch.finfo(torch.bfloat16).min)
    if kind.startswith("sliding"):
        keep = (j <= i) & (j > i - 64)
        return torch.zeros(sq, sk, device="cuda").masked_fill(~keep, float("-inf"))
    keep = torch.ones(b, 1, 1, sk, dtype=torch.bool, device="cuda")
    keep[0, ..., sk // 3:] = False
    return keep


# (deterministic mode never walks: its GQA cases run once)
RUNS = [(case, walk) for case in CASES
        for walk in (("0", "1") if case[1] != case[2] and not case[8] else ("0",))]
ran = skipped = 0
for (b, hq, hkv, sq, sk, d, causal, kind, deterministic), walk in RUNS:
    d, dv = (d, d) if isinstance(d, int) else d
    if not _extension.has_variant(d, torch.bfloat16, dv):
        skipped += 1
        continue
    ran += 1
    os.environ["TORCH_SM90_SDPA_GQA_WALK"] = walk
    _extension.reload_switches()  # (the device layer reads its switches once)
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, sk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, sk, dv, device="cuda", dtype=torch.bfloat16)
    mask = make_mask(kind, b, sq, sk) if kind else None
    out, lse = torch.ops.torch_sm90_sdpa.sdpa(q, k, v, causal, d ** -0.5, True, mask)
    grads = torch.ops.torch_sm90_sdpa.sdpa_backward(torch.randn_like(out), q, k, v, out, lse,
                                                    causal, d ** -0.5, deterministic, mask)
    torch.cuda.synchronize()
    print("case", (b, hq, hkv, sq, sk, d if dv == d else f"{d}x{dv}", causal, kind, deterministic), "walk", walk, "finite:",
          all(g.isfinite().all().item() for g in grads))
# the forward kernel (sdpa_forward): causal and full, GQA, odd lengths, Sq != Sk, masks
FWD_CASES = [(1, 4, 2, 130, 77, 64, True, None), (1, 2, 2, 300, 300, 128, False, None),
             (2, 4, 1, 200, 333, 128, True, None), (1, 2, 2, 1000, 64, 64, False, None),
             (2, 4, 2, 300, 300, 128, False, "padding bool [B,1,S,S]"),
             (2, 4, 2, 260, 260, 64, True, "sliding-window bias [S,S]"),
             (1, 4, 2, 130, 77, 96, True, None), (2, 4, 2, 300, 300, 96, False, "padding bool [B,1,S,S]"),
             # 64-key blocks: two per classified tile (the sliding window empties some halves)
             (1, 2, 2, 200, 333, 192, True, None), (2, 4, 2, 260, 260, 192, True, "sliding-window bias [S,S]"),
             (1, 4, 1, 150, 130, 256, False, None), (2, 2, 1, 200, 333, 256, True, "key padding bool [B,1,1,Sk]"),
             # the clamped fill hidden, rows of fill only: blocks of both kernels in one call
             (2, 4, 2, 300, 300, 128, False, "transformers-fill bias [B,1,S,S]"),
             (2, 4, 2, 260, 260, 64, False, "transformers-fill bias [B,1,S,S]"),
             (2, 4, 2, 300, 333, 192, True, "transformers-fill bias [B,1,S,S]"),
             # more tiles than SMs: persistent CTAs take several (the next tile's Q loaded
             # under the last one's epilogue), longest first; a fill's two kernels
             (2, 16, 4, 1100, 1100, 128, True, None), (2, 16, 4, 1100, 1100, 64, False, None),
             (2, 16, 4, 1100, 1100, 128, False, "transformers-fill bias [B,1,S,S]")]
has_fwd = getattr(_extension.load(), "has_fwd_variant", None)
for (b, hq, hkv, sq, sk, d, causal, kind), overlap in [(c, o) for c in FWD_CASES for o in "01"]:
    if has_fwd is None or not has_fwd(d, _extension.dtype_code(torch.bfloat16)):
        skipped += 1
        continue
    ran += 1
    os.environ["TORCH_SM90_SDPA_FWD_OVERLAP"] = overlap
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, hkv, sk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = make_mask(kind, b, sq, sk) if kind else None
    out, lse = torch.ops.torch_sm90_sdpa.sdpa_forward(q, k, v, causal, None, True, mask)
    torch.cuda.synchronize()
    print("forward case", (b, hq, hkv, sq, sk, d, causal, kind), "overlap", overlap, "finite:",
          out.isfinite().all().item())
print(f"sanitize_case: {ran} calls ran, {skipped} skipped (head dims not built)")
if ran == 0:
    raise SystemExit(1)
