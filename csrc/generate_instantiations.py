#!/usr/bin/env python3
"""The one table of what can be built, and the files generated from it.

``DTYPES`` (dtype names, C++ enumerators, integer codes) and ``TILES`` (the main kernel's tile
configuration per head dim) are the only statement of the variants. Everything else is
generated from them or checked against them:

  csrc/instantiations/bwd_main_<dtype>_hdim<D>.cu   per variant: the kernel without a mask and
                                   run_bwd_main (which picks one of the kernels)
  csrc/instantiations/bwd_main_<dtype>_hdim<D>_masked.cu   per variant: the kernel with a mask
                                   (two files: they compile in parallel)
  csrc/instantiations/bwd_main_<dtype>_hdim<D>_full.cu   head dims of TILES_FULL: the dense
                                   kernel with the tile of long calls
  csrc/instantiations/bwd_main_<dtype>_hdim<D>x<Dv>[_masked].cu   per (D, Dv) pair of TILES_DV
                                   (v head dim Dv != D): its dense kernel with run_bwd_main,
                                   its masked kernel
  csrc/instantiations/fwd_main_<dtype>_hdim<D>.cu   per variant of a head dim of FWD_TILES: the
                                   forward kernel (run_fwd_main)
  csrc/instantiations/fwd_tile_configs.h   the DefaultFwdConfig<D> tile specializations
  csrc/instantiations/variants.h   TORCH_SM90_SDPA_FOR_EACH_VARIANT(X), the C++ dispatch list
                                   (TORCH_SM90_SDPA_FOR_EACH_DV_VARIANT(X), the pairs', and
                                   TORCH_SM90_SDPA_FOR_EACH_FWD_VARIANT(X), the forward's); a
                                   check that sm90_sdpa::DType has these codes
  csrc/instantiations/tile_configs.h   the DefaultBwdConfig<D> (DefaultBwdConfigDv<D, Dv>) tile
                                   specializations
  torch_sm90_sdpa/_build_config.py what was built, for Python (written by setup.py)
  docs/KERNEL.md                   its tile table is tile_table_markdown() (a test compares)

Usage (normally through setup.py's build command):
  python csrc/generate_instantiations.py [--out-dir DIR] [--head-dims 64,128,192x128] [--dtypes bf16]
                                         [--no-main-kernel] [--docs]
Stand-alone it reads no environment; setup.py passes TORCH_SM90_SDPA_HEAD_DIMS and
TORCH_SM90_SDPA_DTYPES through parse_head_dims() / parse_dtypes().
Only files whose content changes are rewritten (keeps incremental builds incremental), and
bwd_main_*.cu / fwd_main_*.cu files of variants no longer selected are removed.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, Iterable, List, NamedTuple, Sequence, Tuple, Union

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT_DIR = os.path.join(HERE, "instantiations")
TEMPLATE_HEADER = "bwd_main_launch_template.h"

# dtype name -> (C++ enumerator of sm90_sdpa::DType, integer code of BwdParams.dtype)
DTYPES = {"fp16": ("kFloat16", 0), "bf16": ("kBFloat16", 1)}
_DTYPE_ALIASES = {
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "f16": "fp16",
    "bf16": "bf16", "bfloat16": "bf16",
}


class Tile(NamedTuple):
    """Arguments of sm90_sdpa::kernel::BwdTileConfig (csrc/kernel/bwd_config.h); the tables
    below name every field (Tile(block_m=..., ...)), never rely on their order."""

    block_m: int        # query rows per m-block
    block_n: int        # key rows per CTA
    mma_wg: int         # MMA (consumer) warpgroups
    stages_q: int       # Q (+ lse) pipeline depth
    stages_do: int      # dO (+ rowsum(dO * O)) pipeline depth
    stages_ds: int      # P / dS shared-memory buffers
    swap_sdp: bool      # S^T = K Q^T and dP^T = V dO^T (P^T, dS^T in registers)
    swap_dkv: bool      # dV^T = dO^T P and dK^T = Q^T dS
    atom_m_sdp: int
    atom_n_dkv: int
    atom_m_dq: int
    dq_slices: int      # dQ computed in this many column slices
    swap_dq: bool = False  # dQ^T = K^T dS^T (block_m need not be a multiple of 64)
    sdp_by_wg: bool = False  # S on warpgroup 0, dP on warpgroup 1 (each the whole tile)
    dkv_stmatrix: bool = False  # swapped dK^T / dV^T written to the epilogue tile by stmatrix .trans


# The main kernel's tile per head dim (bf16 and fp16 share it); its keys are the head dims
# (with Dv == D) that can be built.
TILES: Dict[int, Tile] = {
    64: Tile(block_m=128, block_n=128, mma_wg=2, stages_q=2, stages_do=2, stages_ds=2,
             swap_sdp=True, swap_dkv=False, atom_m_sdp=1, atom_n_dkv=2, atom_m_dq=2, dq_slices=1),
    96: Tile(block_m=64, block_n=128, mma_wg=2, stages_q=2, stages_do=2, stages_ds=2,
             swap_sdp=True, swap_dkv=False, atom_m_sdp=1, atom_n_dkv=2, atom_m_dq=1, dq_slices=1),
    128: Tile(block_m=64, block_n=128, mma_wg=2, stages_q=2, stages_do=2, stages_ds=2,
              swap_sdp=True, swap_dkv=False, atom_m_sdp=1, atom_n_dkv=2, atom_m_dq=1, dq_slices=1),
    192: Tile(block_m=64, block_n=64, mma_wg=2, stages_q=2, stages_do=2, stages_ds=1,
              swap_sdp=False, swap_dkv=True, atom_m_sdp=1, atom_n_dkv=2, atom_m_dq=1, dq_slices=1),
    256: Tile(block_m=64, block_n=64, mma_wg=2, stages_q=2, stages_do=1, stages_ds=1,
              swap_sdp=False, swap_dkv=True, atom_m_sdp=1, atom_n_dkv=1, atom_m_dq=1, dq_slices=2,
              swap_dq=False, sdp_by_wg=True, dkv_stmatrix=True),
}
# d256's dK / dV (swapped, M = the head dim): atom_n_dkv 1, the warpgroups split the head dim
# and each takes all 64 keys (two m64n64k16 per k-step: 8 KB of shared-memory operands per 64
# tensor cycles, what shared memory serves); split along the keys (2, d192's), each issues four
# m64n32k16 (12 KB per 64 cycles, 1.5x over). Main kernel 1-5% faster on every FA-grid d256
# row (A/B of b63d144). d192 keeps 2: its three m64 atoms do not split in two.
# d256's sdp_by_wg: S on warpgroup 0 and dP on warpgroup 1, each over the whole 64 x 64 tile
# (Q, dO, K, V read once per m-block, not Q and dO once per warpgroup); main kernel 0.2-4.7%
# faster on every FA-grid d256 row (A/B of f70d11f).
# d256's dkv_stmatrix: the epilogue writes dK^T / dV^T into the (keys, head dim) tile with
# stmatrix .trans (16-byte rows) instead of one 16-bit store per element; main kernel 1.3-22%
# faster on every FA-grid d256 row, most at short lengths (A/B of 9941635). d192 measured
# level to 1.3% slower with it (its spill grew) and keeps the element-wise stores.


class FwdTile(NamedTuple):
    """Arguments of sm90_sdpa::kernel::FwdTileConfig (csrc/kernel/fwd_config.h)."""

    block_m: int  # query rows per CTA (two MMA warpgroups of 64)
    block_n: int  # keys per step
    stages: int   # K / V pipeline depth


# The forward kernel's tile per head dim (bf16 and fp16 share it): the head dims of the selected
# ones (TORCH_SM90_SDPA_HEAD_DIMS) that are keys here get a forward kernel.
FWD_TILES: Dict[int, FwdTile] = {
    64: FwdTile(block_m=128, block_n=128, stages=2),
    96: FwdTile(block_m=128, block_n=128, stages=2),
    128: FwdTile(block_m=128, block_n=128, stages=2),
    192: FwdTile(block_m=128, block_n=64, stages=2),
    256: FwdTile(block_m=128, block_n=64, stages=2),
}
# Chosen by ptxas (nvcc 13.0, sm_90a; the four kernels: in-turn / overlap x dense / masked, none
# spilling with these tiles but d256's overlap dense kernel, 8 B) and shared memory (Q 128 x D,
# K and V block_n x D per stage, 227 KB at most); docs/FORWARD.md ("Tiles") has the table:
# d96 keeps d64 / d128's 128 x 128 x 2 (121 KB).
# d192: 128 keys and 2 stages need 240 KB; 64 keys and 2 stages take 145 KB, where 128 keys and
#   1 stage (also 145 KB, no K / V prefetch) spill 232 B in the overlap masked kernel.
# d256: O is 128 fp32 registers per thread; 64 keys and 2 stages take 193 KB; 128 keys and
#   1 stage spill 168 B even in the overlap dense kernel.
# A masked kernel's key block divides kFwdTile (128): 64-key blocks read half of a classified
# tile (fwd_kernel.h, block_class).

# Head dims whose dense kernel has a tile of its own for long calls (causal or full,
# deterministic or not; FullBwdConfig<D>: a third kernel in bwd_main_<dtype>_hdim<D>_full.cu).
# The masked kernel keeps TILES' tile: the mask classification is laid out by it. The
# deterministic dQ semaphores are laid out by TILES' m-blocks, at least as many as the full
# tile's (block_m no smaller).
TILES_FULL: Dict[int, Tile] = {
    128: Tile(block_m=80, block_n=128, mma_wg=2, stages_q=2, stages_do=2, stages_ds=2,
              swap_sdp=True, swap_dkv=False, atom_m_sdp=1, atom_n_dkv=2, atom_m_dq=1, dq_slices=1,
              swap_dq=True),
}
# (a full tile keeps the default tile's key block: the split tail's workspace is sized by it,
# registration/bwd_device.cpp)
assert all(t.block_n == TILES[d].block_n for d, t in TILES_FULL.items())
# (nor fewer query rows: the deterministic dQ semaphores, laid out by TILES' m-blocks, cover
# its m-blocks)
assert all(t.block_m >= TILES[d].block_m for d, t in TILES_FULL.items())

# (D, Dv) pairs with a value head dim Dv != D (DeepSeek-style multi-head latent attention: q / k
# 192, v 128) and their tile (kernel::DefaultBwdConfigDv<D, Dv>; a build token "192x128" in
# TORCH_SM90_SDPA_HEAD_DIMS). V, dO, dP's k-steps and dV are Dv wide. Only the swapped dK / dV
# tiles take Dv != D (kernel/bwd_config.h). A pair keeps D's tile extents (block_m, block_n): the
# device layer lays out the mask classification, the deterministic semaphores and the split tail
# by tile_block_m / tile_block_n(D). No full tile (TILES_FULL) for pairs.
TILES_DV: Dict[Tuple[int, int], Tile] = {
    (192, 128): TILES[192],
}
# d192's tile serves (192, 128) unchanged: ptxas (nvcc 13.0) gives it d192's registers and
# spills with 24 KB less shared memory (V and dO 128 wide).
assert all(dv != d and t.swap_dkv and dv % 64 == 0 and (t.block_m, t.block_n) ==
           (TILES[d].block_m, TILES[d].block_n) for (d, dv), t in TILES_DV.items())
# run_bwd_main's choice for a dense call: the full tile past this
# many queries, else the default tile. The one statement of the number: tile_configs_header()
# writes it into C++ as sm90_sdpa::kFullTileMinQueries.
FULL_TILE_MIN_QUERIES = 768


def dense_tile(head_dim: int, seqlen_q: int) -> "Tile":
    """The tile of a dense call (no mask) of this head dim and query length."""
    if head_dim in TILES_FULL and seqlen_q > FULL_TILE_MIN_QUERIES:
        return TILES_FULL[head_dim]
    return TILES[head_dim]


DEFAULT_HEAD_DIMS: Tuple[int, ...] = tuple(sorted(TILES))
TILED_DV_PAIRS: Tuple[Tuple[int, int], ...] = tuple(sorted(TILES_DV))
DEFAULT_DTYPES: Tuple[str, ...] = tuple(DTYPES)

Variant = Tuple[str, int]  # (dtype short name, head dim)
DvVariant = Tuple[str, int, int]  # (dtype short name, head dim D, value head dim Dv != D)
# A head-dim selection (parse_head_dims): head dims D (Dv == D) and (D, Dv) pairs of TILES_DV.
HeadDimKey = Union[int, Tuple[int, int]]


def _key_order(key: HeadDimKey) -> Tuple[int, int, int]:
    # D, then D's own variant before its pairs
    return (key, 0, key) if isinstance(key, int) else (key[0], 1, key[1])


# The default build: every head dim, no pair. A pair is built on request (a "192x128" token):
# (192, 128) measured 1.31-1.40x cuDNN's backward full but 0.81-0.86x causal (H100, bf16,
# benchmarks/bench_bwd.py --dv-pairs 192x128, 2k and 8k keys), and the drop-in and the ops use
# whatever kernel is built, with no speed gate.
DEFAULT_SELECTION: Tuple[HeadDimKey, ...] = DEFAULT_HEAD_DIMS


def split_selection(selection: Iterable[HeadDimKey]) -> Tuple[Tuple[int, ...], Tuple[Tuple[int, int], ...]]:
    """A selection's head dims (Dv == D) and its (D, Dv) pairs, each sorted."""
    dims = sorted({k for k in selection if isinstance(k, int)})
    pairs = sorted({tuple(k) for k in selection if not isinstance(k, int)})
    return tuple(dims), tuple(pairs)

