// Definition of run_bwd_main<DType, D, Dv> (declared in bwd_main_launch.h) and of the launcher
// of each of its kernels, launch_bwd_main<DType, D, kMasked, Cfg>: builds the TMA descriptors
// and launches the SM90 main backward kernel. Included by the generated
// csrc/instantiations/bwd_main_<dtype>_hdim<D>[x<Dv>][_masked|_full].cu (explicit
// instantiations).
#pragma once

// 64xNx16 wgmma shapes with N not a power of two (e.g. 48 for head dim 96 split in two).
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#endif

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include <cutlass/numeric_types.h>

#include "bwd_main_launch.h"
#include "bwd_params.h"
#include "grid_dependency.h"
#include "kernel/bwd_config.h"
#include "kernel/bwd_kernel.h"
#include "launch_utils.h"

namespace sm90_sdpa {

// kMasked: the kernel that reads tile classes (params.mask_kind set); the other one has no
// mask code at all, so the mask's code paths cost the dense kernel no registers.
// Cfg: the tile (DefaultBwdConfig<D>, or FullBwdConfig<D> for the calls run_bwd_main gives it;
// DefaultBwdConfigDv<D, Dv> for a pair of TILES_DV, whose value head dim is Cfg::kHeadDimV).
template <DType kDType, int kHeadDim, bool kMasked, class Cfg>
void launch_bwd_main(const BwdParams& params, cudaStream_t stream) {
  using Element = typename detail::ElementOf<kDType>::type;
  using Mainloop = kernel::BwdMainloop<Cfg, Element, kMasked>;
  using Epilogue = kernel::BwdEpilogue<Cfg, Element, Mainloop>;
  using Scheduler = kernel::SingleTileScheduler;
  using Kernel = kernel::BwdKernel<Mainloop, Epilogue, Scheduler>;

  // The device layer (registration/bwd_device.cpp) checked the call: a served problem with
  // positive sizes, this variant, TMA-addressable operands and workspaces.
  BwdParams p = params;
  // dK / dV into the fp32 accumulators (GQA, one q head per CTA), else stored by the kernel
  bool const dkv_accum = p.heads_q != p.heads_kv && p.heads_per_cta == 1;
  auto fix = [](int64_t& batch_stride, int64_t& head_stride, int64_t& row_stride, int batch, int heads,
                int rows) {
    batch_stride = detail::tma_stride(batch_stride, batch);
    head_stride = detail::tma_stride(head_stride, heads);
    row_stride = detail::tma_stride(row_stride, rows);
  };
  fix(p.q_batch_stride, p.q_head_stride, p.q_row_stride, p.batch, p.heads_q, p.seqlen_q);
  fix(p.dout_batch_stride, p.dout_head_stride, p.dout_row_stride, p.batch, p.heads_q, p.seqlen_q);
  fix(p.k_batch_stride, p.k_head_stride, p.k_row_stride, p.batch, p.heads_kv, p.seqlen_k);
  fix(p.v_batch_stride, p.v_head_stride, p.v_row_stride, p.batch, p.heads_kv, p.seqlen_k);
  if (!dkv_accum) {
    fix(p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride, p.batch, p.heads_kv, p.seqlen_k);
    fix(p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride, p.batch, p.heads_kv, p.seqlen_k);
  }

  // Head groups (heads_per_cta q heads each) per scheduling section: their Q and dO (and K/V)
  // take about half of the L2.
  int const l2_bytes = p.l2_bytes > 0 ? p.l2_bytes : (50 << 20);
  int const heads_per_cta = std::max(1, p.heads_per_cta);
  // (Q and K are D wide, dO and V Dv wide)
  constexpr int64_t kDims = int64_t(kHeadDim) + Cfg::kHeadDimV;
  int64_t const bytes_per_head =
      int64_t(sizeof(Element)) * (kDims * p.seqlen_q + kDims * int64_t(p.seqlen_k) * p.heads_kv / p.heads_q) *
      heads_per_cta;
  int const num_n_blocks = (p.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN;
  int64_t hps = std::max<int64_t>(1, (int64_t(l2_bytes) / 2) / std::max<int64_t>(bytes_per_head, 1));
  // Causal and masked calls (key-block major below): a power of two of head groups. Their CTAs'
  // work falls with the key block, and a section's heaviest CTAs start only once the section
  // before has been handed out; with the head counts models use (powers of two), sections of a
  // power of two divide the heads and the SM waves evenly, where e.g. 3 of 32 heads leave a
  // late-starting partial section (a list-scheduling model and the measured main kernel,
  // BENCHMARKS.md).
  if ((p.is_causal || p.mask_kind != MaskKind::kNone) && !p.deterministic) {
    int64_t pow2 = 1;
    while (pow2 * 2 <= hps) { pow2 *= 2; }
    hps = pow2;
  }
  // A CTA that walks its GQA group does a group's work, so a section of one group has one CTA
  // per key block, fewer than the SMs: take at least kMinWalkSectionCtas (measured, GQA 32/8
  // s8192 d128 is_causal: sections of 64 CTAs 4.79 ms, of 128 4.35 ms; of 256 4.41).
  constexpr int kMinWalkSectionCtas = 128;
  if (heads_per_cta > 1) {
    hps = std::max<int64_t>(hps, (kMinWalkSectionCtas + num_n_blocks - 1) / num_n_blocks);
  }
  if (p.heads_per_section > 0) { hps = p.heads_per_section; }  // forced (A/B measurement)
  int const total_heads = p.heads_q / heads_per_cta * p.batch;
  // Key-block-major order (the key blocks with the most query blocks first) for causal attention
  // and under a mask: the masks models pass are causal-like (causal, padding, sliding windows,
  // packed documents), whose work per key block falls with the key index like causal's.
  // Deterministic mode: key-block major as well, in its order's direction (tile_scheduler.h).
  bool const n_block_major = p.is_causal || p.mask_kind != MaskKind::kNone || p.deterministic;
  bool const reverse_n = p.deterministic && p.deterministic_order == DeterministicOrder::kKeysDescending;
  typename Scheduler::Params sched{num_n_blocks, p.heads_q / heads_per_cta, p.batch,
                                   static_cast<int>(std::min<int64_t>(hps, total_heads)), n_block_major,
                                   reverse_n, p.tile_counter, /*split_tiles=*/0, /*split_m_blocks=*/0};

  // Persistent: one CTA per SM (the shared memory allows one), each taking tiles in turn.
  // Not for GQA's fp32 dK / dV accumulators (their tiles take the mainloop's shared memory)
  // nor in deterministic mode (its turns are laid out for one CTA per tile).
  bool const persistent = p.persistent && Kernel::kPersistentCapable && !dkv_accum && !p.deterministic &&
                          p.num_sms > 0 && p.tile_counter != nullptr;
  dim3 const grid = Scheduler::grid_shape(sched, persistent ? p.num_sms : 0);
  // Split tail (tile_scheduler.h): full attention (equal tiles) as the device layer planned it
  // (make_params), where this kernel's tile gives the same tile count and slot size; every
  // piece holds at least one m-block (r M >= P) and every CTA's first unit is a whole tile.
  if (persistent && !kMasked && !p.is_causal && p.split_tiles > 0 && p.split_count != nullptr &&
      p.split_accum != nullptr && p.split_slot_floats == Cfg::kBlockN * (kHeadDim + Cfg::kHeadDimV)) {
    int64_t const tiles = Scheduler::num_tiles(sched);
    int64_t const ctas = grid.x;
    int const m_blocks = (p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM;
    if (tiles >= 2 * ctas && tiles % ctas == p.split_tiles && int64_t(p.split_tiles) * m_blocks >= ctas) {
      sched.split_tiles = p.split_tiles;
      sched.split_m_blocks = m_blocks;
    }
  }

  typename Kernel::Params kparams{Mainloop::to_params(p), Epilogue::to_params(p), sched};
  // every CTA takes one tile: nothing is loaded after its mainloop (d256's epilogue then writes
  // dK and dV at once into the mainloop's shared memory instead of in turn into the staging tile)
  kparams.epilogue.one_tile_per_cta = int64_t(grid.x) >= Scheduler::num_tiles(sched);

  auto kernel_fn = kernel::bwd_main_kernel<Kernel>;
  int const smem_size = Kernel::kSharedStorageSize;
  detail::set_smem_attribute_once(kernel_fn, smem_size);
  // programmatic: the kernel starts while the preprocess (or the classification) drains
  detail::check_cuda(launch_kernel(kernel_fn, grid, dim3(Kernel::kNumThreads), smem_size, stream,
                                   p.programmatic_launch, kparams),
                     "kernel launch");
}

template <DType kDType, int kHeadDim, int kHeadDimV>
void run_bwd_main(const BwdParams& params, cudaStream_t stream) {
  using Configs = kernel::BwdConfigs<kHeadDim, kHeadDimV>;
  using Default = typename Configs::Default;
  using Full = typename Configs::Full;
  static_assert(Default::kHeadDim == kHeadDim && Default::kHeadDimV == kHeadDimV);
  if (params.mask_kind != MaskKind::kNone) {
    launch_bwd_main<kDType, kHeadDim, true, Default>(params, stream);
    return;
  }
  if constexpr (Configs::kHasFullTile) {
    // causal and full calls (causal measured 3% faster at 8k keys on d128's 80 x 128 tile),
    // deterministic too: the dQ semaphores are laid out for the default tile's m-blocks, at
    // least as many as the full tile's (up to kFullTileMinQueries queries the default tile,
    // instantiations/tile_configs.h: its 64-row m-blocks divide 512 exactly where the 80-row
    // ones round 512 up to 560, 9% of padded rows)
    static_assert(Full::kBlockM >= Default::kBlockM, "the dQ semaphores cover the full tile's m-blocks");
    if (params.seqlen_q > kFullTileMinQueries) {
      launch_bwd_main<kDType, kHeadDim, false, Full>(params, stream);
      return;
    }
  }
  launch_bwd_main<kDType, kHeadDim, false, Default>(params, stream);
}

}  // namespace sm90_sdpa
