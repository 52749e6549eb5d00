// The score bounds of an additive mask's classification (mask_classify.h): per mask instance,
// the max ||q_i|| and min lse_log2 over each m-block's live rows and the max ||k_j|| over each
// n-block's keys. They are computed by extra CTAs of the preprocess launch (prepost.cu), which
// reads rows of the same shape at the same time (one launch, and the reads overlap), each CTA
// writing its share into BwdParams::bounds_partial; the classify kernel folds the shares.
// Device code: included by prepost.cu (the CTAs) and mask_classify.cu (the plan, the fold).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "bwd_params.h"
#include "numeric.h"

namespace sm90_sdpa {
namespace mask_bounds {

// threads of a bounds CTA (the preprocess launch's block size)
constexpr int kBoundsThreads = 256;

struct BoundsArgs {
  const void* q;  // [B, Hq, Sq, D]
  int64_t q_sb, q_sh, q_sr;
  const void* k;  // [B, Hkv, Sk, D]
  int64_t k_sb, k_sh, k_sr;
  const float* lse;  // [B, Hq, Sq] natural log (read directly: the preprocess converts it in
  int64_t lse_sb, lse_sh, lse_sr;  // the same launch, so lse_log2 is not there yet)
  int batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim;
  int tile_m, tile_n, num_m_blocks, num_n_blocks, mask_batch, mask_heads;
  // the rows of a block are split between `splits` CTAs (a block of a broadcast mask covers
  // every (batch, head): few blocks, many rows), each writing its share's values at
  // partial + split * count, count = instances * (2 * num_m_blocks + num_n_blocks): the
  // q_norm_max, lse_min and k_norm_max of every instance, in that order (BwdParams' arrays).
  int splits;
  float* partial;
};

// The bounds CTAs of a problem: false when there are none (no additive mask, or a layout the
// fold does not handle: then finite biases stay partial tiles, correct and only slower).
// Both the preprocess (which runs them) and the classification (which folds their shares)
// call it on the same params, so both see the same split count.
inline bool plan(const BwdParams& p, BoundsArgs& a, int& ctas) {
  ctas = 0;
  if (p.mask_kind == MaskKind::kNone || p.mask_kind == MaskKind::kBool || p.q_norm_max == nullptr ||
      p.lse_min == nullptr || p.k_norm_max == nullptr || p.bounds_partial == nullptr || p.lse == nullptr ||
      p.num_m_blocks <= 0 || p.num_n_blocks <= 0 || p.mask_batch <= 0 || p.mask_heads <= 0 ||
      // BlockRows: the tile sizes are powers of two (every configuration's are)
      (p.tile_m & (p.tile_m - 1)) != 0 || (p.tile_n & (p.tile_n - 1)) != 0 ||
      // the fold writes the three arrays as one (make_params lays them out so)
      p.lse_min != p.q_norm_max + int64_t(p.num_m_blocks) * p.mask_heads * p.mask_batch ||
      p.k_norm_max != p.lse_min + int64_t(p.num_m_blocks) * p.mask_heads * p.mask_batch) {
    return false;
  }
  a = BoundsArgs{};
  a.q = p.q;
  a.q_sb = p.q_batch_stride;
  a.q_sh = p.q_head_stride;
  a.q_sr = p.q_row_stride;
  a.k = p.k;
  a.k_sb = p.k_batch_stride;
  a.k_sh = p.k_head_stride;
  a.k_sr = p.k_row_stride;
  a.lse = p.lse;
  a.lse_sb = p.lse_batch_stride;
  a.lse_sh = p.lse_head_stride;
  a.lse_sr = p.lse_row_stride;
  a.batch = p.batch;
  a.heads_q = p.heads_q;
  a.heads_kv = p.heads_kv;
  a.seqlen_q = p.seqlen_q;
  a.seqlen_k = p.seqlen_k;
  a.head_dim = p.head_dim;
  a.tile_m = p.tile_m;
  a.tile_n = p.tile_n;
  a.num_m_blocks = p.num_m_blocks;
  a.num_n_blocks = p.num_n_blocks;
  a.mask_batch = p.mask_batch;
  a.mask_heads = p.mask_heads;
  a.partial = p.bounds_partial;
  // enough CTAs for about four per multiprocessor
  const int64_t blocks = int64_t(p.num_m_blocks + p.num_n_blocks) * p.mask_heads * p.mask_batch;
  const int64_t want = (4 * int64_t(p.num_sms > 0 ? p.num_sms : 132) + blocks - 1) / blocks;
  a.splits = static_cast<int>(std::min<int64_t>(kMaxBoundSplits, std::max<int64_t>(1, want)));
  const int64_t total = blocks * a.splits;
  if (total > (int64_t(1) << 30)) return false;  // (a 1-D grid share; never near in practice)
  ctas = static_cast<int>(total);
  return true;
}

// values per share: instances * (2 * num_m_blocks + num_n_blocks)
__host__ __device__ inline int64_t share_count(const BoundsArgs& a) {
  return int64_t(a.mask_batch) * a.mask_heads * (2 * a.num_m_blocks + a.num_n_blocks);
}

// ||x||^2 of 8 elements (one 16-byte vector).
template <typename T>
__device__ __forceinline__ float sumsq8(const uint4 v) {
  const T* e = reinterpret_cast<const T*>(&v);
  float s = 0.f;
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    const float x = to_float(e[c]);
    s = fmaf(x, x, s);
  }
  return s;
}

// Rows [begin, end) of one block side: row_of(t, l) is row t's address (null: no such row)
// and sets l to its lse_log2 (q side; -inf on the key side). Vector path (16-byte aligned
// rows, D a multiple of 8): a group of L lanes per row, L the largest power of two <= D / 32
// (2 at d64 / d96, 4 at d128 / d192, 8 at d256), each lane ceil(D / 8 / L) <= kSlots vectors
// of it (4, 6 at d96 / d192, at most 8) and 8 / kSlots rows in flight: the per-row work (index math,
// the lse load, the group's reduction) is shared by 4-6 vectors. Else a warp per row.
constexpr int kVectorsInFlight = 8;

template <typename T, int kSlots, class RowOf, class Take>
__device__ __forceinline__ void vector_rows(int begin, int end, int vecs, int group, RowOf row_of, Take take) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = kBoundsThreads / 32;
  const int per_warp = 32 / group, sub = lane % group;
  const int stride = warps * per_warp;
  constexpr int kRows = kVectorsInFlight / kSlots > 0 ? kVectorsInFlight / kSlots : 1;
  for (int w0 = begin + warp * per_warp; w0 < end; w0 += stride * kRows) {
    uint4 v[kRows][kSlots];
    float l[kRows];
#pragma unroll
    for (int u = 0; u < kRows; ++u) {  // issue every load first
      const int t = w0 + lane / group + u * stride;
      l[u] = INFINITY;  // (no row: skipped by take)
      const uint4* row = t < end ? reinterpret_cast<const uint4*>(row_of(t, l[u])) : nullptr;
#pragma unroll
      for (int x = 0; x < kSlots; ++x) {
        const int vi = sub + x * group;
        v[u][x] = row != nullptr && vi < vecs ? row[vi] : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      float acc = 0.f;
#pragma unroll
      for (int x = 0; x < kSlots; ++x) acc += sumsq8<T>(v[u][x]);
      for (int off = group / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
      take(acc, l[u]);
    }
  }
}

template <typename T, class RowOf>
__device__ void side_bounds(int begin, int end, int head_dim, bool vec_ok, RowOf row_of, float& norm_max,
                            float& lse_lo) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = kBoundsThreads / 32;
  auto take = [&](float sumsq, float l) {  // l: the row's lse_log2 (q side) or -inf (k side)
    if (l == INFINITY) return;             // P = 0 on this row whatever the scores (or no row)
    if (l != l) l = -INFINITY;             // NaN: no bound
    const float n = sqrtf(sumsq);
    norm_max = fmaxf(norm_max, n <= 3.0e38f ? n : INFINITY);  // a NaN must never shrink a bound
    lse_lo = fminf(lse_lo, l);
  };
  if (!vec_ok) {
    for (int t = begin + warp; t < end; t += warps) {
      float l = INFINITY;
      const T* row = row_of(t, l);
      if (row == nullptr || l == INFINITY) continue;
      float acc = 0.f;
      for (int c = lane; c < head_dim; c += 32) {
        const float x = to_float(row[c]);
        acc = fmaf(x, x, acc);
      }
      for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
      take(acc, l);
    }
    return;
  }
  const int vecs = head_dim / 8;
  int group = 32;
  while (group > 1 && group * 4 > vecs) group >>= 1;
  // group * 4 <= vecs < group * 8 (group < 32): at most 8 vectors per lane
  const int slots = (vecs + group - 1) / group;
  if (slots > 6) {
    vector_rows<T, 8>(begin, end, vecs, group, row_of, take);
  } else if (slots > 4) {
    vector_rows<T, 6>(begin, end, vecs, group, row_of, take);  // d96, d192
  } else {
    vector_rows<T, 4>(begin, end, vecs, group, row_of, take);
  }
}

__device__ __forceinline__ bool aligned16(const void* p, int64_t s0, int64_t s1, int64_t s2, int elem) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0 && (s0 * elem) % 16 == 0 && (s1 * elem) % 16 == 0 &&
         (s2 * elem) % 16 == 0;
}

