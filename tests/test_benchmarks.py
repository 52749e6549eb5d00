"""The benchmarks' pure parts on CPU: the rows benchmarks/bench_bwd.py plans beyond the grid,
its ratios and geometric means, which of its rows tools/speed_table.py takes for the gate,
BENCHMARKS.md as tools/benchmarks_md.py writes it, and the readers of Nsight Compute's pages
(tools/ncu_top_instructions.py, tools/ncu_summary.py)."""
import importlib.util
import json
import math
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # (bench_bwd's own imports)
bench_bwd = _load("bench_bwd_under_test", "benchmarks/bench_bwd.py")
speed_table_tool = _load("speed_table_tool_under_test", "tools/speed_table.py")


def test_extra_rows_are_the_rows_issue_8_asks_for():
    rows = bench_bwd.extra_rows()
    gqa = {(hq, hkv) for _, _, hq, hkv, s, d, causal, _ in rows if hq != hkv}
    assert gqa == {(32, 4), (32, 1), (16, 8)}  # (16 / 8: the compiled GPT's attention)
    dims = {d for *_, d, _, _ in rows}
    assert {96, 192, 128} <= dims
    assert any(dtype == torch.float16 for *_, dtype in rows)
    assert {1000, 4097} <= {s for _, _, _, _, s, *_ in rows}
    for label, b, hq, hkv, s, d, causal, dtype in rows:
        assert 12288 <= b * s <= 16384 and hq % hkv == 0, label  # about 16k tokens per batch
        assert hq * d <= 4096 if hq != hkv else hq * d <= 2048, label  # GQA: 32 q heads as the grid's, or the GPT's 16
        assert ("causal" in label) == causal
    both = {(d, s, dtype, causal) for _, _, hq, hkv, s, d, causal, dtype in rows if hq == hkv}
    assert all((d, s, dtype, not c) in both for d, s, dtype, c in both)  # full and causal each
    assert not any(hq != hkv for _, _, hq, hkv, *_ in bench_bwd.extra_rows(gqa=False))
    assert len(bench_bwd.extra_rows(quick=True)) < len(rows)


def test_ratios_and_geometric_means():
    r = bench_bwd.ours_over_stock({"ours": 300.0, "cudnn": 400.0, "flash": 200.0})
    assert r == {"cudnn": 0.75, "flash": 1.5, "best": 0.75}
    assert bench_bwd.ours_over_stock({"cudnn": 400.0}) == {}
    g = bench_bwd.geomeans([r, {"cudnn": 1.0 / 0.75, "best": 1.0}])
    assert math.isclose(g["cudnn"][0], 1.0) and g["cudnn"][1] == 2
    assert math.isclose(g["best"][0], math.sqrt(0.75)) and g["flash"] == (1.5, 1)
    assert "efficient" not in g


def test_fa4_is_a_peer_not_a_stock_backend():
    """--fa4's column gets its own ratio, but "best" (and the speed gate) compare with stock."""
    r = bench_bwd.ours_over_stock({"ours": 300.0, "cudnn": 400.0, "fa4": 600.0})
    assert r == {"cudnn": 0.75, "fa4": 0.5, "best": 0.75}
    assert bench_bwd.ours_over_stock({"ours": 300.0, "fa4": 600.0}) == {"fa4": 0.5}
    assert bench_bwd.geomeans([r])["fa4"] == (0.5, 1)
    assert "fa4" not in bench_bwd.ratio_keys(bench_bwd.BACKENDS)
    assert bench_bwd.ratio_keys(dict(bench_bwd.BACKENDS, fa4=bench_bwd.PEERS["fa4"]))[-1] == "fa4"


def test_speed_table_takes_only_bf16_rows_of_bench_bwd():
    row = dict(head_dim=128, causal=True, seqlen=2048, batch=8, heads=16, kv_heads=16,
               masked=False, tflops={"ours": 400.0, "cudnn": 380.0})
    result = {"meta": {"bench": "bench_bwd"},
              "rows": [dict(row, dtype="fp16", tflops={"ours": 100.0, "cudnn": 400.0}),
                       dict(row, dtype="bf16"), dict(row, seqlen=4096)]}  # (old rows: no dtype)
    got = list(speed_table_tool.rows_of(result, 0))
    assert [(g["seqlen"], g["speedup"]) for g in got] == [(2048, round(400 / 380, 4)),
                                                          (4096, round(400 / 380, 4))]


