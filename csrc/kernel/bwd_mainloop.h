// Collective mainloop of the SM90 attention backward: one CTA owns a block of kBlockN keys
// (K_j, V_j in shared memory, dK_j / dV_j accumulated in registers) and streams the query
// blocks i (Q_i, dO_i, lse_i, dpsum_i) through TMA + mbarrier pipelines.
//
//   producer warp  : load()     K_j, V_j once; Q_i (+lse_i) and dO_i (+dpsum_i) per m-block
//   dQ-writer warp : store_dq() TMA reduce-add of each finished dQ_i tile into dq_accum
//   MMA warpgroups : mma()      S = Q K^T, dP = dO V^T, P, dS, dV += P^T dO, dK += dS^T Q,
//                               dQ_i = dS K, or dQ_i^T = K^T dS^T (kdQSwapAB)  (all five on wgmma);
//                               S / dP in mma() itself, the other steps' lambdas made by
//                               softmax_dv_steps() (P, dS, dV), by_warpgroup_steps() (kSdPByWG:
//                               d256) and dq_dk_steps() (dQ, dK), the per-thread partitions by
//                               hoisted_offsets() (d64) and thread_partitions(); the setup's
//                               small steps by static helpers (warpgroup_first_thread(),
//                               wait_for_kv(), unmasked_m_block_begin(), ...)
#pragma once

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/pipeline.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>

#include "../bwd_params.h"
#include "../grid_dependency.h"
#include "../numeric.h"
#include "bwd_config.h"
#include "mask_elements.h"
#include "utils.h"

namespace sm90_sdpa {
namespace kernel {

using namespace cute;

// Smem operand fragment (GMMA descriptors) for the A (kIsA) or B operand of a tiled MMA.
template <bool kIsA, class ThrMma, class SmemTensor>
CUTE_DEVICE auto mma_smem_fragment(ThrMma const& thr_mma, SmemTensor const& t) {
  if constexpr (kIsA) {
    return thr_mma.partition_fragment_A(t);
  } else {
    return thr_mma.partition_fragment_B(t);
  }
}

// kMasked_: the kernel serves calls with a mask (params.mask_kind set: tile classes, bits and
// the mask's values); the kernel without one has none of that code.
template <class Cfg, class Element_, bool kMasked_>
struct BwdMainloop {
  using Element = Element_;
  using ElementAccum = float;
  static constexpr bool kMasked = kMasked_;

  static constexpr int kBlockM = Cfg::kBlockM;
  static constexpr int kBlockN = Cfg::kBlockN;
  static constexpr int kHeadDim = Cfg::kHeadDim;
  // V, dO (and out) head dim: dP = dO V^T takes its k-steps over it, dV is Dv wide
  static constexpr int kHeadDimV = Cfg::kHeadDimV;
  static constexpr int kNumMmaWG = Cfg::kNumMmaWG;
  static constexpr int kNumMmaThreads = kNumMmaWG * cutlass::NumThreadsPerWarpGroup;
  static constexpr int kStagesQ = Cfg::kStagesQ;
  static constexpr int kStagesdO = Cfg::kStagesdO;
  static constexpr int kStagesdS = Cfg::kStagesdS;
  static constexpr bool kSdPSwapAB = Cfg::kSdPSwapAB;
  static constexpr bool kdKVSwapAB = Cfg::kdKVSwapAB;
  static constexpr int kAtomLayoutMSdP = Cfg::kAtomLayoutMSdP;
  static constexpr int kAtomLayoutNdKV = Cfg::kAtomLayoutNdKV;
  static constexpr int kAtomLayoutMdQ = Cfg::kAtomLayoutMdQ;
  static constexpr int kdQSlices = Cfg::kdQSlices;
  static constexpr int kdQCols = kHeadDim / kdQSlices;
  // dQ^T = K^T dS^T: the warpgroups split the head dim (M), N = kBlockM (80 at d128 full).
  static constexpr bool kdQSwapAB = Cfg::kdQSwapAB;
  // S on warpgroup 0, dP on warpgroup 1 (BwdTileConfig::kSdPByWG): the S / dP tiled MMA is one
  // warpgroup's, and the threads of each warpgroup hold the whole tile.
  static constexpr bool kSdPByWG = Cfg::kSdPByWG;
  static constexpr int kSdPThreads = kSdPByWG ? cutlass::NumThreadsPerWarpGroup : kNumMmaThreads;
  // lse / dpsum rows by TMA when kBlockM does not divide the rounded length (kSeqRound): the
  // last m-block's rows past it are zero-filled, not read past the workspace. Those rows have
  // Q = dO = 0 (TMA zero fill too), so their P = 1 meets dO = 0 and dS = 1 * (0 - 0) = 0.
  static constexpr bool kRowStatTma = kSeqRound % kBlockM != 0;
  static_assert(!kRowStatTma || !kMasked, "the masked kernel keeps a tile that divides kSeqRound");

  // dV / dK from registers: P^T and dS^T are held row-per-key by each warpgroup.
  static constexpr bool kMmadKVIsRS =
      kSdPSwapAB && !kdKVSwapAB && kAtomLayoutMSdP == 1 && kAtomLayoutNdKV == kNumMmaWG;
  static_assert(kSdPSwapAB || !kMmadKVIsRS);
  static_assert(kNumMmaWG % kAtomLayoutMSdP == 0 && kNumMmaWG % kAtomLayoutNdKV == 0 &&
                kNumMmaWG % kAtomLayoutMdQ == 0);

  // Shapes of the accumulator tiles.
  using ShapeS = std::conditional_t<!kSdPSwapAB, Shape<Int<kBlockM>, Int<kBlockN>>,
                                    Shape<Int<kBlockN>, Int<kBlockM>>>;
  using ShapedKV = std::conditional_t<!kdKVSwapAB, Shape<Int<kBlockN>, Int<kHeadDim>>,
                                      Shape<Int<kHeadDim>, Int<kBlockN>>>;  // dK
  using ShapedV = std::conditional_t<!kdKVSwapAB, Shape<Int<kBlockN>, Int<kHeadDimV>>,
                                     Shape<Int<kHeadDimV>, Int<kBlockN>>>;
  using ShapedQ = Shape<Int<kBlockM>, Int<kdQCols>>;  // the staging tile (and dq_accum's box)
  using ShapedQAcc = std::conditional_t<!kdQSwapAB, ShapedQ, Shape<Int<kdQCols>, Int<kBlockM>>>;

  // ---------------- tiled MMAs ----------------
  using AtomShapeSdP = std::conditional_t<
      kSdPByWG, Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>,
      std::conditional_t<
          !kSdPSwapAB, Shape<Int<kBlockM>, Int<kBlockN / (kNumMmaWG / kAtomLayoutMSdP)>, Int<kHeadDim>>,
          Shape<Int<kBlockN>, Int<kBlockM / kAtomLayoutMSdP>, Int<kHeadDim>>>>;
  using AtomLayoutSdP = std::conditional_t<
      kSdPByWG, Layout<Shape<_1, _1, _1>>,
      std::conditional_t<!kSdPSwapAB, Layout<Shape<Int<kAtomLayoutMSdP>, Int<kNumMmaWG / kAtomLayoutMSdP>, _1>>,
                         Layout<Shape<Int<kNumMmaWG / kAtomLayoutMSdP>, Int<kAtomLayoutMSdP>, _1>>>>;
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, ElementAccum, AtomShapeSdP>(), AtomLayoutSdP{}));

  using AtomShapedKV = std::conditional_t<
      !kdKVSwapAB, Shape<Int<kBlockN>, Int<kHeadDim / (kNumMmaWG / kAtomLayoutNdKV)>, Int<kBlockM>>,
      Shape<Int<kHeadDim>, Int<kBlockN / kAtomLayoutNdKV>, Int<kBlockM>>>;
  using AtomLayoutdKV =
      std::conditional_t<!kdKVSwapAB, Layout<Shape<Int<kAtomLayoutNdKV>, Int<kNumMmaWG / kAtomLayoutNdKV>, _1>>,
                         Layout<Shape<Int<kNumMmaWG / kAtomLayoutNdKV>, Int<kAtomLayoutNdKV>, _1>>>;
  // P^T / dS^T (k, q) views are k-contiguous (MN-major); dO^T / Q^T (d, q) views are d-contiguous.
  // (dV with Dv != D: swapped only (BwdTileConfig), M = Dv in more or fewer atoms of the same
  // tiled MMA)
  using TiledMmadKV = decltype(make_tiled_mma(
      std::conditional_t<
          kMmadKVIsRS,
          decltype(GMMA::rs_op_selector<Element, Element, ElementAccum, AtomShapedKV, GMMA::Major::K,
                                        GMMA::Major::MN>()),
          decltype(GMMA::ss_op_selector<Element, Element, ElementAccum, AtomShapedKV, GMMA::Major::MN,
                                        GMMA::Major::MN>())>{},
      AtomLayoutdKV{}));

  // dQ = dS K: A = dS (q, k) K-major, B = K^T (d, k) MN-major. Swapped, dQ^T = K^T dS^T:
  // A = K^T (d, k) MN-major, B = dS (q, k) K-major.
  using AtomShapedQ = std::conditional_t<
      !kdQSwapAB, Shape<Int<kBlockM>, Int<kdQCols / (kNumMmaWG / kAtomLayoutMdQ)>, Int<kBlockN>>,
      Shape<Int<kdQCols / (kNumMmaWG / kAtomLayoutMdQ)>, Int<kBlockM>, Int<kBlockN>>>;
  using AtomLayoutdQ = std::conditional_t<!kdQSwapAB, Layout<Shape<Int<kAtomLayoutMdQ>, Int<kNumMmaWG / kAtomLayoutMdQ>, _1>>,
                                          Layout<Shape<Int<kNumMmaWG / kAtomLayoutMdQ>, Int<kAtomLayoutMdQ>, _1>>>;
  using TiledMmadQ = decltype(make_tiled_mma(
      std::conditional_t<
          !kdQSwapAB,
          decltype(GMMA::ss_op_selector<Element, Element, ElementAccum, AtomShapedQ, GMMA::Major::K, GMMA::Major::MN>()),
          decltype(GMMA::ss_op_selector<Element, Element, ElementAccum, AtomShapedQ, GMMA::Major::MN, GMMA::Major::K>())>{},
      AtomLayoutdQ{}));

