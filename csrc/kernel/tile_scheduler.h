// Work assignment of the main backward kernel: tiles of one (key block, q head, batch) each,
// in the order below. One CTA per tile (gridDim.x = the tile count; B*H may exceed
// gridDim.y/z's 65535), or persistent: one CTA per SM, each taking the next tile of that order
// from a counter in global memory when it starts loading one (BwdKernel::produce_tiles), as
// the hardware hands a one-tile CTA to the first SM that frees up.
//
// Split tail (persistent full attention, BwdParams::split_tiles = r > 0): equal tiles on P
// CTAs take ceil(T / P) tile times, e.g. 2048 tiles on 132 SMs 16 where 15.5 are work. The
// last r = T mod P tiles are then dealt as P equal pieces of their m-blocks instead: piece q
// is the m-blocks [q R / P, (q + 1) R / P) of the r tiles' R = r M m-blocks in a row, one or
// two fragments (the part of a tile it covers). A tile covered by several fragments sums its
// dK / dV in fp32 (BwdEpilogue: the last fragment to finish stores them).
#pragma once

#include <climits>

#include <cute/tensor.hpp>

namespace sm90_sdpa {
namespace kernel {

// (batch, head) pairs are split into sections of `heads_per_section` whose Q / dO fit in a
// share of L2; the CTAs of a section run together, so the many key blocks reading the same
// Q / dO rows hit L2. Within a section:
//  * full attention: key blocks of one head are adjacent (n_block fastest);
//  * causal: key block major (n_block slowest), so the key blocks that see the most query
//    blocks (low n_block, top-left causal) start first, for every head of the section
//    (longest-processing-time first: no heavy CTA is left for the end of the grid).
//  * deterministic mode: key block major too, in the direction of the DeterministicOrder
//    (bwd_params.h), so that the CTAs that add to a dQ tile before a given CTA were launched
//    before it: a CTA never waits on one that may not be resident yet.
struct SingleTileScheduler {
  struct Params {
    int num_n_blocks;
    int num_heads;  // q heads / heads_per_cta (the CTAs' head groups)
    int num_batch;
    int heads_per_section;  // >= 1
    bool n_block_major;
    bool reverse_n;  // key blocks last to first (deterministic kKeysDescending; n_block_major)
    // persistent CTAs: the tiles handed out so far beyond the first gridDim.x (BwdParams::
    // tile_counter, zeroed by the preprocess)
    int* tile_counter;
    // split tail: the last split_tiles tiles are dealt as gridDim.x pieces (0: none; only with
    // persistent CTAs and at least 2 * gridDim.x tiles); split_m_blocks = M, a tile's m-blocks
    int split_tiles;
    int split_m_blocks;
  };

  // One work item: a tile, or the fragment [m_lo, m_hi) of a split tile (split_index: which of
  // the split tiles, -1 for a whole tile; split_frags: the fragments covering that tile).
  struct WorkTile {
    int n_block, head_group, bidb;
    int m_lo, m_hi;
    int split_index, split_frags;
  };

  CUTE_HOST_DEVICE static int64_t num_tiles(Params const& p) {
    return int64_t(p.num_n_blocks) * p.num_heads * p.num_batch;
  }

  // max_ctas > 0 (persistent): at most that many CTAs, each taking tiles in turn.
  static dim3 grid_shape(Params const& p, int max_ctas = 0) {
    int64_t ctas = num_tiles(p);
    if (max_ctas > 0 && ctas > max_ctas) { ctas = max_ctas; }
    return dim3(static_cast<unsigned>(ctas), 1, 1);
  }

  // ---- work items (persistent CTAs): ids [0, T - r) are whole tiles, then two per piece ----
  CUTE_DEVICE static int whole_tiles(Params const& p) { return int(num_tiles(p)) - p.split_tiles; }
  // one past the last item id (the end mark the producer hands on)
  CUTE_DEVICE static int items_end(Params const& p) {
    return p.split_tiles > 0 ? whole_tiles(p) + 2 * int(gridDim.x) : int(num_tiles(p));
  }
  // piece q's first m-block in the row of the split tiles' m-blocks (q in [0, gridDim.x])
  CUTE_DEVICE static int piece_begin(Params const& p, int q) {
    return int(int64_t(q) * p.split_tiles * p.split_m_blocks / int(gridDim.x));
  }
  // the piece holding m-block x of that row
  CUTE_DEVICE static int piece_of(Params const& p, int x) {
    return int((int64_t(x + 1) * gridDim.x - 1) / (int64_t(p.split_tiles) * p.split_m_blocks));
  }
  // The first item of unit u (the counter's value + gridDim.x, or blockIdx.x): a whole tile,
  // a piece's first fragment, or items_end once the units run out.
  CUTE_DEVICE static int unit_first_item(Params const& p, int u) {
    int const whole = whole_tiles(p);
    if (u < whole) { return u; }
    if (p.split_tiles == 0 || u - whole >= int(gridDim.x)) { return items_end(p); }
    return whole + 2 * (u - whole);
  }
  // The item after `item` in the same unit (a piece's second fragment), or -1.
  CUTE_DEVICE static int unit_next_item(Params const& p, int item) {
    int const k = item - whole_tiles(p);
    if (p.split_tiles == 0 || k < 0 || (k & 1)) { return -1; }
    int const q = k >> 1;
    int const first_tile_end = (piece_begin(p, q) / p.split_m_blocks + 1) * p.split_m_blocks;
    return piece_begin(p, q + 1) > first_tile_end ? item + 1 : -1;
  }
  CUTE_DEVICE static WorkTile get_work(Params const& p, int item) {
    int const whole = whole_tiles(p);
    if (item < whole) {
      auto [n_block, head_group, bidb] = get_block(p, item);
      return {n_block, head_group, bidb, 0, INT_MAX, -1, 1};
    }
    int const k = item - whole;
    int const q = k >> 1;
    int const M = p.split_m_blocks;
    int const lo = piece_begin(p, q), hi = piece_begin(p, q + 1);
    int const i = lo / M + (k & 1);  // which split tile
    auto [n_block, head_group, bidb] = get_block(p, whole + i);
    int const frags = piece_of(p, (i + 1) * M - 1) - piece_of(p, i * M) + 1;
    return {n_block, head_group, bidb, cute::max(lo, i * M) - i * M, cute::min(hi, (i + 1) * M) - i * M, i, frags};
  }

  // (n_block, head group, batch) of tile `tile`
  CUTE_DEVICE static cute::tuple<int, int, int> get_block(Params const& p, int tile) {
    int const total_heads = p.num_heads * p.num_batch;
    int const blocks_per_section = p.num_n_blocks * p.heads_per_section;
    int const section = tile / blocks_per_section;
    int const idx = tile - section * blocks_per_section;
    int const head0 = section * p.heads_per_section;
    int const heads_here = min(p.heads_per_section, total_heads - head0);
    int n_block, head_in_section;
    if (p.n_block_major) {
      n_block = idx / heads_here;
      head_in_section = idx - n_block * heads_here;
    } else {
      head_in_section = idx / p.num_n_blocks;
      n_block = idx - head_in_section * p.num_n_blocks;
    }
    if (p.reverse_n) { n_block = p.num_n_blocks - 1 - n_block; }
    int const bh = head0 + head_in_section;
    int const bidb = bh / p.num_heads;
    int const bidh = bh - bidb * p.num_heads;
    return {n_block, bidh, bidb};
  }
};

}  // namespace kernel
}  // namespace sm90_sdpa