HEADER_NOTE = "// Generated by csrc/generate_instantiations.py at build time. Do not edit.\n"


def _is_none(text: str) -> bool:
    return text.strip().lower() in ("", "none")


def _pair_name(pair: Tuple[int, int]) -> str:
    return f"{pair[0]}x{pair[1]}"


def parse_head_dims(text: str | None) -> Tuple[HeadDimKey, ...]:
    """'64,128' -> (64, 128); '128,192x128' -> (128, (192, 128)) (a pair D x Dv of TILES_DV;
    'DxD' is D); None -> DEFAULT_SELECTION (every head dim of TILES, no pair); '' or 'none' ->
    () (no main kernel).
    Sorted by D, a head dim before its pairs."""
    if text is None:
        return DEFAULT_SELECTION
    if _is_none(text):
        return ()
    keys: List[HeadDimKey] = []
    choices = ", ".join([str(d) for d in DEFAULT_HEAD_DIMS] + [_pair_name(p) for p in TILED_DV_PAIRS])
    for part in text.replace(";", ",").split(","):
        part = part.strip().lower()
        if not part:
            continue
        fields = part.split("x")
        try:
            nums = [int(f) for f in fields]
        except ValueError:
            raise ValueError(f"head dim {part!r} is not an integer or a pair DxDv (in {text!r})") from None
        if len(nums) == 2 and nums[0] == nums[1]:
            nums = nums[:1]
        if len(nums) == 1:
            key: HeadDimKey = nums[0]
            if key not in TILES:
                raise ValueError(f"head dim {key} has no tile configuration; choose from {choices}")
        elif len(nums) == 2:
            key = (nums[0], nums[1])
            if key not in TILES_DV:
                raise ValueError(f"head dim pair {_pair_name(key)} (q/k x v) has no tile "
                                 f"configuration; choose from {choices}")
        else:
            raise ValueError(f"head dim {part!r} is not an integer or a pair DxDv (in {text!r})")
        if key not in keys:
            keys.append(key)
    return tuple(sorted(keys, key=_key_order))


