// Work assignment of the main backward kernel: one CTA per (key block, q head, batch).
// The product goes into gridDim.x (B*H may exceed gridDim.y/z's 65535).
#pragma once

#include <cute/tensor.hpp>

namespace sm90_sdpa {
namespace kernel {

struct SingleTileScheduler {
  struct Params {
    int num_n_blocks;
    int num_heads;  // q heads
    int num_batch;
  };

  static dim3 grid_shape(Params const& p) {
    return dim3(static_cast<unsigned>(int64_t(p.num_n_blocks) * p.num_heads * p.num_batch), 1, 1);
  }

  // (n_block, q head, batch). Key blocks of one head are adjacent so that the CTAs reading
  // the same Q / dO run together (L2 reuse); in causal masks the lower n_blocks, which see
  // the most query blocks, start first within a head.
  CUTE_DEVICE static cute::tuple<int, int, int> get_block(Params const& p) {
    int bid = static_cast<int>(blockIdx.x);
    int const n_block = bid % p.num_n_blocks;
    bid /= p.num_n_blocks;
    int const bidh = bid % p.num_heads;
    int const bidb = bid / p.num_heads;
    return {n_block, bidh, bidb};
  }
};

}  // namespace kernel
}  // namespace sm90_sdpa
