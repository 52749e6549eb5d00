// The tile classification of an attention mask (csrc/mask_classify.cu), run between the
// preprocess and the main kernel when BwdParams.mask_kind is set.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "bwd_params.h"

namespace sm90_sdpa {

// For every distinct mask instance (mask_batch x mask_heads) and every tile of the main
// kernel's grid (tile_m query rows x tile_n keys), writes tile_class[b][h][n_block][m_block]:
//   kTileEmpty    no (query < Sq, key) position of the tile is visible: the main kernel skips it.
//                 Masked are -inf entries and, for an additive mask, finite entries b so
//                 negative that P = exp2(s' + b * log2(e) - lse_log2) is exactly 0 in the main
//                 kernel whatever the tile's scores: b * log2(e) < -160 - bound, with
//                 bound = |scale_log2| * max ||q_i|| * max ||k_j|| * (1 + 2^-7) + 1 - min lse_log2
//                 over the tile's live rows (Cauchy-Schwarz; lse_log2 = +inf rows have P = 0
//                 anyway). E.g. the 0 / -65504 bias torch hands cuDNN for a boolean mask.
//                 Rows whose every key carries such a bias have an lse near the bias itself:
//                 the bound fails there and their tiles are computed.
//   kTileFull     every position with query < Sq is visible (key < Sk, the causal cut and the
//                 mask all allow it) and, for a bias, adds exactly 0: no mask work at all
//   kTilePartialBits  neither, but every position is either hidden or visible with a zero bias
//                 (every such tile of a boolean mask; the 0 / -65504 bias): the tile is also
//                 written to tile_bits, one bit per position (1 visible), the causal cut, the
//                 key tail and padding rows (0) folded in; the main kernel reads the bits
//   kTilePartial  anything else: the main kernel applies the mask, the causal cut and the key
//                 tail there
// Then, per instance and n-block, tile_m_range: the m-blocks from its first to past its last
// non-empty tile (a second, small kernel over tile_class; not where tile_m_range is null).
// Each mask element is read once per instance (broadcast dims are not expanded). Reads:
// batch, heads_q, seqlen_q, seqlen_k, is_causal, mask*, tile_*, num_*_blocks, num_sms; for an
// additive mask also scale_log2 and bounds_partial: the score bounds' shares, which the
// preprocess launch's bounds CTAs wrote (mask_bounds.h; run_bwd_preprocess must run first
// on the same params); the classification folds them per tile and writes the folded
// q_norm_max, lse_min and k_norm_max (for tests).
//
// fill (the forward's, classify_fwd_mask; null for the backward): with a float mask, a finite
// entry x whose term the forward kernel clamps to -FLT_MAX (x * log2(e) <= -FLT_MAX, e.g. the
// minimum of bf16 or fp32) counts as hidden too. In a row that sees a key, its P is exactly 0
// either way (while the scaled scores stay far below 2^100 in magnitude). A row that sees no
// key but such a fill gets uniform weights over the fill's keys in SDPA, so every tile of a
// query block holding such a row becomes kTilePartial, computed from the mask's elements. Then
// block_elements says which query blocks have a kTilePartial tile.
struct FwdFillRows {
  uint32_t* row_flags;            // [mask instances, seqlen_q] words, zeroed here
  unsigned char* block_elements;  // [mask instances, num_m_blocks]
  // how many of block_elements are 1: the 16 bytes just before row_flags, zeroed with them (the
  // forward's kernel pair returns at once where the other has every block)
  int* element_count;
};
//
// backward_fill_rows (the backward's, bf16 / fp32 masks; needs lse and lse_log2, which the
// preprocess wrote): a row whose lse is finite but lse * log2(e) at most kFillDeadBelow sees
// no key but the clamped fill: SDPA's lse is the fill plus log(n), rounded to the fill (the
// product overflows: the preprocess wrote +inf as its lse_log2), our forward's about -FLT_MAX
// ln 2 (the product is kFillDeadBelow). SDPA gives the row uniform weights over the fill's n
// keys, and so does our forward. Such a row's lse_log2 becomes the tag of n (numeric.h fill_row_lse_log2)
// and every tile of its m-block kTilePartialFillRows, before the ranges are taken; there the
// main kernel gives the row P = 1 / n on the fill's keys. A forward that gave such a row an
// lse of -inf (cuDNN's, whose out there is 0) leaves it alone: its gradients stay 0, as that
// out is. Only fill rows read their mask row again; the classification itself is unchanged.
void run_mask_classify(const BwdParams& params, cudaStream_t stream, const FwdFillRows* fill = nullptr,
                       bool backward_fill_rows = false);

// The forward's key ranges, after run_mask_classify (its fill rows included): per mask instance
// and query block, key_range[inst * num_m_blocks + m] = the key tiles [lo, hi) from the first to
// past the last non-empty tile of tile_class [inst, num_n_blocks, num_m_blocks], {0, 0} when
// none. The forward kernel starts its walk over the key blocks at hi instead of passing every
// empty tile above it one class read at a time (FwdKernel::key_blocks). block_classes
// [inst, num_m_blocks, num_n_blocks] gets the same classes query-block major: the kernel reads a
// query block's classes from consecutive bytes (one cache line for up to 128 key tiles), where
// tile_class's are num_m_blocks bytes apart.
void run_fwd_key_ranges(const unsigned char* tile_class, int2* key_range, unsigned char* block_classes,
                        int64_t instances, int num_m_blocks, int num_n_blocks, cudaStream_t stream);

}  // namespace sm90_sdpa