def parse_dtypes(text: str | None) -> Tuple[str, ...]:
    """'bf16,fp16' -> ('fp16', 'bf16'); None -> the defaults; '' or 'none' -> ()."""
    if text is None:
        return DEFAULT_DTYPES
    if _is_none(text):
        return ()
    out = []
    for part in text.replace(";", ",").split(","):
        part = part.strip().lower()
        if not part:
            continue
        if part not in _DTYPE_ALIASES:
            raise ValueError(f"unknown dtype {part!r}; choose from {', '.join(DTYPES)}")
        name = _DTYPE_ALIASES[part]
        if name not in out:
            out.append(name)
    return tuple(n for n in DTYPES if n in out)


def variants(head_dims: Iterable[HeadDimKey], dtypes: Iterable[str]) -> List[Variant]:
    """The (dtype, D) variants of a selection (its pairs: dv_variants)."""
    dts = list(dtypes)
    dims, _ = split_selection(head_dims)
    return [(dt, d) for dt in DTYPES if dt in dts for d in dims]


def dv_variants(head_dims: Iterable[HeadDimKey], dtypes: Iterable[str]) -> List[DvVariant]:
    """The (dtype, D, Dv) variants of a selection's pairs (TILES_DV)."""
    dts = list(dtypes)
    _, pairs = split_selection(head_dims)
    return [(dt, d, dv) for dt in DTYPES if dt in dts for d, dv in pairs]


