"""The build: build_info(), the instantiation generator, the torch-free _C bindings, and the
GPU machine's driver's packing of its logs (everything here runs on CPU; the kernels
themselves are tested in test_cuda_prepost.py)."""
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import load_generator
from torch_sm90_sdpa import _extension

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


gen = load_generator()
C = _extension.load()
needs_C = pytest.mark.skipif(C is None, reason=f"_C not loaded: {_extension.unavailable_reason()}")

INFO_KEYS = {"cuda_extension", "reason", "main_kernel_compiled", "variants", "arch",
             "nvcc_version", "cutlass_version", "build_flags"}


# ---- build_info ----------------------------------------------------------------------------

def test_build_info_keys_and_types():
    info = _extension.build_info()
    assert isinstance(info, dict)
    assert INFO_KEYS <= set(info)
    assert isinstance(info["cuda_extension"], bool)
    assert isinstance(info["main_kernel_compiled"], bool)
    assert isinstance(info["variants"], list)
    if info["cuda_extension"]:
        assert info["reason"] is None
        assert info["arch"] == "sm_90a"
        assert "sm_90a" in info["build_flags"]
        assert info["cutlass_version"].startswith("4.")
        assert info["nvcc_version"] != "unknown"
        assert info["main_kernel_compiled"] == bool(info["variants"])
        for dt, d in info["variants"]:
            assert dt in ("fp16", "bf16") and isinstance(d, int)
    else:
        assert isinstance(info["reason"], str) and info["reason"]
        assert info["variants"] == [] and info["main_kernel_compiled"] is False
    # the package's public build_info is this one
    import torch_sm90_sdpa
    assert torch_sm90_sdpa.build_info().keys() == info.keys()


def test_load_is_stable():
    assert _extension.load() is _extension.load()


def test_has_variant_without_kernel_is_false():
    assert _extension.has_variant(80, torch.bfloat16) is False
    assert _extension.has_variant(128, torch.float32) is False


@needs_C
def test_has_variant_agrees_with_build_info():
    info = _extension.build_info()
    compiled = {(d, dt) for dt, d in info["variants"]}
    for dt_name, dt, code in (("fp16", torch.float16, 0), ("bf16", torch.bfloat16, 1)):
        for d in (32, 64, 80, 96, 128, 160, 192, 256):
            want = (d, dt_name) in compiled
            assert _extension.has_variant(d, dt) is want, (d, dt_name)
            assert C.has_variant(d, code) is want, (d, dt_name)
    assert [tuple(v) for v in C.compiled_variants()] == info["variants"]


# ---- the generator ---------------------------------------------------------------------------

def test_parse_env_values():
    assert gen.parse_head_dims(None) == (64, 96, 128, 192, 256)  # pairs only on request
    # (D, Dv) pairs of TILES_DV: "DxDv" tokens, after D; "DxD" is D
    assert gen.parse_head_dims("192x128, 128") == (128, (192, 128))
    assert gen.parse_head_dims("192X128,192,192x192") == (192, (192, 128))
    assert gen.split_selection((128, (192, 128), 64)) == ((64, 128), ((192, 128),))
    assert gen.variants((128, (192, 128)), ("bf16",)) == [("bf16", 128)]
    assert gen.dv_variants((128, (192, 128)), ("fp16", "bf16")) == [("fp16", 192, 128),
                                                                     ("bf16", 192, 128)]
    assert gen.parse_dtypes(None) == ("fp16", "bf16")
    assert gen.parse_head_dims(" 128, 64,128") == (64, 128)
    assert gen.parse_head_dims("none") == () and gen.parse_head_dims("") == ()
    assert gen.parse_dtypes("bfloat16") == ("bf16",)
    assert gen.parse_dtypes("bf16,fp16") == ("fp16", "bf16")
    for bad in ("abc", "0", "65", "512", "192x64", "128x192", "192x128x2", "x128", "192x"):
        with pytest.raises(ValueError):
            gen.parse_head_dims(bad)
    with pytest.raises(ValueError):
        gen.parse_dtypes("fp32")


