// The one host/device interface of the attention forward: the forward kernel reads its inputs
// from this struct. Filled by the device layer (registration/fwd_device.cpp) from plain
// integers; no torch types cross this line.
#pragma once

#include <cstdint>

#include "bwd_params.h"  // DType

namespace sm90_sdpa {

struct FwdParams {
  // ---- problem size ----
  int batch = 0;
  int heads_q = 0;   // Hq
  int heads_kv = 0;  // Hkv; Hq % Hkv == 0
  int seqlen_q = 0;  // Sq
  int seqlen_k = 0;  // Sk
  int head_dim = 0;  // D, for q, k, v and out
  DType dtype = DType::kBFloat16;

  // ---- semantics ----
  float scale_log2 = 0.f;  // softmax scale * log2(e)
  bool is_causal = false;  // SDPA top-left alignment: key j visible to query i iff j <= i
  // the online softmax moves a row's reference max only when a key block's max passes it by
  // more than this (log2 units, 0 to 8): P = 2^(s - ref) < 2^slack, and O's rescale is skipped
  // while no row of a warp moves (FwdKernel's softmax). TORCH_SM90_SDPA_FWD_RESCALE_SLACK.
  float rescale_slack = 0.f;
  // the kernel whose softmax overlaps the previous key block's P V inside each warpgroup
  // (FwdKernel's kOverlap); set unless TORCH_SM90_SDPA_FWD_OVERLAP=0 (_cuda_backend.py).
  // With a float mask, the query blocks that need the mask's elements run the in-turn kernel
  // either way (run_fwd_main).
  bool overlap = false;
  // one CTA per SM (num_sms) walking the tiles, the next tile's loads under the last one's
  // epilogue; set unless TORCH_SM90_SDPA_FWD_PERSISTENT=0 (_cuda_backend.py). Else, or with
  // no more tiles than SMs, one CTA per tile.
  bool persistent = false;

  // ---- inputs: [B, H, S, D] views, element strides, last dim contiguous ----
  const void* q = nullptr;  // [B, Hq, Sq, D]
  int64_t q_batch_stride = 0, q_head_stride = 0, q_row_stride = 0;
  const void* k = nullptr;  // [B, Hkv, Sk, D]
  int64_t k_batch_stride = 0, k_head_stride = 0, k_row_stride = 0;
  const void* v = nullptr;  // [B, Hkv, Sk, D]
  int64_t v_batch_stride = 0, v_head_stride = 0, v_row_stride = 0;

  // ---- outputs ----
  void* out = nullptr;  // [B, Hq, Sq, D], input dtype, even strides
  int64_t out_batch_stride = 0, out_head_stride = 0, out_row_stride = 0;
  // [B, Hq, Sq] fp32, row stride 1: the natural-log logsumexp of each row's scaled scores,
  // the layout the backward reads; -inf (and out 0) for a row that sees no key
  float* lse = nullptr;
  int64_t lse_batch_stride = 0, lse_head_stride = 0;

  // ---- optional mask, as a [B, Hq, Sq, Sk] view (stride 0 on broadcast dims); combined with
  //      is_causal. The mask classification (mask_classify.h) runs first on the forward's
  //      kFwdTile x kFwdTile tiles: the kernel skips empty tiles, runs full ones unmasked and
  //      applies the mask on the partial ones only. Hidden are -inf (false) and, for a float
  //      mask, the finite fill whose term the kernel clamps to -FLT_MAX (below about -2.36e38:
  //      the dtype's minimum of bf16 and fp32, as transformers builds its masks); a query block
  //      with a row that sees that fill only is computed from the mask's elements whole. ----
  MaskKind mask_kind = MaskKind::kNone;
  const void* mask = nullptr;
  int64_t mask_batch_stride = 0, mask_head_stride = 0, mask_row_stride = 0, mask_col_stride = 0;
  int mask_batch = 1;  // distinct mask instances along B: 1 (broadcast) or B
  int mask_heads = 1;  // distinct mask instances along Hq: 1 (broadcast) or Hq
  // the classification's output, fwd_mask_workspace_bytes() bytes of device memory (no need to
  // zero it): tile classes, key ranges and visibility bits
  void* mask_workspace = nullptr;
  int num_sms = 0;  // multiprocessors of the device (the classification's and persistent grids)
};

// Query rows and keys of a tile of the mask classification's grid for the forward: every
// forward configuration's kBlockM; a masked kernel's key block (kBlockN) divides it, and each
// key block takes the class and the bits of the tile it lies in (FwdKernel::block_class).
constexpr int kFwdTile = 128;

// FwdParams::mask_workspace, as byte offsets (16-byte aligned pieces) for a mask of
// mask_batch x mask_heads instances (inst), m_blocks x n_blocks tiles each:
//   tile_class      [inst, n_blocks, m_blocks] bytes (mask_classify.h)
//   key_range       [inst, m_blocks] int2: per query block, the key tiles from the first to
//                   past the last non-empty one (run_fwd_key_ranges)
//   block_classes   [inst, m_blocks, n_blocks] bytes: tile_class query-block major (the
//                   kernel's reads, run_fwd_key_ranges)
//   block_elements  [inst, m_blocks] bytes: 1 where a query block has a tile that needs the
//                   mask's elements (kTilePartial)
//   element_count   one int: how many of block_elements are 1 (16 bytes, zeroed with row_flags)
//   row_flags       [inst, Sq] words: bit 0 the row sees a key, bit 1 it has a fill entry
//   tile_bits       kFwdTile * kFwdTile / 8 bytes per tile, in tile_class order
struct FwdMaskWorkspace {
  int64_t tile_class, key_range, block_classes, block_elements, element_count, row_flags, tile_bits, bytes;
};
inline FwdMaskWorkspace fwd_mask_workspace_layout(int mask_batch, int mask_heads, int seqlen_q, int seqlen_k) {
  auto round16 = [](int64_t x) { return (x + 15) / 16 * 16; };
  const int64_t inst = int64_t(mask_batch) * mask_heads;
  const int64_t m_blocks = (seqlen_q + kFwdTile - 1) / kFwdTile, n_blocks = (seqlen_k + kFwdTile - 1) / kFwdTile;
  const int64_t tiles = inst * m_blocks * n_blocks;
  FwdMaskWorkspace w{};
  w.tile_class = 0;
  w.key_range = w.tile_class + round16(tiles);
  w.block_classes = w.key_range + round16(8 * inst * m_blocks);
  w.block_elements = w.block_classes + round16(tiles);
  w.element_count = w.block_elements + round16(inst * m_blocks);
  w.row_flags = w.element_count + 16;
  w.tile_bits = w.row_flags + round16(4 * inst * int64_t(seqlen_q));
  w.bytes = w.tile_bits + tiles * (kFwdTile * kFwdTile / 8);
  return w;
}

// Bytes of FwdParams::mask_workspace for a mask of mask_batch x mask_heads instances.
inline int64_t fwd_mask_workspace_bytes(int mask_batch, int mask_heads, int seqlen_q, int seqlen_k) {
  return fwd_mask_workspace_layout(mask_batch, mask_heads, seqlen_q, seqlen_k).bytes;
}

}  // namespace sm90_sdpa