KERNEL_KINDS = ("dense", "masked", "full")  # the main kernels of a variant (one file each)


def kernel_kinds(head_dim: int) -> Tuple[str, ...]:
    """The kernels of a head dim: the dense and masked ones, and the full-tile one of
    TILES_FULL."""
    return KERNEL_KINDS if head_dim in TILES_FULL else KERNEL_KINDS[:2]


def instantiation_filename(dtype: str, head_dim: int, kind: str = "dense",
                           head_dim_v: int | None = None) -> str:
    suffix = "" if kind == "dense" else "_" + kind
    pair = "" if head_dim_v is None or head_dim_v == head_dim else f"x{head_dim_v}"
    return f"bwd_main_{dtype}_hdim{head_dim}{pair}{suffix}.cu"


def template_header_exists(csrc_dir: str = HERE) -> bool:
    return os.path.isfile(os.path.join(csrc_dir, TEMPLATE_HEADER))


def write_if_changed(path: str, text: str) -> bool:
    try:
        with open(path, "r", encoding="utf-8") as f:
            if f.read() == text:
                return False
    except OSError:
        pass
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
    return True


def fwd_instantiation_filename(dtype: str, head_dim: int) -> str:
    return f"fwd_main_{dtype}_hdim{head_dim}.cu"


def fwd_instantiation_source(dtype: str, head_dim: int) -> str:
    enum = DTYPES[dtype][0]
    return (
        HEADER_NOTE
        + f"// SM90 forward kernel, dtype {dtype}, head dim {head_dim}.\n"
        + '#include "fwd_main_launch_template.h"\n\n'
        + "namespace sm90_sdpa {\n"
        + f"template void run_fwd_main<DType::{enum}, {head_dim}>(const FwdParams&, cudaStream_t);\n"
        + "}  // namespace sm90_sdpa\n"
    )


