// The one host/device interface of the attention backward: every kernel of the
// backward (preprocess, main, postprocess) reads its inputs from this struct.
// Filled by the device layer (registration/bwd_device.h) from plain integers; no torch types
// cross this line.
#pragma once

#include <cstdint>

namespace sm90_sdpa {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1 };

// The element type of an attention mask: boolean (true = attend) or an additive bias
// (0 = attend, -inf = masked, other values added to the scaled scores).
enum class MaskKind : int { kNone = 0, kBool = 1, kFloat16 = 2, kBFloat16 = 3, kFloat32 = 4 };

// The two orders of the deterministic mode (BwdParams::deterministic_order). Both add the dQ
// tiles of an m-block in the order the key blocks of a head are launched in, so a CTA waits
// only on CTAs launched before it:
//  * kKeysDescending: key blocks launched last to first (for causal: shortest first), each CTA
//    walks its m-blocks first to last, dQ added in descending key-block order. Under causal
//    masking the higher key blocks reach an m-block first on their own: little waiting.
//  * kKeysAscending: key blocks launched first to last (causal: longest first, as the default
//    mode), each CTA walks its m-blocks last to first, dQ added in ascending key-block order.
enum class DeterministicOrder : int { kKeysDescending = 0, kKeysAscending = 1 };

// Classes of the main kernel's (m-block, n-block) tiles under a mask (tile_class below):
// nothing visible (skipped), some entries hidden or biased (the mask applied per element),
// every entry visible with a zero bias (no mask work), or partial with every entry either
// visible with a zero bias or hidden: the classification wrote the tile as one bit per
// entry (tile_bits), which the main kernel reads instead of the mask. The backward's
// kTilePartialFillRows: every tile of an m-block holding a fill row (mask_classify.h,
// run_mask_classify's backward_fill_rows), the mask applied per element and the fill rows
// weighed uniformly.
enum TileClass : unsigned char {
  kTileEmpty = 0,
  kTilePartial = 1,
  kTileFull = 2,
  kTilePartialBits = 3,
  kTilePartialFillRows = 4
};

// Rows of the fp32 workspaces are padded to a multiple of this, so every tile of the
// main kernel (at most 128 rows) reads and writes whole rows, and fp32 rows of the
// LSE / D vectors are 16-byte aligned for TMA.
constexpr int kSeqRound = 128;

inline int round_up_seq(int s) { return (s + kSeqRound - 1) / kSeqRound * kSeqRound; }

// Column order of dq_accum. The main kernel stages each dQ tile in shared memory with the
// 8-column segments of row r permuted (value (r, c) at column c ^ ((r & 3) << 3), inside each
// group of 32 columns: its stores are then free of bank conflicts, see bwd_mainloop.h), and
// the TMA reduce-adds carry that order into dq_accum. The postprocess reads it back. Head
// dims whose kernel keeps the natural order return false here.
constexpr bool dq_accum_permuted_for(int head_dim) {
  return head_dim == 64 || head_dim == 192 || head_dim == 256;
}

// The score bounds of an additive mask's classification: at most this many CTAs share the rows
// of one block (a block of a broadcast mask covers every batch and head); the workspace holds
// as many partial results (BwdParams::bounds_partial).
constexpr int kMaxBoundSplits = 32;

struct BwdParams {
  // ---- problem size ----
  int batch = 0;
  int heads_q = 0;     // Hq
  int heads_kv = 0;    // Hkv; Hq % Hkv == 0 (GQA group = Hq / Hkv)
  int seqlen_q = 0;    // Sq
  int seqlen_k = 0;    // Sk
  int head_dim = 0;    // D (q, k)
  int head_dim_v = 0;  // Dv (v, out): D, or Dv of a compiled (D, Dv) pair (TILES_DV)
  int seqlen_q_rounded = 0;  // round_up_seq(Sq): row count of the fp32 q-side workspaces
  int seqlen_k_rounded = 0;  // round_up_seq(Sk): row count of the fp32 kv-side workspaces
  DType dtype = DType::kBFloat16;