def test_dv_pair_rows_keep_their_v_head_dim_in_the_speed_table():
    """bench_bwd --dv-pairs 192x128: rows of the grid's shapes at D with Dv; their JSON rows
    carry head_dim_v, which the gate's table keeps (a case of its own: the slowest-row rule
    does not mix them with D's rows) and BENCHMARKS.md's table prints as DxDv."""
    assert bench_bwd.parse_dv_pairs("192x128, 256X128") == [(192, 128), (256, 128)]
    assert bench_bwd.parse_dv_pairs("") == []
    for bad in ("192", "192x192", "ax128"):
        with pytest.raises(ValueError):
            bench_bwd.parse_dv_pairs(bad)
    rows = bench_bwd.dv_pair_rows([(192, 128)], [2048, 8192])
    assert len(rows) == 4 and all(r[5] == 192 and r[8] == 128 for r in rows)
    assert rows[0][1:5] == (8, 10, 10, 2048) and rows[0][0].startswith("d=192x128 full")
    row = dict(head_dim=192, causal=False, seqlen=2048, batch=8, heads=10, kv_heads=10,
               masked=False, dtype="bf16", tflops={"ours": 300.0, "cudnn": 400.0})
    result = {"meta": {"bench": "bench_bwd"},
              "rows": [dict(row, head_dim_v=128), row, dict(row, head_dim_v=192)]}
    got = list(speed_table_tool.rows_of(result, 0))
    assert [(g["head_dim"], g.get("head_dim_v"), g["speedup"]) for g in got] == [
        (192, 128, 0.75), (192, None, 0.75), (192, None, 0.75)]
    faster = dict(row, head_dim_v=128, tflops={"ours": 500.0, "cudnn": 400.0})
    result = {"meta": {"bench": "bench_bwd", "device": "X"}, "rows": [faster, row]}
    table = {}
    for r in speed_table_tool.rows_of(result, 0):
        speed_table_tool._keep_slowest(table, r)
    assert sorted((r.get("head_dim_v", 0), r["speedup"]) for r in table.values()) == [
        (0, 0.75), (128, 1.25)]
    assert benchmarks_md._head_dim(dict(row, head_dim_v=128)) == "192x128"
    assert benchmarks_md._head_dim(row) == "192"
    assert benchmarks_md._key(dict(row, head_dim_v=128)) != benchmarks_md._key(row)


def test_speed_table_keeps_the_slowest_row_of_a_case(tmp_path):
    row = dict(head_dim=128, causal=True, seqlen=8192, batch=2, heads=32, masked=False,
               dtype="bf16")
    first = {"meta": {"bench": "bench_bwd"},
             "rows": [dict(row, kv_heads=8, tflops={"ours": 420.0, "cudnn": 400.0}),
                      dict(row, kv_heads=1, tflops={"ours": 404.0, "cudnn": 400.0}),
                      dict(row, kv_heads=4, tflops={"ours": 412.0, "cudnn": 400.0}),
                      dict(row, kv_heads=32, tflops={"ours": 300.0, "cudnn": 400.0})]}
    later = {"meta": {"bench": "bench_bwd"},
             "rows": [dict(row, kv_heads=32, tflops={"ours": 440.0, "cudnn": 400.0}),  # faster
                      dict(row, kv_heads=2, tflops={"ours": 408.0, "cudnn": 400.0})]}
    paths = []
    for i, result in enumerate((first, later)):
        paths.append(str(tmp_path / f"r{i}.json"))
        with open(paths[-1], "w") as f:
            json.dump(result, f)
    sources, rows, _ = speed_table_tool.build(paths)
    got = {(r["gqa"], r["walk"]): (r["speedup"], r["source"]) for r in rows}
    # per code path, the slowest ratio: GQA walked by groups of 4 (kv 8: 1024 kv-head key-block
    # CTAs) and of 8 (kv 4: 512 CTAs) each their own; GQA with accumulators (kv 1, kv 2: 128 and
    # 256 CTAs) the first file's kv 1, not its last row nor the later file's; MHA the first file's
    assert got == {(True, 4): (1.05, 0), (True, 8): (1.03, 0), (True, 1): (1.01, 0),
                   (False, 1): (0.75, 0)}


