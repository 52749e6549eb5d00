// The tile classification of an attention mask: see mask_classify.h.
//
// One to eight warps per tile and mask instance (more when tiles are few); their lanes walk the
// tile's rows in chunks of 8 keys (a warp reads consecutive keys, as vectors where the layout
// allows) and vote. Any layout works (stride 0 on broadcast dims, e.g. [B, 1, 1, Sk]
// key-padding masks: plain strided loads). A partial tile whose entries are all
// either hidden or a zero bias (every partial tile of a boolean mask, and the 0 / -65504 bias
// torch hands cuDNN) is written as bits too: the main kernel reads 1 bit per entry there.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "bwd_params.h"
#include "grid_dependency.h"
#include "mask_bounds.h"
#include "mask_classify.h"
#include "numeric.h"

namespace sm90_sdpa {
namespace {

// The mask and the problem's grid of tile_m x tile_n tiles over it, as both mask kernels'
// arguments read them.
struct TileGrid {
  const void* mask;
  int64_t sb, sh, sr, sc;  // element strides of the mask's [B, Hq, Sq, Sk] view
  int seqlen_q, seqlen_k, tile_m, tile_n, num_m_blocks, num_n_blocks, mask_heads;
  bool is_causal;
  unsigned char* tile_class;  // [mask_batch, mask_heads, num_n_blocks, num_m_blocks]
};
TileGrid tile_grid(const BwdParams& p) {
  TileGrid g{};
  g.mask = p.mask;
  g.sb = p.mask_batch_stride;
  g.sh = p.mask_head_stride;
  g.sr = p.mask_row_stride;
  g.sc = p.mask_col_stride;
  g.seqlen_q = p.seqlen_q;
  g.seqlen_k = p.seqlen_k;
  g.tile_m = p.tile_m;
  g.tile_n = p.tile_n;
  g.num_m_blocks = p.num_m_blocks;
  g.num_n_blocks = p.num_n_blocks;
  g.mask_heads = p.mask_heads;
  g.is_causal = p.is_causal;
  g.tile_class = p.tile_class;
  return g;
}

struct ClassifyArgs : TileGrid {
  uint32_t* tile_bits;  // tile_m * tile_n / 32 words per tile, in tile_class order
  // additive masks: the bounds CTAs' shares of the score bounds (null: no bounds), folded per
  // tile; the tiles of n-block 0 / m-block 0 write the folded values into q_norm_max and
  // lse_min / k_norm_max (BwdParams; for tests)
  const float* bounds_partial;
  int bounds_splits;
  int64_t bounds_count;  // values per share: instances * (2 * num_m_blocks + num_n_blocks)
  float* q_norm_max;     // [mask_batch, mask_heads, num_m_blocks], then lse_min, k_norm_max
  float scale_log2_abs;
  int warps_per_tile;  // classify kernel: 1, 2, 4 or 8 warps share a tile (few tiles: more)
  // the forward's (FwdFillRows): a float mask's finite entries clamped to -FLT_MAX are hidden;
  // each row's bit 0 (sees a key) and bit 1 (has such a fill entry) are or-ed into row_flags
  // ([mask_batch, mask_heads, seqlen_q]); null: the backward's classification
  uint32_t* row_flags;
};

template <MaskKind kKind>
struct MaskElem;
template <> struct MaskElem<MaskKind::kBool> { using type = unsigned char; };
template <> struct MaskElem<MaskKind::kFloat16> { using type = __half; };
template <> struct MaskElem<MaskKind::kBFloat16> { using type = __nv_bfloat16; };
template <> struct MaskElem<MaskKind::kFloat32> { using type = float; };

// Keys per thread and step: 8 consecutive keys, read as one vector where the mask's key stride
// is 1 and the address allows it (8 bytes for bool, 16 for fp16 / bf16, 32 for fp32).
constexpr int kChunk = 8;

// A chunk's 8 mask elements, loaded as one vector where `vec`.
template <typename T>
struct Chunk {
  T e[kChunk];
};
template <typename T>
__device__ __forceinline__ Chunk<T> load_chunk(const T* src, bool vec) {
  Chunk<T> c;
  if (vec) {
    if constexpr (sizeof(T) == 1) {
      *reinterpret_cast<uint2*>(c.e) = *reinterpret_cast<const uint2*>(src);
    } else if constexpr (sizeof(T) == 2) {
      *reinterpret_cast<uint4*>(c.e) = *reinterpret_cast<const uint4*>(src);
    } else {
      reinterpret_cast<uint4*>(c.e)[0] = reinterpret_cast<const uint4*>(src)[0];
      reinterpret_cast<uint4*>(c.e)[1] = reinterpret_cast<const uint4*>(src)[1];
    }
  }
  return c;
}

// Bit c of the result: byte c of the 8 bytes x is nonzero (a boolean chunk's visible keys).
__device__ __forceinline__ uint32_t nonzero_bits(uint2 x) {
  // 0xFF per nonzero byte; then byte i keeps bit i alone, and the multiply sums the four bytes
  // into the top one (distinct bits: no carries)
  const uint32_t lo = __vcmpne4(x.x, 0u) & 0x08040201u, hi = __vcmpne4(x.y, 0u) & 0x08040201u;
  return ((lo * 0x01010101u) >> 24) | (((hi * 0x01010101u) >> 24) << 4);
}

// The bits of an additive mask element type, in an order-preserving integer key (so the
// values between two elements are a range of keys).
template <typename T>
struct ElemBits;
template <>
struct ElemBits<__half> {
  using U = uint16_t;
  static constexpr U kSign = 0x8000, kInf = 0x7C00;
  static __device__ float value(U u) { return __half2float(__ushort_as_half(u)); }
  static __device__ U round_down(float f) { return __half_as_ushort(__float2half_rd(f)); }
};
template <>
struct ElemBits<__nv_bfloat16> {
  using U = uint16_t;
  static constexpr U kSign = 0x8000, kInf = 0x7F80;
  static __device__ float value(U u) { return __bfloat162float(__ushort_as_bfloat16(u)); }
  static __device__ U round_down(float f) { return __bfloat16_as_ushort(__float2bfloat16_rd(f)); }
};
template <>
struct ElemBits<float> {
  using U = uint32_t;
  static constexpr U kSign = 0x80000000u, kInf = 0x7F800000u;
  static __device__ float value(U u) { return __uint_as_float(u); }
  static __device__ U round_down(float f) { return __float_as_uint(f); }
};

// The largest value t of T such that an element x is hidden iff float(x) <= t (NaN never is):
// hidden are -inf and the values whose P is exactly 0 in the main kernel, x * log2(e) <
// dead_below as the main kernel rounds it. That product is monotone in x, so the hidden values
// are a prefix of T's values: the search starts at dead_below / log2(e) rounded down and
// steps one value at a time to the boundary (a step or two from the start).
template <typename T>
__device__ float hidden_at_or_below(float dead_below) {
  if (!(dead_below > -INFINITY)) return -INFINITY;  // no bound: -inf alone is hidden
  using B = ElemBits<T>;
  using U = typename B::U;
  auto key = [](U u) { return (u & B::kSign) ? U(~u) : U(u | B::kSign); };
  auto unkey = [](U k) { return (k & B::kSign) ? U(k & U(~B::kSign)) : U(~k); };
  auto dead = [&](U k) { return B::value(unkey(k)) * kLog2e < dead_below; };
  const U lo = key(U(B::kSign | B::kInf)), hi = key(B::kInf);  // -inf, +inf
  // (start at most at FLT_MAX / log2(e): above it every product overflows to +inf, and a
  // start at +inf would step down through millions of fp32 values to the boundary)
  const float start = fminf(dead_below / kLog2e, 3.4028234663852886e38f / kLog2e);
  U k = start != start ? hi : key(B::round_down(start));
  k = k < lo ? lo : (k > hi ? hi : k);
  while (k < hi && dead(U(k + 1))) ++k;
  while (k > lo && !dead(k)) --k;  // dead(lo): -inf * log2(e) < dead_below
  return B::value(unkey(k));
}

// Warps per CTA of the classify kernel: 8 / warps_per_tile tiles per CTA. One warp per tile
// when there are many (the vote is a warp vote and the CTA's tiles' loads overlap); up to 8
// when there are few (a mask broadcast over batch and heads at 2k keys has 256-512 tiles:
// one warp each would leave most of the GPU idle), which then also vote across warps.
constexpr int kClassifyWarps = 8;
// Chunks per tile at most: 128 x 128 keys / 8.
constexpr int kMaxChunks = 2048;

// warps_per_tile warps per (tile, mask instance), each taking every warps_per_tile-th group
// of rows. A pass of a warp reads 32 consecutive chunks (whole rows of the tile), kInFlight
// passes' loads in flight per lane (4 chunks: 32 bytes of bool,
// 64 of fp16 / bf16; 2 fp32 chunks: 64 bytes); each chunk's visibility byte goes to shared
// memory, and the warp copies the bytes out if the tile is kTilePartialBits.
// kFill: the forward's classification of a float mask (FwdFillRows: a.row_flags set, no bounds).
template <MaskKind kKind, bool kFill = false>
__global__ void __launch_bounds__(kClassifyWarps * 32, 3) mask_classify_kernel(const ClassifyArgs a) {
  using T = typename MaskElem<kKind>::type;
  constexpr int kInFlight = sizeof(T) == 1 ? 4 : 64 / int(kChunk * sizeof(T));
  __shared__ __align__(16) unsigned char s_bits[kClassifyWarps][kMaxChunks];  // per tile slot
  __shared__ unsigned char s_votes[kClassifyWarps][3];  // per warp: any visible, all full, binary
  // per chunk: its keys of a finite fill hidden (FwdFillRows; additive masks only)
  static_assert(!kFill || kKind != MaskKind::kBool, "a boolean mask has no fill");
  __shared__ __align__(16) unsigned char s_fill[kClassifyWarps][kFill ? kMaxChunks : 1];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wpt = a.warps_per_tile;
  const int slot = warp / wpt, part = warp % wpt;  // the tile in this CTA, this warp's share
  const int tile = blockIdx.x * (kClassifyWarps / wpt) + slot;  // n_block * num_m_blocks + m_block
  // (a CTA-wide barrier follows when warps share tiles: no early return before it)
  const bool active = tile < a.num_m_blocks * a.num_n_blocks;
  if (!active && wpt == 1) return;
  const int n_block = active ? tile / a.num_m_blocks : 0;
  const int m_block = active ? tile - n_block * a.num_m_blocks : 0;
  const int h = blockIdx.y, b = blockIdx.z;
  const int q0 = m_block * a.tile_m, k0 = n_block * a.tile_n;
  const T* const base = static_cast<const T*>(a.mask) + int64_t(b) * a.sb + int64_t(h) * a.sh;
  // additive masks: a finite entry below `dead_below` (log2 domain) gives P = 0 exactly
  // (mask_classify.h); -inf when no bound holds (bool masks never use it)
  float dead_below = -INFINITY;
  bool no_live_row = false;
  if (kKind != MaskKind::kBool && !kFill && a.bounds_partial != nullptr) {
    // the shares of the tile's blocks: lane s < splits (at most 32) reads share s
    const int64_t inst = int64_t(b) * a.mask_heads + h, instances = int64_t(gridDim.z) * gridDim.y;
    const int64_t at_q = inst * a.num_m_blocks + m_block;
    const int64_t at_lse = (instances + inst) * a.num_m_blocks + m_block;
    const int64_t at_k = 2 * instances * a.num_m_blocks + inst * a.num_n_blocks + n_block;
    float q_norm = 0.f, lse_lo = INFINITY, k_norm = 0.f;
    if (active && lane < a.bounds_splits) {
      const float* share = a.bounds_partial + lane * a.bounds_count;
      q_norm = share[at_q];
      lse_lo = share[at_lse];
      k_norm = share[at_k];
    }
    for (int off = 16; off > 0; off >>= 1) {
      q_norm = fmaxf(q_norm, __shfl_xor_sync(0xffffffffu, q_norm, off));
      lse_lo = fminf(lse_lo, __shfl_xor_sync(0xffffffffu, lse_lo, off));
      k_norm = fmaxf(k_norm, __shfl_xor_sync(0xffffffffu, k_norm, off));
    }
    if (active && part == 0 && lane == 0) {  // the folded bounds, once per block
      if (n_block == 0) {
        a.q_norm_max[at_q] = q_norm;
        a.q_norm_max[at_lse] = lse_lo;
      }
      if (m_block == 0) a.q_norm_max[at_k] = k_norm;
    }
    no_live_row = lse_lo == INFINITY;  // every row of the tile has P = 0
    const float bound = a.scale_log2_abs * q_norm * k_norm * (1.f + 1.f / 128.f) + 1.f - lse_lo;
    const float limit = -160.f - bound;
    if (limit == limit) dead_below = limit;  // NaN (inf - inf): no bound
  }
  // Chunk i of the tile: row i / chunks_per_row, keys from (i % chunks_per_row) * 8; its
  // visibility byte is byte i of the tile's bits. chunks_per_row is a power of two <= 32, so
  // a lane keeps one key column kc and takes every (32 / chunks_per_row)-th row.
  int cpr_shift = 0;
  while ((kChunk << cpr_shift) < a.tile_n) ++cpr_shift;
  const int col = lane & ((1 << cpr_shift) - 1);
  const int kc = k0 + col * kChunk;
  const int rows_step = 32 >> cpr_shift;
  const T* const col_base = base + int64_t(kc) * a.sc;
  const bool keys_vec = a.sc == 1 && kc + kChunk <= a.seqlen_k;  // (row alignment: per row)
  // an additive element x is hidden iff float(x) <= hidden_at (-inf or a dead bias)
  float hidden_at = -INFINITY;
  // (no live row: the tile is empty whatever its entries, no threshold needed)
  // (the forward's fill: x * log2(e) <= -FLT_MAX, i.e. below the float next to -FLT_MAX)
  if constexpr (kKind != MaskKind::kBool) {
    if constexpr (kFill) dead_below = -3.4028232635611926e38f;
    hidden_at = no_live_row ? INFINITY : hidden_at_or_below<T>(dead_below);
  }
  // one key's bits: visible, (additive) adding exactly 0, and (additive) a finite hidden fill
  auto judge = [&](T x, int c, uint32_t& visible, uint32_t& zero, uint32_t& fill) {
    if constexpr (kKind == MaskKind::kBool) {
      visible |= uint32_t(x != 0) << c;
    } else {
      const float f = to_float(x);
      visible |= uint32_t(!(f <= hidden_at)) << c;
      zero |= uint32_t(f == 0.f) << c;
      if constexpr (kFill) fill |= uint32_t(f <= hidden_at && f != -INFINITY) << c;
    }
  };
  bool any_visible = false, all_full = true, binary = true;
  // the bits of a chunk's first n keys (n <= 0: none)
  auto first_keys = [](int n) { return n >= kChunk ? 0xFFu : (n > 0 ? (1u << n) - 1u : 0u); };
  // chunk i's bits, already cut to the keys in range: its byte, its fill byte and the votes
  auto record = [&](int i, uint32_t visible, uint32_t zero, uint32_t fill) {
    if constexpr (kFill) s_fill[slot][i] = static_cast<unsigned char>(fill);
    any_visible |= visible != 0;
    all_full &= (visible & zero) == 0xFFu;
    binary &= (visible & ~zero) == 0;  // hidden, or visible with nothing added
    s_bits[slot][i] = static_cast<unsigned char>(visible);
  };
  // this warp's rows: groups of rows_step rows, every wpt-th group from its part
  const int group_step = rows_step * wpt;
  // A tile inside the mask whose chunks are aligned runs of keys (a contiguous [B, 1, Sq, Sk]
  // mask: transformers'), the fast path: one pointer step per load, 128 bytes in flight per
  // lane, byte compares for a boolean chunk's bits. (The general loop below, with its
  // per-chunk strides, tails and scalar fallback, holds about 80 registers with 32 / 64 bytes
  // in flight; with more it spilled.)
  constexpr int kFastInFlight = (sizeof(T) == 1 ? 128 : 64) / int(kChunk * sizeof(T));
  const bool fast = active && a.sc == 1 && a.sr % kChunk == 0 &&
                    reinterpret_cast<uintptr_t>(base) % (kChunk * sizeof(T)) == 0 &&
                    q0 + a.tile_m <= a.seqlen_q && k0 + a.tile_n <= a.seqlen_k;
  if (fast) {
    const int r_first = (lane >> cpr_shift) + part * rows_step;
    const int64_t step = int64_t(group_step) * a.sr;  // elements
    const T* p = col_base + int64_t(q0 + r_first) * a.sr;
    for (int r0 = r_first; r0 < a.tile_m; r0 += group_step * kFastInFlight, p += step * kFastInFlight) {
      Chunk<T> loaded[kFastInFlight];
#pragma unroll
      for (int u = 0; u < kFastInFlight; ++u) {  // issue every load first
        if (r0 + u * group_step < a.tile_m) loaded[u] = load_chunk(p + u * step, true);
      }
#pragma unroll
      for (int u = 0; u < kFastInFlight; ++u) {
        const int r = r0 + u * group_step;
        if (r >= a.tile_m) break;
        uint32_t visible = 0, zero = kKind == MaskKind::kBool ? 0xFFu : 0u, fill = 0;
        if constexpr (kKind == MaskKind::kBool) {
          visible = nonzero_bits(*reinterpret_cast<const uint2*>(loaded[u].e));
        } else {
#pragma unroll
          for (int c = 0; c < kChunk; ++c) judge(loaded[u].e[c], c, visible, zero, fill);
        }
        // the causal cut (the key tail lies past the tile)
        const uint32_t range = a.is_causal ? first_keys(q0 + r + 1 - kc) : 0xFFu;
        record((r << cpr_shift) + col, visible & range, zero, fill & range);
      }
    }
  }
  for (int r0 = active && !fast ? (lane >> cpr_shift) + part * rows_step : a.tile_m; r0 < a.tile_m;
       r0 += group_step * kInFlight) {
    Chunk<T> loaded[kInFlight];
    uint32_t vec = 0;  // bit u: chunk u was loaded as a vector
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {  // issue every load first
      const int q = q0 + r0 + u * group_step;
      const T* src = col_base + int64_t(q) * a.sr;
      const bool v = keys_vec && r0 + u * group_step < a.tile_m && q < a.seqlen_q &&
                     reinterpret_cast<uintptr_t>(src) % (kChunk * sizeof(T)) == 0;
      loaded[u] = load_chunk(src, v);
      vec |= uint32_t(v) << u;
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int r = r0 + u * group_step, q = q0 + r;
      if (r >= a.tile_m) continue;
      const int i = (r << cpr_shift) + col;
      if (q >= a.seqlen_q) {  // padding rows: P = 0 there whatever the class
        s_bits[slot][i] = 0;
        if constexpr (kFill) s_fill[slot][i] = 0;
        continue;
      }
      // the chunk's keys inside the key tail and the causal cut: the first `in_range`
      int in_range = a.seqlen_k - kc;
      if (a.is_causal) in_range = min(in_range, q + 1 - kc);
      const uint32_t range = first_keys(in_range);
      uint32_t visible = 0, zero = kKind == MaskKind::kBool ? 0xFFu : 0u, fill = 0;  // one bit per key
      if ((vec >> u) & 1u) {
#pragma unroll
        for (int c = 0; c < kChunk; ++c) judge(loaded[u].e[c], c, visible, zero, fill);
      } else {
        const T* src = col_base + int64_t(q) * a.sr;
#pragma unroll
        for (int c = 0; c < kChunk; ++c) {
          if ((range >> c) & 1u) judge(src[int64_t(c) * a.sc], c, visible, zero, fill);  // (keys < Sk only)
        }
      }
      record(i, visible & range, zero, fill & range);
    }
  }
  const int chunks = a.tile_m << cpr_shift;
  any_visible = __any_sync(0xffffffffu, any_visible);
  all_full = __all_sync(0xffffffffu, all_full);
  binary = __all_sync(0xffffffffu, binary);
  if (wpt > 1) {  // the tile's warps' votes (and bytes) through shared memory
    if (lane == 0) {
      s_votes[warp][0] = any_visible;
      s_votes[warp][1] = all_full;
      s_votes[warp][2] = binary;
    }
    __syncthreads();
    if (!active || part != 0) return;  // the tile's first warp writes it
    for (int w = warp + 1; w < warp + wpt; ++w) {
      any_visible |= s_votes[w][0] != 0;
      all_full &= s_votes[w][1] != 0;
      binary &= s_votes[w][2] != 0;
    }
  }
  any_visible = any_visible && !no_live_row;
  binary = kKind == MaskKind::kBool || binary;
  const unsigned char cls = !any_visible ? kTileEmpty
                            : all_full   ? kTileFull
                            : binary     ? kTilePartialBits
                                         : kTilePartial;
  const int64_t idx = ((int64_t(b) * a.mask_heads + h) * a.num_n_blocks + n_block) * a.num_m_blocks + m_block;
  if constexpr (kFill) {  // this tile's share of each row's flags: lane per row, chunks or-ed
    __syncwarp();  // the other lanes' bytes (the other warps': the barrier above)
    uint32_t* flags = a.row_flags + (int64_t(b) * a.mask_heads + h) * a.seqlen_q + q0;
    for (int r = lane; r < a.tile_m && q0 + r < a.seqlen_q; r += 32) {
      unsigned seen = 0, fill = 0;
      for (int c = 0; c < (1 << cpr_shift); ++c) {
        seen |= s_bits[slot][(r << cpr_shift) + c];
        fill |= s_fill[slot][(r << cpr_shift) + c];
      }
      const uint32_t want = (seen != 0 ? 1u : 0u) | (fill != 0 ? 2u : 0u);
      // (flags only gain bits: a stale read costs an atomic, never a lost bit)
      if (want != 0u && (flags[r] & want) != want) atomicOr(flags + r, want);
    }
  }
  if (cls == kTilePartialBits) {
    __syncwarp();  // the other lanes' bytes (the other warps': the barrier above)
    // (chunks is a multiple of 16: tile_m * tile_n / 8 with tile sizes multiples of 64)
    auto* out = reinterpret_cast<uint4*>(reinterpret_cast<unsigned char*>(a.tile_bits) + idx * chunks);
    const auto* in = reinterpret_cast<const uint4*>(s_bits[slot]);
    for (int v = lane; v < chunks / 16; v += 32) out[v] = in[v];
  }
  if (lane == 0) a.tile_class[idx] = cls;
}

// The forward's fill rows (FwdFillRows), one warp per (mask instance, m-block): a block with a
// row whose flags are "a fill entry, no visible key" has every tile made kTilePartial (the
// element path gives that row SDPA's uniform weights over the fill's keys); then
// block_elements[instance][m-block] = 1 where the block has a kTilePartial tile.
constexpr int kFillRowsWarps = 4;

__global__ void __launch_bounds__(kFillRowsWarps * 32)
    fill_rows_kernel(unsigned char* tile_class, const uint32_t* row_flags, unsigned char* block_elements,
                     int* element_count, int64_t blocks, int num_m_blocks, int num_n_blocks, int tile_m, int seqlen_q) {
  const int64_t block = int64_t(blockIdx.x) * kFillRowsWarps + threadIdx.x / 32;  // inst * m_blocks + m
  const int lane = threadIdx.x % 32;
  if (block >= blocks) return;
  const int64_t inst = block / num_m_blocks;
  const int m_block = int(block - inst * num_m_blocks);
  bool fill_row = false;
  for (int r = lane; r < tile_m; r += 32) {
    const int q = m_block * tile_m + r;
    if (q < seqlen_q) fill_row |= row_flags[inst * seqlen_q + q] == 2u;
  }
  fill_row = __any_sync(0xffffffffu, fill_row);
  unsigned char* cls = tile_class + inst * num_n_blocks * num_m_blocks + m_block;
  bool elements = false;
  for (int n = lane; n < num_n_blocks; n += 32) {
    unsigned char& c = cls[int64_t(n) * num_m_blocks];
    if (fill_row) c = kTilePartial;
    elements |= c == kTilePartial;
  }
  elements = __any_sync(0xffffffffu, elements);
  if (lane == 0) {
    block_elements[block] = elements;
    if (elements) atomicAdd(element_count, 1);
  }
}

// The backward's fill rows (run_mask_classify's backward_fill_rows): one thread per (batch,
// q head, query row) reads its lse; a row whose lse is finite but lse * log2(e) at most
// kFillDeadBelow (it overflows for SDPA's lse, the fill plus log n; our forward writes about
// -FLT_MAX ln 2, whose product is kFillDeadBelow itself) is a fill row. The warp then takes
// its fill rows (rare: padding queries) one after the other: it counts the keys of the row's
// fill inside the key tail and the causal cut; with n >= 1 it tags the row's lse_log2 with n
// and makes every tile of its m-block (of its mask instance) kTilePartialFillRows. (One warp
// per row cost the masked backward 4-9% at d64 2k keys, H100: most of the grid's warps only
// read one lse.)
struct FillLseArgs : TileGrid {
  const float* lse;  // [B, Hq, Sq], strided (BwdParams::lse)
  int64_t lse_sb, lse_sh, lse_sr;
  float* lse_log2;  // [B, Hq, lse_rows]
  int64_t lse_rows;
  int batch, heads_q, mask_batch;
};

constexpr int kFillLseThreads = 256;

template <MaskKind kKind>
__global__ void __launch_bounds__(kFillLseThreads) fill_rows_from_lse_kernel(const FillLseArgs a) {
  using T = typename MaskElem<kKind>::type;
  const int64_t rows = int64_t(a.batch) * a.heads_q * a.seqlen_q;
  const int64_t row = int64_t(blockIdx.x) * kFillLseThreads + threadIdx.x;  // (b * Hq + h) * Sq + q
  const int lane = threadIdx.x % 32;
  bool fill = false;
  if (row < rows) {
    const int64_t bh = row / a.seqlen_q;
    const int q = int(row - bh * a.seqlen_q), h = int(bh % a.heads_q), b = int(bh / a.heads_q);
    const float lse = a.lse[int64_t(b) * a.lse_sb + int64_t(h) * a.lse_sh + int64_t(q) * a.lse_sr];
    // not a fill row: -inf / NaN, or a product above the fill (the preprocess's lse_log2 is the
    // same product, +inf where it overflowed)
    fill = isfinite(lse) && lse * kLog2e <= kFillDeadBelow;
  }
  unsigned pending = __ballot_sync(0xffffffffu, fill);
  const float fill_at = hidden_at_or_below<T>(kFillDeadBelow);
  while (pending != 0u) {  // (warp-uniform)
    const int from = __ffs(int(pending)) - 1;
    pending &= pending - 1u;
    const int64_t r = __shfl_sync(0xffffffffu, static_cast<long long>(row), from);
    const int64_t bh = r / a.seqlen_q;
    const int q = int(r - bh * a.seqlen_q), h = int(bh % a.heads_q), b = int(bh / a.heads_q);
    const int mb = a.mask_batch == 1 ? 0 : b, mh = a.mask_heads == 1 ? 0 : h;
    const T* src = static_cast<const T*>(a.mask) + int64_t(mb) * a.sb + int64_t(mh) * a.sh + int64_t(q) * a.sr;
    const int keys = a.is_causal ? min(a.seqlen_k, q + 1) : a.seqlen_k;
    uint32_t n = 0;
    for (int j = lane; j < keys; j += 32) {
      const float f = to_float(src[int64_t(j) * a.sc]);
      n += f <= fill_at && f != -INFINITY;
    }
    for (int off = 16; off > 0; off >>= 1) n += __shfl_xor_sync(0xffffffffu, n, off);
    if (n == 0) continue;  // (an lse so low without the fill: nothing to weigh uniformly)
    if (lane == 0) a.lse_log2[bh * a.lse_rows + q] = fill_row_lse_log2(n);
    // (rows of one m-block write the same class: a benign race)
    unsigned char* cls = a.tile_class + (int64_t(mb) * a.mask_heads + mh) * a.num_n_blocks * a.num_m_blocks +
                         q / a.tile_m;
    for (int nb = lane; nb < a.num_n_blocks; nb += 32) cls[int64_t(nb) * a.num_m_blocks] = kTilePartialFillRows;
  }
}

template <MaskKind kKind>
void launch_fill_rows_from_lse(const FillLseArgs& a, cudaStream_t stream) {
  const int64_t rows = int64_t(a.batch) * a.heads_q * a.seqlen_q;
  fill_rows_from_lse_kernel<kKind>
      <<<unsigned((rows + kFillLseThreads - 1) / kFillLseThreads), kFillLseThreads, 0, stream>>>(a);
}

// The non-empty stretch of a row of `count` tile classes (row[i * stride]), one warp: [lo, hi)
// from the first to past the last non-empty class, {0, 0} when none. Every lane returns it.
__device__ int2 live_range(const unsigned char* row, int count, int64_t stride, unsigned char* copy = nullptr) {
  const int lane = threadIdx.x % 32;
  int lo = count, hi = 0;
  for (int i0 = 0; i0 < count; i0 += 32) {
    const int i = i0 + lane;
    const unsigned char cls = i < count ? row[int64_t(i) * stride] : kTileEmpty;
    if (copy != nullptr && i < count) copy[i] = cls;
    const unsigned live = __ballot_sync(0xffffffffu, cls != kTileEmpty);
    if (live != 0u) {
      lo = min(lo, i0 + __ffs(int(live)) - 1);
      hi = i0 + 32 - __clz(int(live));
    }
  }
  return lo < hi ? make_int2(lo, hi) : make_int2(0, 0);
}

// One warp per (mask instance, n-block) row of tile classes: the m-blocks [lo, hi) from the
// first to past the last non-empty tile, {0, 0} when none (BwdParams::tile_m_range).
constexpr int kRangeWarps = 4;

__global__ void __launch_bounds__(kRangeWarps * 32)
    tile_range_kernel(const unsigned char* tile_class, int2* tile_m_range, int64_t rows,
                      int num_m_blocks) {
  // The main kernel, launched programmatically after this one, may start its prologue now;
  // it waits for this grid's completion before it reads a class or a range (grid_dependency.h)
  allow_dependent_grids();
  const int64_t row = int64_t(blockIdx.x) * kRangeWarps + threadIdx.x / 32;
  if (row >= rows) return;
  const int2 r = live_range(tile_class + row * num_m_blocks, num_m_blocks, 1);
  if (threadIdx.x % 32 == 0) tile_m_range[row] = r;
}

// The forward's key ranges and class rows (run_fwd_key_ranges): one warp per (mask instance,
// query block).
__global__ void __launch_bounds__(kRangeWarps * 32)
    key_range_kernel(const unsigned char* tile_class, int2* key_range, unsigned char* block_classes,
                     int64_t blocks, int num_m_blocks, int num_n_blocks) {
  const int64_t block = int64_t(blockIdx.x) * kRangeWarps + threadIdx.x / 32;  // inst * m_blocks + m
  if (block >= blocks) return;
  const int64_t inst = block / num_m_blocks;
  const int m_block = int(block - inst * num_m_blocks);
  const int2 r = live_range(tile_class + inst * num_n_blocks * num_m_blocks + m_block, num_n_blocks,
                            num_m_blocks, block_classes + block * num_n_blocks);
  if (threadIdx.x % 32 == 0) key_range[block] = r;
}

// A float mask's classification: with the forward's fill flags (kFill) or without.
template <MaskKind kKind>
void launch_float_classify(bool fill_rows, dim3 grid, int threads, cudaStream_t stream,
                           const ClassifyArgs& a) {
  if (fill_rows) {
    mask_classify_kernel<kKind, true><<<grid, threads, 0, stream>>>(a);
  } else {
    mask_classify_kernel<kKind><<<grid, threads, 0, stream>>>(a);
  }
}

}  // namespace

void run_mask_classify(const BwdParams& p, cudaStream_t stream, const FwdFillRows* fill,
                       bool backward_fill_rows) {
  // the classify kernel's tile: rows of at most 32 chunks (a power of two), kMaxChunks in all
  if (p.tile_n % kChunk != 0 || p.tile_n > 32 * kChunk || (p.tile_n & (p.tile_n - 1)) != 0 ||
      int64_t(p.tile_m) * p.tile_n / kChunk > kMaxChunks) {
    throw std::invalid_argument("run_mask_classify: unsupported tile " + std::to_string(p.tile_m) + " x " +
                                std::to_string(p.tile_n));
  }
  ClassifyArgs a{};
  static_cast<TileGrid&>(a) = tile_grid(p);
  a.tile_bits = p.tile_bits;
  // additive masks: the shares the preprocess launch's bounds CTAs wrote (mask_bounds.h)
  mask_bounds::BoundsArgs ba;
  int bounds_ctas = 0;
  if (mask_bounds::plan(p, ba, bounds_ctas)) {
    a.bounds_partial = p.bounds_partial;
    a.bounds_splits = ba.splits;
    a.bounds_count = mask_bounds::share_count(ba);
    a.q_norm_max = p.q_norm_max;
    a.scale_log2_abs = fabsf(p.scale_log2);
  }
  const int64_t instances = int64_t(p.mask_heads) * p.mask_batch;
  const bool fill_rows = fill != nullptr && p.mask_kind != MaskKind::kBool;
  if (fill_rows) {
    a.row_flags = fill->row_flags;
    // element_count lies before row_flags (fwd_mask_workspace_layout): one memset zeroes both,
    // its size taken from the two addresses rather than from the layout's gap
    const char* first = reinterpret_cast<const char*>(fill->element_count);
    const size_t bytes = size_t(reinterpret_cast<const char*>(fill->row_flags) - first) +
                         size_t(instances * p.seqlen_q) * sizeof(uint32_t);
    cudaMemsetAsync(fill->element_count, 0, bytes, stream);
  }
  const int64_t tiles = int64_t(p.num_m_blocks) * p.num_n_blocks;
  // warps per tile: enough warps for about 24 per multiprocessor (3 CTAs of 8)
  const int64_t want_warps = 24 * int64_t(p.num_sms > 0 ? p.num_sms : 132);
  const int64_t all_tiles = tiles * p.mask_heads * p.mask_batch;
  a.warps_per_tile = 1;
  while (a.warps_per_tile < kClassifyWarps && all_tiles * a.warps_per_tile < want_warps) a.warps_per_tile *= 2;
  const int64_t tiles_per_cta = kClassifyWarps / a.warps_per_tile;
  const dim3 grid(unsigned((tiles + tiles_per_cta - 1) / tiles_per_cta), unsigned(p.mask_heads),
                  unsigned(p.mask_batch));
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  constexpr int kClassifyThreads = kClassifyWarps * 32;
  switch (p.mask_kind) {
    case MaskKind::kBool:
      mask_classify_kernel<MaskKind::kBool><<<grid, kClassifyThreads, 0, stream>>>(a);
      break;
    case MaskKind::kFloat16:
      launch_float_classify<MaskKind::kFloat16>(fill_rows, grid, kClassifyThreads, stream, a);
      break;
    case MaskKind::kBFloat16:
      launch_float_classify<MaskKind::kBFloat16>(fill_rows, grid, kClassifyThreads, stream, a);
      break;
    case MaskKind::kFloat32:
      launch_float_classify<MaskKind::kFloat32>(fill_rows, grid, kClassifyThreads, stream, a);
      break;
    default:
      return;
  }
  if (fill_rows) {
    const int64_t blocks = instances * p.num_m_blocks;
    fill_rows_kernel<<<unsigned((blocks + kFillRowsWarps - 1) / kFillRowsWarps), kFillRowsWarps * 32, 0, stream>>>(
        p.tile_class, fill->row_flags, fill->block_elements, fill->element_count, blocks, p.num_m_blocks,
        p.num_n_blocks, p.tile_m, p.seqlen_q);
  }
  // (fp16's minimum, -65504, is no clamped fill: such rows keep a finite lse_log2)
  if (backward_fill_rows && (p.mask_kind == MaskKind::kBFloat16 || p.mask_kind == MaskKind::kFloat32) &&
      p.lse != nullptr && p.lse_log2 != nullptr && int64_t(p.batch) * p.heads_q * p.seqlen_q > 0) {
    FillLseArgs f{};
    static_cast<TileGrid&>(f) = tile_grid(p);
    f.lse = p.lse;
    f.lse_sb = p.lse_batch_stride;
    f.lse_sh = p.lse_head_stride;
    f.lse_sr = p.lse_row_stride;
    f.lse_log2 = p.lse_log2;
    f.lse_rows = p.seqlen_q_rounded;
    f.batch = p.batch;
    f.heads_q = p.heads_q;
    f.mask_batch = p.mask_batch;
    if (p.mask_kind == MaskKind::kBFloat16) {
      launch_fill_rows_from_lse<MaskKind::kBFloat16>(f, stream);
    } else {
      launch_fill_rows_from_lse<MaskKind::kFloat32>(f, stream);
    }
  }
  if (p.tile_m_range == nullptr) return;  // (the forward: run_fwd_key_ranges instead)
  const int64_t rows = int64_t(p.mask_batch) * p.mask_heads * p.num_n_blocks;
  tile_range_kernel<<<unsigned((rows + kRangeWarps - 1) / kRangeWarps), kRangeWarps * 32, 0, stream>>>(
      p.tile_class, reinterpret_cast<int2*>(p.tile_m_range), rows, p.num_m_blocks);
}

void run_fwd_key_ranges(const unsigned char* tile_class, int2* key_range, unsigned char* block_classes,
                        int64_t instances, int num_m_blocks, int num_n_blocks, cudaStream_t stream) {
  const int64_t blocks = instances * num_m_blocks;
  if (blocks == 0) return;
  key_range_kernel<<<unsigned((blocks + kRangeWarps - 1) / kRangeWarps), kRangeWarps * 32, 0, stream>>>(
      tile_class, key_range, block_classes, blocks, num_m_blocks, num_n_blocks);
}

}  // namespace sm90_sdpa