def test_generator_writes_a_file_per_kernel(tmp_path):
    """Per variant: the kernel without a mask with run_bwd_main, and the masked kernel; for the
    head dims of TILES_FULL the full-tile kernel too; for those of FWD_TILES the forward."""
    assert set(gen.TILES_FULL) <= set(gen.TILES) and 128 in gen.TILES_FULL and 64 not in gen.TILES_FULL
    paths = gen.generate(str(tmp_path), head_dims=(128, 64), dtypes=("bf16",), main_kernel=True)
    names = sorted(os.path.basename(p) for p in paths)
    assert names == ["bwd_main_bf16_hdim128.cu", "bwd_main_bf16_hdim128_full.cu",
                     "bwd_main_bf16_hdim128_masked.cu",
                     "bwd_main_bf16_hdim64.cu", "bwd_main_bf16_hdim64_masked.cu",
                     "fwd_main_bf16_hdim128.cu", "fwd_main_bf16_hdim64.cu"]
    assert sorted(os.listdir(tmp_path)) == names + ["fwd_tile_configs.h", "tile_configs.h",
                                                    "variants.h"]
    assert "run_fwd_main<DType::kBFloat16, 64>" in (tmp_path / "fwd_main_bf16_hdim64.cu").read_text()
    assert "X(kBFloat16, \"bf16\", 1, 64)" in (tmp_path / "variants.h").read_text().split(
        "FOR_EACH_FWD_VARIANT")[1]
    src = (tmp_path / "bwd_main_bf16_hdim64.cu").read_text()
    assert '#include "bwd_main_launch_template.h"' in src
    assert "template void run_bwd_main<DType::kBFloat16, 64>(const BwdParams&, cudaStream_t);" in src
    default64, full128 = "kernel::DefaultBwdConfig<64>", "kernel::FullBwdConfig<128>"
    assert f"\ntemplate void launch_bwd_main<DType::kBFloat16, 64, false, {default64}>(" in src
    assert f"extern template void launch_bwd_main<DType::kBFloat16, 64, true, {default64}>(" in src
    assert "FullBwdConfig" not in src  # d64 has no full-tile kernel
    masked = (tmp_path / "bwd_main_bf16_hdim64_masked.cu").read_text()
    assert f"\ntemplate void launch_bwd_main<DType::kBFloat16, 64, true, {default64}>(" in masked
    assert "run_bwd_main" not in masked and "false," not in masked
    src128 = (tmp_path / "bwd_main_bf16_hdim128.cu").read_text()
    assert f"extern template void launch_bwd_main<DType::kBFloat16, 128, false, {full128}>(" in src128
    full = (tmp_path / "bwd_main_bf16_hdim128_full.cu").read_text()
    assert f"\ntemplate void launch_bwd_main<DType::kBFloat16, 128, false, {full128}>(" in full
    assert "run_bwd_main" not in full and "true," not in full
    hdr = (tmp_path / "variants.h").read_text()
    assert "#define TORCH_SM90_SDPA_MAIN_KERNEL_COMPILED 1" in hdr
    assert 'X(kBFloat16, "bf16", 1, 64)' in hdr and 'X(kBFloat16, "bf16", 1, 128)' in hdr
    assert 'X(kFloat16' not in hdr
    tiles = (tmp_path / "tile_configs.h").read_text()
    for d in gen.TILES:  # every head dim's tile, compiled or not
        assert f"struct DefaultBwdConfig<{d}>" in tiles
        assert (f"struct FullBwdConfig<{d}>" in tiles) == (d in gen.TILES_FULL)

    # all defaults: 22 backward files (no pair), fp16 first, then the forward's
    paths = gen.generate(str(tmp_path))
    assert [os.path.basename(p) for p in paths] == [
        name for dt in ("fp16", "bf16") for name in
        [f"bwd_main_{dt}_hdim{d}{m}.cu" for d in (64, 96, 128, 192, 256)
         for m in (("", "_masked", "_full") if d == 128 else ("", "_masked"))]] + [
        f"fwd_main_{dt}_hdim{d}.cu" for dt in ("fp16", "bf16") for d in sorted(gen.FWD_TILES)]

    # with the pair requested: per dtype the head dims, then the pair's two files
    paths = gen.generate(str(tmp_path), head_dims=gen.parse_head_dims("64,192,192x128"),
                         dtypes=("bf16",))
    assert [os.path.basename(p) for p in paths] == [
        "bwd_main_bf16_hdim64.cu", "bwd_main_bf16_hdim64_masked.cu", "bwd_main_bf16_hdim192.cu",
        "bwd_main_bf16_hdim192_masked.cu", "bwd_main_bf16_hdim192x128.cu",
        "bwd_main_bf16_hdim192x128_masked.cu", "fwd_main_bf16_hdim64.cu",
        "fwd_main_bf16_hdim192.cu"]

    # a pair alone (no d192): its two files, DefaultBwdConfigDv, no forward kernel
    paths = gen.generate(str(tmp_path), head_dims=((192, 128),), dtypes=("bf16",))
    assert [os.path.basename(p) for p in paths] == ["bwd_main_bf16_hdim192x128.cu",
                                                    "bwd_main_bf16_hdim192x128_masked.cu"]
    pair_cfg = "kernel::DefaultBwdConfigDv<192, 128>"
    src = (tmp_path / "bwd_main_bf16_hdim192x128.cu").read_text()
    assert "template void run_bwd_main<DType::kBFloat16, 192, 128>(const BwdParams&, cudaStream_t);" in src
    assert f"\ntemplate void launch_bwd_main<DType::kBFloat16, 192, false, {pair_cfg}>(" in src
    assert f"extern template void launch_bwd_main<DType::kBFloat16, 192, true, {pair_cfg}>(" in src
    masked = (tmp_path / "bwd_main_bf16_hdim192x128_masked.cu").read_text()
    assert f"\ntemplate void launch_bwd_main<DType::kBFloat16, 192, true, {pair_cfg}>(" in masked
    hdr = (tmp_path / "variants.h").read_text()
    assert "#define TORCH_SM90_SDPA_MAIN_KERNEL_COMPILED 1" in hdr
    assert "#define TORCH_SM90_SDPA_NUM_VARIANTS 0" in hdr
    assert "#define TORCH_SM90_SDPA_NUM_DV_VARIANTS 1" in hdr
    assert 'X(kBFloat16, "bf16", 1, 192, 128)' in hdr.split("FOR_EACH_DV_VARIANT")[1]
    tiles = (tmp_path / "tile_configs.h").read_text()
    assert "struct DefaultBwdConfigDv<192, 128>" in tiles and ", 128> {};" in tiles

    # a narrower selection removes the files of the variants no longer built
    gen.generate(str(tmp_path), head_dims=(96,), dtypes=("fp16",))
    assert sorted(os.listdir(tmp_path)) == ["bwd_main_fp16_hdim96.cu", "bwd_main_fp16_hdim96_masked.cu",
                                            "fwd_main_fp16_hdim96.cu", "fwd_tile_configs.h",
                                            "tile_configs.h", "variants.h"]


def test_forward_tiles_cover_the_backward_head_dims():
    """Every head dim the backward builds has a forward kernel, and every forward tile can run
    the masked kernel: 128 query rows (the classification's tile rows, kFwdTile) and a key block
    that is a slice of a 128-key classified tile in whole 32-key words of its bits."""
    assert set(gen.FWD_TILES) == set(gen.TILES)
    for d, t in gen.FWD_TILES.items():
        assert t.block_m == 128, d
        assert 128 % t.block_n == 0 and t.block_n % 32 == 0, d
        assert t.stages >= 1, d
    configs = gen.fwd_tile_configs_header()
    for d, t in gen.FWD_TILES.items():
        assert (f"struct DefaultFwdConfig<{d}>\n    : FwdTileConfig<{d}, {t.block_m}, {t.block_n}, "
                f"{t.stages}>") in configs


def test_generator_without_main_kernel(tmp_path):
    paths = gen.generate(str(tmp_path), head_dims=(64,), dtypes=("fp16",), main_kernel=False)
    assert paths == []
    assert sorted(os.listdir(tmp_path)) == ["fwd_tile_configs.h", "tile_configs.h", "variants.h"]
    hdr = (tmp_path / "variants.h").read_text()
    assert "#define TORCH_SM90_SDPA_MAIN_KERNEL_COMPILED 0" in hdr
    assert "#define TORCH_SM90_SDPA_NUM_VARIANTS 0" in hdr