def test_speed_table_keeps_each_gpu_models_rows(tmp_path):
    """One case measured on two GPU models keeps a row per model (the gate picks the call's),
    each the slowest of that model's runs."""
    row = dict(head_dim=128, causal=False, seqlen=2048, batch=8, heads=16, kv_heads=16,
               masked=False, dtype="bf16")
    runs = [("NVIDIA H200", 420.0), ("NVIDIA H200", 410.0), ("NVIDIA H100 80GB HBM3", 390.0)]
    paths = []
    for i, (device, ours) in enumerate(runs):
        paths.append(str(tmp_path / f"r{i}.json"))
        with open(paths[-1], "w") as f:
            json.dump({"meta": {"bench": "bench_bwd", "device": device},
                       "rows": [dict(row, tflops={"ours": ours, "cudnn": 400.0})]}, f)
    _, rows, _ = speed_table_tool.build(paths)
    assert [(r["device"], r["speedup"], r["source"]) for r in rows] == [
        ("NVIDIA H100 80GB HBM3", 0.975, 2), ("NVIDIA H200", 1.025, 1)]


def test_speed_table_runs_file_lists_existing_results(tmp_path):
    listed = speed_table_tool.read_runs_file()
    assert listed and len(set(listed)) == len(listed)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert all(os.path.isfile(os.path.join(root, p)) for p in listed), listed
    (tmp_path / "runs.txt").write_text("# a comment\n\na.json  # why\n  b.json head_dims=128,64\n")
    assert speed_table_tool.read_runs_file(str(tmp_path / "runs.txt")) == ["a.json", "b.json"]
    assert speed_table_tool.read_runs(str(tmp_path / "runs.txt")) == [("a.json", None),
                                                                       ("b.json", (64, 128))]
    (tmp_path / "bad.txt").write_text("a.json dims=64\n")
    with pytest.raises(ValueError, match="unknown option"):
        speed_table_tool.read_runs(str(tmp_path / "bad.txt"))


def test_speed_table_sources_name_the_kept_file_in_their_command():
    meta = {"command": "benchmarks/bench_bwd.py --extra --json /root/out/x.json --quick"}
    assert speed_table_tool.command_of(meta, "benchmarks/results/y.json") == (
        "benchmarks/bench_bwd.py --extra --json benchmarks/results/y.json --quick")


def test_speed_table_takes_only_the_head_dims_a_run_is_restricted_to(tmp_path):
    row = dict(causal=True, seqlen=2048, batch=8, heads=16, kv_heads=16, masked=False,
               dtype="bf16", tflops={"ours": 300.0, "cudnn": 400.0})
    path = str(tmp_path / "r.json")
    with open(path, "w") as f:
        json.dump({"meta": {"bench": "bench_bwd", "device": "NVIDIA H200"},
                   "rows": [dict(row, head_dim=128), dict(row, head_dim=256)]}, f)
    sources, rows, _ = speed_table_tool.build([(path, (128,))])
    assert [r["head_dim"] for r in rows] == [128] and sources[0]["head_dims"] == [128]
    sources, rows, _ = speed_table_tool.build([path])
    assert [r["head_dim"] for r in rows] == [128, 256] and "head_dims" not in sources[0]