  // ---------------- shared memory layouts ----------------
  // Q / dO: K-major for S / dP; their transposed views feed dK / dV (MN-major), whose per-warpgroup
  // extent along the head dim decides the swizzle width.
  using SmemAtomQdO = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                               GMMA::Major::K, Element, Int<kBlockM>, Int<kHeadDim / (kNumMmaWG / kAtomLayoutNdKV)>>());
  using SmemLayoutQ = decltype(tile_to_shape(
      SmemAtomQdO{}, make_shape(Int<kBlockM>{}, Int<kHeadDim>{}, Int<kStagesQ>{})));
  // dO: Dv wide (the same atom as Q's where Dv == D)
  using SmemAtomdO = std::conditional_t<
      kHeadDimV == kHeadDim, SmemAtomQdO,
      decltype(cutlass::gemm::collective::detail::ss_smem_selector<
               GMMA::Major::K, Element, Int<kBlockM>, Int<kHeadDimV / (kNumMmaWG / kAtomLayoutNdKV)>>())>;
  using SmemLayoutdO = decltype(tile_to_shape(
      SmemAtomdO{}, make_shape(Int<kBlockM>{}, Int<kHeadDimV>{}, Int<kStagesdO>{})));
  // K: K-major for S; its transposed view is the B operand of dQ, sliced per warpgroup along d.
  using SmemAtomK = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                             GMMA::Major::K, Element, Int<kBlockN>, Int<kdQCols / (kNumMmaWG / kAtomLayoutMdQ)>>());
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomK{}, make_shape(Int<kBlockN>{}, Int<kHeadDim>{})));
  using SmemAtomV = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                             GMMA::Major::K, Element, Int<kBlockN>, Int<kHeadDimV>>());
  using SmemLayoutV = decltype(tile_to_shape(SmemAtomV{}, make_shape(Int<kBlockN>{}, Int<kHeadDimV>{})));
  // P / dS: (q, k), k contiguous (K-major as the A operand of dQ = dS K).
  using SmemAtomPdS = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                               GMMA::Major::K, Element, Int<kBlockM / kAtomLayoutMSdP>,
                               Int<kBlockN / (kSdPByWG ? 1 : kNumMmaWG / kAtomLayoutMSdP)>>());
  using SmemLayoutPdS = decltype(tile_to_shape(
      SmemAtomPdS{}, make_shape(Int<kBlockM>{}, Int<kBlockN>{}, Int<kStagesdS>{})));

  // Transposed views (same memory).
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_layout(make_shape(Int<kHeadDim>{}, Int<kBlockM>{}, Int<kStagesQ>{}),
                                 make_stride(Int<kBlockM>{}, _1{}, Int<kBlockM * kHeadDim>{}))));
  using SmemLayoutdOt = decltype(composition(
      SmemLayoutdO{}, make_layout(make_shape(Int<kHeadDimV>{}, Int<kBlockM>{}, Int<kStagesdO>{}),
                                  make_stride(Int<kBlockM>{}, _1{}, Int<kBlockM * kHeadDimV>{}))));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_layout(make_shape(Int<kHeadDim>{}, Int<kBlockN>{}),
                                 make_stride(Int<kBlockN>{}, _1{}))));
  using SmemLayoutPdSt = decltype(composition(
      SmemLayoutPdS{}, make_layout(make_shape(Int<kBlockN>{}, Int<kBlockM>{}, Int<kStagesdS>{}),
                                   make_stride(Int<kBlockM>{}, _1{}, Int<kBlockM * kBlockN>{}))));

  // lse_log2 / dpsum rows per stage, and their broadcast views over the S tile.
  // (stages 128 bytes apart at least: a TMA destination is 128-byte aligned)
  static constexpr int kRowStatStageStride = (kBlockM + 31) / 32 * 32;
  using SmemLayoutLSE = Layout<Shape<Int<kBlockM>, Int<kStagesQ>>, Stride<_1, Int<kRowStatStageStride>>>;
  using SmemLayoutdPsum = Layout<Shape<Int<kBlockM>, Int<kStagesdO>>, Stride<_1, Int<kRowStatStageStride>>>;
  template <int kStages>
  using SmemLayoutRowStatMma = std::conditional_t<
      !kSdPSwapAB,
      Layout<Shape<Int<kBlockM>, Int<kBlockN>, Int<kStages>>, Stride<_1, _0, Int<kRowStatStageStride>>>,
      Layout<Shape<Int<kBlockN>, Int<kBlockM>, Int<kStages>>, Stride<_0, _1, Int<kRowStatStageStride>>>>;

  // dQ slice staging tile (fp32, TMA reduce-add source). At d128 the 32-byte swizzle
  // makes the accumulator's 64-bit stores conflict-free: the hardware splits a warp's 64-bit
  // store into half-warps (4 rows x 2 16-byte chunks each), and only rows of 32 bytes with the
  // chunk flipped every 4 rows put each half-warp on 32 distinct banks. With the 128-byte
  // swizzle, rows r and r^1 meet on the same chunk and every store takes 4 wavefronts for 2
  // (ncu of 18e7339). The TMA box is then 8 columns wide: more, smaller reduce-adds. That
  // trade lost elsewhere (A/B of e8da14c's staging variants, main kernel at 2k keys): d256
  // 1.157 -> 1.199 ms, d192 rows 5-14% lower against cuDNN; d128 0.740 -> 0.722 ms and d64
  // 0.873 -> 0.860 ms gained. d96 was not measured and keeps the selector's swizzle.
  // d64 uses the permuted order below (A/B of dd94878, main kernel, full 16k keys: 10.963 ->
  // 10.659 ms over four interleaved rounds; 2k level).
  // The head dims of dq_accum_permuted_for (bwd_params.h) keep the 128-byte swizzle and its
  // 32-column TMA boxes, and permute each row's 8-column segments instead: value (r, c) is
  // stored at column c ^ ((r & 3) << 3). A half-warp's four rows then fall on four different
  // 32-byte bank groups (one wavefront per 64-bit store, where the natural order takes two);
  // dq_accum receives the same order and the postprocess reads it back.
  static constexpr int kdQColsPerWG = kdQCols / (kNumMmaWG / kAtomLayoutMdQ);
  static constexpr bool kdQStagePermuted = dq_accum_permuted_for(kHeadDim);
  // The steps' per-thread shared-memory partitions (lse / dpsum, P / dS stores, dQ staging)
  // kept across the m-loop as one int each instead of partitioned from the thread index per
  // use (mma()). At d64 that index math was ~100 of 680 instructions per warp and step (SASS;
  // ncu: 1.59e9 instructions against FlashAttention-4's 1.39e9 for d64 full 8k, its kernel
  // 11% faster); hoisted, 579, and the main kernel 2.2-8.3% faster on the FA grid's d64 rows.
  // At d128 it took 473 -> 414 (default tile) and 553 -> 535 (full tile) instructions but the
  // main kernel 0.2-4.1% slower (A/B of efc288c): d64 only (d96 / d192 / d256 not
  // measured).
  static constexpr bool kHoistThreadPartitions = kHeadDim == 64;
  // Swapped dQ (dQ^T in registers) stores single floats down the columns of the (q, d) tile:
  // the 128-byte swizzle puts a warp's 4 rows x 8 columns on 32 distinct banks (the rows are
  // even and XOR distinct 16-byte chunks), so it keeps the selector's swizzle.
  static constexpr bool kdQStageSw32 =
      !kdQStagePermuted && !kdQSwapAB && kdQSlices == 1 && (kHeadDim == 64 || kHeadDim == 128);
  using SmemAtomdQ = std::conditional_t<
      kdQStagePermuted, GMMA::Layout_K_SW128_Atom<ElementAccum>,
      std::conditional_t<kdQStageSw32, GMMA::Layout_K_SW32_Atom<ElementAccum>,
                         decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                                  GMMA::Major::K, ElementAccum, Int<kBlockM>, Int<kdQColsPerWG>>())>>;
  static_assert(!kdQStageSw32 || kdQColsPerWG % 8 == 0);
  static_assert(!kdQStagePermuted || (kdQColsPerWG % 32 == 0 && kBlockM % 8 == 0 && !kdQSwapAB));
  using SmemLayoutdQ = decltype(tile_to_shape(SmemAtomdQ{}, make_shape(Int<kBlockM>{}, Int<kdQCols>{})));

  // P / dS register -> smem copies (stmatrix). Registers hold S (rows q) or S^T (rows k).
  static constexpr int kNumPdSStore = kBlockM * kBlockN / kSdPThreads;
  using SmemCopyAtomPdS = Copy_Atom<
      std::conditional_t<!kSdPSwapAB,
                         std::conditional_t<kNumPdSStore % 8 == 0, SM90_U32x4_STSM_N, SM90_U32x2_STSM_N>,
                         std::conditional_t<kNumPdSStore % 8 == 0, SM90_U16x8_STSM_T, SM90_U16x4_STSM_T>>,
      Element>;

  // The P tile back into a warpgroup's accumulator layout (kSdPByWG: the dP warpgroup reads
  // what the S warpgroup stored with SmemCopyAtomPdS; ldmatrix, the inverse of stmatrix).
  using SmemLoadAtomP = Copy_Atom<
      std::conditional_t<kNumPdSStore % 8 == 0, SM75_U32x4_LDSM_N, SM75_U32x2_LDSM_N>, Element>;

  // ---------------- pipelines ----------------
  using PipelineQ = cutlass::PipelineTmaAsync<kStagesQ>;
  using PipelinedO = cutlass::PipelineTmaAsync<kStagesdO>;
  using PipelineStateQ = typename PipelineQ::PipelineState;
  using PipelineStatedO = typename PipelinedO::PipelineState;

  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesK = kBlockN * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesdO = kBlockM * kHeadDimV * sizeof(Element);
  static constexpr uint32_t kTmaBytesV = kBlockN * kHeadDimV * sizeof(Element);
  static constexpr uint32_t kBytesRowStat = kBlockM * sizeof(ElementAccum);
  // Mask bits of one tile (row-major, kBlockN bits per query row), a 1-D bulk copy.
  static constexpr int kMaskBitWords = kBlockM * kBlockN / 32;
  static constexpr uint32_t kMaskBitBytes = kMaskBitWords * sizeof(uint32_t);
  static_assert(kMaskBitBytes % 16 == 0);
  // How an m-block's scores are masked (bwd_step's tag): not at all, per element from the
  // mask (and the causal cut, the key tail), or from the classification's bits.
  static constexpr int kMaskNone = 0, kMaskValues = 1, kMaskBits = 2;

  // ---------------- shared storage ----------------
  using SmemP_t = std::conditional_t<kMmadKVIsRS, cute::array<Element, 0>,
                                     cute::array_aligned<Element, cute::cosize_v<SmemLayoutPdS>, 1024>>;
  struct TensorStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> smem_k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutV>, 1024> smem_v;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> smem_q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutdO>, 1024> smem_do;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutPdS>, 1024> smem_ds;
    SmemP_t smem_p;
    cute::array_aligned<ElementAccum, cute::cosize_v<SmemLayoutLSE>, 128> smem_lse;
    cute::array_aligned<ElementAccum, cute::cosize_v<SmemLayoutdPsum>, 128> smem_dpsum;
    // a kTilePartialBits tile's visibility bits (BwdParams::tile_bits), one per Q stage: the
    // producer loads them with the m-block's Q (same barrier), so the MMA warps neither copy
    // nor wait for them (a cp.async in the kernel made ptxas pad every async-proxy fence)
    cute::array_aligned<uint32_t, kMasked ? kMaskBitWords * kStagesQ : 0, 128> smem_mask_bits;
  };
  // Kept out of the epilogue union: the last dQ reduce-add may still be reading it.
  struct dQStorage {
    cute::array_aligned<ElementAccum, cute::cosize_v<SmemLayoutdQ>, 1024> smem_dq;
  };

  // ---------------- params ----------------
  using ShapeQKV = Shape<int32_t, int32_t, int32_t, int32_t>;  // (seqlen, d, head, batch)
  using StrideQKV = Stride<int64_t, _1, int64_t, int64_t>;

  using TMA_Q = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{}, StrideQKV{}),
      take<0, 2>(SmemLayoutQ{}), Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TMA_dO = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{}, StrideQKV{}),
      take<0, 2>(SmemLayoutdO{}), Shape<Int<kBlockM>, Int<kHeadDimV>>{}, _1{}));
  using TMA_K = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{}, StrideQKV{}),
      SmemLayoutK{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  using TMA_V = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{}, StrideQKV{}),
      SmemLayoutV{}, Shape<Int<kBlockN>, Int<kHeadDimV>>{}, _1{}));
  using TMA_dQ = decltype(make_tma_copy(
      SM90_TMA_REDUCE_ADD{}, make_tensor(make_gmem_ptr(static_cast<ElementAccum*>(nullptr)), ShapeQKV{}, StrideQKV{}),
      SmemLayoutdQ{}, Shape<Int<kBlockM>, Int<kdQCols>>{}, _1{}));
  // kRowStatTma: lse_log2 / dpsum as (Sq_rounded, B * Hq), one kBlockM-row box per m-block
  using ShapeRowStat = Shape<int32_t, int32_t>;
  using StrideRowStat = Stride<_1, int64_t>;
  using SmemLayoutRowStatBox = Layout<Shape<Int<kBlockM>, _1>>;
  using TMA_RowStat = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<float const*>(nullptr)), ShapeRowStat{}, StrideRowStat{}),
      SmemLayoutRowStatBox{}, Shape<Int<kBlockM>, _1>{}, _1{}));

  struct Params {
    ShapeQKV shape_Q;       // (Sq, D, Hq, B); dO's: shape_dO()
    ShapeQKV shape_K;       // (Sk, D, Hkv, B); V's: shape_V()
    ShapeQKV shape_dQacc;   // (Sq_rounded, D, Hq, B)
    TMA_Q tma_load_Q;
    TMA_dO tma_load_dO;
    TMA_K tma_load_K;
    TMA_V tma_load_V;
    TMA_dQ tma_add_dQ;
    TMA_RowStat tma_load_lse;    // kRowStatTma only (else default-constructed, unused)
    TMA_RowStat tma_load_dpsum;
    float const* ptr_lse_log2;
    float const* ptr_dpsum;
    int seqlen_q;
    int seqlen_k;
    int seqlen_q_rounded;
    int num_heads_q;
    int qhead_per_khead;
    // q heads one CTA walks in turn (BwdParams::heads_per_cta): 1, or the GQA group, whose
    // heads then run the m-block walk one after the other with K / V loaded once
    int heads_per_cta;
    float scale_log2;
    bool is_causal;
    // optional mask (BwdParams' fields; mask_kind kNone: none) and its tile classes
    MaskKind mask_kind;
    void const* mask;
    int64_t mask_batch_stride, mask_head_stride, mask_row_stride, mask_col_stride;
    unsigned char const* tile_class;
    int const* tile_m_range;
    uint32_t const* tile_bits;
    int mask_batch, mask_heads, num_m_blocks, num_n_blocks;
    int* dq_semaphore;  // deterministic mode: [B, Hq, ceil(Sq / kBlockM)], else null
    bool m_descending;     // deterministic kKeysAscending: m-blocks visited last to first
    bool keys_descending;  // deterministic kKeysDescending: dQ added in descending key order
  };

  // The (S, Dv, H, B) shapes of dO and V: Params' (S, D, H, B) with the value head dim (the
  // same shapes where Dv == D; kept out of Params, whose layout the kernels of Dv == D keep).
  CUTE_HOST_DEVICE static ShapeQKV with_value_dim(ShapeQKV const& shape) {
    if constexpr (kHeadDimV == kHeadDim) {
      return shape;
    } else {
      return make_shape(get<0>(shape), int32_t(kHeadDimV), get<2>(shape), get<3>(shape));
    }
  }
  CUTE_HOST_DEVICE static ShapeQKV shape_dO(Params const& params) { return with_value_dim(params.shape_Q); }
  CUTE_HOST_DEVICE static ShapeQKV shape_V(Params const& params) { return with_value_dim(params.shape_K); }

  static Params to_params(BwdParams const& p) {
    auto make_in = [](void const* ptr, int s, int h, int b, int64_t rs, int64_t hs, int64_t bs, auto dim) {
      return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)),
                         make_shape(s, int32_t(decltype(dim)::value), h, b), make_stride(rs, _1{}, hs, bs));
    };
    auto mQ = make_in(p.q, p.seqlen_q, p.heads_q, p.batch, p.q_row_stride, p.q_head_stride, p.q_batch_stride,
                      Int<kHeadDim>{});
    auto mdO = make_in(p.dout, p.seqlen_q, p.heads_q, p.batch, p.dout_row_stride, p.dout_head_stride,
                       p.dout_batch_stride, Int<kHeadDimV>{});
    auto mK = make_in(p.k, p.seqlen_k, p.heads_kv, p.batch, p.k_row_stride, p.k_head_stride, p.k_batch_stride,
                      Int<kHeadDim>{});
    auto mV = make_in(p.v, p.seqlen_k, p.heads_kv, p.batch, p.v_row_stride, p.v_head_stride, p.v_batch_stride,
                      Int<kHeadDimV>{});
    int64_t const acc_head_stride = int64_t(p.seqlen_q_rounded) * kHeadDim;
    TMA_RowStat tma_lse{}, tma_dpsum{};
    if constexpr (kRowStatTma) {
      auto row_stat = [&](float const* ptr) {
        return make_tensor(make_gmem_ptr(ptr), make_shape(p.seqlen_q_rounded, p.batch * p.heads_q),
                           make_stride(_1{}, int64_t(p.seqlen_q_rounded)));
      };
      tma_lse = make_tma_copy(SM90_TMA_LOAD{}, row_stat(p.lse_log2), SmemLayoutRowStatBox{},
                              Shape<Int<kBlockM>, _1>{}, _1{});
      tma_dpsum = make_tma_copy(SM90_TMA_LOAD{}, row_stat(p.dpsum), SmemLayoutRowStatBox{},
                                Shape<Int<kBlockM>, _1>{}, _1{});
    }
    auto mdQacc = make_tensor(make_gmem_ptr(p.dq_accum),
                              make_shape(p.seqlen_q_rounded, int32_t(kHeadDim), p.heads_q, p.batch),
                              make_stride(int64_t(kHeadDim), _1{}, acc_head_stride, acc_head_stride * p.heads_q));
    return Params{
        make_shape(p.seqlen_q, int32_t(kHeadDim), p.heads_q, p.batch),
        make_shape(p.seqlen_k, int32_t(kHeadDim), p.heads_kv, p.batch),
        make_shape(p.seqlen_q_rounded, int32_t(kHeadDim), p.heads_q, p.batch),
        make_tma_copy(SM90_TMA_LOAD{}, mQ, take<0, 2>(SmemLayoutQ{}), Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}),
        make_tma_copy(SM90_TMA_LOAD{}, mdO, take<0, 2>(SmemLayoutdO{}), Shape<Int<kBlockM>, Int<kHeadDimV>>{}, _1{}),
        make_tma_copy(SM90_TMA_LOAD{}, mK, SmemLayoutK{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}),
        make_tma_copy(SM90_TMA_LOAD{}, mV, SmemLayoutV{}, Shape<Int<kBlockN>, Int<kHeadDimV>>{}, _1{}),
        make_tma_copy(SM90_TMA_REDUCE_ADD{}, mdQacc, SmemLayoutdQ{}, Shape<Int<kBlockM>, Int<kdQCols>>{}, _1{}),
        tma_lse,
        tma_dpsum,
        p.lse_log2,
        p.dpsum,
        p.seqlen_q,
        p.seqlen_k,
        p.seqlen_q_rounded,
        p.heads_q,
        p.heads_q / p.heads_kv,
        p.heads_per_cta,
        p.scale_log2,
        p.is_causal,
        p.mask_kind,
        p.mask,
        p.mask_batch_stride,
        p.mask_head_stride,
        p.mask_row_stride,
        p.mask_col_stride,
        p.tile_class,
        p.tile_m_range,
        p.tile_bits,
        p.mask_batch,
        p.mask_heads,
        p.num_m_blocks,
        p.num_n_blocks,
        p.deterministic ? p.dq_semaphore : nullptr,
        p.deterministic && p.deterministic_order == DeterministicOrder::kKeysAscending,
        p.deterministic && p.deterministic_order == DeterministicOrder::kKeysDescending};
  }

  CUTE_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    cute::prefetch_tma_descriptor(params.tma_load_Q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_load_dO.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_load_K.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_load_V.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_add_dQ.get_tma_descriptor());
    if constexpr (kRowStatTma) {
      cute::prefetch_tma_descriptor(params.tma_load_lse.get_tma_descriptor());
      cute::prefetch_tma_descriptor(params.tma_load_dpsum.get_tma_descriptor());
    }
  }

  // Query blocks [m_min, m_max) that see any key of this n-block. Causal is SDPA's top-left
  // alignment: key j is visible to query i iff j <= i.
  CUTE_HOST_DEVICE static cute::tuple<int, int> m_block_range(Params const& params, int n_block) {
    int const m_max = (params.seqlen_q + kBlockM - 1) / kBlockM;
    int const m_min = params.is_causal ? (n_block * kBlockN) / kBlockM : 0;
    return {m_min, m_max};
  }

  // The m-blocks a CTA walks: m_block_range, with a mask narrowed to the n-block's first..last
  // non-empty tile (tile_m_range, written by the classification), and to the work item's
  // [m_lo, m_hi) (a split-tail fragment; a whole tile: [0, INT_MAX)).
  CUTE_DEVICE static cute::tuple<int, int> walk_range(Params const& params, int n_block, int bidh, int bidb,
                                                      int m_lo, int m_hi) {
    auto [m_min, m_max] = m_block_range(params, n_block);
    m_min = cute::max(m_min, m_lo);
    m_max = cute::min(m_max, m_hi);
    if (params.mask_kind != MaskKind::kNone) {
      int const mb = params.mask_batch == 1 ? 0 : bidb;
      int const mh = params.mask_heads == 1 ? 0 : bidh;
      int2 const r = reinterpret_cast<int2 const*>(
          params.tile_m_range)[(int64_t(mb) * params.mask_heads + mh) * params.num_n_blocks + n_block];
      m_min = cute::max(m_min, r.x);
      m_max = cute::min(m_max, r.y);
    }
    return {m_min, m_max};
  }

  // With a mask: the index of this CTA's first tile in tile_class order (its m-block 0).
  // mma()'s masked walk keeps this index as an int (computed once, one register; run() checks
  // the tile grid fits) and rebuilds the row's address from it where used (a 64-bit value live
  // across the loop cost registers; the full index math per use cost ~25 uniform instructions
  // per step, ncu at d128 2k). Each step's class comes from the same load as the walk's (one
  // class load per step, after the step: loads moved before the step's MMAs delayed them).
  CUTE_DEVICE static int64_t first_tile_index(Params const& params, int n_block, int bidh, int bidb) {
    int const mb = params.mask_batch == 1 ? 0 : bidb;
    int const mh = params.mask_heads == 1 ? 0 : bidh;
    return ((int64_t(mb) * params.mask_heads + mh) * params.num_n_blocks + n_block) * int64_t(params.num_m_blocks);
  }

  // With a mask: this CTA's row of tile classes (one byte per m-block), else null.
  CUTE_DEVICE static unsigned char const* tile_classes(Params const& params, int n_block, int bidh, int bidb) {
    if (params.mask_kind == MaskKind::kNone) { return nullptr; }
    return params.tile_class + first_tile_index(params, n_block, bidh, bidb);
  }

  // The m-blocks of [m_min, m_max) a CTA visits, skipping tiles that are empty under the mask:
  // ascending, or descending in deterministic mode. The producer, the dQ writer and the MMA
  // warpgroups walk the same sequence: first_m_block, then following_m_block until it is -1.
  // (tile: the class of the block returned, from the same load; kTileFull without a mask)
  CUTE_DEVICE static int walk_m_blocks(Params const& params, unsigned char const* classes, int m,
                                       int m_min, int m_max, int& tile) {
    int const step = params.m_descending ? -1 : 1;
    tile = kTileFull;
    if (classes != nullptr) {
      while (m >= m_min && m < m_max && (tile = classes[m]) == kTileEmpty) { m += step; }
    }
    return (m >= m_min && m < m_max) ? m : -1;
  }
  CUTE_DEVICE static int walk_m_blocks(Params const& params, unsigned char const* classes, int m,
                                       int m_min, int m_max) {
    int tile;
    return walk_m_blocks(params, classes, m, m_min, m_max, tile);
  }
  CUTE_DEVICE static int first_m_block(Params const& params, unsigned char const* classes, int m_min,
                                       int m_max) {
    return walk_m_blocks(params, classes, params.m_descending ? m_max - 1 : m_min, m_min, m_max);
  }
  CUTE_DEVICE static int following_m_block(Params const& params, unsigned char const* classes, int m,
                                           int m_min, int m_max) {
    return walk_m_blocks(params, classes, params.m_descending ? m - 1 : m + 1, m_min, m_max);
  }
  CUTE_DEVICE static int following_m_block(Params const& params, unsigned char const* classes, int m,
                                           int m_min, int m_max, int& tile) {
    return walk_m_blocks(params, classes, params.m_descending ? m - 1 : m + 1, m_min, m_max, tile);
  }

  // ---------------- producer warp ----------------
  // One tile. kv_loads: the K / V loads of this CTA so far (one per tile that sees a query),
  // counted here; from the second on, the load waits until the MMA warps are done with the
  // previous tile's K / V (barrier_KV_empty), after this tile's first Q stage is issued.
  template <class SharedStorage>
  CUTE_DEVICE void load(Params const& params, PipelineQ& pipeline_q, PipelinedO& pipeline_do,
                        PipelineStateQ& write_q, PipelineStatedO& write_do, SharedStorage& ss, int n_block,
                        int bidh, int bidb, int m_lo, int m_hi, int& kv_loads) {
    // The walk of a mask reads the classification's output (grid_dependency.h); without a
    // mask, K and V (inputs of the call, complete before the plainly launched preprocess
    // started: grid_dependency.h's invariant) are loaded before the wait.
    if (params.mask_kind != MaskKind::kNone) { wait_for_prior_grid(); }
    auto [m_min, m_max] = walk_range(params, n_block, bidh, bidb, m_lo, m_hi);
    unsigned char const* classes = tile_classes(params, n_block, bidh, bidb);
    int const m_first = first_m_block(params, classes, m_min, m_max);
    if (m_first < 0) { return; }

    auto& st = ss.tensors.mainloop;
    Tensor sQ = make_tensor(make_smem_ptr(st.smem_q.data()), SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(st.smem_do.data()), SmemLayoutdO{});
    Tensor sK = make_tensor(make_smem_ptr(st.smem_k.data()), SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(st.smem_v.data()), SmemLayoutV{});
    Tensor sLSE = make_tensor(make_smem_ptr(st.smem_lse.data()), SmemLayoutLSE{});
    Tensor sdPsum = make_tensor(make_smem_ptr(st.smem_dpsum.data()), SmemLayoutdPsum{});

    int const bidh_kv = bidh / params.qhead_per_khead;
    Tensor mK = params.tma_load_K.get_tma_tensor(params.shape_K)(_, _, bidh_kv, bidb);
    Tensor mV = params.tma_load_V.get_tma_tensor(shape_V(params))(_, _, bidh_kv, bidb);
    Tensor gK = local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, _0{}));  // (N, D)
    Tensor gV = local_tile(mV, Shape<Int<kBlockN>, Int<kHeadDimV>>{}, make_coord(n_block, _0{}));  // (N, Dv)

    auto tma_Q = params.tma_load_Q.get_slice(_0{});
    auto tma_dO = params.tma_load_dO.get_slice(_0{});
    auto tma_K = params.tma_load_K.get_slice(_0{});
    auto tma_V = params.tma_load_V.get_slice(_0{});
    Tensor tQsQ = group_modes<0, 3>(tma_Q.partition_D(sQ));       // (TMA, stage)
    Tensor tdOsdO = group_modes<0, 3>(tma_dO.partition_D(sdO));   // (TMA, stage)
    Tensor tKgK = tma_K.partition_S(gK);
    Tensor tKsK = tma_K.partition_D(sK);
    Tensor tVgV = tma_V.partition_S(gV);
    Tensor tVsV = tma_V.partition_D(sV);
    auto bulk_copy = Copy_Traits<SM90_BULK_COPY_AUTO>{};
    auto row_stat_stage = [&](auto const& tma, float* stage_ptr) {
      return tma.get_slice(_0{}).partition_D(make_tensor(make_smem_ptr(stage_ptr), SmemLayoutRowStatBox{}));
    };

    int const kv_load = kv_loads;
    kv_loads = kv_load + 1;
    if (cute::elect_one_sync()) {
      using BarrierT = cutlass::arch::ClusterTransactionBarrier::ValueType;
      auto load_kv = [&] {
        if (kv_load > 0) { ss.pipelines.barrier_KV_empty.wait((kv_load - 1) & 1); }
        ss.pipelines.barrier_KV.arrive_and_expect_tx(kTmaBytesK + kTmaBytesV);
        copy(params.tma_load_K.with(reinterpret_cast<BarrierT&>(ss.pipelines.barrier_KV), 0), tKgK, tKsK);
        copy(params.tma_load_V.with(reinterpret_cast<BarrierT&>(ss.pipelines.barrier_KV), 0), tVgV, tVsV);
      };
      if (kv_load == 0) { load_kv(); }  // the CTA's first tile: nothing to wait for
      wait_for_prior_grid();  // lse_log2 and dpsum come from the preprocess
      // The q heads of this CTA (heads_per_cta > 1: a GQA group, each walking the same
      // m-blocks: no mask, or one shared by the heads), one after the other through the same
      // pipelines; K and V stay.
      CUTLASS_PRAGMA_NO_UNROLL
      for (int h = bidh; h < bidh + params.heads_per_cta; ++h) {
        Tensor mQ = params.tma_load_Q.get_tma_tensor(params.shape_Q)(_, _, h, bidb);
        Tensor mdO = params.tma_load_dO.get_tma_tensor(shape_dO(params))(_, _, h, bidb);
        Tensor gQ = local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(_, _0{}));   // (M, D, m)
        Tensor gdO = local_tile(mdO, Shape<Int<kBlockM>, Int<kHeadDimV>>{}, make_coord(_, _0{})); // (M, Dv, m)
        Tensor tQgQ = group_modes<0, 3>(tma_Q.partition_S(gQ));       // (TMA, m)
        Tensor tdOgdO = group_modes<0, 3>(tma_dO.partition_S(gdO));   // (TMA, m)
        int64_t const row_offset = (int64_t(bidb) * params.num_heads_q + h) * params.seqlen_q_rounded;
        Tensor mLSE = make_tensor(make_gmem_ptr(params.ptr_lse_log2 + row_offset), make_shape(params.seqlen_q_rounded));
        Tensor mdPsum = make_tensor(make_gmem_ptr(params.ptr_dpsum + row_offset), make_shape(params.seqlen_q_rounded));
        Tensor gLSE = local_tile(mLSE, Shape<Int<kBlockM>>{}, make_coord(_));      // (M, m)
        Tensor gdPsum = local_tile(mdPsum, Shape<Int<kBlockM>>{}, make_coord(_));  // (M, m)
        // kRowStatTma: this head's row of (Sq_rounded, B * Hq) in kBlockM-row boxes
        auto row_stat_boxes = [&](auto const& tma) {
          Tensor m = tma.get_tma_tensor(make_shape(params.seqlen_q_rounded, params.num_heads_q * get<3>(params.shape_Q)));
          Tensor g = local_tile(m, Shape<Int<kBlockM>, _1>{}, make_coord(_, bidb * params.num_heads_q + h));
          return tma.get_slice(_0{}).partition_S(g);  // (TMA, TMA_M, TMA_N, m)
        };
        auto load_q = [&](int m) {
          pipeline_q.producer_acquire(write_q);
          auto* bar = pipeline_q.producer_get_barrier(write_q);
          if constexpr (kMasked) {
            if (classes[m] == kTilePartialBits) {
              // the stage's expected bytes grow before any of its copies is issued, so its
              // phase cannot complete without the bits
              cutlass::arch::ClusterTransactionBarrier::expect_transaction(bar, kMaskBitBytes);
              Tensor gBits = make_tensor(
                  make_gmem_ptr(params.tile_bits + (first_tile_index(params, n_block, h, bidb) + m) * kMaskBitWords),
                  Shape<Int<kMaskBitWords>>{});
              Tensor sBits = make_tensor(make_smem_ptr(st.smem_mask_bits.data() + write_q.index() * kMaskBitWords),
                                         Shape<Int<kMaskBitWords>>{});
              copy(bulk_copy.with(*bar), gBits, sBits);
            }
          }
          copy(params.tma_load_Q.with(*bar, 0, TMA::CacheHintSm90::EVICT_LAST), tQgQ(_, m), tQsQ(_, write_q.index()));
          if constexpr (kRowStatTma) {
            copy(params.tma_load_lse.with(*bar, 0), row_stat_boxes(params.tma_load_lse)(_, _, _, m),
                 row_stat_stage(params.tma_load_lse, st.smem_lse.data() + write_q.index() * kRowStatStageStride));
          } else {
            copy(bulk_copy.with(*bar), gLSE(_, m), sLSE(_, write_q.index()));
          }
          ++write_q;
        };
        auto load_do = [&](int m) {
          pipeline_do.producer_acquire(write_do);
          auto* bar = pipeline_do.producer_get_barrier(write_do);
          copy(params.tma_load_dO.with(*bar, 0, TMA::CacheHintSm90::EVICT_LAST), tdOgdO(_, m),
               tdOsdO(_, write_do.index()));
          if constexpr (kRowStatTma) {
            copy(params.tma_load_dpsum.with(*bar, 0), row_stat_boxes(params.tma_load_dpsum)(_, _, _, m),
                 row_stat_stage(params.tma_load_dpsum, st.smem_dpsum.data() + write_do.index() * kRowStatStageStride));
          } else {
            copy(bulk_copy.with(*bar), gdPsum(_, m), sdPsum(_, write_do.index()));
          }
          ++write_do;
        };
        load_q(m_first);
        // a later tile: its K / V once the MMA warps are done with the previous tile's (its
        // first Q is on the way meanwhile)
        if (kv_load > 0 && h == bidh) { load_kv(); }
        int m = m_first;
        CUTLASS_PRAGMA_NO_UNROLL
        for (int m_next = following_m_block(params, classes, m, m_min, m_max); m_next >= 0;
             m = m_next, m_next = following_m_block(params, classes, m, m_min, m_max)) {
          load_do(m);
          load_q(m_next);  // one Q ahead of dO: S of the next block starts while dO arrives
        }
        load_do(m);
      }
    }
  }

  // ---------------- dQ-writer warp ----------------
  // Deterministic mode: the number of key blocks that add their dQ tile to m-block m before
  // this one, in the order of params (DeterministicOrder, bwd_params.h): the contributing key
  // blocks below n_block (ascending order) or above it (descending). Without a mask every key
  // block whose m-block range holds m contributes (causal: those starting at or before m);
  // under a mask only those whose (m, n) tile is not empty. Called by the whole writer warp;
  // `classes` is this CTA's row of tile classes or null.
  CUTE_DEVICE static int dq_turn(Params const& params, unsigned char const* classes, int n_block, int m) {
    int n_begin = 0, n_end = n_block;  // the key blocks that come before n_block
    if (params.keys_descending) {
      n_begin = n_block + 1;
      n_end = (params.seqlen_k + kBlockN - 1) / kBlockN;
      // causal: key blocks whose m-block range starts at or before m (m_block_range's m_min)
      if (params.is_causal) { n_end = cute::min(n_end, ((m + 1) * kBlockM - 1) / kBlockN + 1); }
    }
    if (classes == nullptr) { return cute::max(n_end - n_begin, 0); }
    int const lane = int(threadIdx.x) % cutlass::NumThreadsPerWarp;
    int count = 0;
    for (int n0 = n_begin; n0 < n_end; n0 += cutlass::NumThreadsPerWarp) {
      int const n = n0 + lane;
      bool const adds =
          n < n_end && classes[int64_t(n - n_block) * params.num_m_blocks + m] != kTileEmpty;
      count += __popc(__ballot_sync(0xffffffffu, adds));
    }
    return count;
  }

  template <class SharedStorage>
  CUTE_DEVICE void store_dq(Params const& params, SharedStorage& ss, int n_block, int bidh, int bidb, int m_lo,
                           int m_hi) {
    wait_for_prior_grid();  // dq_accum zeroed by the preprocess, a mask's tile classes
    auto [m_min, m_max] = walk_range(params, n_block, bidh, bidb, m_lo, m_hi);
    unsigned char const* classes = tile_classes(params, n_block, bidh, bidb);
    int const m_first = first_m_block(params, classes, m_min, m_max);
    if (m_first < 0) { return; }
    Tensor sdQ = make_tensor(make_smem_ptr(ss.dq.smem_dq.data()), SmemLayoutdQ{});
    auto tma = params.tma_add_dQ.get_slice(_0{});
    Tensor tdQsdQ = tma.partition_S(sdQ);  // (TMA, TMA_M, TMA_N)
    bool const leader = cute::elect_one_sync();
    int const m_blocks = (params.seqlen_q + kBlockM - 1) / kBlockM;  // (m_max may be narrowed)
    // this CTA's q heads in the producer's order (load)
    CUTLASS_PRAGMA_NO_UNROLL
    for (int h = bidh; h < bidh + params.heads_per_cta; ++h) {
      Tensor mdQ = params.tma_add_dQ.get_tma_tensor(params.shape_dQacc)(_, _, h, bidb);
      Tensor gdQ = local_tile(mdQ, ShapedQ{}, make_coord(_, _));  // (M, cols, m, slice)
      Tensor tdQgdQ = tma.partition_D(gdQ);  // (TMA, TMA_M, TMA_N, m, slice)
      // deterministic mode: this head's row of dQ semaphores, one per m-block
      int* sem = params.dq_semaphore == nullptr
                     ? nullptr
                     : params.dq_semaphore + (int64_t(bidb) * params.num_heads_q + h) * m_blocks;
      CUTLASS_PRAGMA_NO_UNROLL
      for (int m = m_first; m >= 0; m = following_m_block(params, classes, m, m_min, m_max)) {
        if (sem != nullptr) {
          // waits while the MMA warps still compute this m-block's dQ
          int const turn = dq_turn(params, classes, n_block, m);
          if (leader) { wait_for_turn(sem + m, turn); }
        }
        CUTLASS_PRAGMA_UNROLL
        for (int s = 0; s < kdQSlices; ++s) {
          named_sync(kNumMmaThreads + cutlass::NumThreadsPerWarp, BwdBarrier::kdQFull);
          if (leader) {
            copy(params.tma_add_dQ, tdQsdQ, tdQgdQ(_, _, _, m, s));
            tma_store_arrive();
            tma_store_wait<0>();  // smem read back before the MMA warps may overwrite it
          }
          __syncwarp();
          named_arrive(kNumMmaThreads + cutlass::NumThreadsPerWarp, BwdBarrier::kdQEmpty);
        }
        if (sem != nullptr && leader) {
          bulk_wait_all_complete();  // the adds have landed, not only been read from smem
          pass_turn(sem + m);
        }
        __syncwarp();
      }
    }
  }

  // ---------------- MMA warpgroups ----------------
  // mma() holds a tile's state (shared-memory tensors, tiled MMAs, descriptors), the S / dP
  // wgmma steps and bwd_step, which chains one m-block's steps, and walks the m-blocks. The
  // other steps are lambdas over that state, by reference, that the helpers below make and hand
  // back in aggregates (pack): the same closures as when mma() defined them, so the compiler
  // sees the same code. Kept in mma() because moving them changed the register allocation
  // (d128, d256): gemm_s_dp / gemm_s_or_dp, bwd_step and the m-block walk. So did force-inlined
  // member functions in place of the lambdas, and a lambda returned by itself rather than
  // through pack.

  // Types of mma()'s locals that the helpers take by reference.
  template <class T, class Layout>
  using SmemTensor = decltype(make_tensor(make_smem_ptr(static_cast<T*>(nullptr)), Layout{}));
  using ThrMmadKV = decltype(TiledMmadKV{}.get_thread_slice(0));
  using ThrMmadQ = decltype(TiledMmadQ{}.get_thread_slice(0));
  using SmemCopyPdS = decltype(make_tiled_copy_C(SmemCopyAtomPdS{}, TiledMmaSdP{}));
  using SmemLSE = SmemTensor<ElementAccum, SmemLayoutRowStatMma<kStagesQ>>;
  using SmemdPsum = SmemTensor<ElementAccum, SmemLayoutRowStatMma<kStagesdO>>;
  using SmemdQ = SmemTensor<ElementAccum, SmemLayoutdQ>;

  // A helper's lambdas in its aggregate, copied in through references (the aggregate built in
  // the return statement instead changed the register allocation).
  template <template <class...> class Aggregate, class... L>
  CUTE_DEVICE static Aggregate<L...> pack(L const&... l) {
    return {l...};
  }

  // ---- the steps' per-thread shared-memory partitions ----
  // The lse / dpsum values, the P / dS stores, the dQ staging. kHoistThreadPartitions (d64):
  // each kept across the m-loop as one int (smem_partition_offset, utils.h) and rebuilt where
  // used (hoisted_offsets, thread_partitions); else partitioned from the thread index where
  // used.
  struct HoistedOffsets {
    int row_stat_offset;
    int pds_store_offset;
    uint32_t dq_seg0_addr;
  };

  // The P / dS tile (.., stage) as stmatrix stores it (store_pds_gemm_dv; one offset for P and
  // dS: one layout); smem: smem_p or smem_ds.
  CUTE_DEVICE static auto pds_tile(Element* smem) {
    return cute::conditional_return<!kSdPSwapAB>(
        as_position_independent_swizzle_tensor(make_tensor(make_smem_ptr(smem), SmemLayoutPdS{})),
        as_position_independent_swizzle_tensor(make_tensor(make_smem_ptr(smem), SmemLayoutPdSt{})));
  }

  // The hoisted partitions' offsets (zero unless kHoistThreadPartitions: d64).
  template <class SdPThread>
  CUTE_DEVICE HoistedOffsets hoisted_offsets(TiledMmaSdP& tiled_mma_SdP, TiledMmadQ& tiled_mma_dQ,
                                             SmemCopyPdS& smem_tiled_copy_PdS, SmemLSE& sLSEMma, TensorStorage& st,
                                             SmemdQ& sdQ, SdPThread& sdp_thread, int const& thread_idx) {
    int const row_stat_offset = [&] {
      if constexpr (kHoistThreadPartitions) {
        return smem_partition_offset(tiled_mma_SdP.get_thread_slice(sdp_thread()).partition_C(sLSEMma), sLSEMma.data());
      } else {
        return 0;
      }
    }();
    int const pds_store_offset = [&] {
      if constexpr (kHoistThreadPartitions) {
        return smem_partition_offset(smem_tiled_copy_PdS.get_thread_slice(sdp_thread()).partition_D(pds_tile(st.smem_ds.data())),
                                     pds_tile(st.smem_ds.data()).data());
      } else {
        return 0;
      }
    }();
    // (permuted dQ staging, hand_dq_to_writer) the thread's address of segment 0, whose
    // column is (c0 & ~31) + 8 * (r0 & 3) + (c0 & 7). Segment s's column differs from it in
    // bits 3-4 only (s ^ (r0 & 3) for r0 & 3), and the 128-byte swizzle moves bytes by the row
    // bits (7-9) into bits 4-6: flipping bits 5-6 of the address flips them in the swizzled
    // address too (the tile is 1024-byte aligned), so segment s's address is
    // dq_seg0_addr ^ (s << 5).
    uint32_t const dq_seg0_addr = [&] {
      if constexpr (kHoistThreadPartitions && kdQStagePermuted) {
        static_assert(std::is_same_v<SmemAtomdQ, GMMA::Layout_K_SW128_Atom<ElementAccum>> && sizeof(ElementAccum) == 4,
                      "the XOR above is the 128-byte swizzle's, on 4-byte values");
        Tensor tdQcdQ = tiled_mma_dQ.get_thread_slice(thread_idx).partition_C(make_identity_tensor(ShapedQ{}));
        int const r0 = get<0>(tdQcdQ(0)), c0 = get<1>(tdQcdQ(0));
        Tensor sdQ_pi = as_position_independent_swizzle_tensor(sdQ);
        return cute::cast_smem_ptr_to_uint(raw_pointer_cast(&sdQ_pi(r0, (c0 & ~31) + 8 * (r0 & 3) + (c0 & 7))));
      } else {
        return 0u;
      }
    }();
    return {row_stat_offset, pds_store_offset, dq_seg0_addr};
  }

  template <class RowStatFragment, class PdSStorePartition, class DqStageTile>
  struct ThreadPartitions {
    RowStatFragment row_stat_fragment;
    PdSStorePartition pds_store_partition;
    DqStageTile dq_stage_tile;
  };

  // The partitions as the steps take them (rebuilt from the offsets, or partitioned).
  template <class SdPThread>
  CUTE_DEVICE auto thread_partitions(TiledMmaSdP& tiled_mma_SdP, SmemCopyPdS& smem_tiled_copy_PdS, SmemLSE& sLSEMma,
                                     TensorStorage& st, SmemdQ& sdQ, SdPThread& sdp_thread,
                                     int const& row_stat_offset, int const& pds_store_offset) {
    // lse / dpsum of one stage in the S / dP accumulator's layout (one offset for both:
    // SmemLayoutRowStatMma differs only in the stage count).
    using RowStatLayout = decltype(tiled_mma_SdP.get_thread_slice(0).partition_C(sLSEMma)(_, _, _, 0).layout());
    // sRowStatMma: sLSEMma or sdPsumMma.
    auto row_stat_fragment = [&](auto const& sRowStatMma, int stage) {
      if constexpr (kHoistThreadPartitions) {
        return rebuild_smem_partition<RowStatLayout>(sRowStatMma.data() + stage * kRowStatStageStride,
                                                     row_stat_offset);
      } else {
        return tiled_mma_SdP.get_thread_slice(sdp_thread()).partition_C(sRowStatMma)(_, _, _, stage);
      }
    };
    using PdSStoreLayout = decltype(smem_tiled_copy_PdS.get_thread_slice(0).partition_D(pds_tile(st.smem_ds.data())).layout());
    auto pds_store_partition = [&](Element* smem) {
      if constexpr (kHoistThreadPartitions) {
        return rebuild_smem_partition<PdSStoreLayout>(pds_tile(smem).data(), pds_store_offset);
      } else {
        return smem_tiled_copy_PdS.get_thread_slice(sdp_thread()).partition_D(pds_tile(smem));
      }
    };
    // The dQ staging tile as the dQ accumulator's fragment stores it (hand_dq_to_writer; dQ^T
    // through the tile's transposed view when swapped). Partitioned where used: the hoisted
    // head dim (d64) stages dQ permuted (dq_seg0_addr, hoisted_offsets), and keeping this partition across
    // the loop at d128 measured level (5d6527a).
    auto dq_stage_tile = [&] {
      Tensor sdQ_pi = as_position_independent_swizzle_tensor(sdQ);
      if constexpr (kdQSwapAB) {
        return make_tensor(sdQ_pi.data(), composition(sdQ_pi.layout(), make_layout(ShapedQAcc{}, LayoutRight{})));
      } else {
        return sdQ_pi;
      }
    };
    return pack<ThreadPartitions>(row_stat_fragment, pds_store_partition, dq_stage_tile);
  }

  // ---- the steps of one m-block after S and dP (bwd_step in mma() chains them) ----
  template <class SoftmaxP, class SoftmaxGrad, class StorePdSGemmdV>
  struct SoftmaxdVSteps {
    SoftmaxP softmax_p;
    SoftmaxGrad softmax_grad;
    StorePdSGemmdV store_pds_gemm_dv;
  };

  // P and dS in registers, then dV, with the S / dP MMA over all MMA warpgroups (softmax_p
  // serves kSdPByWG too).
  template <class TdVrdO, class FrgdKV, class SdPThread, class RowStatFragment, class PdSStorePartition>
  CUTE_DEVICE auto softmax_dv_steps(Params const& params, int const& n_block, int const& bidh, int const& bidb,
                                    TensorStorage& st, SmemLSE& sLSEMma, SmemdPsum& sdPsumMma,
                                    TiledMmaSdP& tiled_mma_SdP, TiledMmadKV& tiled_mma_dKV, ThrMmadKV& thr_dKV,
                                    SmemCopyPdS& smem_tiled_copy_PdS, TdVrdO& tdVrdO, FrgdKV& tdVrdV,
                                    SdPThread& sdp_thread, RowStatFragment& row_stat_fragment,
                                    PdSStorePartition& pds_store_partition, int const& seqlen_q,
                                    int const& seqlen_k, bool const& is_causal, float const& scale_log2) {
    // P = exp2(S * scale_log2 - lse_log2) in place of S, once S is done (dP may still run).
    // kMaskValues: the key tail, the causal cut and the mask element by element (only in the
    // iterations that need it: kTilePartial tiles under a mask, else the causal diagonal and
    // the last key block). kMaskBits: P = 0 where the staged bits of a kTilePartialBits tile
    // are 0 (they fold in the cut and the tail).
    auto softmax_p = [&](auto& tSrS, int m_block, int stage_q, auto mask_tag, bool fill_rows) {
      constexpr int kMode = decltype(mask_tag)::value;
      warpgroup_wait<kSdPByWG ? 0 : 1>();  // (by warpgroup: S is this warpgroup's only batch)
      warpgroup_fence_operand(tSrS);
      auto thr = tiled_mma_SdP.get_thread_slice(sdp_thread());
      Tensor tLSE = row_stat_fragment(sLSEMma, stage_q);
      if constexpr (kMode == kMaskNone) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(tSrS); ++i) { tSrS(i) = exp2_ftz(tSrS(i) * scale_log2 - tLSE(i)); }
      } else if constexpr (kMode == kMaskBits) {
        Tensor tScS = thr.partition_C(make_identity_tensor(ShapeS{}));
        uint32_t const* bits = st.smem_mask_bits.data() + stage_q * kMaskBitWords;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(tSrS); ++i) {
          auto c = tScS(i);
          int const q = kSdPSwapAB ? get<1>(c) : get<0>(c);
          int const k = kSdPSwapAB ? get<0>(c) : get<1>(c);
          bool const visible = (bits[q * (kBlockN / 32) + k / 32] >> (k % 32)) & 1u;
          tSrS(i) = visible ? exp2_ftz(tSrS(i) * scale_log2 - tLSE(i)) : 0.f;
        }
      } else {
        Tensor tScS = thr.partition_C(make_identity_tensor(ShapeS{}));
        int const row0 = m_block * kBlockM;
        int const col0 = n_block * kBlockN;
        // the mask's [B, Hq] offset (stride 0 on broadcast dims), computed here rather than
        // kept live across the m-loop
        int64_t const mask_offset = int64_t(launder_int(bidb)) * params.mask_batch_stride +
                                    int64_t(bidh) * params.mask_head_stride;
        // fill_rows (kTilePartialFillRows): the tile's m-block holds a fill row, a row of a bf16
        // / fp32 additive mask that sees no key but the clamped fill (e.g. left padding in
        // transformers' form), whose lse_log2 the classification tagged with the fill's key
        // count n (numeric.h). SDPA gives such a row uniform weights: its lse is taken as
        // -FLT_MAX here, which the fill's clamped term cancels (P = 1 on the fill's keys, 0
        // elsewhere), and P is then weighed by 1 / n.
        // bias(offset) -> the mask element's additive term in the log2 domain (-inf: masked)
        auto apply = [&](auto bias) {
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < size(tSrS); ++i) {
            auto c = tScS(i);
            int const q_idx = row0 + (kSdPSwapAB ? get<1>(c) : get<0>(c));
            int const k_idx = col0 + (kSdPSwapAB ? get<0>(c) : get<1>(c));
            float add = 0.f;
            if (k_idx >= seqlen_k || (is_causal && k_idx > q_idx)) {
              add = -INFINITY;
            } else if (q_idx < seqlen_q) {  // padding rows have lse_log2 = +inf: P = 0
              add = bias(mask_offset + int64_t(q_idx) * params.mask_row_stride +
                         int64_t(k_idx) * params.mask_col_stride);
            }
            float const lse_log2 = tLSE(i);
            float const lse_used = fill_rows && is_fill_row(lse_log2) ? -FLT_MAX : lse_log2;
            tSrS(i) = exp2_ftz(tSrS(i) * scale_log2 + add - lse_used);
          }
        };
        // (kLog2e from numeric.h: the classification's dead-bias rule assumes this very product;
        // a finite entry's term is clamped to -FLT_MAX, where its P is 0 all the same in a row
        // that sees a key, and a fill row's cancels)
        with_mask_elements</*kHasNone=*/true>(
            params.mask_kind, params.mask,
            [](float b) { return b == -INFINITY ? b : fmaxf(b * kLog2e, -FLT_MAX); }, apply);
        if (fill_rows) {
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < size(tSrS); ++i) {
            float const lse_log2 = tLSE(i);
            if (is_fill_row(lse_log2)) tSrS(i) *= fill_row_weight(lse_log2);
          }
        }
      }
      // Pin P here, before the wait for dP: the exponentials overlap the dP wgmma instead of
      // being scheduled after it.
      warpgroup_fence_operand(tSrS);
    };

    // dS = P * (dP - dpsum) in place of dP, once dP is done.
    auto softmax_grad = [&](auto const& tSrP, auto& tdPrdP, int stage_do) {
      warpgroup_wait<0>();
      warpgroup_fence_operand(tdPrdP);
      Tensor tdPsum = row_stat_fragment(sdPsumMma, stage_do);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(tdPrdP); ++i) { tdPrdP(i) = tSrP(i) * (tdPrdP(i) - tdPsum(i)); }
    };

    // P and dS to shared memory as needed, then dV += P^T dO (or dV^T += dO^T P). On return
    // dS is visible in smem to every MMA warpgroup (dQ and, SS, dK read it there).
    auto store_pds_gemm_dv = [&](auto& rP, auto& rdS, int stage_do, int stage_ds) {
      auto smem_thr_copy_PdS = smem_tiled_copy_PdS.get_thread_slice(sdp_thread());
      Tensor tdSsdS = pds_store_partition(st.smem_ds.data());
      if constexpr (kStagesdS == 1) {
        // every warpgroup is done reading the previous P / dS
        named_sync(kNumMmaThreads, BwdBarrier::kPdS);
      }
      if constexpr (!kMmadKVIsRS) {
        Tensor sPt = make_tensor(make_smem_ptr(st.smem_p.data()), SmemLayoutPdSt{});
        Tensor tPsP = pds_store_partition(st.smem_p.data());
        cute::copy(smem_tiled_copy_PdS, smem_thr_copy_PdS.retile_S(rP), tPsP(_, _, _, stage_ds));
        cutlass::arch::fence_view_async_shared();
        named_sync(kNumMmaThreads, BwdBarrier::kPdS);  // P visible to every warpgroup
        cute::copy(smem_tiled_copy_PdS, smem_thr_copy_PdS.retile_S(rdS), tdSsdS(_, _, _, stage_ds));
        Tensor tdVrP = mma_smem_fragment<!kdKVSwapAB>(thr_dKV, sPt);
        if constexpr (kdKVSwapAB) {
          wg_gemm<false, -1>(tiled_mma_dKV, tdVrdO(_, _, _, stage_do), tdVrP(_, _, _, stage_ds), tdVrdV);
        } else {
          wg_gemm<false, -1>(tiled_mma_dKV, tdVrP(_, _, _, stage_ds), tdVrdO(_, _, _, stage_do), tdVrdV);
        }
      } else {
        cute::copy(smem_tiled_copy_PdS, smem_thr_copy_PdS.retile_S(rdS), tdSsdS(_, _, _, stage_ds));
        // P^T straight from registers
        Tensor tdVrP = make_tensor(rP.data(), acc_layout_as_A_operand(rP.layout()));
        wg_gemm<false, -1>(tiled_mma_dKV, tdVrP, tdVrdO(_, _, _, stage_do), tdVrdV);
      }
      cutlass::arch::fence_view_async_shared();
      named_sync(kNumMmaThreads, BwdBarrier::kPdS);  // dS visible to every warpgroup
    };
    return pack<SoftmaxdVSteps>(softmax_p, softmax_grad, store_pds_gemm_dv);
  }

  template <class ExchangePdSGemmdV>
  struct ByWarpgroupSteps {
    ExchangePdSGemmdV exchange_p_ds_gemm_dv;
  };

  // kSdPByWG (d256): P and dS exchanged between the S and the dP warpgroup, then dV (the
  // other kSdPByWG code: gemm_s_or_dp and bwd_step's dv_step in mma()).
  template <class TdVrdO, class FrgdKV, class SdPThread, class RowStatFragment>
  CUTE_DEVICE auto by_warpgroup_steps(TensorStorage& st, SmemdPsum& sdPsumMma, SmemTensor<Element, SmemLayoutPdS>& sdS,
                                      TiledMmaSdP& tiled_mma_SdP, bool const& s_warpgroup,
                                      TiledMmadKV& tiled_mma_dKV, ThrMmadKV& thr_dKV,
                                      SmemCopyPdS& smem_tiled_copy_PdS, TdVrdO& tdVrdO, FrgdKV& tdVrdV,
                                      SdPThread& sdp_thread, RowStatFragment& row_stat_fragment) {
    // kSdPByWG: the S warpgroup stores P (its acc, converted: rP); the dP warpgroup reads it
    // back in its accumulator layout and computes dS = P (dP - dpsum) in place of dP (acc),
    // then stores dS. Both issue dV^T += dO^T P (P from shared memory). The same three
    // barriers as store_pds_gemm_dv (the first only with one P / dS buffer): on return dS is
    // visible to every MMA warpgroup.
    auto exchange_p_ds_gemm_dv = [&](auto& acc, auto& rP, int stage_do, int stage_ds) {
      // (a body for kSdPByWG tiles only: the other tiles' P / dS layouts do not fit it, and
      // a generic lambda's body is instantiated with the enclosing function)
      if constexpr (kSdPByWG) {
        auto smem_thr_copy_PdS = smem_tiled_copy_PdS.get_thread_slice(sdp_thread());
        Tensor sP = make_tensor(make_smem_ptr(st.smem_p.data()), SmemLayoutPdS{});
        Tensor sPt = make_tensor(make_smem_ptr(st.smem_p.data()), SmemLayoutPdSt{});
        if constexpr (kStagesdS == 1) {
          named_sync(kNumMmaThreads, BwdBarrier::kPdS);  // every warpgroup is done with the last P / dS
        }
        if (s_warpgroup) {
          Tensor tPsP = smem_thr_copy_PdS.partition_D(as_position_independent_swizzle_tensor(sP));
          cute::copy(smem_tiled_copy_PdS, smem_thr_copy_PdS.retile_S(rP), tPsP(_, _, _, stage_ds));
          cutlass::arch::fence_view_async_shared();
          named_sync(kNumMmaThreads, BwdBarrier::kPdS);  // P visible to every warpgroup
        } else {
          named_sync(kNumMmaThreads, BwdBarrier::kPdS);
          auto load_copy_P = make_tiled_copy_C(SmemLoadAtomP{}, tiled_mma_SdP);
          auto load_thr_P = load_copy_P.get_thread_slice(sdp_thread());
          Tensor tPsP = load_thr_P.partition_S(as_position_independent_swizzle_tensor(sP));
          cute::copy(load_copy_P, tPsP(_, _, _, stage_ds), load_thr_P.retile_D(rP));
          Tensor tdPsum = row_stat_fragment(sdPsumMma, stage_do);
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < size(acc); ++i) { acc(i) = float(rP(i)) * (acc(i) - tdPsum(i)); }
          Tensor rdS = make_tensor_like<Element>(acc);
          convert_fragment(acc, rdS);
          Tensor tdSsdS = smem_thr_copy_PdS.partition_D(as_position_independent_swizzle_tensor(sdS));
          cute::copy(smem_tiled_copy_PdS, smem_thr_copy_PdS.retile_S(rdS), tdSsdS(_, _, _, stage_ds));
        }
        Tensor tdVrP = mma_smem_fragment<!kdKVSwapAB>(thr_dKV, sPt);
        wg_gemm<false, -1>(tiled_mma_dKV, tdVrdO(_, _, _, stage_do), tdVrP(_, _, _, stage_ds), tdVrdV);
        cutlass::arch::fence_view_async_shared();
        named_sync(kNumMmaThreads, BwdBarrier::kPdS);  // dS visible to every warpgroup
      }
    };
    return pack<ByWarpgroupSteps>(exchange_p_ds_gemm_dv);
  }

  template <class GemmdQSlice, class GemmdK, class HanddQToWriter>
  struct DqDkSteps {
    GemmdQSlice gemm_dq_slice;
    GemmdK gemm_dk;
    HanddQToWriter hand_dq_to_writer;
  };

  // dQ, dK, and the dQ slices' hand-over to the dQ writer (kdQStagePermuted, d64: permuted).
  template <class TdQrdS, class TdKrQ, class FrgdKV, class KOperandPtr, class DqStageTile>
  CUTE_DEVICE auto dq_dk_steps(TiledMmadQ& tiled_mma_dQ, ThrMmadQ& thr_dQ, TiledMmadKV& tiled_mma_dKV,
                               ThrMmadKV& thr_dKV, TdQrdS& tdQrdS, TdKrQ& tdKrQ, FrgdKV& tdKrdK,
                               SmemTensor<Element, SmemLayoutPdSt>& sdSt, SmemdQ& sdQ, KOperandPtr& k_operand_ptr,
                               int const& thread_idx, uint32_t const& dq_seg0_addr, DqStageTile& dq_stage_tile) {
    // dQ slice s = dS K[:, slice s] (swapped: dQ^T = K^T dS^T); kWait as wg_gemm's.
    auto gemm_dq_slice = [&](auto& tdQrdQ, int slice, int stage_ds, auto wait_tag) {
      constexpr int kWait = decltype(wait_tag)::value;
      Tensor sKt = make_tensor(make_smem_ptr(k_operand_ptr()), SmemLayoutKt{});
      Tensor sKt_s = local_tile(sKt, Shape<Int<kdQCols>, Int<kBlockN>>{}, make_coord(slice, _0{}));
      Tensor tdQrK = mma_smem_fragment<kdQSwapAB>(thr_dQ, sKt_s);
      if constexpr (kdQSwapAB) {
        wg_gemm<true, kWait>(tiled_mma_dQ, tdQrK, tdQrdS(_, _, _, stage_ds), tdQrdQ);
      } else {
        wg_gemm<true, kWait>(tiled_mma_dQ, tdQrdS(_, _, _, stage_ds), tdQrK, tdQrdQ);
      }
    };

    // dK += dS^T Q (or dK^T += Q^T dS); leaves one wgmma batch in flight.
    auto gemm_dk = [&](auto& rdS, int stage_q, int stage_ds) {
      if constexpr (kMmadKVIsRS) {
        Tensor tdKrdS = make_tensor(rdS.data(), acc_layout_as_A_operand(rdS.layout()));
        wg_gemm<false, 1>(tiled_mma_dKV, tdKrdS, tdKrQ(_, _, _, stage_q), tdKrdK);
      } else {
        Tensor tdKrdS = mma_smem_fragment<!kdKVSwapAB>(thr_dKV, sdSt);
        if constexpr (kdKVSwapAB) {
          wg_gemm<false, 1>(tiled_mma_dKV, tdKrQ(_, _, _, stage_q), tdKrdS(_, _, _, stage_ds), tdKrdK);
        } else {
          wg_gemm<false, 1>(tiled_mma_dKV, tdKrdS(_, _, _, stage_ds), tdKrQ(_, _, _, stage_q), tdKrdK);
        }
      }
    };

    // A finished dQ slice to the staging tile, for the dQ-writer warp's TMA reduce-add.
    auto hand_dq_to_writer = [&](auto const& tdQrdQ) {
      // (position-independent swizzle: keeps the address in the shared space, STS, not ST.E)
      if constexpr (kdQStagePermuted) {
        // wgmma's C fragment: value i of thread t sits at (row, column) = t's first value's
        // + thread 0's value i; the offsets are multiples of 8 rows and of 8 columns (values
        // 2i and 2i + 1 are columns c, c + 1 of one row), the thread's first column is
        // 2 * (lane % 4) past a multiple of 32. So r & 7 (the swizzle) and r & 3 (the
        // permutation) are the thread's, the 8-column segment within 32 columns is the
        // value's: four addresses per thread, one per segment, and whole 8 x 32 swizzle atoms
        // (1 KB, which the swizzle leaves alone) added as immediates.
        Tensor tdQcdQ0 = tiled_mma_dQ.get_thread_slice(0).partition_C(make_identity_tensor(ShapedQ{}));
        static_assert(size(decltype(tdQcdQ0){}) % 2 == 0);
        uint32_t seg_addr[4];  // segment seg: column (c0 & ~31) + 8 * (seg ^ (r0 & 3)) + (c0 & 7)
        if constexpr (kHoistThreadPartitions) {
          uint32_t const seg0_addr = uint32_t(launder_int(int(dq_seg0_addr)));
          CUTLASS_PRAGMA_UNROLL
          for (int seg = 0; seg < 4; ++seg) { seg_addr[seg] = seg0_addr ^ (uint32_t(seg) << 5); }
        } else {
          Tensor tdQcdQ = tiled_mma_dQ.get_thread_slice(launder_int(thread_idx)).partition_C(make_identity_tensor(ShapedQ{}));
          int const r0 = get<0>(tdQcdQ(0)), c0 = get<1>(tdQcdQ(0));
          Tensor sdQ_pi = as_position_independent_swizzle_tensor(sdQ);
          CUTLASS_PRAGMA_UNROLL
          for (int seg = 0; seg < 4; ++seg) {
            int const c = (c0 & ~31) + 8 * (seg ^ (r0 & 3)) + (c0 & 7);
            seg_addr[seg] = cute::cast_smem_ptr_to_uint(raw_pointer_cast(&sdQ_pi(r0, c)));
          }
        }
        auto natural = get_nonswizzle_portion(SmemLayoutdQ{});
        named_sync(kNumMmaThreads + cutlass::NumThreadsPerWarp, BwdBarrier::kdQEmpty);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(tdQrdQ); i += 2) {
          int const dr = get<0>(tdQcdQ0(i)), dc = get<1>(tdQcdQ0(i));
          uint32_t const addr = seg_addr[(dc >> 3) & 3] + 4u * uint32_t(natural(dr, dc & ~31));
          asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(tdQrdQ(i)), "f"(tdQrdQ(i + 1))
                       : "memory");
        }
      } else {
        // (swapped: dQ^T's fragment into the (q, d) tile through its transposed view, single floats)
        Tensor tdQsdQ = tiled_mma_dQ.get_thread_slice(launder_int(thread_idx)).partition_C(dq_stage_tile());
        named_sync(kNumMmaThreads + cutlass::NumThreadsPerWarp, BwdBarrier::kdQEmpty);
        cute::copy(tdQrdQ, tdQsdQ);
      }
      cutlass::arch::fence_view_async_shared();
      named_arrive(kNumMmaThreads + cutlass::NumThreadsPerWarp, BwdBarrier::kdQFull);
    };
    return pack<DqDkSteps>(gemm_dq_slice, gemm_dk, hand_dq_to_writer);
  }

  // With several dQ slices the last one goes to the writer in the next step, once that
  // step's S and dP wgmmas are issued (or after the loop): handed at once, it waited for the
  // TMA reduce-add of the slice before it to read the staging tile (ncu at d256, 18e7339:
  // the first dQ store after that barrier held 20% of the kernel's warp stall samples).
  // The masked kernel (three step variants) needs bwd_step forced inline for this: left
  // to the inliner, the step became a call with a 1.6 KB stack frame and its wgmmas were
  // serialized (C7519 at d256). Measured at d256 b8 h8/2 s2048 with a causal bias (H200,
  // main kernel): 0.986 against 1.085 ms without the deferral.
  static constexpr bool kDeferLastdQSlice = kdQSlices > 1;

  // Without a mask, the m-blocks of [m_min, m_max) that need the mask code are
  // [m_min, the returned value): every one of the last (partial) key block, else the causal
  // diagonal blocks, whose rows are not all >= the block's last key (n_block_end - 1). (With a
  // mask, the partial tiles: the classification folded the causal cut and the key tail in, and
  // empty tiles are skipped.)
  CUTE_DEVICE static int unmasked_m_block_begin(int n_block_end, int seqlen_k, bool is_causal, int m_min,
                                                int m_max) {
    int m_mask_end = m_min;
    if (n_block_end > seqlen_k) {
      m_mask_end = m_max;
    } else if (is_causal) {
      m_mask_end = cute::min(m_max, (n_block_end - 1 + kBlockM - 1) / kBlockM);
    }
    return m_mask_end;
  }

  // dst = src, through registers the compiler cannot see into: a wgmma accumulator read while
  // the next step's wgmmas run made ptxas inject a full warpgroup.wait (C7517).
  template <class Src, class Dst>
  CUTE_DEVICE static void copy_out_of_accumulator(Src const& src, Dst& dst) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(src); ++i) {
      uint32_t bits;
      asm volatile("mov.b32 %0, %1;" : "=r"(bits) : "r"(__float_as_uint(src(i))));
      dst(i) = __uint_as_float(bits);
    }
  }

  // The first thread of thread_idx's warpgroup, warp-uniform. mma() slices the tiled MMAs with
  // it for the shared-memory operands' descriptors only, which depend on the warpgroup alone:
  // made uniform by a shuffle, ptxas builds the descriptors in uniform registers (from the
  // per-thread index it moved them with 4 R2UR before every HGMMA: 112 per step at d128).
  // Register fragments (C, copies) take the thread's own slice where they are used.
  CUTE_DEVICE static int warpgroup_first_thread(int thread_idx) {
    return __shfl_sync(0xffffffffu, thread_idx / cutlass::NumThreadsPerWarpGroup, 0) *
           cutlass::NumThreadsPerWarpGroup;
  }

  // Let the MMA warps take the first turn on the dQ staging tile.
  CUTE_DEVICE static void give_mma_warps_first_dq_turn(int thread_idx) {
    if (thread_idx < cutlass::NumThreadsPerWarp) {
      named_arrive(kNumMmaThreads + cutlass::NumThreadsPerWarp, BwdBarrier::kdQEmpty);
    }
  }

  // K_j and V_j of this tile: the CTA's kv_loads-th load (kv_loads counts them, as load() does).
  template <class SharedStorage>
  CUTE_DEVICE static void wait_for_kv(SharedStorage& ss, int& kv_loads) {
    int const kv_load = kv_loads;
    kv_loads = kv_load + 1;
    ss.pipelines.barrier_KV.wait(kv_load & 1);
  }

  // Returns false when this n-block sees no query (dK = dV = 0).
  template <class SharedStorage, class FrgdK, class FrgdV>
  CUTE_DEVICE bool mma(Params const& params, PipelineQ& pipeline_q, PipelinedO& pipeline_do,
                       PipelineStateQ& read_q, PipelineStatedO& read_do, FrgdK& tdKrdK, FrgdV& tdVrdV,
                       int thread_idx, int n_block, int bidh, int bidb, int m_lo, int m_hi, SharedStorage& ss,
                       int& kv_loads) {
    // a mask's tile classes; GQA's dk_accum / dv_accum, zeroed by the preprocess, in the
    // epilogue (grid_dependency.h)
    wait_for_prior_grid();
    clear(tdKrdK);
    clear(tdVrdV);
    auto [m_min, m_max] = walk_range(params, n_block, bidh, bidb, m_lo, m_hi);
    int const m_first = first_m_block(params, tile_classes(params, n_block, bidh, bidb), m_min, m_max);
    if (m_first < 0) { return false; }

    auto& st = ss.tensors.mainloop;
    Tensor sQ = make_tensor(make_smem_ptr(st.smem_q.data()), SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(st.smem_do.data()), SmemLayoutdO{});
    Tensor sQt = make_tensor(make_smem_ptr(st.smem_q.data()), SmemLayoutQt{});
    Tensor sdOt = make_tensor(make_smem_ptr(st.smem_do.data()), SmemLayoutdOt{});
    Tensor sdS = make_tensor(make_smem_ptr(st.smem_ds.data()), SmemLayoutPdS{});
    Tensor sdSt = make_tensor(make_smem_ptr(st.smem_ds.data()), SmemLayoutPdSt{});
    Tensor sLSEMma = make_tensor(make_smem_ptr(st.smem_lse.data()), SmemLayoutRowStatMma<kStagesQ>{});
    Tensor sdPsumMma = make_tensor(make_smem_ptr(st.smem_dpsum.data()), SmemLayoutRowStatMma<kStagesdO>{});
    Tensor sdQ = make_tensor(make_smem_ptr(ss.dq.smem_dq.data()), SmemLayoutdQ{});

    TiledMmaSdP tiled_mma_SdP;
    TiledMmadKV tiled_mma_dKV;
    TiledMmadQ tiled_mma_dQ;
    // (slices for the shared-memory operands' descriptors: warpgroup_first_thread)
    int const wg_thread0 = warpgroup_first_thread(thread_idx);
    // (kSdPByWG: the S / dP tiled MMA is one warpgroup's; its thread index is the thread's
    // index within its warpgroup, and s_warpgroup tells the S warpgroup from the dP one)
    auto thr_SdP = tiled_mma_SdP.get_thread_slice(kSdPByWG ? 0 : wg_thread0);
    bool const s_warpgroup = wg_thread0 == 0;
    auto sdp_thread = [&] {
      return kSdPByWG ? launder_int(thread_idx) % cutlass::NumThreadsPerWarpGroup : launder_int(thread_idx);
    };
    auto thr_dKV = tiled_mma_dKV.get_thread_slice(wg_thread0);
    auto thr_dQ = tiled_mma_dQ.get_thread_slice(wg_thread0);

    auto smem_tiled_copy_PdS = make_tiled_copy_C(SmemCopyAtomPdS{}, tiled_mma_SdP);

    // the steps' per-thread shared-memory partitions (hoisted at d64)
    auto const [row_stat_offset, pds_store_offset, dq_seg0_addr] =
        hoisted_offsets(tiled_mma_SdP, tiled_mma_dQ, smem_tiled_copy_PdS, sLSEMma, st, sdQ, sdp_thread, thread_idx);
    auto partitions = thread_partitions(tiled_mma_SdP, smem_tiled_copy_PdS, sLSEMma, st, sdQ, sdp_thread,
                                        row_stat_offset, pds_store_offset);
    auto& row_stat_fragment = partitions.row_stat_fragment;
    auto& pds_store_partition = partitions.pds_store_partition;
    auto& dq_stage_tile = partitions.dq_stage_tile;

    // Operand descriptors.
    Tensor tSrQ = mma_smem_fragment<!kSdPSwapAB>(thr_SdP, sQ);    // (.., stage)
    Tensor tdPrdO = mma_smem_fragment<!kSdPSwapAB>(thr_SdP, sdO); // (.., stage)
    Tensor tdVrdO = mma_smem_fragment<kdKVSwapAB>(thr_dKV, sdOt); // (.., stage)
    Tensor tdKrQ = mma_smem_fragment<kdKVSwapAB>(thr_dKV, sQt);   // (.., stage)
    Tensor tdQrdS = mma_smem_fragment<!kdQSwapAB>(thr_dQ, sdS);   // (.., dS stage)

    give_mma_warps_first_dq_turn(thread_idx);

    int const seqlen_q = params.seqlen_q;
    int const seqlen_k = params.seqlen_k;
    bool const is_causal = params.is_causal;
    float const scale_log2 = params.scale_log2;
    int const n_block_end = (n_block + 1) * kBlockN;

    wait_for_kv(ss, kv_loads);

    // ---- the steps of one m-block (bwd_step below chains them; most from the helpers above) ----
    // Per-iteration operand descriptors and per-thread smem addresses are rebuilt inside the
    // steps from laundered values (see launder_ptr) instead of being kept live across the
    // m-loop: the MMA warps are at their register limit.
    auto k_operand_ptr = [&] { return launder_ptr(st.smem_k.data()); };
    auto v_operand_ptr = [&] { return launder_ptr(st.smem_v.data()); };

    // S = Q K^T and dP = dO V^T (or S^T = K Q^T, dP^T = V dO^T), issued back to back.
    auto gemm_s_dp = [&](auto& tSrS, auto& tdPrdP, int stage_q, int stage_do) {
      Tensor tSrK = mma_smem_fragment<kSdPSwapAB>(
          thr_SdP, make_tensor(make_smem_ptr(k_operand_ptr()), SmemLayoutK{}));
      Tensor tdPrV = mma_smem_fragment<kSdPSwapAB>(
          thr_SdP, make_tensor(make_smem_ptr(v_operand_ptr()), SmemLayoutV{}));
      pipeline_q.consumer_wait(read_q);
      if constexpr (kSdPSwapAB) {
        wg_gemm<true, -1>(tiled_mma_SdP, tSrK, tSrQ(_, _, _, stage_q), tSrS);
      } else {
        wg_gemm<true, -1>(tiled_mma_SdP, tSrQ(_, _, _, stage_q), tSrK, tSrS);
      }
      pipeline_do.consumer_wait(read_do);
      if constexpr (kSdPSwapAB) {
        wg_gemm<true, -1>(tiled_mma_SdP, tdPrV, tdPrdO(_, _, _, stage_do), tdPrdP);
      } else {
        wg_gemm<true, -1>(tiled_mma_SdP, tdPrdO(_, _, _, stage_do), tdPrV, tdPrdP);
      }
    };

    // kSdPByWG: S = Q K^T on the S warpgroup, dP = dO V^T on the other, into acc.
    auto gemm_s_or_dp = [&](auto& acc, int stage_q, int stage_do) {
      pipeline_q.consumer_wait(read_q);
      pipeline_do.consumer_wait(read_do);
      if (s_warpgroup) {
        Tensor tSrK = mma_smem_fragment<false>(thr_SdP, make_tensor(make_smem_ptr(k_operand_ptr()), SmemLayoutK{}));
        wg_gemm<true, -1>(tiled_mma_SdP, tSrQ(_, _, _, stage_q), tSrK, acc);
      } else {
        Tensor tdPrV = mma_smem_fragment<false>(thr_SdP, make_tensor(make_smem_ptr(v_operand_ptr()), SmemLayoutV{}));
        wg_gemm<true, -1>(tiled_mma_SdP, tdPrdO(_, _, _, stage_do), tdPrV, acc);
      }
    };

    // (named by references: bwd_step captures them as it captured the lambdas themselves)
    auto softmax_dv = softmax_dv_steps(params, n_block, bidh, bidb, st, sLSEMma, sdPsumMma, tiled_mma_SdP,
                                       tiled_mma_dKV, thr_dKV, smem_tiled_copy_PdS, tdVrdO, tdVrdV, sdp_thread,
                                       row_stat_fragment, pds_store_partition, seqlen_q, seqlen_k, is_causal,
                                       scale_log2);
    auto& softmax_p = softmax_dv.softmax_p;
    auto& softmax_grad = softmax_dv.softmax_grad;
    auto& store_pds_gemm_dv = softmax_dv.store_pds_gemm_dv;
    auto by_warpgroup = by_warpgroup_steps(st, sdPsumMma, sdS, tiled_mma_SdP, s_warpgroup, tiled_mma_dKV, thr_dKV,
                                           smem_tiled_copy_PdS, tdVrdO, tdVrdV, sdp_thread, row_stat_fragment);
    auto& exchange_p_ds_gemm_dv = by_warpgroup.exchange_p_ds_gemm_dv;
    auto dq_dk = dq_dk_steps(tiled_mma_dQ, thr_dQ, tiled_mma_dKV, thr_dKV, tdQrdS, tdKrQ, tdKrdK, sdSt, sdQ,
                             k_operand_ptr, thread_idx, dq_seg0_addr, dq_stage_tile);
    auto& gemm_dq_slice = dq_dk.gemm_dq_slice;
    auto& gemm_dk = dq_dk.gemm_dk;
    auto& hand_dq_to_writer = dq_dk.hand_dq_to_writer;

    // kDeferLastdQSlice: the last dQ slice of a step, handed to the writer in the next one
    Tensor tdQrdQ_last = partition_fragment_C(tiled_mma_dQ, ShapedQAcc{});
    // (copied out of the accumulator: copy_out_of_accumulator)
    Tensor tdQrdQ_pending = make_tensor_like(tdQrdQ_last);
    bool dq_pending = false;

    // One m-block; mask_tag: cute::Int<kMaskNone / kMaskValues / kMaskBits>. Forced inline:
    // with the deferred dQ slice carried from step to step, the masked kernel's three
    // instantiations were otherwise left as calls (see kDeferLastdQSlice).
    auto bwd_step = [&](int m_block, auto mask_tag, bool fill_rows) __attribute__((always_inline)) {
      int const stage_q = read_q.index();
      int const stage_do = read_do.index();
      int const stage_ds = kStagesdS == 1 ? 0 : stage_q;

      auto hand_pending_dq = [&] {
        if constexpr (kDeferLastdQSlice) {
          if (dq_pending) {  // the previous m-block's
            hand_dq_to_writer(tdQrdQ_pending);
            dq_pending = false;
          }
        }
      };
      // rdS: dK's register operand (kMmadKVIsRS), else unused
      auto dv_step = [&]() __attribute__((always_inline)) {
        if constexpr (kSdPByWG) {
          Tensor acc = partition_fragment_C(tiled_mma_SdP, ShapeS{});  // S then P, or dP then dS
          gemm_s_or_dp(acc, stage_q, stage_do);
          hand_pending_dq();
          Tensor rP = make_tensor_like<Element>(acc);
          if (s_warpgroup) {
            softmax_p(acc, m_block, stage_q, mask_tag, fill_rows);
            convert_fragment(acc, rP);
          } else {
            warpgroup_wait<0>();
            warpgroup_fence_operand(acc);
          }
          exchange_p_ds_gemm_dv(acc, rP, stage_do, stage_ds);
          return rP;
        } else {
          Tensor tSrS = partition_fragment_C(tiled_mma_SdP, ShapeS{});    // S, then P
          Tensor tdPrdP = partition_fragment_C(tiled_mma_SdP, ShapeS{});  // dP, then dS
          gemm_s_dp(tSrS, tdPrdP, stage_q, stage_do);
          hand_pending_dq();
          softmax_p(tSrS, m_block, stage_q, mask_tag, fill_rows);
          softmax_grad(tSrS, tdPrdP, stage_do);
          Tensor rP = make_tensor_like<Element>(tSrS);
          convert_fragment(tSrS, rP);
          Tensor rdS = make_tensor_like<Element>(tdPrdP);
          convert_fragment(tdPrdP, rdS);
          store_pds_gemm_dv(rP, rdS, stage_do, stage_ds);
          return rdS;
        }
      };
      auto rdS = dv_step();
      Tensor tdQrdQ = partition_fragment_C(tiled_mma_dQ, ShapedQAcc{});
      gemm_dq_slice(tdQrdQ, 0, stage_ds, cute::Int<1>{});  // dV is done after this wait
      pipeline_do.consumer_release(read_do);  // dO read by dP and dV only
      ++read_do;
      gemm_dk(rdS, stage_q, stage_ds);
      hand_dq_to_writer(tdQrdQ);  // slice 0 is complete (the wait above)
      CUTLASS_PRAGMA_UNROLL
      for (int s = 1; s < kdQSlices; ++s) {
        if (kDeferLastdQSlice && s == kdQSlices - 1) {
          gemm_dq_slice(tdQrdQ_last, s, stage_ds, cute::Int<0>{});
          dq_pending = true;
        } else {
          gemm_dq_slice(tdQrdQ, s, stage_ds, cute::Int<0>{});
          hand_dq_to_writer(tdQrdQ);
        }
      }
      warpgroup_wait<0>();
      if constexpr (kDeferLastdQSlice) {
        warpgroup_fence_operand(tdQrdQ_last);
        copy_out_of_accumulator(tdQrdQ_last, tdQrdQ_pending);
      }
      warpgroup_fence_operand(tdKrdK);
      pipeline_q.consumer_release(read_q);  // Q read by S and dK
      ++read_q;
    };

    int const m_mask_end = unmasked_m_block_begin(n_block_end, seqlen_k, is_causal, m_min, m_max);
    // The same walk for each of this CTA's q heads (heads_per_cta > 1: a GQA group, dK / dV
    // summed over it here; the producer and the dQ writer take the heads in the same order).
    // The heads share the mask, if any (a per-head mask keeps one head per CTA).
    CUTLASS_PRAGMA_NO_UNROLL
    for (int heads_left = params.heads_per_cta; heads_left > 0; --heads_left) {
      if constexpr (kMasked) {
        // (the row's offset kept as an int: first_tile_index)
        int const row_offset = int(first_tile_index(params, n_block, bidh, bidb));
        auto classes = [&] { return params.tile_class + launder_int(row_offset); };
        int tile = classes()[m_first];
        CUTLASS_PRAGMA_NO_UNROLL
        for (int m_block = m_first; m_block >= 0;
             m_block = following_m_block(params, classes(), m_block, m_min, m_max, tile)) {
          if (tile == kTilePartialBits) {
            bwd_step(m_block, cute::Int<kMaskBits>{}, false);  // (its bits came with its Q stage)
          } else if (tile == kTilePartial || tile == kTilePartialFillRows) {
            bwd_step(m_block, cute::Int<kMaskValues>{}, tile == kTilePartialFillRows);
          } else {
            bwd_step(m_block, cute::Int<kMaskNone>{}, false);
          }
        }
      } else {
        // (the same loop as a masked kernel's before the split: the dense kernel keeps its
        // register allocation; compile-time knowledge of no mask here made ptxas spill more)
        auto classes = [&] { return tile_classes(params, n_block, launder_int(bidh), bidb); };
        CUTLASS_PRAGMA_NO_UNROLL
        for (int m_block = m_first; m_block >= 0;
             m_block = following_m_block(params, classes(), m_block, m_min, m_max)) {
          unsigned char const* cls = classes();
          bool const partial = cls != nullptr ? cls[m_block] == kTilePartial : m_block < m_mask_end;
          if (partial) {
            bwd_step(m_block, cute::Int<kMaskValues>{}, false);
          } else {
            bwd_step(m_block, cute::Int<kMaskNone>{}, false);
          }
        }
      }
    }
    if constexpr (kDeferLastdQSlice) {
      if (dq_pending) { hand_dq_to_writer(tdQrdQ_pending); }  // the last m-block's
    }
    // every wgmma of the tile has completed (each step ends waiting for them): K and V are free
    ss.pipelines.barrier_KV_empty.arrive();
    warpgroup_fence_operand(tdKrdK);
    warpgroup_fence_operand(tdVrdV);
    return true;
  }
};

}  // namespace kernel
}  // namespace sm90_sdpa