def fwd_tile_configs_header() -> str:
    """DefaultFwdConfig<D> for every head dim of FWD_TILES (included by kernel/fwd_config.h)."""
    lines = [HEADER_NOTE,
             "// The forward kernel's tile per head dim (FWD_TILES in csrc/generate_instantiations.py).\n",
             "#pragma once\n\n",
             "namespace sm90_sdpa {\nnamespace kernel {\n\n"]
    for d, t in sorted(FWD_TILES.items()):
        lines.append(f"template <> struct DefaultFwdConfig<{d}>\n"
                     f"    : FwdTileConfig<{d}, {t.block_m}, {t.block_n}, {t.stages}> {{}};\n")
    lines.append("\n}  // namespace kernel\n}  // namespace sm90_sdpa\n")
    return "".join(lines)


def fwd_variants(selected: Sequence[Variant]) -> List[Variant]:
    """The forward kernels of a build: the selected variants whose head dim has a forward tile."""
    return [(dt, d) for dt, d in selected if d in FWD_TILES]


def instantiation_source(dtype: str, head_dim: int, kind: str = "dense",
                         head_dim_v: int | None = None) -> str:
    enum = DTYPES[dtype][0]
    pair = head_dim_v is not None and head_dim_v != head_dim
    assert not pair or (kind != "full" and (head_dim, head_dim_v) in TILES_DV)
    default_cfg = (f"kernel::DefaultBwdConfigDv<{head_dim}, {head_dim_v}>" if pair
                   else f"kernel::DefaultBwdConfig<{head_dim}>")
    full_cfg = f"kernel::FullBwdConfig<{head_dim}>"
    launch = (f"launch_bwd_main<DType::{enum}, {head_dim}, %s, %s>(const BwdParams&, "
              "cudaStream_t);\n")
    run_args = f"DType::{enum}, {head_dim}" + (f", {head_dim_v}" if pair else "")
    if kind == "masked":
        body = "template void " + launch % ("true", default_cfg)
    elif kind == "full":
        body = "template void " + launch % ("false", full_cfg)
    else:
        body = ("extern template void " + launch % ("true", default_cfg)  # in the _masked file
                + ("extern template void " + launch % ("false", full_cfg)  # in the _full file
                   if head_dim in TILES_FULL and not pair else "")
                + "template void " + launch % ("false", default_cfg)
                + f"template void run_bwd_main<{run_args}>(const BwdParams&, cudaStream_t);\n")
    what = {"masked": "with a mask.\n",
            "full": "without a mask, tile of long calls.\n",
            "dense": "without a mask; run_bwd_main.\n"}[kind]
    dims = f"head dim {head_dim}" + (f", v head dim {head_dim_v}" if pair else "")
    return (
        HEADER_NOTE
        + f"// Main SM90 backward kernel, dtype {dtype}, {dims}, "
        + what
        + f'#include "{TEMPLATE_HEADER}"\n\n'
        + "namespace sm90_sdpa {\n"
        + body
        + "}  // namespace sm90_sdpa\n"
    )