def test_speed_table_files_gqa_rows_by_the_walk_they_ran():
    """A row that records heads_per_cta is filed by it; older rows by the rule of their commits
    (kv-head key-block CTAs >= 512, tile width 128 at d128, 64 at d256)."""
    row = dict(head_dim=128, causal=True, seqlen=8192, batch=2, heads=32, kv_heads=8,
               masked=False, dtype="bf16", tflops={"ours": 420.0, "cudnn": 400.0})
    walk = lambda r: next(speed_table_tool.rows_of({"meta": {"bench": "bench_bwd"}, "rows": [r]}, 0))["walk"]
    assert walk(row) == 4 and walk(dict(row, kv_heads=2)) == 1  # 1024 / 256 CTAs
    assert walk(dict(row, heads_per_cta=1)) == 1 and walk(dict(row, kv_heads=2, heads_per_cta=16)) == 16
    assert walk(dict(row, heads=8)) == 1  # MHA
    assert walk(dict(row, head_dim=256, kv_heads=2, seqlen=8192)) == 16  # 2 * 2 * 128 CTAs of 64 keys
    assert walk(dict(row, head_dim=256, kv_heads=2, seqlen=4096)) == 1


benchmarks_md = _load("benchmarks_md_under_test", "tools/benchmarks_md.py")


def test_benchmarks_md_is_what_the_script_prints():
    """BENCHMARKS.md is generated (python3 tools/benchmarks_md.py -o BENCHMARKS.md) from the
    result files the speed table is built from: nobody edited its tables by hand."""
    with open(os.path.join(ROOT, "BENCHMARKS.md")) as f:
        assert f.read() == benchmarks_md.render()


def test_benchmarks_md_shows_each_gpus_newest_pair_and_every_masks_file():
    runs = speed_table_tool.read_runs_file()
    bwd, masks = benchmarks_md.select(runs)
    assert masks == [p for p in runs if "/bench_masks_" in p]
    assert [device for device, _, _ in bwd][0] == "NVIDIA H200"
    for device, sync, b2b in bwd:
        same_gpu = [p for p in runs if "/bench_bwd_" in p
                    and benchmarks_md._load(p)["meta"]["device"] == device]
        assert sync == [p for p in same_gpu if p.endswith("_sync.json")][-1]
        assert b2b == [p for p in same_gpu if p.endswith("_b2b.json")][-1]
    text = benchmarks_md.render()
    for path in [p for _, s, b in bwd for p in (s, b)] + masks:
        assert f"--json {path}`" in text  # each table names the command of its file
    assert "docs/bench_bwd.png" in text and os.path.isfile(os.path.join(ROOT, "docs", "bench_bwd.png"))


def test_result_files_are_named_by_gpu_commit_and_mode():
    """benchmarks/results/ holds the runs list and the files it names, named by benchmark, GPU,
    commit and mode (sync / b2b) or head dim, and the Dv != D backward, forward and
    transformers-step results (BENCHMARKS.md's other tables), named by benchmark, GPU and
    commit."""
    listed = speed_table_tool.read_runs_file()
    here = sorted(os.listdir(os.path.join(ROOT, "benchmarks", "results")))
    others = [n for n in here if n.startswith(("bench_fwd_", "bench_transformers_", "bench_bwd_dv_"))]
    assert sorted(set(here) - set(others)) == sorted(
        [os.path.basename(p) for p in listed if not any(
            other in p for other in ("/bench_fwd_", "/bench_bwd_dv_"))] + ["speed_table_runs.txt"])
    for name in others:
        meta = benchmarks_md._load(f"benchmarks/results/{name}")["meta"]
        gpu = "h200" if "H200" in meta["device"] else "h100"
        bench = next(b for b in ("bench_fwd", "bench_transformers", "bench_bwd_dv")
                     if name.startswith(b + "_"))
        assert name.startswith(f"{bench}_{gpu}_{meta['commit']}"), name
    for path in [p for p in listed if "/bench_fwd_" not in p and "/bench_bwd_dv_" not in p]:
        # (the forward's and the Dv pair's: named with the others above)
        meta = benchmarks_md._load(path)["meta"]
        name = os.path.basename(path)
        gpu = "h200" if "H200" in meta["device"] else "h100"
        if meta["bench"] == "bench_bwd":
            mode = "b2b" if "--batched" in meta["command"] else "sync"
            assert name.startswith(f"bench_bwd_{gpu}_") and name.endswith(f"_{mode}.json"), name
        else:
            assert name.startswith(f"bench_masks_{gpu}_{meta['commit']}_d"), name