def test_generator_leaves_unchanged_files_alone(tmp_path):
    paths = gen.generate(str(tmp_path), head_dims=(64,), dtypes=("bf16",))
    assert len(paths) == 3  # the dense and the masked kernel, the forward
    for p in paths:
        os.utime(p, (1000, 1000))
    gen.generate(str(tmp_path), head_dims=(64,), dtypes=("bf16",))
    for p in paths:  # not rewritten: incremental builds stay incremental
        assert os.path.getmtime(p) == 1000


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_generated_headers_compile_into_a_dispatch(tmp_path):
    """variants.h and tile_configs.h compile against the real bwd_params.h / bwd_config.h."""
    inst = tmp_path / "instantiations"
    gen.generate(str(inst), head_dims=(64, 256), dtypes=("fp16", "bf16"))
    prog = tmp_path / "check.cpp"
    prog.write_text(
        '#include "instantiations/variants.h"\n'
        '#include "kernel/bwd_config.h"\n'
        "using sm90_sdpa::DType;\n"
        "template <DType T, int D> int run() {\n"
        "  return int(T) * 1000 + sm90_sdpa::kernel::DefaultBwdConfig<D>::kBlockN; }\n"
        "static_assert(sm90_sdpa::kernel::FullBwdConfig<128>::kHasFullTile &&\n"
        "              sm90_sdpa::kernel::FullBwdConfig<128>::kBlockM == 80 &&\n"
        "              sm90_sdpa::kernel::FullBwdConfig<128>::kdQSwapAB &&\n"
        "              !sm90_sdpa::kernel::FullBwdConfig<64>::kHasFullTile &&\n"
        "              sm90_sdpa::kernel::FullBwdConfig<64>::kBlockM == 128, \"full tiles\");\n"
        "using Pair = sm90_sdpa::kernel::BwdConfigs<192, 128>;\n"
        "static_assert(Pair::Default::kHeadDim == 192 && Pair::Default::kHeadDimV == 128 &&\n"
        "              Pair::Default::kBlockN == sm90_sdpa::kernel::DefaultBwdConfig<192>::kBlockN &&\n"
        "              !Pair::kHasFullTile && sm90_sdpa::kernel::BwdConfigs<128, 128>::kHasFullTile &&\n"
        "              sm90_sdpa::kernel::DefaultBwdConfig<192>::kHeadDimV == 192, \"pairs\");\n"
        "int dispatch(int dt, int d) {\n"
        "#define CASE(E, N, C, D) if (dt == C && d == D) return run<DType::E, D>();\n"
        "  TORCH_SM90_SDPA_FOR_EACH_VARIANT(CASE)\n  return -1;\n}\n"
        "int main() { return (dispatch(1, 256) == 1064 && dispatch(0, 64) == 128 &&\n"
        "                     dispatch(0, 128) == -1 && TORCH_SM90_SDPA_NUM_VARIANTS == 4) ? 0 : 1; }\n")
    exe = tmp_path / "check"
    subprocess.run(["g++", "-std=c++17", f"-I{tmp_path}", f"-I{os.path.join(ROOT, 'csrc')}",
                    str(prog), "-o", str(exe)], check=True)
    assert subprocess.run([str(exe)]).returncode == 0


def test_docs_tile_table_is_the_generators():
    """docs/KERNEL.md shows the tile table generated from TILES (the one source)."""
    with open(os.path.join(ROOT, "docs", "KERNEL.md"), encoding="utf-8") as f:
        doc = f.read()
    assert gen.tile_table_markdown() in doc, (
        "docs/KERNEL.md's tile table differs from csrc/generate_instantiations.py's TILES; "
        "regenerate it with `python csrc/generate_instantiations.py --docs`")


def test_build_config_matches_the_generator():
    """Python's tables come from the generator (through the build's _build_config)."""
    cfg = _extension._build_config()
    assert cfg is not None, "torch_sm90_sdpa/_build_config.py is generated by every build"
    assert cfg.DTYPE_CODES == {n: c for n, (_, c) in gen.DTYPES.items()}
    assert tuple(cfg.HEAD_DIMS) == gen.DEFAULT_HEAD_DIMS
    assert [_extension.dtype_code(d) for d in _extension.KERNEL_DTYPES] == list(
        cfg.DTYPE_CODES.values())
    if C is not None:
        assert dict(C.DTYPE_CODES) == cfg.DTYPE_CODES


def test_setup_py_import_writes_nothing(tmp_path):
    """Importing setup.py (what pip does to read metadata) generates no file."""
    watched = [os.path.join(ROOT, "csrc", "instantiations"), os.path.join(ROOT, "torch_sm90_sdpa")]
    before = {d: {f: os.path.getmtime(os.path.join(d, f)) for f in os.listdir(d)}
              for d in watched if os.path.isdir(d)}
    code = ("import runpy, sys, setuptools; setuptools.setup = lambda **kw: None; "
            f"sys.argv = ['setup.py']; runpy.run_path({os.path.join(ROOT, 'setup.py')!r})")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(tmp_path),
                   env={**os.environ, "TORCH_SM90_SDPA_HEAD_DIMS": "64"})
    after = {d: {f: os.path.getmtime(os.path.join(d, f)) for f in os.listdir(d)}
             for d in watched if os.path.isdir(d)}
    assert before == after


# ---- the GPU machine's driver (tools/gpu.sh) -----------------------------------------------

@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("tar") is None,
                    reason="needs bash and tar")
@pytest.mark.parametrize("pack", [False, True])
def test_gpu_driver_packs_its_logs_on_request(tmp_path, pack):
    """tools/gpu.sh with PACK=1 leaves OUTDIR.tar.gz beside OUTDIR (also when a step fails,
    with the script's exit status kept); without it, no archive. An unknown command fails at
    once, before any build or GPU work."""
    import tarfile

    out = tmp_path / "logs"
    env = dict(os.environ, GIT_COMMIT="test", PACK="1" if pack else "0")
    res = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu.sh"), "nosuch", str(out)],
                         env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "unknown command 'nosuch'" in (out / "summary.txt").read_text()
    archive = tmp_path / "logs.tar.gz"
    assert archive.exists() == pack
    if pack:
        with tarfile.open(archive) as tar:
            summary = tar.extractfile("logs/summary.txt").read().decode()
        assert "result: FAIL" in summary


