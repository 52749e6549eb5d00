// Work assignment of the main backward kernel: tiles of one (key block, q head, batch) each.
// One CTA per tile, or (persistent) one CTA per SM taking a tile of each round of gridDim.x
// consecutive tiles in turn (tile_of_round): the order of the tiles is the same, a round runs
// what one wave of one-tile CTAs would. The tile count goes into gridDim.x (B*H may exceed
// gridDim.y/z's 65535).
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
  };

  CUTE_HOST_DEVICE static int64_t num_tiles(Params const& p) {
    return int64_t(p.num_n_blocks) * p.num_heads * p.num_batch;
  }

  // max_ctas > 0 (persistent): at most that many CTAs, each walking tiles in turn.
  static dim3 grid_shape(Params const& p, int max_ctas = 0) {
    int64_t ctas = num_tiles(p);
    if (max_ctas > 0 && ctas > max_ctas) { ctas = max_ctas; }
    return dim3(static_cast<unsigned>(ctas), 1, 1);
  }

  // This CTA's tile of round r (>= num_tiles: none; then no later round has one either). The
  // rounds are dealt in alternating directions: tiles come heaviest first under causal
  // attention (key block major), and a CTA that took a round's heaviest tile takes the next
  // round's lightest, which evens out the CTAs' total work as the hardware's dispatch of
  // one-tile CTAs to the first free SM does.
  CUTE_DEVICE static int tile_of_round(int r) {
    int const ctas = static_cast<int>(gridDim.x), cta = static_cast<int>(blockIdx.x);
    return r * ctas + ((r & 1) ? ctas - 1 - cta : cta);
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