plot_bwd = _load("plot_bwd_under_test", "tools/plot_bwd.py")


def test_plot_series_are_the_grid_rows_by_head_dim_and_length():
    row = dict(head_dim=128, causal=False, seqlen=4096, batch=4, heads=16, kv_heads=16,
               masked=False, tflops={"ours": 500.0, "cudnn": 520.0})
    rows = [row, dict(row, seqlen=1024, tflops={"ours": 400.0}),
            dict(row, causal=True, tflops={"ours": 450.0}),
            dict(row, dtype="fp16"), dict(row, heads=32, kv_heads=8), dict(row, head_dim=64)]
    got = plot_bwd.series(rows)
    assert sorted(got) == [64, 128]
    assert got[128][("ours", "full")] == [(1024, 400.0), (4096, 500.0)]  # sorted by length
    assert got[128][("ours", "causal")] == [(4096, 450.0)]
    assert got[128][("cudnn", "full")] == [(4096, 520.0)]  # fp16 and GQA rows left out
    only = plot_bwd.series([dict(row, tflops={"ours": 1.0, "dropin": 2.0})], plot_bwd.PLOTTED)
    assert list(only[128]) == [("ours", "full")]  # the public paths' columns are not drawn


def test_dropin_column_times_the_drop_in_backward():
    """--dropin's column runs the drop-in's backward (our op, reached through autograd) and its
    gradients are SDPA's; a call the drop-in hands to stock is refused, not timed as ours."""
    torch.manual_seed(0)
    b, hq, hkv, s, d = 1, 4, 2, 24, 16
    q = torch.randn(b, hq, s, d, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, s, d, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(b, hq, s, d, dtype=torch.float64)
    scale = 0.3
    for causal in (False, True):
        grads = bench_bwd.backend_dropin(q, k, v, dout, causal, scale)()
        qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(
            qr, kr, vr, is_causal=causal, scale=scale, enable_gqa=True)
        expected = torch.autograd.grad(ref, (qr, kr, vr), dout)
        for got, want, name in zip(grads, expected, ("dq", "dk", "dv")):
            torch.testing.assert_close(got, want, msg=f"{name}, causal={causal}")
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the drop-in falls back under autocast
        try:
            bench_bwd.backend_dropin(q.float(), k.float(), v.float(), dout.float(), False, scale)
        except RuntimeError as exc:
            assert "fell back" in str(exc)
        else:
            raise AssertionError("a call the drop-in does not serve was timed as ours")


def test_dropin_is_a_column_of_its_own_not_stock():
    r = bench_bwd.ours_over_stock({"ours": 500.0, "cudnn": 400.0, "dropin": 490.0})
    assert math.isclose(r["dropin"], 500.0 / 490.0) and r["best"] == 1.25
    assert "dropin" not in bench_bwd.ratio_keys(bench_bwd.BACKENDS)
    assert "dropin" in bench_bwd.ratio_keys(dict(bench_bwd.BACKENDS, dropin=None))


def test_public_paths_ratio_and_its_agreement_with_the_op():
    """--dropin's two public columns: "public" is the drop-in over cuDNN's public path, "agree"
    that ratio over the op-level ours / cudnn (1.0 when both paths cost the same over the op)."""
    tf = {"ours": 500.0, "cudnn": 400.0, "dropin": 450.0, "cudnn_sdpa": 380.0}
    r = bench_bwd.ours_over_stock(tf)
    assert math.isclose(r["public"], 450.0 / 380.0)
    assert math.isclose(r["agree"], (450.0 / 380.0) / (500.0 / 400.0))
    assert math.isclose(r["cudnn_sdpa"], 500.0 / 380.0) and r["best"] == 1.25  # never stock
    assert "public" not in bench_bwd.ours_over_stock({"ours": 500.0, "cudnn": 400.0, "dropin": 450.0})
    both = dict(bench_bwd.BACKENDS, dropin=None, cudnn_sdpa=None)
    assert bench_bwd.ratio_keys(both)[-2:] == ("public", "agree")
    assert "public" not in bench_bwd.ratio_keys(dict(bench_bwd.BACKENDS, dropin=None))
    g = bench_bwd.geomeans([r, bench_bwd.ours_over_stock(dict(tf, dropin=500.0))])
    assert math.isclose(g["agree"][0], math.sqrt(r["agree"] * (500.0 / 380.0) / 1.25))


def test_batched_samples_time_calls_back_to_back(monkeypatch):
    """--batched N: each sample is N calls between one pair of events, reported per call; the
    columns still take their samples in turn, the order rotated each round. (CUDA events replaced by a clock that every call
    of a timed function advances by its cost.)"""
    clock = [0.0]
    order = []

    class FakeEvent:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            self.t = clock[0]

        def elapsed_time(self, end):
            return end.t - self.t

    monkeypatch.setattr(bench_bwd.torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(bench_bwd.torch.cuda, "synchronize", lambda: None)

    def cost(name, ms):
        def fn():
            clock[0] += ms
            order.append(name)
        return fn

    fns = {"a": cost("a", 1.0), "b": cost("b", 3.0)}
    got = bench_bwd.time_interleaved(fns, reps=3, warmup=1, calls=4)
    assert got == {"a": 1.0, "b": 3.0}  # ms per call, not per sample
    # warmup, then the rounds, each starting one column later
    assert order == ["a", "b"] + ["a"] * 4 + ["b"] * 4 + ["b"] * 4 + ["a"] * 4 + ["a"] * 4 + ["b"] * 4
    order.clear()
    fns["c"] = cost("c", 2.0)
    assert bench_bwd.time_interleaved(fns, reps=3, warmup=0) == {"a": 1.0, "b": 3.0, "c": 2.0}
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]  # one synchronized call per sample


def test_ab_env_column_runs_ours_with_the_variable_set(monkeypatch):
    """--ab-env VAR=VALUE: the ours_env column calls our op with VAR=VALUE in the environment
    (the device layer reads its switches again on each change) and restores VAR after each call, also when
    the call raises; its gradients are the op's; its ratio column is ours over it."""
    seen = []
    real_ours = bench_bwd.backend_ours

    def spy_ours(*args):
        run = real_ours(*args)

        def call():
            seen.append(os.environ.get("TORCH_SM90_SDPA_PERSISTENT"))
            return run()
        return call

    monkeypatch.setattr(bench_bwd, "backend_ours", spy_ours)
    monkeypatch.setenv("TORCH_SM90_SDPA_PERSISTENT", "0")
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, 2, 20, 16, dtype=torch.float64) for _ in range(4))
    run = bench_bwd.backend_ours_env("TORCH_SM90_SDPA_PERSISTENT", "1")(q, k, v, dout, True, 0.25)
    grads = run()
    want = bench_bwd.backend_ours(q, k, v, dout, True, 0.25)()
    assert seen == ["1", "0"] and os.environ["TORCH_SM90_SDPA_PERSISTENT"] == "0"
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref)
    monkeypatch.delenv("TORCH_SM90_SDPA_PERSISTENT")

    def failing(*args):
        def call():
            raise RuntimeError("boom")
        return call
    monkeypatch.setattr(bench_bwd, "backend_ours", failing)
    run = bench_bwd.backend_ours_env("TORCH_SM90_SDPA_PERSISTENT", "1")(q, k, v, dout, True, 0.25)
    try:
        run()
    except RuntimeError:
        pass
    assert "TORCH_SM90_SDPA_PERSISTENT" not in os.environ
    r = bench_bwd.ours_over_stock({"ours": 500.0, "cudnn": 400.0, "ours_env": 520.0})
    assert math.isclose(r["ours_env"], 500.0 / 520.0) and r["best"] == 1.25
    assert "ours_env" in bench_bwd.ratio_keys(dict(bench_bwd.BACKENDS, ours_env=None))
    assert "ours_env" not in bench_bwd.ratio_keys(bench_bwd.BACKENDS)


