// The tile classification of an attention mask: see mask_classify.h.
//
// One CTA per tile and mask instance; its threads walk the tile's elements row by row (keys
// fastest, so a warp reads consecutive keys) and vote. Masks are read with plain strided loads:
// any layout works (stride 0 on broadcast dims, e.g. [B, 1, 1, Sk] key-padding masks).
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

// (visible, adds exactly zero) of one mask element
template <MaskKind kKind>
__device__ __forceinline__ void mask_element(const void* base, int64_t off, bool& visible,
                                             bool& zero) {
  if constexpr (kKind == MaskKind::kBool) {
    visible = static_cast<const unsigned char*>(base)[off] != 0;
    zero = true;
  } else {
    float x;
    if constexpr (kKind == MaskKind::kFloat16) {
      x = __half2float(static_cast<const __half*>(base)[off]);
    } else if constexpr (kKind == MaskKind::kBFloat16) {
      x = __bfloat162float(static_cast<const __nv_bfloat16*>(base)[off]);
    } else {
      x = static_cast<const float*>(base)[off];
    }
    visible = x != -INFINITY;
    zero = x == 0.f;
  }
}

template <MaskKind kKind>
__global__ void __launch_bounds__(kThreads) mask_classify_kernel(const ClassifyArgs a) {
  const int tile = blockIdx.x;  // n_block * num_m_blocks + m_block
  const int n_block = tile / a.num_m_blocks;
  const int m_block = tile - n_block * a.num_m_blocks;
  const int h = blockIdx.y, b = blockIdx.z;
  const int q0 = m_block * a.tile_m, k0 = n_block * a.tile_n;
  const char* base = static_cast<const char*>(a.mask);
  const int64_t off_bh = int64_t(b) * a.sb + int64_t(h) * a.sh;
  bool any_visible = false, all_full = true;
  const int elems = a.tile_m * a.tile_n;
  for (int i = threadIdx.x; i < elems; i += kThreads) {
    const int r = i / a.tile_n, c = i - r * a.tile_n;
    const int q = q0 + r, k = k0 + c;
    if (q >= a.seqlen_q) continue;  // padding rows: P = 0 there whatever the class
    bool visible = false, zero = true;
    if (k < a.seqlen_k && !(a.is_causal && k > q)) {
      mask_element<kKind>(base, off_bh + int64_t(q) * a.sr + int64_t(k) * a.sc, visible, zero);
    }
    any_visible |= visible;
    all_full &= visible && zero;
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
