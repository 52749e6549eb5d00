// Work assignment of the main backward kernel: tiles of one (key block, q head, batch) each,
// in the order below. One CTA per tile (gridDim.x = the tile count; B*H may exceed
// gridDim.y/z's 65535), or persistent: one CTA per SM, each taking the next tile of that order
// from a counter in global memory when it starts loading one (BwdKernel::produce_tiles), as
// the hardware hands a one-tile CTA to the first SM that frees up.
#pragma once

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