ncu_top = _load("ncu_top_instructions_under_test", "tools/ncu_top_instructions.py")
ncu_summary = _load("ncu_summary_under_test", "tools/ncu_summary.py")


def _write_csv(path, rows):
    import csv
    with open(path, "w", newline="") as f:
        csv.writer(f, quoting=csv.QUOTE_ALL).writerows(rows)
    return str(path)


def test_ncu_opcode_mix_reads_the_kernel_that_executed_most(tmp_path, capsys, monkeypatch):
    # a source page of two kernels (a preprocess, then the main kernel): the mix is the main one's,
    # summed by opcode, predicates and operands dropped
    head = ["Address", "Source", "Instructions Executed", "Warp Stall Sampling (All Samples)"]
    page = [head, ["0", "LDG.E R0, [R2.64] ;", "10", "1"],
            head, ["0", "HGMMA.64x128x16.F32.BF16 R88, gdesc[UR16], RZ ;", "400", "9"],
            ["10", "@P0 LDS.64 R4, [R2] ;", "300", "5"], ["20", "LDS.64 R6, [R2+0x8] ;", "100", "2"]]
    path = _write_csv(tmp_path / "source.csv", page)
    monkeypatch.setattr(sys, "argv", ["ncu_top_instructions.py", path, "--opcodes", "--top", "2"])
    assert ncu_top.main() == 0
    out = capsys.readouterr().out
    assert "2 kernel(s) on the page" in out and "LDG" not in out
    mix = out.split("by opcode")[1].split("==")[0]
    assert "400  50.0%  HGMMA.64x128x16.F32.BF16" in mix and "400  50.0%  LDS.64" in mix


