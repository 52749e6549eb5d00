// The tile classification of an attention mask (csrc/mask_classify.cu), run between the
// preprocess and the main kernel when BwdParams.mask_kind is set.
#pragma once

#include <cuda_runtime.h>

#include "bwd_params.h"

namespace sm90_sdpa {

// For every distinct mask instance (mask_batch x mask_heads) and every tile of the main
// kernel's grid (tile_m query rows x tile_n keys), writes tile_class[b][h][n_block][m_block]:
//   kTileEmpty    no (query < Sq, key) position of the tile is visible: the main kernel skips it
//   kTileFull     every position with query < Sq is visible (key < Sk, the causal cut and the
//                 mask all allow it) and, for a bias, adds exactly 0: no mask work at all
//   kTilePartial  anything else: the main kernel applies the mask, the causal cut and the key
//                 tail there
// Each mask element is read once per instance (broadcast dims are not expanded). Reads:
// batch, heads_q, seqlen_q, seqlen_k, is_causal, mask*, tile_*, num_*_blocks, num_sms.
void run_mask_classify(const BwdParams& params, cudaStream_t stream);

}  // namespace sm90_sdpa