// The rows of one block side over the (batch, head) pairs an instance covers: row t is
// (pair t >> shift, row r = t & (span - 1) of the block), span = the tile size (a power of two),
// rows r >= rows (the last block's tail) absent; pair -> (b, h) by a multiply (no division
// in the per-row index math, which dominated this kernel's instructions).
struct BlockRows {
  int shift, rows, r0;  // r0: the block's first row
  int b0, h0, nh;       // pairs: b0 + pair / nh, h0 + pair % nh
  uint32_t magic;       // floor((2^32 - 1) / nh)
  __device__ BlockRows(int span, int rows_, int r0_, int b0_, int h0_, int nh_)
      : shift(0), rows(rows_), r0(r0_), b0(b0_), h0(h0_), nh(nh_), magic(0xFFFFFFFFu / uint32_t(nh_)) {
    while ((1 << shift) < span) ++shift;
  }
  __device__ int count(int pairs) const { return pairs << shift; }
  // false for an absent row; else its (b, h, row index)
  __device__ bool at(int t, int& b, int& h, int& r) const {
    const int pair = t >> shift;
    r = t & ((1 << shift) - 1);
    if (r >= rows) return false;
    int q = int(__umulhi(uint32_t(pair), magic));  // pair / nh or one less
    if (pair - q * nh >= nh) ++q;
    b = b0 + q;
    h = h0 + (pair - q * nh);
    r += r0;
    return true;
  }
};