def test_ncu_summary_headlines_and_stalls(tmp_path, capsys):
    head = ["ID", "Kernel Name", "Section Name", "Metric Name", "Metric Unit", "Metric Value"]
    details = [head, ["0", "pre_kernel", "SOL", "Duration", "us", "70.1"],
               ["0", "pre_kernel", "SOL", "DRAM Frequency", "GHz", "3.2"],
               ["1", "main_kernel", "SOL", "Duration", "ms", "4.59"],
               ["1", "main_kernel", "Launch", "Grid Size", "", "4,096"]]
    ncu_summary.details(_write_csv(tmp_path / "details.csv", details), "1_fa4")
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("kernel 1: pre_kernel") and out[2].endswith("kernel 2: main_kernel")
    assert [ln.split()[1] for ln in out if "]" in ln and "kernel" not in ln] == ["Duration", "Duration", "Grid"]
    assert not any("Frequency" in ln for ln in out)  # only the headline metrics
    stall = "smsp__pcsamp_warps_issue_stalled_"
    raw = [["ID", "gpu__time_duration.sum", stall + "barrier", stall + "barrier_not_issued", stall + "wait",
            "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"],
           ["", "ns", "", "", "", "%"],  # the units row
           ["0", "70000", "900", "5", "100", "0"], ["1", "4590000", "30", "7", "10", "63.6"]]
    ncu_summary.raw(_write_csv(tmp_path / "raw.csv", raw))
    out = capsys.readouterr().out
    assert "barrier" in out and "75.0%" in out and "25.0%" in out  # the longest kernel's 30 / 10
    assert "_not_issued" not in out and "63.6%" in out