def _cpp_bool(b: bool) -> str:
    return "true" if b else "false"


def variants_header(selected: Sequence[Variant], main_kernel: bool,
                    dv_selected: Sequence[DvVariant] = ()) -> str:
    lines = [
        HEADER_NOTE,
        "// The variants compiled into torch_sm90_sdpa._C and the tile configuration of every\n",
        "// head dim, from csrc/generate_instantiations.py (DTYPES, TILES, TILES_DV).\n",
        "#pragma once\n\n",
        '#include "bwd_params.h"\n\n',
    ]
    for name, (enum, code) in DTYPES.items():
        lines.append(f"static_assert(static_cast<int>(sm90_sdpa::DType::{enum}) == {code}, "
                     f"\"DType code of {name}\");\n")
    lines.append("\nnamespace sm90_sdpa {\n"
                 "// The main kernel's tile (kBlockM query rows x kBlockN keys) of a head dim;\n"
                 "// 0 for a head dim without a tile configuration. (A (D, Dv) pair of TILES_DV\n"
                 "// has D's extents.)\n")
    for what, field in (("m", "block_m"), ("n", "block_n")):
        lines.append(f"constexpr int tile_block_{what}(int head_dim) {{\n  switch (head_dim) {{\n")
        for d, t in sorted(TILES.items()):
            lines.append(f"    case {d}: return {getattr(t, field)};\n")
        lines.append("    default: return 0;\n  }\n}\n")
    lines.append("// The full tile's query rows (TILES_FULL; its kBlockN is the default tile's), else\n"
                 "// the default tile's: the dense kernel of more than kFullTileMinQueries queries.\n"
                 "constexpr int full_tile_block_m(int head_dim) {\n  switch (head_dim) {\n")
    for d, t in sorted(TILES.items()):
        lines.append(f"    case {d}: return {TILES_FULL.get(d, t).block_m};\n")
    lines.append("    default: return 0;\n  }\n}\n")
    lines.append("}  // namespace sm90_sdpa\n")
    lines += [
        "\n",
        f"#define TORCH_SM90_SDPA_MAIN_KERNEL_COMPILED {1 if main_kernel and (selected or dv_selected) else 0}\n",
        f"#define TORCH_SM90_SDPA_NUM_VARIANTS {len(selected) if main_kernel else 0}\n",
        f"#define TORCH_SM90_SDPA_NUM_DV_VARIANTS {len(dv_selected) if main_kernel else 0}\n",
        "// X(dtype enumerator of sm90_sdpa::DType, dtype name, dtype code, head dim)\n",
        "#define TORCH_SM90_SDPA_FOR_EACH_VARIANT(X)",
    ]
    if main_kernel:
        for dt, d in selected:
            enum, code = DTYPES[dt]
            lines.append(f" \\\n  X({enum}, \"{dt}\", {code}, {d})")
    lines.append("\n")
    lines.append("// the (D, Dv) pairs (TILES_DV): X(dtype enumerator, dtype name, dtype code, head dim,\n"
                 "// value head dim)\n"
                 "#define TORCH_SM90_SDPA_FOR_EACH_DV_VARIANT(X)")
    if main_kernel:
        for dt, d, dv in dv_selected:
            enum, code = DTYPES[dt]
            lines.append(f" \\\n  X({enum}, \"{dt}\", {code}, {d}, {dv})")
    lines.append("\n")
    lines.append("// the forward kernels: X(dtype enumerator, dtype name, dtype code, head dim)\n"
                 "#define TORCH_SM90_SDPA_FOR_EACH_FWD_VARIANT(X)")
    if main_kernel:
        for dt, d in fwd_variants(selected):
            enum, code = DTYPES[dt]
            lines.append(f" \\\n  X({enum}, \"{dt}\", {code}, {d})")
    lines.append("\n")
    return "".join(lines)


