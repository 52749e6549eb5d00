// Tile configurations of the main SM90 attention-backward kernel, one per head dim.
//
// Two families:
//  * "swapped S" (head dims <= 128): each MMA warpgroup owns kBlockN / kNumMmaWG rows of K/V.
//    It computes S^T = K Q^T and dP^T = V dO^T, so P^T and dS^T sit in its registers in the
//    layout of a wgmma A operand: dV += P^T dO and dK += dS^T Q run register-sourced (RS),
//    and only dS goes through shared memory (for dQ = dS K).
//  * "swapped dK/dV" (head dims 192 / 256): the dK/dV accumulators are too large for one
//    warpgroup's rows, so the warpgroups compute dV^T = dO^T P and dK^T = Q^T dS (M = head dim)
//    with P and dS from shared memory; S and dP are split between warpgroups along kBlockN.
// The value head dim kHeadDimV (Dv, default D) may differ from D in the swapped-dK/dV family
// (DeepSeek-style MLA, D = 192 with Dv = 128): V, dO, dP = dO V^T (k-steps over Dv), the dV
// accumulator and its epilogue are Dv wide; Q, K, S = Q K^T, dQ and dK are D wide.
// The dQ tile (kBlockM x D) is dS K, split between warpgroups, and computed in kdQSlices
// column slices (register pressure at D = 256); or, kdQSwapAB, dQ^T = K^T dS^T with the
// warpgroups split along the head dim, for a kBlockM that is not a multiple of 64 (wgmma's M).
#pragma once

namespace sm90_sdpa {
namespace kernel {

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNumMmaWG_, int kStagesQ_, int kStagesdO_,
          int kStagesdS_, bool kSdPSwapAB_, bool kdKVSwapAB_, int kAtomLayoutMSdP_,
          int kAtomLayoutNdKV_, int kAtomLayoutMdQ_, int kdQSlices_, bool kdQSwapAB_ = false,
          bool kSdPByWG_ = false, bool kdKVStmatrix_ = false, int kHeadDimV_ = kHeadDim_>
struct BwdTileConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;    // v / out / dO head dim (Dv)
  static constexpr int kBlockM = kBlockM_;        // query rows per m-block
  static constexpr int kBlockN = kBlockN_;        // key rows per CTA
  static constexpr int kNumMmaWG = kNumMmaWG_;    // consumer (MMA) warpgroups
  static constexpr int kStagesQ = kStagesQ_;      // Q (+ lse) pipeline depth
  static constexpr int kStagesdO = kStagesdO_;    // dO (+ dpsum) pipeline depth
  static constexpr int kStagesdS = kStagesdS_;    // P / dS smem buffers (1 or kStagesQ)
  static constexpr bool kSdPSwapAB = kSdPSwapAB_;
  static constexpr bool kdKVSwapAB = kdKVSwapAB_;
  static constexpr int kAtomLayoutMSdP = kAtomLayoutMSdP_;
  static constexpr int kAtomLayoutNdKV = kAtomLayoutNdKV_;
  static constexpr int kAtomLayoutMdQ = kAtomLayoutMdQ_;
  static constexpr int kdQSlices = kdQSlices_;
  static constexpr bool kdQSwapAB = kdQSwapAB_;
  // S on MMA warpgroup 0 and dP on warpgroup 1, each over the whole kBlockM x kBlockN tile
  // (N = kBlockN per wgmma instead of kBlockN / 2): Q, dO, K and V are each read once per
  // m-block instead of Q and dO once per warpgroup. P goes to the dP warpgroup through the P
  // tile in shared memory (16-bit, which dV's wgmma reads anyway), so dS = P (dP - dpsum)
  // takes the 16-bit P, and dS is computed after P.
  static constexpr bool kSdPByWG = kSdPByWG_;
  // The epilogue writes the swapped dK^T / dV^T accumulators into the (kBlockN, D) tile with
  // stmatrix .trans (a 16-byte row of eight head-dim elements per lane and matrix) instead of
  // one 16-bit store per element (BwdEpilogue::write_tile; 16-bit tiles only).
  static constexpr bool kdKVStmatrix = kdKVStmatrix_;

  static_assert(kStagesdS == 1 || kStagesdS == kStagesQ);
  static_assert(kStagesQ >= kStagesdO);
  // a kBlockM that does not divide kSeqRound (128) reads its lse / dpsum rows with TMA, whose
  // zero fill covers the rows past the rounded length (BwdMainloop::kRowStatTma)
  static_assert(kBlockM % 16 == 0 && kBlockM <= 128);
  static_assert(kdQSwapAB || kBlockM % 64 == 0, "dQ = dS K needs wgmma's M = 64 rows per block");
  static_assert(!kdQSwapAB || (kSdPSwapAB && kdQSlices == 1 && kAtomLayoutMdQ == 1));
  static_assert(kHeadDim % (16 * kdQSlices) == 0);
  static_assert(!kSdPByWG || (!kSdPSwapAB && kdKVSwapAB && kNumMmaWG == 2 && kAtomLayoutMSdP == 1),
                "S / dP by warpgroup: unswapped S, P from shared memory for dV, two MMA warpgroups");
  static_assert(!kdKVStmatrix || kdKVSwapAB, "stmatrix .trans stores the swapped dK^T / dV^T");
  // Dv != D: the swapped dK / dV only (dV^T's M = Dv in wgmma atoms of 64 rows per warpgroup;
  // the unswapped family's dV tiled MMA splits D between the warpgroups)
  static_assert(kHeadDimV == kHeadDim ||
                    (kdKVSwapAB && kHeadDimV % (64 * (kNumMmaWG / kAtomLayoutNdKV)) == 0 && kHeadDimV % 64 == 0),
                "a value head dim other than D needs the swapped dK / dV and a multiple of 64");
};

// Default tile per head dim (bf16 and fp16 share it). The specializations are generated from
// TILES in csrc/generate_instantiations.py, the one table of what can be built.
template <int kHeadDim>
struct DefaultBwdConfig;

// The tile of the dense kernel for long calls (causal or full), where a head dim has one of
// its own (TILES_FULL in csrc/generate_instantiations.py); else the
// default tile. kHasFullTile: whether run_bwd_main has a third kernel for those calls.
template <int kHeadDim>
struct FullBwdConfig : DefaultBwdConfig<kHeadDim> {
  static constexpr bool kHasFullTile = false;
};

// The tile of a (D, Dv) pair with Dv != D (TILES_DV in csrc/generate_instantiations.py): a
// template of its own, so that the kernels of Dv == D keep their types (and symbols).
template <int kHeadDim, int kHeadDimV>
struct DefaultBwdConfigDv;

// run_bwd_main's tiles of a (D, Dv) variant: Default (masked, and the dense kernel's default)
// and, kHasFullTile, Full (dense, long query lengths, deterministic or not).
template <int kHeadDim, int kHeadDimV>
struct BwdConfigs {
  using Default = DefaultBwdConfigDv<kHeadDim, kHeadDimV>;
  using Full = Default;
  static constexpr bool kHasFullTile = false;
};
template <int kHeadDim>
struct BwdConfigs<kHeadDim, kHeadDim> {
  using Default = DefaultBwdConfig<kHeadDim>;
  using Full = FullBwdConfig<kHeadDim>;
  static constexpr bool kHasFullTile = FullBwdConfig<kHeadDim>::kHasFullTile;
};

}  // namespace kernel
}  // namespace sm90_sdpa

#include "instantiations/tile_configs.h"
