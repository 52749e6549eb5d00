// Preprocess and postprocess kernels of the attention backward. See prepost.h for the contract.
//
// Both kernels map a group of G threads (G a power of two, 1..32, aligned inside a warp) to one
// row of D elements. A CTA takes chunks of kChunkRows consecutive rows of one (batch, head) in
// a grid-stride loop, so the grid stays small whatever B * H * S is (the big product lives in
// the loop, never in gridDim.y/z) and the (batch, head, row) of a row comes from one division
// per chunk, not per row. (Both kernels are memory bound, about 2.8 TB/s on the H200: the
// per-row divisions they had before cost them only 3-4%.)
// Rows are read and written with 16-byte vectors when the pointers and every stride that
// matters allow it (checked on the host for each launch); otherwise the scalar path handles
// any element alignment.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "bwd_params.h"
#include "grid_dependency.h"
#include "mask_bounds.h"
#include "numeric.h"
#include "prepost.h"

namespace sm90_sdpa {
namespace {

constexpr int kThreads = 256;
// rows of one (batch, head) per chunk of work (the workspaces' row counts are multiples of it)
constexpr int kChunkRows = kSeqRound;

// ---- small conversion helpers -------------------------------------------------------------

template <typename T>
struct Vec2;
template <>
struct Vec2<__half> {
  using type = __half2;
};
template <>
struct Vec2<__nv_bfloat16> {
  using type = __nv_bfloat162;
};

__device__ __forceinline__ float2 to_float2(__half2 x) { return __half22float2(x); }
__device__ __forceinline__ float2 to_float2(__nv_bfloat162 x) { return __bfloat1622float2(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

template <typename T>
__device__ __forceinline__ typename Vec2<T>::type from_float2(float a, float b);
template <>
__device__ __forceinline__ __half2 from_float2<__half>(float a, float b) {
  return __floats2half2_rn(a, b);
}
template <>
__device__ __forceinline__ __nv_bfloat162 from_float2<__nv_bfloat16>(float a, float b) {
  return __floats2bfloat162_rn(a, b);
}

// sum of the 8 products of two 16-byte vectors of 16-bit floats
template <typename T>
__device__ __forceinline__ float dot8(const uint4& a, const uint4& b) {
  using V2 = typename Vec2<T>::type;
  const V2* pa = reinterpret_cast<const V2*>(&a);
  const V2* pb = reinterpret_cast<const V2*>(&b);
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 fa = to_float2(pa[i]);
    float2 fb = to_float2(pb[i]);
    acc = fmaf(fa.x, fb.x, acc);
    acc = fmaf(fa.y, fb.y, acc);
  }
  return acc;
}

// ---- preprocess ---------------------------------------------------------------------------

struct PreArgs {
  const void* out;
  int64_t out_sb, out_sh, out_sr;
  const void* dout;
  int64_t dout_sb, dout_sh, dout_sr;
  const float* lse;
  int64_t lse_sb, lse_sh, lse_sr;
  float* dpsum;
  float* lse_log2;
  float* dq_accum;
  float* dk_accum;  // may be null (then chunks_kv == 0)
  int* tile_counter;  // zeroed (the main kernel's persistent CTAs), may be null
  float4* split_zero;      // the split tail's counts and sums (BwdParams), zeroed; may be null
  int64_t split_zero_vec4; // their 16-byte words
  float* dv_accum;
  int heads_q, seqlen_q, seqlen_q_rounded, seqlen_k_rounded, head_dim, head_dim_v;
  int64_t chunks_q;   // B * Hq * ceil(Sq_rounded / kChunkRows)
  int64_t chunks_kv;  // B * Hkv * ceil(Sk_rounded / kChunkRows) when the kv accumulators are
                      // zeroed, else 0
  int group_log2;     // G = 1 << group_log2 threads per row
  // additive masks: the first bounds_ctas CTAs of the launch compute the score bounds' shares
  // (mask_bounds.h) while the rest run the preprocess: one launch, the reads overlapping
  int bounds_ctas;
  mask_bounds::BoundsArgs bounds;
  bool reversed;  // BwdParams::prepost_reversed: the kv chunks, then the q chunks last to first
};

__device__ __forceinline__ void zero_row(float* p, int n, int lane, int group, bool vec) {
  if (vec) {
    float4* p4 = reinterpret_cast<float4*>(p);
    const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int c = lane; c < n / 4; c += group) p4[c] = z;
  } else {
    for (int c = lane; c < n; c += group) p[c] = 0.f;
  }
}

template <typename T, bool kVecIn, bool kVecAcc, bool kBounds>
__global__ void __launch_bounds__(kThreads) bwd_preprocess_kernel(const PreArgs a) {
  static_assert(kThreads == mask_bounds::kBoundsThreads, "a bounds CTA is a preprocess CTA");
  // the main kernel may start on the SMs this launch leaves free (grid_dependency.h)
  allow_dependent_grids();
  if (blockIdx.x == 0 && threadIdx.x == 0 && a.tile_counter != nullptr) { *a.tile_counter = 0; }
  int block = blockIdx.x, blocks = gridDim.x;
  if constexpr (kBounds) {
    if (block < a.bounds_ctas) {
      mask_bounds::block_bounds_cta<T>(a.bounds, block);
      return;
    }
    block -= a.bounds_ctas;
    blocks -= a.bounds_ctas;
  }
  for (int64_t i = int64_t(block) * kThreads + threadIdx.x; i < a.split_zero_vec4; i += int64_t(blocks) * kThreads) {
    a.split_zero[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  const int group = 1 << a.group_log2;
  const int lane = threadIdx.x & (group - 1);
  // rows of a chunk: slot, slot + per_pass, ...; every group of a warp makes the same number
  // of passes (kChunkRows is a multiple of per_pass, or a whole warp's slots are >= it), so
  // every lane reaches the shuffles of every pass
  const int slot = threadIdx.x >> a.group_log2;
  const int per_pass = kThreads >> a.group_log2;
  const int chunks_per_bh_q = (a.seqlen_q_rounded + kChunkRows - 1) / kChunkRows;
  const int chunks_per_bh_kv = (a.seqlen_k_rounded + kChunkRows - 1) / kChunkRows;

  for (int64_t item = block; item < a.chunks_q + a.chunks_kv; item += blocks) {
    // (reversed: the q chunks of the first (batch, head) come last, the main kernel's first reads)
    const int64_t chunk = !a.reversed ? item
                          : item < a.chunks_kv ? a.chunks_q + item
                                               : a.chunks_q - 1 - (item - a.chunks_kv);
    if (chunk < a.chunks_q) {
      const int64_t bh = chunk / chunks_per_bh_q;
      const int s0 = int(chunk - bh * chunks_per_bh_q) * kChunkRows;
      const int64_t h = bh % a.heads_q, b = bh / a.heads_q;
      const T* o_bh = static_cast<const T*>(a.out) + b * a.out_sb + h * a.out_sh;
      const T* g_bh = static_cast<const T*>(a.dout) + b * a.dout_sb + h * a.dout_sh;
      const int64_t row0 = bh * a.seqlen_q_rounded;  // of the fp32 q-side workspaces
#pragma unroll 2
      for (int r = slot; r < kChunkRows; r += per_pass) {
        const int s = s0 + r;  // < seqlen_q_rounded, a multiple of kChunkRows (checked by the host)
        float partial = 0.f;
        zero_row(a.dq_accum + (row0 + s) * a.head_dim, a.head_dim, lane, group, kVecAcc);
        if (s < a.seqlen_q) {
          const T* o = o_bh + s * a.out_sr;
          const T* g = g_bh + s * a.dout_sr;
          if (kVecIn) {
            const uint4* o4 = reinterpret_cast<const uint4*>(o);
            const uint4* g4 = reinterpret_cast<const uint4*>(g);
            for (int c = lane; c < a.head_dim_v / 8; c += group) {
              partial += dot8<T>(__ldg(o4 + c), __ldg(g4 + c));
            }
          } else {
            for (int c = lane; c < a.head_dim_v; c += group) {
              partial = fmaf(to_float(o[c]), to_float(g[c]), partial);
            }
          }
        }
        // reduce inside the group (groups are aligned blocks of lanes, so xor stays inside)
        for (int off = group >> 1; off > 0; off >>= 1) {
          partial += __shfl_xor_sync(0xffffffffu, partial, off);
        }
        if (lane == 0) {
          const bool live = s < a.seqlen_q;
          a.dpsum[row0 + s] = live ? partial : 0.f;
          a.lse_log2[row0 + s] = live ? lse_log2_of(a.lse[b * a.lse_sb + h * a.lse_sh + s * a.lse_sr])
                                      : INFINITY;
        }
      }
    } else {
      const int64_t c = chunk - a.chunks_q;
      const int64_t bh = c / chunks_per_bh_kv;
      const int s0 = int(c - bh * chunks_per_bh_kv) * kChunkRows;
      const int64_t row0 = bh * a.seqlen_k_rounded;
      for (int r = slot; r < kChunkRows && s0 + r < a.seqlen_k_rounded; r += per_pass) {
        zero_row(a.dk_accum + (row0 + s0 + r) * a.head_dim, a.head_dim, lane, group, kVecAcc);
        zero_row(a.dv_accum + (row0 + s0 + r) * a.head_dim_v, a.head_dim_v, lane, group, kVecAcc);
      }
    }
  }
}

// ---- postprocess --------------------------------------------------------------------------

struct PostJob {
  const float* acc;  // [B, H * sum_heads, S_rounded, D] contiguous
  void* out;         // [B, H, S, D] with the strides below, last dim contiguous
  int64_t sb, sh, sr;
  int heads, seqlen, seqlen_rounded, dim;
  int sum_heads;  // accumulator heads summed (in order) into each output head: 1, or the GQA group
  float factor;
  int vec;         // 16-byte path allowed
  int group_log2;  // threads per row
  int64_t chunks;  // B * H * ceil(S / kChunkRows)
  int permuted;    // acc's row s holds column c at c ^ ((s & 3) << 3) (BwdParams::dq_accum_permuted)
  int reversed;    // BwdParams::prepost_reversed: chunks last to first
};

struct PostArgs {
  PostJob job[3];
};

template <typename T>
__global__ void __launch_bounds__(kThreads) bwd_postprocess_kernel(const PostArgs a) {
  wait_for_prior_grid();  // the main kernel's accumulators (grid_dependency.h)
  const PostJob j = a.job[blockIdx.y];
  const int group = 1 << j.group_log2;
  const int lane = threadIdx.x & (group - 1);
  const int slot = threadIdx.x >> j.group_log2;
  const int per_pass = kThreads >> j.group_log2;
  const int chunks_per_bh = (j.seqlen + kChunkRows - 1) / kChunkRows;
  const int64_t head_step = int64_t(j.seqlen_rounded) * j.dim;  // between summed heads
  for (int64_t item = blockIdx.x; item < j.chunks; item += gridDim.x) {
    // (reversed: the rows the main kernel added to last, still in L2, are read first)
    const int64_t chunk = j.reversed ? j.chunks - 1 - item : item;
    const int64_t bh = chunk / chunks_per_bh;
    const int s0 = int(chunk - bh * chunks_per_bh) * kChunkRows;
    const int64_t h = bh % j.heads, b = bh / j.heads;
    const float* src_bh = j.acc + bh * j.sum_heads * head_step;
    T* dst_bh = static_cast<T*>(j.out) + b * j.sb + h * j.sh;
#pragma unroll 2
    for (int r = slot; r < kChunkRows; r += per_pass) {
      const int s = s0 + r;
      if (s >= j.seqlen) break;  // (no shuffles here: lanes may leave on their own)
      const float* src = src_bh + int64_t(s) * j.dim;
      T* dst = dst_bh + s * j.sr;
      if (j.vec) {
        const float4* src4 = reinterpret_cast<const float4*>(src);
        uint4* dst4 = reinterpret_cast<uint4*>(dst);
        const int seg_xor = j.permuted ? (s & 3) : 0;  // 8-column segment c sits at c ^ seg_xor
        for (int c = lane; c < j.dim / 8; c += group) {
          const int cs = c ^ seg_xor;
          float4 x0 = __ldcs(src4 + 2 * cs);  // read once: streaming
          float4 x1 = __ldcs(src4 + 2 * cs + 1);
          for (int g = 1; g < j.sum_heads; ++g) {  // a fixed order: bitwise repeatable
            const float4* more = reinterpret_cast<const float4*>(src + g * head_step);
            const float4 y0 = __ldcs(more + 2 * cs), y1 = __ldcs(more + 2 * cs + 1);
            x0 = make_float4(x0.x + y0.x, x0.y + y0.y, x0.z + y0.z, x0.w + y0.w);
            x1 = make_float4(x1.x + y1.x, x1.y + y1.y, x1.z + y1.z, x1.w + y1.w);
          }
          uint4 y;
          using V2 = typename Vec2<T>::type;
          V2* py = reinterpret_cast<V2*>(&y);
          py[0] = from_float2<T>(x0.x * j.factor, x0.y * j.factor);
          py[1] = from_float2<T>(x0.z * j.factor, x0.w * j.factor);
          py[2] = from_float2<T>(x1.x * j.factor, x1.y * j.factor);
          py[3] = from_float2<T>(x1.z * j.factor, x1.w * j.factor);
          dst4[c] = y;
        }
      } else {
        const int col_xor = j.permuted ? (s & 3) << 3 : 0;
        for (int c = lane; c < j.dim; c += group) {
          const int cs = c ^ col_xor;
          float x = src[cs];
          for (int g = 1; g < j.sum_heads; ++g) x += src[g * head_step + cs];
          dst[c] = from_float<T>(x * j.factor);
        }
      }
    }
  }
}

// ---- host helpers -------------------------------------------------------------------------

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// true when every stride of a dim with more than one element moves by a multiple of 16 bytes
inline bool strides_aligned16(int64_t elem_bytes, int64_t sb, int nb, int64_t sh, int nh,
                              int64_t sr, int nr) {
  auto ok = [&](int64_t stride, int n) { return n <= 1 || (stride * elem_bytes) % 16 == 0; };
  return ok(sb, nb) && ok(sh, nh) && ok(sr, nr);
}

inline int ceil_log2(int x) {
  int l = 0;
  while ((1 << l) < x) ++l;
  return l;
}

// threads per row: enough for one pass over `units` items, at most a warp
inline int group_log2_for(int units) {
  int l = ceil_log2(units < 1 ? 1 : units);
  return l > 5 ? 5 : l;
}

// CTAs of `kernel` resident on one SM (call once per kernel: the callers keep it in a static).
template <class Kernel>
int blocks_per_sm(Kernel kernel) {
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, 0) != cudaSuccess || n < 1) {
    cudaGetLastError();  // (not the launch's error to report)
    n = 1;
  }
  return n;
}

// One CTA per chunk, at most one wave (the rest in the grid-stride loop): a grid beyond what
// is resident at once (48 registers a thread fit 5 CTAs of 256 on an SM, not 8) ran a second,
// partial wave of CTAs each with a whole share of the loop.
inline unsigned grid_for_chunks(int64_t chunks, int per_sm, int num_sms) {
  const int64_t cap = (num_sms > 0 ? int64_t(num_sms) : 132) * per_sm;
  return unsigned(chunks < 1 ? 1 : chunks > cap ? cap : chunks);
}

template <typename T, bool kVecIn, bool kVecAcc>
void launch_pre(const PreArgs& a, int num_sms, cudaStream_t stream) {
  const int64_t chunks = a.chunks_q + a.chunks_kv;
  if (a.bounds_ctas > 0) {
    auto* kernel = bwd_preprocess_kernel<T, kVecIn, kVecAcc, true>;
    static const int per_sm = blocks_per_sm(kernel);
    kernel<<<grid_for_chunks(chunks, per_sm, num_sms) + a.bounds_ctas, kThreads, 0, stream>>>(a);
  } else {
    auto* kernel = bwd_preprocess_kernel<T, kVecIn, kVecAcc, false>;
    static const int per_sm = blocks_per_sm(kernel);
    kernel<<<grid_for_chunks(chunks, per_sm, num_sms), kThreads, 0, stream>>>(a);
  }
}

template <typename T>
void dispatch_pre(const PreArgs& a, bool vec_in, bool vec_acc, int num_sms, cudaStream_t stream) {
  if (vec_in) {
    if (vec_acc) launch_pre<T, true, true>(a, num_sms, stream);
    else launch_pre<T, true, false>(a, num_sms, stream);
  } else {
    if (vec_acc) launch_pre<T, false, true>(a, num_sms, stream);
    else launch_pre<T, false, false>(a, num_sms, stream);
  }
}

}  // namespace

void run_bwd_preprocess(const BwdParams& p, cudaStream_t stream) {
  const int64_t bh_q = int64_t(p.batch) * p.heads_q;
  PreArgs a{};
  a.out = p.out;
  a.out_sb = p.out_batch_stride;
  a.out_sh = p.out_head_stride;
  a.out_sr = p.out_row_stride;
  a.dout = p.dout;
  a.dout_sb = p.dout_batch_stride;
  a.dout_sh = p.dout_head_stride;
  a.dout_sr = p.dout_row_stride;
  a.lse = p.lse;
  a.lse_sb = p.lse_batch_stride;
  a.lse_sh = p.lse_head_stride;
  a.lse_sr = p.lse_row_stride;
  a.dpsum = p.dpsum;
  a.lse_log2 = p.lse_log2;
  a.dq_accum = p.dq_accum;
  a.dk_accum = p.dk_accum;
  a.dv_accum = p.dv_accum;
  a.tile_counter = p.tile_counter;
  if (p.split_tiles > 0 && p.split_count != nullptr && p.split_accum != nullptr) {
    // counts then sums, one span (bwd_device: 16-byte aligned, whole 16-byte words)
    a.split_zero = reinterpret_cast<float4*>(p.split_count);
    const char* end = reinterpret_cast<const char*>(p.split_accum + int64_t(p.split_tiles) * p.split_slot_floats);
    a.split_zero_vec4 = (end - reinterpret_cast<const char*>(p.split_count)) / 16;
  }
  a.heads_q = p.heads_q;
  a.seqlen_q = p.seqlen_q;
  a.seqlen_q_rounded = p.seqlen_q_rounded;
  a.head_dim = p.head_dim;
  a.head_dim_v = p.head_dim_v;
  a.seqlen_k_rounded = p.seqlen_k_rounded;
  a.chunks_q = bh_q * ((p.seqlen_q_rounded + kChunkRows - 1) / kChunkRows);
  // (deterministic GQA stores every per-q-head tile: nothing to zero)
  a.chunks_kv = (p.dk_accum != nullptr && p.dv_accum != nullptr && !p.deterministic)
                    ? int64_t(p.batch) * p.heads_kv * ((p.seqlen_k_rounded + kChunkRows - 1) / kChunkRows)
                    : 0;
  if (a.chunks_q + a.chunks_kv <= 0) return;

  const bool vec_in = p.head_dim_v % 8 == 0 && aligned16(p.out) && aligned16(p.dout) &&
                      strides_aligned16(2, p.out_batch_stride, p.batch, p.out_head_stride,
                                        p.heads_q, p.out_row_stride, p.seqlen_q) &&
                      strides_aligned16(2, p.dout_batch_stride, p.batch, p.dout_head_stride,
                                        p.heads_q, p.dout_row_stride, p.seqlen_q);
  bool vec_acc = p.head_dim % 4 == 0 && aligned16(p.dq_accum);
  if (a.chunks_kv > 0) {
    vec_acc = vec_acc && p.head_dim_v % 4 == 0 && aligned16(p.dk_accum) && aligned16(p.dv_accum);
  }
  a.group_log2 = group_log2_for(vec_in ? p.head_dim_v / 8 : p.head_dim_v);
  a.reversed = p.prepost_reversed;
  if (!mask_bounds::plan(p, a.bounds, a.bounds_ctas)) a.bounds_ctas = 0;
  if (p.dtype == DType::kFloat16) {
    dispatch_pre<__half>(a, vec_in, vec_acc, p.num_sms, stream);
  } else {
    dispatch_pre<__nv_bfloat16>(a, vec_in, vec_acc, p.num_sms, stream);
  }
}

void run_bwd_postprocess(const BwdParams& p, cudaStream_t stream) {
  PostArgs a{};
  int num_jobs = 0;
  auto add_job = [&](const float* acc, void* out, int64_t sb, int64_t sh, int64_t sr, int heads,
                     int seqlen, int seqlen_rounded, int dim, float factor, int sum_heads,
                     bool permuted) {
    PostJob& j = a.job[num_jobs];
    j.acc = acc;
    j.out = out;
    j.sb = sb;
    j.sh = sh;
    j.sr = sr;
    j.heads = heads;
    j.seqlen = seqlen;
    j.seqlen_rounded = seqlen_rounded;
    j.dim = dim;
    j.factor = factor;
    j.sum_heads = sum_heads;
    j.permuted = permuted;
    j.reversed = p.prepost_reversed;
    j.chunks = int64_t(p.batch) * heads * ((seqlen + kChunkRows - 1) / kChunkRows);
    j.vec = dim % 8 == 0 && aligned16(acc) && aligned16(out) &&
            strides_aligned16(2, sb, p.batch, sh, heads, sr, seqlen);
    j.group_log2 = group_log2_for(j.vec ? dim / 8 : dim);
    if (j.chunks > 0 && dim > 0) ++num_jobs;
  };
  add_job(p.dq_accum, p.dq, p.dq_batch_stride, p.dq_head_stride, p.dq_row_stride, p.heads_q,
          p.seqlen_q, p.seqlen_q_rounded, p.head_dim, p.scale, 1, p.dq_accum_permuted);
  if (p.dk_accum != nullptr) {
    // deterministic GQA: the q heads' tiles of each group, summed here in q-head order
    const int group = p.deterministic ? p.heads_q / p.heads_kv : 1;
    add_job(p.dk_accum, p.dk, p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride, p.heads_kv,
            p.seqlen_k, p.seqlen_k_rounded, p.head_dim, p.scale, group, false);
    add_job(p.dv_accum, p.dv, p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride, p.heads_kv,
            p.seqlen_k, p.seqlen_k_rounded, p.head_dim_v, 1.0f, group, false);
  }
  if (num_jobs == 0) return;
  int64_t chunks = 1;
  for (int i = 0; i < num_jobs; ++i) chunks = a.job[i].chunks > chunks ? a.job[i].chunks : chunks;
  // (dq's CTAs come first; the smaller GQA dk / dv jobs take the slots they free)
  // (the launch's error is the caller's to check, as for the <<<>>> launches)
  if (p.dtype == DType::kFloat16) {
    auto* kernel = bwd_postprocess_kernel<__half>;
    static const int per_sm = blocks_per_sm(kernel);
    launch_kernel(kernel, dim3(grid_for_chunks(chunks, per_sm, p.num_sms), num_jobs), dim3(kThreads),
                  0, stream, p.programmatic_launch, a);
  } else {
    auto* kernel = bwd_postprocess_kernel<__nv_bfloat16>;
    static const int per_sm = blocks_per_sm(kernel);
    launch_kernel(kernel, dim3(grid_for_chunks(chunks, per_sm, p.num_sms), num_jobs), dim3(kThreads),
                  0, stream, p.programmatic_launch, a);
  }
}

}  // namespace sm90_sdpa