# ---- the torch-free bindings (no GPU needed) ------------------------------------------------

@needs_C
def test_bwd_params_properties_round_trip():
    p = C.BwdParams()
    ints = ["batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k", "head_dim", "head_dim_v",
            "seqlen_q_rounded", "seqlen_k_rounded", "num_sms"]
    for i, name in enumerate(ints):
        setattr(p, name, 3 + i)
        assert getattr(p, name) == 3 + i
    tensors = ["q", "k", "v", "out", "dout", "lse", "dq", "dk", "dv"]
    for i, name in enumerate(tensors):
        ptr = (1 << 40) + 256 * i
        setattr(p, name, ptr)
        assert getattr(p, name) == ptr
        for j, kind in enumerate(("batch", "head", "row")):
            field = f"{name}_{kind}_stride"
            setattr(p, field, (1 << 33) + 7 * j + i)
            assert getattr(p, field) == (1 << 33) + 7 * j + i
    for i, name in enumerate(["dpsum", "lse_log2", "dq_accum", "dk_accum", "dv_accum"]):
        setattr(p, name, 4096 * (i + 1))
        assert getattr(p, name) == 4096 * (i + 1)
    p.dtype = 0
    assert p.dtype == 0
    p.dtype = 1
    assert p.dtype == 1
    with pytest.raises(ValueError):
        p.dtype = 2
    p.scale = 0.125
    assert p.scale == 0.125
    p.is_causal = True
    p.deterministic = True
    assert p.is_causal is True and p.deterministic is True
    q = p.copy()
    q.batch = 99
    assert p.batch == 3 and q.dk_accum == p.dk_accum
    assert "BwdParams(" in repr(p)
    assert C.SEQ_ROUND == 128 and dict(C.DTYPE_CODES) == {"fp16": 0, "bf16": 1}


@needs_C
def test_make_params_fills_every_field():
    from torch_sm90_sdpa import _cuda_backend as cb

    q = torch.randn(2, 40, 8, 64, dtype=torch.bfloat16).transpose(1, 2)  # BSHD view
    k = torch.randn(2, 2, 33, 64, dtype=torch.bfloat16)
    v = torch.randn(2, 2, 33, 64, dtype=torch.bfloat16)
    out, dout = torch.randn_like(q), torch.randn_like(q)
    lse = torch.randn(2, 8, 40, 1)[..., 0]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    p, ws = cb.make_params(dout, q, k, v, out, lse, True, 0.3, False, dq=dq, dk=dk, dv=dv)
    assert (p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_k) == (2, 8, 2, 40, 33)
    assert (p.head_dim, p.head_dim_v, p.seqlen_q_rounded, p.seqlen_k_rounded) == (64, 64, 128, 128)
    assert p.dtype == 1 and p.is_causal and not p.deterministic
    assert math.isclose(p.scale, 0.3, rel_tol=1e-7)
    assert math.isclose(p.scale_log2, 0.3 * math.log2(math.e), rel_tol=1e-7)
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout), ("lse", lse),
                    ("dq", dq), ("dk", dk), ("dv", dv)):
        assert getattr(p, name) == t.data_ptr(), name
        assert (getattr(p, f"{name}_batch_stride"), getattr(p, f"{name}_head_stride"),
                getattr(p, f"{name}_row_stride")) == t.stride()[:3], name
    assert p.dq_accum == ws.dq_accum.data_ptr() and p.dpsum == ws.dpsum.data_ptr()
    assert p.dk_accum == ws.dk_accum.data_ptr() and p.dv_accum == ws.dv_accum.data_ptr()
    assert p.lse_log2 == ws.lse_log2.data_ptr()
    assert ws.dq_accum.shape == (2, 8, 128, 64) and ws.dk_accum.shape == (2, 2, 128, 64)
    for t in (ws.dq_accum, ws.dk_accum, ws.dv_accum, ws.dpsum, ws.lse_log2):
        assert t.data_ptr() % 16 == 0 and t.is_contiguous()
    # the workspace pieces tile the allocation without overlap
    spans = sorted((t.data_ptr(), t.data_ptr() + 4 * t.numel())
                   for t in (ws.dq_accum, ws.dk_accum, ws.dv_accum, ws.dpsum, ws.lse_log2))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    # (the persistent CTAs' tile counter, 16 bytes, ends the allocation)
    assert spans[-1][1] - spans[0][0] == 4 * ws.buffer.numel() - 16
    assert p.tile_counter == ws.buffer.data_ptr() + 4 * ws.buffer.numel() - 16


@needs_C
def test_workspace_layout_mha_has_no_kv_accumulators():
    p = C.BwdProblem(batch=2, heads_q=4, heads_kv=4, seqlen_q=130, seqlen_k=7, head_dim=64,
                     head_dim_v=64, dtype=1)
    w = C.workspace_layout(p)
    sqr = 256
    assert not w.gqa and w.dk_accum == w.dv_accum == w.dpsum
    assert w.dpsum == 4 * 2 * 4 * sqr * 64 and w.lse_log2 == w.dpsum + 4 * 2 * 4 * sqr
    # last, the persistent CTAs' tile counter (16 bytes)
    assert w.tile_counter == w.lse_log2 + 4 * 2 * 4 * sqr and w.bytes == w.tile_counter + 16


