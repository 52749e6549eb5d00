"""routing_stats(): its keys, and the one-paragraph summary (CPU route)."""
import os
import subprocess
import sys
import textwrap
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import torch_sm90_sdpa
from torch_sm90_sdpa import routing

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def weighted_loss(q, k, v, w):
    return (F.scaled_dot_product_attention(q, k, v, is_causal=True) * w).sum()


def inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g, requires_grad=True) for _ in range(3))
    return q, k, v, torch.randn(1, 2, 8, 16, generator=g)


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path):
    """A fresh Inductor cache dir: a graph cached by an earlier run would not be examined."""
    with mock.patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}):
        yield


def test_summary_after_a_compile():
    torch._dynamo.reset()
    routing.reset_stats()
    try:
        with torch_sm90_sdpa.enable(cpu=True):
            torch.compile(weighted_loss)(*inputs()).backward()
            stats = torch_sm90_sdpa.routing_stats()
            text = torch_sm90_sdpa.routing_stats(summary=True)
    finally:
        torch._dynamo.reset()
        routing.reset_stats()
    assert stats["routed_nodes"] == {"cpu": 1} and stats["not_routed"] == {}, stats
    assert stats["routed_calls"] == 1 and stats["routed_calls_by_device"] == {"cpu": 1}, stats
    assert stats["graphs_compiled"] >= 1, stats
    assert isinstance(text, str) and "\n" not in text
    assert text.startswith("Routing is on (CUDA and CPU calls"), text
    assert "routed 1 stock attention backward to torch_sm90_sdpa (1 CPU flash attention)" in text
    assert "kept none on stock" in text and "backward 1 time (1 on cpu)" in text, text
    assert routing.routing_summary() == routing.routing_stats(summary=True)


def test_summary_says_why_not_routed():
    """CPU calls with the CPU route off are kept, and the text says what would route them."""
    torch._dynamo.reset()
    routing.reset_stats()
    try:
        with torch_sm90_sdpa.enable():
            torch.compile(weighted_loss)(*inputs()).backward()
            stats = torch_sm90_sdpa.routing_stats()
            text = routing.routing_summary()
    finally:
        torch._dynamo.reset()
        routing.reset_stats()
    assert stats["routed_nodes"] == {} and stats["not_routed"] == {"CPU route off": 1}, stats
    assert "kept 1 on stock: 1 because CPU route off (enable(cpu=True) routes" in text, text


def test_summary_of_calls_from_cached_graphs():
    """routed_calls > 0 with routed_nodes == {}: the note and the summary say why."""
    stats = {**routing.routing_options(), "enabled": True, "cpu": True, "routed_calls": 6,
             "routed_calls_by_device": {"cpu": 6}, "routed_nodes": {}, "not_routed": {},
             "causal_masks": {}, "graphs_compiled": 0, "graphs_from_cache": 2}
    note = routing._note(stats)
    assert "served by torch.compile's cache (2 graph(s))" in note, note
    text = routing._summary_text(stats)
    assert "2 graphs came from torch.compile's cache" in text, text
    assert "backward 6 times (6 on cpu)" in text, text
    stats["graphs_from_cache"] = 0
    assert "before the last reset_stats()" in routing._note(stats)


def test_off_and_nothing_compiled():
    routing.reset_stats()
    stats = torch_sm90_sdpa.routing_stats()
    assert stats["note"] == "" and stats["graphs_from_cache"] == 0, stats
    text = torch_sm90_sdpa.routing_stats(summary=True)
    assert text.startswith("Routing is off: torch_sm90_sdpa.enable()"), text


def test_cache_hit_in_a_new_process(tmp_path):
    """The same compile in two processes sharing a cache dir: the second is served by the
    cache, its nodes are not examined, its calls are counted and the summary says so."""
    script = textwrap.dedent("""
        import torch, torch.nn.functional as F
        import torch_sm90_sdpa
        torch_sm90_sdpa.enable(cpu=True)
        def weighted_loss(q, k, v, w):
            return (F.scaled_dot_product_attention(q, k, v, is_causal=True) * w).sum()
        q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))
        torch.compile(weighted_loss)(q, k, v, torch.randn(1, 2, 8, 16)).backward()
        s = torch_sm90_sdpa.routing_stats()
        print(s["routed_calls"], s["routed_nodes"], s["graphs_from_cache"] > 0)
        print(torch_sm90_sdpa.routing_stats(summary=True))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_SM90_SDPA"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "cache")
    outs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stdout + out.stderr
        outs.append(out.stdout.splitlines())
    assert outs[0][0] == "1 {'cpu': 1} False", outs[0]
    assert outs[1][0] == "1 {} True", outs[1]
    assert "came from torch.compile's cache" in outs[1][1], outs[1][1]
    assert "backward 1 time (1 on cpu)" in outs[1][1], outs[1][1]


def test_summary_of_forward_nodes():
    """The forward sentence: what was routed, and why the rest stayed, with what would route
    them."""
    stats = dict(enabled=True, cpu=False, only_faster=True, forward=True, routed_nodes={"cudnn": 2},
                 not_routed={}, routed_forward_nodes={"cudnn": 1},
                 forward_not_routed={"stock forward is faster here": 2}, causal_masks={},
                 graphs_compiled=2, graphs_from_cache=0, routed_calls=0,
                 routed_calls_by_device={})
    text = routing._summary_text(stats)
    assert ("Forward nodes: 1 stock attention forward (1 cuDNN attention) routed to "
            "torch_sm90_sdpa, each with its backward where the graph held it; 2 kept on stock: "
            "2 because stock forward is faster here (enable(only_faster=False) routes them "
            "anyway).") in text, text
    off = routing._summary_text(dict(stats, forward=False, routed_forward_nodes={},
                                     forward_not_routed={}))
    assert ("Forward nodes stay on stock (enable(forward=False); enable() routes masked "
            "ones).") in off, off
