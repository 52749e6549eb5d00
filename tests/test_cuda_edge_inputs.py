"""The generator of tests/test_edge_inputs.py on an SM90 GPU, for the kernels: every public
entry point against stock SDPA (same result within 2x stock's error against float64, or a
refusal where stock refuses), fp16 / bf16, the compiled head dims plus one served by stock,
lengths across several tiles, empty and size-1 sizes, masks, GQA, causal, layouts."""
import pytest
import torch

from conftest import requires_sm90
from sdpa_cases import check_case, random_cases
from torch_sm90_sdpa import _extension

pytestmark = [pytest.mark.gpu, requires_sm90]

CHUNKS, PER_CHUNK = 6, 25


def _head_dims():
    built = [d for d in (64, 96, 128, 192, 256)
             if any(_extension.has_variant(d, dt) for dt in (torch.float16, torch.bfloat16))]
    return tuple(built) + (8,)  # d8: no kernel, the drop-in's stock path


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_entry_points_match_stock_on_random_cuda_calls(chunk):
    failures = []
    for case in random_cases(PER_CHUNK, seed=1000 + chunk,
                             dtypes=(torch.bfloat16, torch.float16),
                             head_dims=_head_dims(), max_seqlen=300):
        problems = check_case(case, "cuda")
        if problems:
            failures.append(f"{case}: {'; '.join(problems)}")
    assert not failures, "\n".join(failures)