  // ---- semantics ----
  float scale = 0.f;       // softmax scale applied to q k^T
  float scale_log2 = 0.f;  // scale * log2(e): P = exp2(S * scale_log2 - lse_log2)
  bool is_causal = false;  // SDPA top-left alignment: key j visible to query i iff j <= i
  // Deterministic mode: the dQ tiles of an m-block are added in a fixed order, ordered by
  // dq_semaphore (CTAs run key blocks in descending order, so that each waits only on CTAs
  // launched before it); GQA dK / dV are kept per q head and summed by the postprocess.
  bool deterministic = false;
  DeterministicOrder deterministic_order = DeterministicOrder::kKeysDescending;
  // The q heads one CTA of the main kernel walks, one after the other, for its key block: 1,
  // or (GQA, default mode, no mask or one shared by the heads) the whole group Hq / Hkv. Then
  // the CTA sums the group's dK / dV in registers and stores them as MHA's: no dk_accum /
  // dv_accum (null), nothing to zero or convert, and K / V are loaded once per group.
  // Set by the device layer (make_params).
  int heads_per_cta = 1;

  // ---- inputs: [B, H, S, D] views, element strides, last dim contiguous ----
  const void* q = nullptr;     // [B, Hq, Sq, D]
  int64_t q_batch_stride = 0, q_head_stride = 0, q_row_stride = 0;
  const void* k = nullptr;     // [B, Hkv, Sk, D]
  int64_t k_batch_stride = 0, k_head_stride = 0, k_row_stride = 0;
  const void* v = nullptr;     // [B, Hkv, Sk, Dv]
  int64_t v_batch_stride = 0, v_head_stride = 0, v_row_stride = 0;
  const void* out = nullptr;   // [B, Hq, Sq, Dv]
  int64_t out_batch_stride = 0, out_head_stride = 0, out_row_stride = 0;
  const void* dout = nullptr;  // [B, Hq, Sq, Dv]
  int64_t dout_batch_stride = 0, dout_head_stride = 0, dout_row_stride = 0;
  const float* lse = nullptr;  // [B, Hq, Sq] natural-log logsumexp of scaled scores
  int64_t lse_batch_stride = 0, lse_head_stride = 0, lse_row_stride = 0;

  // ---- optional mask, as a [B, Hq, Sq, Sk] view (stride 0 on broadcast dims); combined with
  //      is_causal ----
  MaskKind mask_kind = MaskKind::kNone;
  const void* mask = nullptr;
  int64_t mask_batch_stride = 0, mask_head_stride = 0, mask_row_stride = 0, mask_col_stride = 0;
  int mask_batch = 1;  // distinct mask instances along B: 1 (broadcast) or B
  int mask_heads = 1;  // distinct mask instances along Hq: 1 (broadcast) or Hq
  // Written by the classification kernel: the class of every tile of the main kernel's tile
  // grid, [mask_batch, mask_heads, num_n_blocks, num_m_blocks] (TileClass). Tiles are
  // tile_m query rows by tile_n keys (the variant's kBlockM x kBlockN).
  unsigned char* tile_class = nullptr;
  // Written with tile_class: per mask instance and n-block, the m-blocks [lo, hi) from its first
  // to past its last non-empty tile ({0, 0} when all are empty), [mask_batch, mask_heads,
  // num_n_blocks] pairs of int32. The main kernel's walks stay inside them instead of stepping
  // over leading and trailing empty tiles one class byte at a time.
  int* tile_m_range = nullptr;
  // Written with tile_class, for kTilePartialBits tiles only: the tile as visibility bits
  // (1: visible, zero bias; 0: hidden, the key tail and the causal cut included), row-major
  // over the tile's tile_m rows of tile_n bits, tile_m * tile_n / 32 words per tile, tiles
  // in tile_class order.
  uint32_t* tile_bits = nullptr;
  int tile_m = 0, tile_n = 0, num_m_blocks = 0, num_n_blocks = 0;
  // Additive (float) masks only, else nullptr: per mask instance and block, bounds of the
  // scores that let the classification prove a finite bias hides a tile (mask_classify.h):
  //   q_norm_max  [mask_batch, mask_heads, num_m_blocks]  max ||q_i|| over the live rows
  //   lse_min     [mask_batch, mask_heads, num_m_blocks]  min lse_log2 over the live rows
  //   k_norm_max  [mask_batch, mask_heads, num_n_blocks]  max ||k_j|| over the keys < Sk
  float* q_norm_max = nullptr;
  float* lse_min = nullptr;
  float* k_norm_max = nullptr;
  // Scratch of the bounds kernel: up to kMaxBoundSplits shares of the three
  // arrays above, each [mask_batch * mask_heads * (2 * num_m_blocks + num_n_blocks)].
  float* bounds_partial = nullptr;

