// Tile configurations of the SM90 attention-forward kernel (fwd_kernel.h), one per head dim.
#pragma once

namespace sm90_sdpa {
namespace kernel {

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_>
struct FwdTileConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // query rows per CTA: 64 per MMA warpgroup
  static constexpr int kBlockN = kBlockN_;  // keys per step
  static constexpr int kStages = kStages_;  // K / V pipeline depth
  static_assert(kBlockM == 128, "two MMA warpgroups of 64 query rows");
  static_assert(kBlockN % 16 == 0 && kHeadDim % 16 == 0);
};

// The tile of a head dim; specializations generated from FWD_TILES in
// csrc/generate_instantiations.py.
template <int kHeadDim>
struct DefaultFwdConfig;

}  // namespace kernel
}  // namespace sm90_sdpa

#include "instantiations/fwd_tile_configs.h"