def tile_configs_header() -> str:
    """DefaultBwdConfig<D> for every head dim of TILES, FullBwdConfig<D> of TILES_FULL and
    kFullTileMinQueries (included by kernel/bwd_config.h)."""
    lines = [
        HEADER_NOTE,
        "// The main kernel's tile per head dim (TILES in csrc/generate_instantiations.py).\n",
        "#pragma once\n\n",
        "namespace sm90_sdpa {\nnamespace kernel {\n\n",
        "//                  D    M    N  WG  Q dO dS  swapSdP swapdKV MSdP NdKV MdQ slices swapdQ "
        "SdPByWG dKVstmatrix\n",
    ]
    def config(d: int, t: Tile, dv: int | None = None) -> str:
        return (f"BwdTileConfig<{d}, {t.block_m}, {t.block_n}, {t.mma_wg}, {t.stages_q}, "
                f"{t.stages_do}, {t.stages_ds}, {_cpp_bool(t.swap_sdp)}, {_cpp_bool(t.swap_dkv)}, "
                f"{t.atom_m_sdp}, {t.atom_n_dkv}, {t.atom_m_dq}, {t.dq_slices}, "
                f"{_cpp_bool(t.swap_dq)}, {_cpp_bool(t.sdp_by_wg)}, {_cpp_bool(t.dkv_stmatrix)}"
                + (f", {dv}" if dv is not None else "") + ">")

    for d, t in sorted(TILES.items()):
        lines.append(f"template <> struct DefaultBwdConfig<{d}>\n    : {config(d, t)} {{}};\n")
    lines.append("\n// (D, Dv) pairs, v head dim Dv != D (TILES_DV); the last argument is Dv\n")
    for (d, dv), t in sorted(TILES_DV.items()):
        lines.append(f"template <> struct DefaultBwdConfigDv<{d}, {dv}>\n    : {config(d, t, dv)} {{}};\n")
    lines.append("\n// the dense kernel's tile for long calls (TILES_FULL)\n")
    for d, t in sorted(TILES_FULL.items()):
        lines.append(f"template <> struct FullBwdConfig<{d}>\n    : {config(d, t)} {{\n"
                     "  static constexpr bool kHasFullTile = true;\n};\n")
    lines.append("\n}  // namespace kernel\n\n")
    lines.append("// run_bwd_main's choice for a dense call: a head dim's full\n"
                 "// tile (FullBwdConfig<D>) past this many queries, else the default tile\n"
                 "// (FULL_TILE_MIN_QUERIES).\n"
                 f"constexpr int kFullTileMinQueries = {FULL_TILE_MIN_QUERIES};\n\n"
                 "}  // namespace sm90_sdpa\n")
    return "".join(lines)


def tile_table_markdown() -> str:
    """The tile table of docs/KERNEL.md."""
    rows = ["| D | tile (M x N) | MMA WGs | stages Q/dO/dS | S, dP | dV, dK | dQ slices |",
            "|---|---|---|---|---|---|---|"]
    tiles = [(str(d), t) for d, t in sorted(TILES.items())]
    tiles += [(f"{d}, dense past {FULL_TILE_MIN_QUERIES} queries", t) for d, t in sorted(TILES_FULL.items())]
    tiles += [(f"{d} (Dv {dv})", t) for (d, dv), t in sorted(TILES_DV.items())]
    for d, t in tiles:
        sdp = ("S^T = K Q^T (swapped)" if t.swap_sdp else
               "S = Q K^T on warpgroup 0, dP = dO V^T on 1" if t.sdp_by_wg else "S = Q K^T")
        # swapped dK / dV: the warpgroups split the keys (N) or the head dim (M, atom_n_dkv 1)
        split = "keys" if t.atom_n_dkv > 1 else "head dim"
        dkv = (f"dV^T = dO^T P, dK^T = Q^T dS (SS, warpgroups split the {split}"
               f"{'; stored by stmatrix' if t.dkv_stmatrix else ''})" if t.swap_dkv else
               "RS: P^T, dS^T from registers" if t.swap_sdp else "SS")
        dq = f"{t.dq_slices}" + (" (dQ^T = K^T dS^T)" if t.swap_dq else "")
        rows.append(f"| {d} | {t.block_m} x {t.block_n} | {t.mma_wg} | "
                    f"{t.stages_q}/{t.stages_do}/{t.stages_ds} | {sdp} | {dkv} | {dq} |")
    return "\n".join(rows) + "\n"