  // ---- fp32 workspaces, contiguous, allocated by the caller (no need to zero them) ----
  float* dpsum = nullptr;      // [B, Hq, Sq_rounded]    rowsum(dO * O) per row; 0 in padding
  float* lse_log2 = nullptr;  // [B, Hq, Sq_rounded]     lse * log2(e); +inf in padding
  float* dq_accum = nullptr;  // [B, Hq, Sq_rounded, D]  unscaled dQ, zeroed by the preprocess
  // dq_accum's columns in the main kernel's permuted order (dq_accum_permuted_for): set by the
  // device layer from head_dim, read by the postprocess.
  bool dq_accum_permuted = false;
  // GQA with heads_per_cta == 1 only, else nullptr: unscaled dK and dV. Default mode: [B, Hkv, Sk_rounded,
  // D / Dv], summed over each group by reduce-adds into buffers the preprocess zeroed.
  // Deterministic mode: [B, Hq, Sk_rounded, D / Dv], one tile per q head, stored (every tile,
  // zeros included); the postprocess sums each group in q-head order.
  float* dk_accum = nullptr;
  float* dv_accum = nullptr;
  // Deterministic mode only, else nullptr; zeroed by run() before the main kernel:
  // [B, Hq, num_m_blocks], the number of dQ tiles already added to each m-block.
  int* dq_semaphore = nullptr;
  // One int32, zeroed by the preprocess: the tiles persistent CTAs of the main kernel have
  // taken beyond their first (BwdParams::persistent; null: no persistent CTAs).
  int* tile_counter = nullptr;

  // Split tail (tile_scheduler.h), planned by the device layer (make_params): full attention
  // on persistent CTAs deals its last split_tiles tiles (T mod the SM count) as one equal
  // piece of their m-blocks per SM; 0: no split. split_count [split_tiles] int32 and
  // split_accum [split_tiles, split_slot_floats] fp32 (dK then dV of a tile, by MMA thread and
  // register), both zeroed by the preprocess. split_slot_floats = kBlockN * (D + Dv) of the
  // tile planned for (launch_bwd_main splits only when its kernel's tile and counts match).
  int split_tiles = 0;
  int split_slot_floats = 0;
  int* split_count = nullptr;
  float* split_accum = nullptr;

  // ---- outputs, in the input dtype, any strides with a contiguous last dim ----
  void* dq = nullptr;  // [B, Hq, Sq, D]
  int64_t dq_batch_stride = 0, dq_head_stride = 0, dq_row_stride = 0;
  void* dk = nullptr;  // [B, Hkv, Sk, D]
  int64_t dk_batch_stride = 0, dk_head_stride = 0, dk_row_stride = 0;
  void* dv = nullptr;  // [B, Hkv, Sk, Dv]
  int64_t dv_batch_stride = 0, dv_head_stride = 0, dv_row_stride = 0;

  int num_sms = 0;   // multiprocessors of the device (grid sizes of the pre/post kernels)
  int l2_bytes = 0;  // L2 cache size of the device (the main kernel's scheduling sections)
  // Head groups per scheduling section when > 0 (make_params: TORCH_SM90_SDPA_SECTION_HEADS, for
  // A/B measurement); 0: launch_bwd_main's rule.
  int heads_per_section = 0;
  // The main and postprocess kernels start while the kernel before them drains (programmatic
  // dependent launch, csrc/grid_dependency.h); false: plain launches, each after the last.
  // make_params sets it from TORCH_SM90_SDPA_PDL (off unless "1").
  bool programmatic_launch = false;
  // The main kernel runs one CTA per SM, each taking tiles (key blocks) in turn, where the
  // variant and the call allow it (launch_bwd_main): the next tile's K / V / Q / dO loads then
  // overlap this tile's last m-block and its dK / dV epilogue, and a CTA starts once. false:
  // one CTA per tile. make_params sets it (TORCH_SM90_SDPA_PERSISTENT).
  bool persistent = false;
  // The preprocess walks the q-side rows from the last (batch, head) to the first and the
  // postprocess from the last to the first, so that the rows the main kernel reads first (its
  // tiles go by ascending batch and head) are the preprocess's last writes (dq_accum's zeros,
  // dO read for dpsum), and the rows it wrote last are the postprocess's first reads: both
  // still in L2. Results do not change (each row is computed the same way). make_params sets
  // it (TORCH_SM90_SDPA_PREPOST_ORDER).
  bool prepost_reversed = false;
};

}  // namespace sm90_sdpa