@needs_C
def test_gqa_group_walk_decision(switch_env):
    """GQA in the default mode: one CTA walks its kv head's whole group of q heads
    (heads_per_cta; it stores dK / dV itself, so no fp32 accumulators are laid out) once the kv
    heads' key blocks make at least 512 CTAs (kMinGroupWalkCtas) and the group is at most 4
    heads (kMaxWalkGroup: walked groups of 8 measured slower), unless masked or deterministic.
    TORCH_SM90_SDPA_GQA_WALK=0 switches it off, =1 on whatever the CTA count and group size,
    under a mask shared by the heads (a per-head mask never walks) and in deterministic mode."""
    from torch_sm90_sdpa import _cuda_backend as cb

    d = 128  # (the decision reads the generated tile table, built variant or not)
    switch_env.delenv("TORCH_SM90_SDPA_GQA_WALK", raising=False)
    n = gen.TILES[d].block_n
    sk = 512 // 8 * n  # 8 kv heads x 64 key blocks: 512 CTAs

    def layout(hq, hkv, sk, deterministic=False, mask=None):
        q = torch.empty(1, hq, 1, d, dtype=torch.bfloat16)
        k = torch.empty(1, hkv, sk, d, dtype=torch.bfloat16)
        lse = torch.empty(1, hq, 1)
        return C.workspace_layout(cb.problem_of(q, q, k, k, q, lse, False, deterministic,
                                                attn_mask=mask))

    w = layout(32, 8, sk)
    assert w.heads_per_cta == 4 and not w.gqa
    assert w.dk_accum == w.dv_accum == w.dpsum  # no accumulators between dq_accum and dpsum
    fewer = layout(32, 8, sk - n)  # 504 CTAs
    assert fewer.heads_per_cta == 1 and fewer.gqa and fewer.dv_accum > fewer.dk_accum
    assert layout(32, 8, sk, deterministic=True).heads_per_cta == 1  # walked only when forced
    assert layout(8, 8, sk, deterministic=True).heads_per_cta == 1  # MHA
    assert layout(8, 8, sk).heads_per_cta == 1  # MHA
    assert layout(16, 8, sk).heads_per_cta == 2
    assert layout(64, 8, sk).heads_per_cta == 1  # a group of 8
    assert layout(32, 4, 2 * sk).heads_per_cta == 1  # a group of 8, 512 CTAs
    shared = torch.zeros(1, 1, 1, sk, dtype=torch.bool)
    per_head = torch.zeros(1, 32, 1, sk, dtype=torch.bool)
    assert layout(32, 8, sk, mask=shared).heads_per_cta == 1  # masked: only when forced
    assert layout(32, 8, sk, mask=per_head).heads_per_cta == 1
    switch_env.setenv("TORCH_SM90_SDPA_GQA_WALK", "0")
    assert layout(32, 8, sk).heads_per_cta == 1
    switch_env.setenv("TORCH_SM90_SDPA_GQA_WALK", "1")
    assert layout(32, 8, sk, mask=shared).heads_per_cta == 4
    assert layout(32, 8, sk, mask=per_head).heads_per_cta == 1
    assert layout(4, 2, 100).heads_per_cta == 2
    assert layout(32, 4, 2 * sk).heads_per_cta == 8  # forced: any group size
    assert layout(4, 2, 100, deterministic=True).heads_per_cta == 2  # forced: deterministic too
    assert layout(64, 8, sk, deterministic=True).heads_per_cta == 8
    assert layout(32, 8, sk, deterministic=True, mask=shared).heads_per_cta == 4
    assert layout(32, 8, sk, deterministic=True, mask=per_head).heads_per_cta == 1
    # make_params passes it on, with the accumulators null
    q = torch.randn(1, 4, 70, d, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 90, d, dtype=torch.bfloat16)
    p, ws = cb.make_params(q, q, k, k, q, torch.randn(1, 4, 70))
    assert p.heads_per_cta == 2 and p.dk_accum == p.dv_accum == 0 and ws.dk_accum is None


def _split_problem(b, hq, hkv, sq, sk, d, num_sms=132, head_dim_v=None, **kw):
    return C.BwdProblem(batch=b, heads_q=hq, heads_kv=hkv, seqlen_q=sq, seqlen_k=sk, head_dim=d,
                        head_dim_v=d if head_dim_v is None else head_dim_v, dtype=1,
                        num_sms=num_sms, **kw)