def test_forward_rows_take_a_mask_that_hides_nothing(tmp_path):
    """FORWARD_ROWS: a row's speedup is that of an all-True mask (measured in the full row where
    the file has it, else bounded from the causal row), or the causal mask's where lower."""
    full = dict(d=128, hq=16, hkv=4, b=8, s=2048, causal=False,
                ms={"ours": 0.8, "cudnn": 0.5})
    causal = dict(full, causal=True, ms={"ours": 0.5, "cudnn": 0.33, "cudnn_mask": 0.96,
                                          "ours_mask": 0.54})
    meta = {"device": "NVIDIA H100 80GB HBM3", "command": "benchmarks/bench_fwd.py --json x.json"}

    def rows_of(result):
        path = tmp_path / "fwd.json"
        path.write_text(json.dumps(result))
        sources, rows, forward = speed_table_tool.build([str(path)])
        assert rows == [] and sources[0]["file"] == str(path)
        return [(r["head_dim"], r["seqlen"], r["speedup"], r["causal_mask_speedup"])
                for r in forward]

    # no dense columns (files before them): cuDNN 0.96 / (our full 0.8 + the mask's 0.04)
    assert rows_of({"meta": meta, "rows": [full, causal]}) == [(128, 2048, 1.1429, 1.7778)]
    measured = dict(full, ms=dict(full["ms"], cudnn_mask_dense=0.95, ours_mask_dense=0.86))
    assert rows_of({"meta": dict(meta, bench="bench_fwd"), "rows": [measured, causal]}) == [
        (128, 2048, 1.1047, 1.7778)]
    slow_causal = dict(causal, ms=dict(causal["ms"], ours_mask=1.0))
    assert rows_of({"meta": meta, "rows": [measured, slow_causal]}) == [(128, 2048, 0.96, 0.96)]


def test_bench_fwd_ab_columns_parse_and_refuse_the_kernel_switch():
    bench_fwd = _load("bench_fwd", "benchmarks/bench_fwd.py")
    assert bench_fwd.parse_ab(["per_tile:TORCH_SM90_SDPA_FWD_PERSISTENT=0",
                               "both:A=1,B=x=y"]) == {
        "per_tile": {"TORCH_SM90_SDPA_FWD_PERSISTENT": "0"}, "both": {"A": "1", "B": "x=y"}}
    for bad in ["noequals", ":A=1", "in_turn:TORCH_SM90_SDPA_FWD_OVERLAP=0"]:
        with pytest.raises(SystemExit, match="--ab"):
            bench_fwd.parse_ab([bad])


def test_host_overhead_profile_prints_ops_and_python_functions(capsys):
    """benchmarks/host_overhead.py --profile: per row, the ops by self CPU time (torch.profiler)
    and the Python functions by their own time (cProfile), over the calls asked for."""
    host_overhead = _load("host_overhead_under_test", "benchmarks/host_overhead.py")
    a = torch.randn(4, 4, requires_grad=True)
    calls = []

    def row():
        calls.append(1)
        return torch.autograd.grad((a @ a).sum(), a)

    host_overhead.profile_rows({"matmul and its gradient": row}, 7, lambda: None, cuda=False, top=5)
    text = capsys.readouterr().out
    assert len(calls) == 14  # the calls asked for, under each profiler
    assert "== matmul and its gradient: 7 calls under torch.profiler" in text
    assert "aten::mm" in text and "Self CPU" in text
    assert "== matmul and its gradient: 7 calls under cProfile" in text
    assert "autograd/__init__.py" in text and "(grad)" in text


def test_profile_fwd_takes_the_modes_asked_for():
    """benchmarks/profile_fwd.py --modes: one or more of causal / bool / bias / full, in order
    (full only when asked for); an unknown mode is an argument error (ncu's cases name one mode
    each)."""
    profile_fwd = _load("profile_fwd_under_test", "benchmarks/profile_fwd.py")
    args = profile_fwd.parse_args(["--modes", "bool", "--once", "--s", "8192"])
    assert args.modes == ["bool"] and args.once and args.s == 8192
    assert profile_fwd.parse_args([]).modes == ["causal", "bool", "bias"]
    assert profile_fwd.parse_args(["--modes", "full,causal"]).modes == ["full", "causal"]
    with pytest.raises(SystemExit):
        profile_fwd.parse_args(["--modes", "causal,alibi"])


def test_profile_bwd_takes_the_deterministic_mode():
    """benchmarks/profile_bwd.py --deterministic (for ncu of the deterministic main kernel)."""
    profile_bwd = _load("profile_bwd_under_test", "benchmarks/profile_bwd.py")
    assert profile_bwd.parse_args(["--deterministic", "--once"]).deterministic
    assert not profile_bwd.parse_args([]).deterministic
