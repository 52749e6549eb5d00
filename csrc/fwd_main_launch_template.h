// Definition of run_fwd_main<DType, D> (declared in fwd_main_launch.h) and of its launcher
// launch_fwd_main<DType, D, kOverlap, kMasked> (FwdParams::overlap and mask_kind pick): with a
// mask, runs the mask classification on the forward's tiles first; then builds the TMA
// descriptors and launches the SM90 forward kernel over the (query block, q head, batch) tiles:
// one persistent CTA per SM (FwdParams::persistent), else one CTA per tile (with a float mask
// and overlap, two kernels share the query blocks).
// Included by the generated csrc/instantiations/fwd_main_<dtype>_hdim<D>.cu.
#pragma once

#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#endif

#include <cuda_runtime.h>

#include "fwd_main_launch.h"
#include "fwd_params.h"
#include "kernel/fwd_kernel.h"
#include "launch_utils.h"
#include "mask_classify.h"

namespace sm90_sdpa {

// The classification's output for the forward kernels: tile classes and bits, each query
// block's range of non-empty key tiles, and (float masks) which query blocks need the mask's
// elements.
struct FwdMaskTiles {
  unsigned char const* tile_class = nullptr;
  uint32_t const* tile_bits = nullptr;
  int2 const* key_range = nullptr;
  unsigned char const* block_classes = nullptr;  // tile_class query-block major
  unsigned char const* block_elements = nullptr;  // null: a boolean mask (no element tiles)
  int const* element_count = nullptr;             // (with block_elements) how many are 1
};

// The classification of p's mask on the forward's kFwdTile x kFwdTile tiles, into
// p.mask_workspace (fwd_mask_workspace_layout): the tile classes, the bits of the
// kTilePartialBits tiles, the key ranges (run_fwd_key_ranges) and, for a float mask, its fill
// rows (FwdFillRows). No score bounds:
// -inf (false) and the clamped fill alone hide an entry.
inline FwdMaskTiles classify_fwd_mask(const FwdParams& p, cudaStream_t stream) {
  BwdParams c;
  c.batch = p.batch;
  c.heads_q = p.heads_q;
  c.heads_kv = p.heads_kv;
  c.seqlen_q = p.seqlen_q;
  c.seqlen_k = p.seqlen_k;
  c.head_dim = p.head_dim;
  c.head_dim_v = p.head_dim;
  c.dtype = p.dtype;
  c.scale_log2 = p.scale_log2;
  c.is_causal = p.is_causal;
  c.mask_kind = p.mask_kind;
  c.mask = p.mask;
  c.mask_batch_stride = p.mask_batch_stride;
  c.mask_head_stride = p.mask_head_stride;
  c.mask_row_stride = p.mask_row_stride;
  c.mask_col_stride = p.mask_col_stride;
  c.mask_batch = p.mask_batch;
  c.mask_heads = p.mask_heads;
  c.tile_m = kFwdTile;
  c.tile_n = kFwdTile;
  c.num_m_blocks = (p.seqlen_q + kFwdTile - 1) / kFwdTile;
  c.num_n_blocks = (p.seqlen_k + kFwdTile - 1) / kFwdTile;
  c.num_sms = p.num_sms;
  const FwdMaskWorkspace w = fwd_mask_workspace_layout(p.mask_batch, p.mask_heads, p.seqlen_q, p.seqlen_k);
  char* base = static_cast<char*>(p.mask_workspace);
  c.tile_class = reinterpret_cast<unsigned char*>(base + w.tile_class);
  c.tile_m_range = nullptr;  // (the backward's ranges: the forward walks key ranges instead)
  c.tile_bits = reinterpret_cast<uint32_t*>(base + w.tile_bits);
  const bool float_mask = p.mask_kind != MaskKind::kBool;
  FwdFillRows fill{reinterpret_cast<uint32_t*>(base + w.row_flags),
                   reinterpret_cast<unsigned char*>(base + w.block_elements),
                   reinterpret_cast<int*>(base + w.element_count)};
  run_mask_classify(c, stream, float_mask ? &fill : nullptr);
  int2* key_range = reinterpret_cast<int2*>(base + w.key_range);
  unsigned char* block_classes = reinterpret_cast<unsigned char*>(base + w.block_classes);
  run_fwd_key_ranges(c.tile_class, key_range, block_classes, int64_t(p.mask_batch) * p.mask_heads, c.num_m_blocks,
                     c.num_n_blocks, stream);
  return FwdMaskTiles{c.tile_class, c.tile_bits, key_range, block_classes,
                      float_mask ? fill.block_elements : nullptr, float_mask ? fill.element_count : nullptr};
}

// One launch of FwdKernel<..., kOverlap, kMasked>. tiles (kMasked): the classification's output;
// with tiles.block_elements set, the kernel runs only the query blocks whose need of the
// mask's elements matches its own (FwdKernel::kReadsMaskElements).
template <DType kDType, int kHeadDim, bool kOverlap, bool kMasked>
void launch_fwd_main(const FwdParams& params, const FwdMaskTiles& tiles, cudaStream_t stream) {
  using Element = typename detail::ElementOf<kDType>::type;
  using Kernel = kernel::FwdKernel<kernel::DefaultFwdConfig<kHeadDim>, Element, kOverlap, kMasked>;
  FwdParams p = params;
  p.q_batch_stride = detail::tma_stride(p.q_batch_stride, p.batch);
  p.q_head_stride = detail::tma_stride(p.q_head_stride, p.heads_q);
  p.q_row_stride = detail::tma_stride(p.q_row_stride, p.seqlen_q);
  p.k_batch_stride = detail::tma_stride(p.k_batch_stride, p.batch);
  p.k_head_stride = detail::tma_stride(p.k_head_stride, p.heads_kv);
  p.k_row_stride = detail::tma_stride(p.k_row_stride, p.seqlen_k);
  p.v_batch_stride = detail::tma_stride(p.v_batch_stride, p.batch);
  p.v_head_stride = detail::tma_stride(p.v_head_stride, p.heads_kv);
  p.v_row_stride = detail::tma_stride(p.v_row_stride, p.seqlen_k);
  int64_t const num_tiles = int64_t((p.seqlen_q + Kernel::kBlockM - 1) / Kernel::kBlockM) * p.heads_q * p.batch;
  bool const persistent = p.persistent && p.num_sms > 0 && num_tiles > p.num_sms;
  // Persistent CTAs take their tiles in a fixed order: longest first where tiles differ (the
  // causal cut, a mask). One CTA per tile: the hardware hands the next to the first free SM.
  bool const longest_first = persistent && (p.is_causal || kMasked);
  typename Kernel::Params kparams =
      Kernel::to_params(p, longest_first, tiles.tile_class, tiles.tile_bits, tiles.key_range,
                        tiles.block_classes, tiles.block_elements, tiles.element_count);

  auto kernel_fn = kernel::fwd_main_kernel<Kernel>;
  int const smem_size = Kernel::kSharedStorageSize;
  detail::set_smem_attribute_once(kernel_fn, smem_size);
  dim3 const grid(static_cast<unsigned>(persistent ? p.num_sms : num_tiles));
  kernel_fn<<<grid, Kernel::kNumThreads, smem_size, stream>>>(kparams);
  detail::check_cuda(cudaGetLastError(), "forward kernel launch");
}

template <DType kDType, int kHeadDim>
void run_fwd_main(const FwdParams& params, cudaStream_t stream) {
  if (params.mask_kind == MaskKind::kNone) {
    if (params.overlap) {
      launch_fwd_main<kDType, kHeadDim, true, false>(params, FwdMaskTiles{}, stream);
    } else {
      launch_fwd_main<kDType, kHeadDim, false, false>(params, FwdMaskTiles{}, stream);
    }
    return;
  }
  FwdMaskTiles tiles = classify_fwd_mask(params, stream);
  if (!params.overlap) {  // the in-turn kernel runs every query block
    tiles.block_elements = nullptr;
    tiles.element_count = nullptr;
    launch_fwd_main<kDType, kHeadDim, false, true>(params, tiles, stream);
    return;
  }
  // The overlap kernel reads no mask elements (FwdKernel::kReadsMaskElements): a float mask's
  // query blocks with an element tile (block_elements) run in the in-turn kernel, launched
  // after it over the same grid; each kernel's other blocks return at once.
  launch_fwd_main<kDType, kHeadDim, true, true>(params, tiles, stream);
  if (tiles.block_elements != nullptr) {
    launch_fwd_main<kDType, kHeadDim, false, true>(params, tiles, stream);
  }
}

}  // namespace sm90_sdpa