// Bounds CTA `cta` of plan()'s `ctas`: (block x, split and mask head instance y, mask batch
// instance z), x-fastest. Block x < num_m_blocks is a query block (max ||q_i|| and min
// lse_log2 over its live rows, lse_log2 < +inf, of every (batch, q head) the instance
// covers), the rest key blocks (max ||k_j||, keys < Sk, of every (batch, kv head) it covers);
// the CTA takes split y / mask_heads of those rows. Uses the CTA's kBoundsThreads threads and
// one __syncthreads.
template <typename T>
__device__ void block_bounds_cta(const BoundsArgs& a, int cta) {
  const int bx = cta % (a.num_m_blocks + a.num_n_blocks);
  const int by = cta / (a.num_m_blocks + a.num_n_blocks) % (a.mask_heads * a.splits);
  const int mb = cta / ((a.num_m_blocks + a.num_n_blocks) * a.mask_heads * a.splits);
  const int mh = by % a.mask_heads, split = by / a.mask_heads;
  // this CTA's share [begin, end) of `total` rows
  auto share = [&](int total, int& begin, int& end) {
    const int per = (total + a.splits - 1) / a.splits;
    begin = min(total, split * per);
    end = min(total, begin + per);
  };
  const int b0 = a.mask_batch == 1 ? 0 : mb, b1 = a.mask_batch == 1 ? a.batch : mb + 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = kBoundsThreads / 32;
  const bool q_side = bx < a.num_m_blocks;
  const bool vec_dim = a.head_dim % 8 == 0;
  float norm_max = 0.f, lse_lo = INFINITY;
  if (q_side) {
    const int m = bx;
    const int h0 = a.mask_heads == 1 ? 0 : mh, h1 = a.mask_heads == 1 ? a.heads_q : mh + 1;
    const int r0 = m * a.tile_m, r1 = min(r0 + a.tile_m, a.seqlen_q);
    const BlockRows space(a.tile_m, r1 > r0 ? r1 - r0 : 0, r0, b0, h0, h1 - h0);
    int begin, end;
    share(space.count((b1 - b0) * (h1 - h0)), begin, end);
    auto row_of = [&](int t, float& l) -> const T* {
      int b, h, r;
      if (!space.at(t, b, h, r)) return nullptr;
      l = lse_log2_of(a.lse[b * a.lse_sb + h * a.lse_sh + r * a.lse_sr]);  // (as the preprocess)
      return static_cast<const T*>(a.q) + b * a.q_sb + h * a.q_sh + r * a.q_sr;
    };
    side_bounds<T>(begin, end, a.head_dim, vec_dim && aligned16(a.q, a.q_sb, a.q_sh, a.q_sr, sizeof(T)),
                   row_of, norm_max, lse_lo);
  } else {
    const int n = bx - a.num_m_blocks;
    const int group = a.heads_q / a.heads_kv;
    const int h0 = a.mask_heads == 1 ? 0 : mh / group;
    const int h1 = a.mask_heads == 1 ? a.heads_kv : mh / group + 1;
    const int r0 = n * a.tile_n, r1 = min(r0 + a.tile_n, a.seqlen_k);
    const BlockRows space(a.tile_n, r1 > r0 ? r1 - r0 : 0, r0, b0, h0, h1 - h0);
    int begin, end;
    share(space.count((b1 - b0) * (h1 - h0)), begin, end);
    auto row_of = [&](int t, float& l) -> const T* {  // keys: every row counts (l = -inf)
      int b, h, r;
      if (!space.at(t, b, h, r)) return nullptr;
      l = -INFINITY;
      return static_cast<const T*>(a.k) + b * a.k_sb + h * a.k_sh + r * a.k_sr;
    };
    side_bounds<T>(begin, end, a.head_dim, vec_dim && aligned16(a.k, a.k_sb, a.k_sh, a.k_sr, sizeof(T)),
                   row_of, norm_max, lse_lo);
    lse_lo = INFINITY;  // (unused on the key side)
  }
  for (int off = 16; off > 0; off >>= 1) {  // the vector path's row groups hold their own values
    norm_max = fmaxf(norm_max, __shfl_xor_sync(0xffffffffu, norm_max, off));
    lse_lo = fminf(lse_lo, __shfl_xor_sync(0xffffffffu, lse_lo, off));
  }
  __shared__ float s_norm[kBoundsThreads / 32], s_lse[kBoundsThreads / 32];
  if (lane == 0) {
    s_norm[warp] = norm_max;
    s_lse[warp] = lse_lo;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < warps; ++w) {
      norm_max = fmaxf(norm_max, s_norm[w]);
      lse_lo = fminf(lse_lo, s_lse[w]);
    }
    const int64_t inst = int64_t(mb) * a.mask_heads + mh, instances = int64_t(a.mask_batch) * a.mask_heads;
    float* part = a.partial + split * share_count(a);
    if (q_side) {
      part[inst * a.num_m_blocks + bx] = norm_max;
      part[(instances + inst) * a.num_m_blocks + bx] = lse_lo;
    } else {
      part[2 * instances * a.num_m_blocks + inst * a.num_n_blocks + (bx - a.num_m_blocks)] = norm_max;
    }
  }
}

}  // namespace mask_bounds
}  // namespace sm90_sdpa