def build_config_source(*, cuda: bool, reason: str | None, main_kernel: bool,
                        selected: Sequence[Variant], arch: str,
                        dv_selected: Sequence[DvVariant] = ()) -> str:
    """torch_sm90_sdpa/_build_config.py: what a build produced, and the tables it was made
    from (Python reads them here instead of keeping its own copies)."""
    built = tuple(selected) if cuda and main_kernel else ()
    dv_built = tuple(dv_selected) if cuda and main_kernel else ()
    return "\n".join([
        "# Generated at build time by csrc/generate_instantiations.py (through setup.py); do not",
        "# edit (git-ignored). The loaded torch_sm90_sdpa._C is the authority at run time.",
        f"CUDA_EXTENSION = {cuda!r}",
        f"REASON = {reason!r}",
        f"MAIN_KERNEL = {bool(built or dv_built)!r}",
        f"VARIANTS = {built!r}  # ((dtype name, head dim), ...) built",
        f"DV_VARIANTS = {dv_built!r}  # ((dtype name, head dim, v head dim), ...) built, Dv != D",
        f"FWD_VARIANTS = {tuple(fwd_variants(built))!r}  # ... with a forward kernel",
        f"ARCH = {arch!r}",
        f"DTYPE_CODES = {{{', '.join(f'{n!r}: {c}' for n, (_, c) in DTYPES.items())}}}",
        f"HEAD_DIMS = {DEFAULT_HEAD_DIMS!r}  # head dims with a tile configuration",
        f"DV_PAIRS = {TILED_DV_PAIRS!r}  # (D, Dv) pairs with a tile configuration",
        "",
    ])


def generate(
    out_dir: str = DEFAULT_OUT_DIR,
    head_dims: Iterable[HeadDimKey] = DEFAULT_SELECTION,
    dtypes: Iterable[str] = DEFAULT_DTYPES,
    main_kernel: bool = True,
) -> List[str]:
    """Write the instantiation files, variants.h and tile_configs.h into out_dir.

    head_dims: a selection (parse_head_dims): head dims and (D, Dv) pairs of TILES_DV.
    main_kernel=False writes no instantiation and an empty variant list. Returns the paths of
    the .cu files to compile, in order (per dtype the head dims, then the pairs; then the
    forward's).
    """
    os.makedirs(out_dir, exist_ok=True)
    head_dims = tuple(head_dims)
    selected = variants(head_dims, dtypes) if main_kernel else []
    dv_selected = dv_variants(head_dims, dtypes) if main_kernel else []
    wanted = {}
    for dt in DTYPES:
        for d in [d for t, d in selected if t == dt]:
            for kind in kernel_kinds(d):
                wanted[instantiation_filename(dt, d, kind)] = instantiation_source(dt, d, kind)
        for d, dv in [(d, dv) for t, d, dv in dv_selected if t == dt]:
            for kind in KERNEL_KINDS[:2]:
                wanted[instantiation_filename(dt, d, kind, dv)] = instantiation_source(dt, d, kind, dv)
    for dt, d in fwd_variants(selected):
        wanted[fwd_instantiation_filename(dt, d)] = fwd_instantiation_source(dt, d)
    for name in sorted(os.listdir(out_dir)):
        if name.startswith(("bwd_main_", "fwd_main_")) and name.endswith(".cu") and name not in wanted:
            os.remove(os.path.join(out_dir, name))
    paths = []
    for name, text in wanted.items():
        path = os.path.join(out_dir, name)
        write_if_changed(path, text)
        paths.append(path)
    write_if_changed(os.path.join(out_dir, "variants.h"),
                     variants_header(selected, main_kernel, dv_selected))
    write_if_changed(os.path.join(out_dir, "tile_configs.h"), tile_configs_header())
    write_if_changed(os.path.join(out_dir, "fwd_tile_configs.h"), fwd_tile_configs_header())
    stale = os.path.join(out_dir, "compiled_variants.h")  # the name before variants.h
    if os.path.exists(stale):
        os.remove(stale)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default=DEFAULT_OUT_DIR)
    ap.add_argument("--head-dims", default=None,
                    help="as TORCH_SM90_SDPA_HEAD_DIMS, e.g. 128,192x128 (default: every head dim of TILES, no pair)")
    ap.add_argument("--dtypes", default=",".join(DEFAULT_DTYPES))
    ap.add_argument("--no-main-kernel", action="store_true",
                    help="write no instantiation (pre/post kernels only)")
    ap.add_argument("--docs", action="store_true",
                    help="print the tile table of docs/KERNEL.md and exit")
    args = ap.parse_args(argv)
    if args.docs:
        print(tile_table_markdown(), end="")
        return 0
    main_kernel = not args.no_main_kernel
    if main_kernel and not template_header_exists():
        print(f"note: csrc/{TEMPLATE_HEADER} does not exist: no main-kernel instantiations",
              file=sys.stderr)
        main_kernel = False
    paths = generate(args.out_dir, parse_head_dims(args.head_dims), parse_dtypes(args.dtypes),
                     main_kernel)
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
