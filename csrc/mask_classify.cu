// The tile classification of an attention mask: see mask_classify.h.
//
// One CTA per tile and mask instance; its threads walk the tile's rows in chunks of 8 keys (a
// warp reads consecutive keys, as vectors where the layout allows) and vote. Any layout works
// (stride 0 on broadcast dims, e.g. [B, 1, 1, Sk] key-padding masks: plain strided loads).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "bwd_params.h"
#include "mask_classify.h"

namespace sm90_sdpa {
namespace {

constexpr int kThreads = 256;

struct ClassifyArgs {
  const void* mask;
  int64_t sb, sh, sr, sc;  // element strides of the [B, Hq, Sq, Sk] view
  int seqlen_q, seqlen_k, tile_m, tile_n, num_m_blocks, num_n_blocks, mask_heads;
  bool is_causal;
  unsigned char* tile_class;
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

template <MaskKind kKind>
__global__ void __launch_bounds__(kThreads) mask_classify_kernel(const ClassifyArgs a) {
  using T = typename MaskElem<kKind>::type;
  const int tile = blockIdx.x;  // n_block * num_m_blocks + m_block
  const int n_block = tile / a.num_m_blocks;
  const int m_block = tile - n_block * a.num_m_blocks;
  const int h = blockIdx.y, b = blockIdx.z;
  const int q0 = m_block * a.tile_m, k0 = n_block * a.tile_n;
  const T* base = static_cast<const T*>(a.mask) + int64_t(b) * a.sb + int64_t(h) * a.sh;
  bool any_visible = false, all_full = true;
  const int chunks_per_row = a.tile_n / kChunk;
  const int chunks = a.tile_m * chunks_per_row;
  for (int i = threadIdx.x; i < chunks; i += kThreads) {
    const int r = i / chunks_per_row;
    const int q = q0 + r, kc = k0 + (i - r * chunks_per_row) * kChunk;
    if (q >= a.seqlen_q) continue;  // padding rows: P = 0 there whatever the class
    const T* row = base + int64_t(q) * a.sr;
    T vals[kChunk];
    const T* src = row + int64_t(kc) * a.sc;
    const bool vec = a.sc == 1 && kc + kChunk <= a.seqlen_k &&
                     reinterpret_cast<uintptr_t>(src) % (kChunk * sizeof(T)) == 0;
    if (vec) {
      if constexpr (sizeof(T) == 1) {
        *reinterpret_cast<uint2*>(vals) = *reinterpret_cast<const uint2*>(src);
      } else if constexpr (sizeof(T) == 2) {
        *reinterpret_cast<uint4*>(vals) = *reinterpret_cast<const uint4*>(src);
      } else {
        reinterpret_cast<uint4*>(vals)[0] = reinterpret_cast<const uint4*>(src)[0];
        reinterpret_cast<uint4*>(vals)[1] = reinterpret_cast<const uint4*>(src)[1];
      }
    }
#pragma unroll
    for (int c = 0; c < kChunk; ++c) {
      const int k = kc + c;
      bool visible = false, zero = true;
      if (k < a.seqlen_k && !(a.is_causal && k > q)) {
        const T x = vec ? vals[c] : row[int64_t(k) * a.sc];
        if constexpr (kKind == MaskKind::kBool) {
          visible = x != 0;
        } else {
          float f;
          if constexpr (kKind == MaskKind::kFloat16) {
            f = __half2float(x);
          } else if constexpr (kKind == MaskKind::kBFloat16) {
            f = __bfloat162float(x);
          } else {
            f = x;
          }
          visible = f != -INFINITY;
          zero = f == 0.f;
        }
      }
      any_visible |= visible;
      all_full &= visible && zero;
    }
  }
  any_visible = __syncthreads_or(any_visible);
  all_full = __syncthreads_and(all_full);
  if (threadIdx.x == 0) {
    const int64_t idx = ((int64_t(b) * a.mask_heads + h) * a.num_n_blocks + n_block) *
                            a.num_m_blocks + m_block;
    a.tile_class[idx] = !any_visible ? kTileEmpty : (all_full ? kTileFull : kTilePartial);
  }
}

}  // namespace

void run_mask_classify(const BwdParams& p, cudaStream_t stream) {
  ClassifyArgs a{};
  a.mask = p.mask;
  a.sb = p.mask_batch_stride;
  a.sh = p.mask_head_stride;
  a.sr = p.mask_row_stride;
  a.sc = p.mask_col_stride;
  a.seqlen_q = p.seqlen_q;
  a.seqlen_k = p.seqlen_k;
  a.tile_m = p.tile_m;
  a.tile_n = p.tile_n;
  a.num_m_blocks = p.num_m_blocks;
  a.num_n_blocks = p.num_n_blocks;
  a.mask_heads = p.mask_heads;
  a.is_causal = p.is_causal;
  a.tile_class = p.tile_class;
  const dim3 grid(unsigned(p.num_m_blocks * p.num_n_blocks), unsigned(p.mask_heads),
                  unsigned(p.mask_batch));
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  switch (p.mask_kind) {
    case MaskKind::kBool:
      mask_classify_kernel<MaskKind::kBool><<<grid, kThreads, 0, stream>>>(a);
      break;
    case MaskKind::kFloat16:
      mask_classify_kernel<MaskKind::kFloat16><<<grid, kThreads, 0, stream>>>(a);
      break;
    case MaskKind::kBFloat16:
      mask_classify_kernel<MaskKind::kBFloat16><<<grid, kThreads, 0, stream>>>(a);
      break;
    case MaskKind::kFloat32:
      mask_classify_kernel<MaskKind::kFloat32><<<grid, kThreads, 0, stream>>>(a);
      break;
    default:
      break;
  }
}

}  // namespace sm90_sdpa