@needs_C
def test_split_tail_plan(switch_env):
    """The split tail (BwdParams.split_tiles, split_tail_tiles in bwd_device.h): full attention
    on persistent CTAs deals its last T mod P tiles as P pieces, where that saves at least
    SPLIT_MIN_SAVED_BLOCKS m-blocks per SM; never for causal, masked or deterministic calls,
    GQA with fp32 accumulators, fewer than 2 P tiles, r = 0, or an unknown SM count (every head
    dim, d256 included: its epilogue stores through the dQ staging tile in turn).
    TORCH_SM90_SDPA_SPLIT_TAIL=0 plans none, =1 every structural case."""
    for var in ("TORCH_SM90_SDPA_SPLIT_TAIL", "TORCH_SM90_SDPA_PERSISTENT", "TORCH_SM90_SDPA_GQA_WALK"):
        switch_env.delenv(var, raising=False)
    plan = lambda *a, **kw: C.workspace_layout(_split_problem(*a, **kw)).split_tiles  # noqa: E731
    bn, bm = gen.TILES[128].block_n, gen.TILES[128].block_m
    tiles = 8192 // bn * 32  # the FA grid's d128 rows: b2 h16 s8192
    assert plan(2, 16, 16, 8192, 8192, 128) == tiles % 132 == 68
    assert plan(2, 16, 16, 8192, 8192, 128, num_sms=0) == 0
    assert plan(2, 16, 16, 8192, 8192, 128, is_causal=True) == 0
    assert plan(2, 16, 16, 8192, 8192, 128, deterministic=True) == 0
    # d256's grid row (b2 h8 s8192): 2048 tiles of 64 keys
    assert plan(2, 8, 8, 8192, 8192, 256) == 8192 // gen.TILES[256].block_n * 16 % 132 == 68
    assert plan(2, 32, 2, 8192, 8192, 128) == 0   # a group of 16: fp32 accumulators
    assert plan(2, 32, 8, 8192, 8192, 128) == 64 * 2 * 8 % 132  # walked groups of 4
    assert plan(1, 33, 33, 8192, 8192, 128) == 0  # 2112 tiles: 16 whole waves
    assert plan(1, 2, 2, 8192, 8192, 128) == 0    # 128 tiles < 2 P
    problem = _split_problem(2, 16, 16, 8192, 8192, 128)
    problem.mask_kind = 1
    assert C.workspace_layout(problem).split_tiles == 0
    # the rule, with the tile run_bwd_main picks (the full tile's 80-row m-blocks past
    # FULL_TILE_MIN_QUERIES queries): s1024 saves (132 - 68) x 13 / 132 = 6.3 m-blocks per SM (< 10: measured slower),
    # s2048 12.6
    bm_full = gen.TILES_FULL[128].block_m
    assert C.SPLIT_MIN_SAVED_BLOCKS == 10
    assert (132 - 68) * -(-1024 // bm_full) < 10 * 132 <= (132 - 68) * -(-2048 // bm_full)
    small = (16, 16, 16, 1024, 1024, 128)
    assert plan(*small) == 0 and plan(8, 16, 16, 2048, 2048, 128) == 68
    assert plan(32, 16, 16, 512, 512, 128) == 0  # 8 m-blocks of the default tile's 64 rows
    assert bm == 64
    switch_env.setenv("TORCH_SM90_SDPA_SPLIT_TAIL", "1")
    assert plan(*small) == 68 and plan(32, 16, 16, 512, 512, 128) == 68
    assert plan(1, 2, 2, 8192, 8192, 128) == 0  # still structural: < 2 P tiles
    switch_env.setenv("TORCH_SM90_SDPA_SPLIT_TAIL", "0")
    assert plan(2, 16, 16, 8192, 8192, 128) == 0
    switch_env.delenv("TORCH_SM90_SDPA_SPLIT_TAIL")
    switch_env.setenv("TORCH_SM90_SDPA_PERSISTENT", "0")
    assert plan(2, 16, 16, 8192, 8192, 128) == 0


@needs_C
def test_split_tail_workspace_and_params(switch_env):
    """A split tail adds its int32 counts (padded to 16 bytes) and fp32 sums (block_n * (D +
    Dv) per split tile: dK then dV) before the tile counter; make_params points at them."""
    for var in ("TORCH_SM90_SDPA_SPLIT_TAIL", "TORCH_SM90_SDPA_PERSISTENT"):
        switch_env.delenv(var, raising=False)
    problem = _split_problem(2, 16, 16, 8192, 8192, 128)
    for name in ("q", "k", "v", "out", "dout", "dq", "dk", "dv"):
        setattr(problem, name, C.OperandLayout(batch_stride=16 * 8192 * 128, head_stride=8192 * 128,
                                               row_stride=128))
    w = C.workspace_layout(problem)
    slot = 2 * gen.TILES[128].block_n * 128
    assert (w.split_tiles, w.split_slot_floats) == (68, slot)
    assert w.split_tail % 16 == 0
    counts_bytes = -(-68 * 4 // 16) * 16
    assert w.tile_counter == w.split_tail + counts_bytes + 4 * 68 * slot
    assert w.bytes == w.tile_counter + 16
    unsplit = C.workspace_layout(_split_problem(2, 16, 16, 8192, 8192, 128, num_sms=0))
    assert unsplit.split_tiles == 0 and unsplit.tile_counter == unsplit.split_tail == w.split_tail
    base = 1 << 20
    p = C.make_params(problem, C.BwdPointers(workspace=base), 0.1)
    assert (p.split_tiles, p.split_slot_floats) == (68, slot)
    assert p.split_count == base + w.split_tail
    assert p.split_accum == base + w.split_tail + counts_bytes
    q = C.make_params(_split_problem(2, 16, 16, 8192, 8192, 128, num_sms=0), C.BwdPointers(workspace=base), 0.1)
    assert q.split_tiles == 0 and q.split_count == q.split_accum == 0


@needs_C
def test_workspace_of_a_dv_pair(switch_env):
    """Dv != D (the 192x128 pair): the split tail's slot holds dK (D wide) then dV (Dv wide) of
    a tile, block_n * (D + Dv) floats. The layout is host arithmetic: it holds whether or not
    the pair's kernel is built."""
    for var in ("TORCH_SM90_SDPA_SPLIT_TAIL", "TORCH_SM90_SDPA_PERSISTENT", "TORCH_SM90_SDPA_GQA_WALK"):
        switch_env.delenv(var, raising=False)
    switch_env.setenv("TORCH_SM90_SDPA_SPLIT_TAIL", "1")  # every structural case splits
    pair = C.workspace_layout(_split_problem(1, 16, 16, 4096, 4096 + 64, 192, head_dim_v=128))
    same = C.workspace_layout(_split_problem(1, 16, 16, 4096, 4096 + 64, 192))
    bn = gen.TILES[192].block_n
    assert pair.split_tiles == same.split_tiles > 0
    assert (pair.split_slot_floats, same.split_slot_floats) == (bn * (192 + 128), bn * 2 * 192)


@needs_C
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.bfloat16])
def test_masked_workspace_has_tile_classes_ranges_bits_and_bounds(mask_dtype):
    """A mask adds, in this order: one class byte per tile and mask instance, one (lo, hi) int32
    pair per n-block and instance (the non-empty m-block range), one bit per entry of every
    tile (the bits of partial tiles), and for an additive mask the fp32 score bounds (two per
    m-block, one per n-block), then room for 32 partial copies of them (the bounds kernel's
    shares)."""
    from torch_sm90_sdpa import _cuda_backend as cb

    b, hq, sq, sk, d = 2, 4, 130, 300, 128
    q = torch.randn(b, hq, sq, d, dtype=torch.bfloat16)
    k = v = torch.randn(b, 2, sk, d, dtype=torch.bfloat16)
    lse = torch.randn(b, hq, sq)
    mask = torch.ones(b, 1, sq, sk, dtype=mask_dtype)  # per batch, broadcast over heads
    w = C.workspace_layout(cb.problem_of(q, q, k, v, q, lse, False, attn_mask=mask))
    m_blocks, n_blocks = -(-sq // gen.TILES[d].block_m), -(-sk // gen.TILES[d].block_n)
    inst = b  # mask_batch x mask_heads
    assert w.tile_m_range == w.tile_class + -(-inst * m_blocks * n_blocks // 16) * 16
    assert w.tile_bits == w.tile_m_range + -(-8 * inst * n_blocks // 16) * 16
    tile_bytes = gen.TILES[d].block_m * gen.TILES[d].block_n // 8
    assert w.score_bounds == w.tile_bits + inst * m_blocks * n_blocks * tile_bytes
    bounds = 4 * inst * (2 * m_blocks + n_blocks) if mask_dtype != torch.bool else 0
    assert w.dq_semaphore == w.score_bounds + -(-bounds // 16) * 16 * 33
    assert w.tile_m_range % 16 == 0 and w.tile_bits % 16 == 0 and w.score_bounds % 16 == 0


@needs_C
def test_make_params_reads_the_programmatic_launch_switch(switch_env):
    # TORCH_SM90_SDPA_PDL=1: the main and post kernels launched programmatically
    # (csrc/grid_dependency.h); unset or anything else: plain launches. Read once; SwitchEnv re-reads.
    from torch_sm90_sdpa import _cuda_backend as cb

    q = torch.randn(1, 2, 70, 64, dtype=torch.bfloat16)
    lse = torch.randn(1, 2, 70)
    switch_env.delenv("TORCH_SM90_SDPA_PDL", raising=False)
    assert not cb.make_params(q, q, q, q, q, lse)[0].programmatic_launch
    switch_env.setenv("TORCH_SM90_SDPA_PDL", "1")
    assert cb.make_params(q, q, q, q, q, lse)[0].programmatic_launch
    for off in ("0", "", "yes"):
        switch_env.setenv("TORCH_SM90_SDPA_PDL", off)
        assert not cb.make_params(q, q, q, q, q, lse)[0].programmatic_launch


def _check_two_way_switch(switch_env, var, field, on, off, others, default_key):
    """make_params passes the environment switch `var` (read once; SwitchEnv makes _C read it
    again) into BwdParams.`field`: `on` sets it, `off` clears it, unset or any of `others`
    gives the built-in default, which build_info() reports under `default_key`."""
    from torch_sm90_sdpa import _cuda_backend as cb

    q = torch.randn(1, 2, 70, 64, dtype=torch.bfloat16)
    lse = torch.randn(1, 2, 70)
    read = lambda: getattr(cb.make_params(q, q, q, q, q, lse)[0], field)  # noqa: E731
    switch_env.delenv(var, raising=False)
    default = read()
    assert default == _extension.build_info()[default_key]
    switch_env.setenv(var, on)
    assert read()
    switch_env.setenv(var, off)
    assert not read()
    for other in others:
        switch_env.setenv(var, other)
        assert read() == default
    return default


@needs_C
def test_make_params_reads_the_persistent_switch(switch_env):
    # TORCH_SM90_SDPA_PERSISTENT=1 / 0: the main kernel's CTAs take several tiles each / one
    # tile each (BwdParams.persistent); unset or anything else: the built-in default, which
    # build_info() reports. Read once; SwitchEnv re-reads.
    _check_two_way_switch(switch_env, "TORCH_SM90_SDPA_PERSISTENT", "persistent", "1", "0",
                          ("", "yes", "2"), "persistent_by_default")


@needs_C
def test_make_params_reads_the_prepost_order(switch_env):
    # TORCH_SM90_SDPA_PREPOST_ORDER=reversed / forward: the pre- and postprocess walk the rows
    # last (batch, head) first / first first (BwdParams.prepost_reversed); unset or anything
    # else: the built-in default, which build_info() reports. Read once; SwitchEnv re-reads.
    default = _check_two_way_switch(switch_env, "TORCH_SM90_SDPA_PREPOST_ORDER", "prepost_reversed",
                                    "reversed", "forward", ("", "1", "Reversed"),
                                    "prepost_reversed_by_default")
    assert isinstance(default, bool)


@needs_C
def test_make_params_reads_the_section_switch(switch_env):
    # TORCH_SM90_SDPA_SECTION_HEADS=N (N > 0): the main kernel's scheduling sections hold N head
    # groups (BwdParams.heads_per_section, for A/B measurement); unset or anything else: 0, the
    # launch's own rule. Read once; SwitchEnv re-reads.
    from torch_sm90_sdpa import _cuda_backend as cb

    q = torch.randn(1, 2, 70, 64, dtype=torch.bfloat16)
    lse = torch.randn(1, 2, 70)
    switch_env.delenv("TORCH_SM90_SDPA_SECTION_HEADS", raising=False)
    assert cb.make_params(q, q, q, q, q, lse)[0].heads_per_section == 0
    switch_env.setenv("TORCH_SM90_SDPA_SECTION_HEADS", "3")
    assert cb.make_params(q, q, q, q, q, lse)[0].heads_per_section == 3
    for other in ("", "0", "-2", "2x", "many"):
        switch_env.setenv("TORCH_SM90_SDPA_SECTION_HEADS", other)
        assert cb.make_params(q, q, q, q, q, lse)[0].heads_per_section == 0


@needs_C
@pytest.mark.parametrize("d", sorted(gen.TILES))
def test_make_params_sets_the_dq_accum_order_of_the_head_dims_kernel(d):
    # d64 / d192 / d256 stage dQ with permuted segments (bwd_mainloop.h) and dq_accum keeps that
    # order; the postprocess must be told, whatever the head dims built here
    from torch_sm90_sdpa import _cuda_backend as cb

    q = torch.randn(1, 2, 70, d, dtype=torch.bfloat16)
    lse = torch.randn(1, 2, 70)
    p, _ = cb.make_params(q, q, q, q, q, lse, False, 1.0, False)
    assert p.dq_accum_permuted == (d in (64, 192, 256))


@needs_C
@pytest.mark.parametrize("heads_kv", [4, 1])
def test_deterministic_workspace_and_order(heads_kv, switch_env):
    """Deterministic mode: dQ turn semaphores [B, Hq, m-blocks] after the other pieces; GQA keeps
    dK / dV per q head; the order is chosen per problem unless the environment forces one."""
    from torch_sm90_sdpa import _cuda_backend as cb

    switch_env.delenv("TORCH_SM90_SDPA_DETERMINISTIC_ORDER", raising=False)
    b, hq, sq, sk, d = 2, 4, 130, 300, 128
    q = torch.randn(b, hq, sq, d, dtype=torch.bfloat16)
    k = v = torch.randn(b, heads_kv, sk, d, dtype=torch.bfloat16)
    out = dout = q
    lse = torch.randn(b, hq, sq)
    default = C.workspace_layout(cb.problem_of(dout, q, k, v, out, lse, False, False))
    w = C.workspace_layout(cb.problem_of(dout, q, k, v, out, lse, False, True))
    block_m = gen.TILES[d].block_m
    m_blocks = -(-sq // block_m)
    assert w.dq_semaphore == w.tile_class
    assert w.tile_counter == w.dq_semaphore + -(-4 * b * hq * m_blocks // 16) * 16
    assert w.bytes == w.tile_counter + 16
    kv_factor = hq if heads_kv != hq else 0  # accumulators only for GQA, per q head
    skr = -(-sk // 128) * 128
    assert w.dv_accum - w.dk_accum == 4 * b * kv_factor * skr * d
    assert default.tile_counter == default.tile_class and default.bytes == default.tile_counter + 16 < w.bytes
    p, ws = cb.make_params(dout, q, k, v, out, lse, False, 1.0, True)
    assert p.deterministic and p.dq_semaphore != 0
    assert p.deterministic_order == ("ascending" if heads_kv != hq else "descending")
    if heads_kv != hq:
        assert ws.dk_accum.shape == (b, hq, skr, d)
    for forced in ("ascending", "descending"):
        switch_env.setenv("TORCH_SM90_SDPA_DETERMINISTIC_ORDER", forced)
        p, ws = cb.make_params(dout, q, k, v, out, lse, False, 1.0, True)
        assert p.deterministic_order == forced


def _valid_params():
    p = C.BwdParams()
    p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_k = 1, 2, 1, 5, 6
    p.head_dim = p.head_dim_v = 64
    p.seqlen_q_rounded = p.seqlen_k_rounded = 128
    for name in ("q", "k", "v", "out", "dout", "lse", "dq", "dk", "dv", "dpsum", "lse_log2",
                 "dq_accum", "dk_accum", "dv_accum"):
        setattr(p, name, 1 << 20)
    for name in ("q", "k", "v", "out", "dout", "lse", "dq", "dk", "dv"):
        for kind in ("batch", "head", "row"):
            setattr(p, f"{name}_{kind}_stride", 64)
    return p


@needs_C
@pytest.mark.parametrize("fn", ["preprocess", "postprocess", "run"])
@pytest.mark.parametrize("field,value,pattern", [
    ("seqlen_q", -1, "seqlen_q = -1 is negative|seqlen_q = -1 must be positive"),
    ("heads_kv", 3, "multiple of heads_kv"),
    ("seqlen_q_rounded", 5, "rounded up to a multiple of 128"),
    ("dq_accum", 0, "dq_accum is null"),
])
def test_bad_params_raise_value_error_before_touching_the_gpu(fn, field, value, pattern):
    p = _valid_params()
    setattr(p, field, value)
    with pytest.raises(ValueError, match=pattern):
        getattr(C, fn)(p, 0)


@needs_C
def test_backward_param_errors():
    p = _valid_params()
    p.head_dim_v = 32
    with pytest.raises(ValueError, match="head_dim_v == head_dim"):
        C.run(p, 0)
    p = _valid_params()
    p.dk_accum = p.dv_accum = 0
    with pytest.raises(ValueError, match="GQA"):
        C.run(p, 0)
    p = _valid_params()
    p.heads_q = 1
    with pytest.raises(ValueError, match="must be null when heads_q == heads_kv"):
        C.run(p, 0)
    p = _valid_params()
    p.dv_accum = 0
    with pytest.raises(ValueError, match="both set or both null"):
        C.preprocess(p, 0)
    # heads_per_cta: 1, or the whole GQA group (2 here) with the accumulators null
    p = _valid_params()
    p.heads_per_cta = 2
    with pytest.raises(ValueError, match="must be null when heads_q == heads_kv or a CTA walks"):
        C.run(p, 0)
    for field, value in (("heads_per_cta", 3), ("heads_q", 4)):
        p = _valid_params()
        p.heads_per_cta = 2
        p.dk_accum = p.dv_accum = 0
        setattr(p, field, value)
        with pytest.raises(ValueError, match=r"heads_per_cta \(\d\) must be 1, or the GQA group"):
            C.run(p, 0)
    p = _valid_params()
    p.head_dim = p.head_dim_v = 72
    p.dq_accum_permuted = True  # 8-column segments permuted within groups of 32 columns
    with pytest.raises(ValueError, match="dq_accum_permuted needs head_dim % 32 == 0"):
        C.postprocess(p, 0)
    p = _valid_params()
    p.head_dim = p.head_dim_v = 72  # never compiled
    with pytest.raises(RuntimeError, match=r"head_dim=72"):
        C.run(p, 0)


@needs_C
@pytest.mark.parametrize("field", ["batch", "heads_q", "seqlen_q", "seqlen_k", "head_dim"])
def test_empty_problems(field):
    # pre/post: nothing to do, so no launch, no pointer checks and no device access (this
    # passes on a machine without a GPU); backward refuses: the caller zero-fills the outputs
    p = C.BwdParams()
    p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_k = 1, 2, 1, 5, 6
    p.head_dim = p.head_dim_v = 64
    setattr(p, field, 0)
    C.preprocess(p, 0)
    C.postprocess(p, 0)
    p = _valid_params()
    setattr(p, field, 0)
    with pytest.raises(ValueError, match="must be positive"):
        C.run(p, 0)


@needs_C
@pytest.mark.parametrize("field,value", [("q", (1 << 20) + 2), ("k_row_stride", 68),
                                         ("dout_head_stride", 4), ("q_row_stride", 0),
                                         ("v_head_stride", -64)])
def test_backward_needs_tma_compatible_operands(field, value):
    p = _valid_params()
    p.batch, p.heads_q, p.heads_kv = 2, 4, 2
    setattr(p, field, value)
    with pytest.raises(ValueError, match=field.split("_")[0] + " must have a 16-byte aligned"):
        C.run(p, 0)
