"""Scheduling sections of causal calls (GPU machine): the main kernel with the launch's rule for
the head groups per section (`launch_bwd_main`: as many as fill half the L2, rounded down to a
power of two for causal and masked calls) against a forced count (TORCH_SM90_SDPA_SECTION_HEADS,
read per call), in interleaved rounds, beside a list-scheduling model of the tile order.

The model: the scheduler's tiles in order (sections of `hps` heads, key-block major inside, the
key blocks with the most m-blocks first), each taken by the first SM to free up (persistent
CTAs take tiles from a counter, one-tile CTAs are handed out by the hardware in launch order);
a tile costs its m-blocks plus `--fixed` m-blocks (a CTA's cost outside its m-loop, about two:
tools/cta_cost_probe.py). It prints makespan / (total work / SMs): 1.00 is a perfect balance.
    python tools/section_probe.py [--rows 128:8:16:1024,...] [--sections 0,old] [--rounds 3]
A row is D:B:H:S (bf16, MHA, is_causal, Sq = Sk = S); a section side is 0 (the launch's rule,
the variable unset), `old` (the L2 count before its power-of-two rounding) or a number.
"""
import argparse
import heapq
import os
import statistics
import sys

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "csrc")]
from profile_bwd import kernel_ms  # noqa: E402
from generate_instantiations import dense_tile  # noqa: E402

import torch_sm90_sdpa  # noqa: E402,F401  (registers the ops)

ENV = "TORCH_SM90_SDPA_SECTION_HEADS"
DEFAULT_ROWS = ("64:16:32:1024,64:8:32:2048,128:16:16:1024,128:8:16:2048,128:4:16:4096,"
                "128:2:16:8192,256:32:8:512,256:16:8:1024,256:8:8:2048,256:4:8:4096")


def l2_section_heads(d, s, heads, l2_bytes):
    """The L2 rule's head count per section (MHA, 16-bit, Sq = Sk = s), before rounding."""
    per_head = d * 2 * 4 * s  # Q, dO, K, V rows of one head
    return max(1, min(heads, (l2_bytes // 2) // per_head))


def pow2_floor(x):
    p = 1
    while p * 2 <= x:
        p *= 2
    return p


def model_balance(n_blocks, heads, hps, m_per_block, sms, fixed):
    """makespan / ideal of the causal tile order with sections of hps heads (above)."""
    tiles = []
    for first in range(0, heads, hps):
        here = min(hps, heads - first)
        for n in range(n_blocks):
            tiles += [(n_blocks - n) * m_per_block + fixed] * here
    free = [0.0] * sms
    end = 0.0
    for t in tiles:
        f = heapq.heappop(free) + t
        end = max(end, f)
        heapq.heappush(free, f)
    return end / (sum(tiles) / sms)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=DEFAULT_ROWS)
    ap.add_argument("--sections", default="0,old", help="sides, comma-separated: 0, old, or N")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--fixed", type=float, default=2.0, help="model: a CTA's fixed cost, m-blocks")
    a = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    sms, l2 = props.multi_processor_count, props.L2_cache_size
    ops = torch.ops.torch_sm90_sdpa
    print(f"{torch.cuda.get_device_name()}, {sms} SMs, L2 {l2 >> 20} MiB; bf16 MHA is_causal; "
          f"main-kernel ms (profiler, mean of {a.reps}) per round, sides interleaved")
    os.environ.pop(ENV, None)
    for row in a.rows.split(","):
        d, b, h, s = (int(x) for x in row.split(":"))
        # the tile run_bwd_main picks (the full tile from 769 queries where there is one)
        tile = dense_tile(d, s)
        heads, n_blocks = b * h, -(-s // tile.block_n)
        old = l2_section_heads(d, s, heads, l2)
        sides = []
        for side in a.sections.split(","):
            hps = pow2_floor(old) if side == "0" else old if side == "old" else int(side)
            sides.append((side, hps))
        q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        scale = d ** -0.5
        o, lse = ops.sdpa(q, k, v, True, scale, False)
        times = {side: [] for side, _ in sides}
        for _ in range(a.rounds):
            for side, hps in sides:
                if side == "0":
                    os.environ.pop(ENV, None)
                else:
                    os.environ[ENV] = str(hps)
                per = kernel_ms(lambda: ops.sdpa_backward(do, q, k, v, o, lse, True, scale, False), a.reps)
                times[side].append(sum(ms for name, ms in per.items() if "bwd_main_kernel" in name))
        os.environ.pop(ENV, None)
        base = statistics.median(times[sides[0][0]])
        cells = []
        for side, hps in sides:
            model = model_balance(n_blocks, heads, hps, tile.block_n / tile.block_m, sms, a.fixed)
            med = statistics.median(times[side])
            cells.append(f"{side}={hps} heads: model {model:.3f}, ms "
                         + " ".join(f"{t:.3f}" for t in times[side]) + f" (x{med / base:.3f})")
        print(f"d{d} b{b} h{h} s{s} ({heads} heads, {n_blocks} key blocks): " + "; ".join(cells),
              flush=True)


if __name__ == "__main__":
    main()
