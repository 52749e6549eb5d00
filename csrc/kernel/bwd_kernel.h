// The SM90 attention-backward kernel: warp-specialized roles over (key block, head, batch)
// tiles. Warpgroup 0 is the producer (warp 0: TMA loads, warp 1: dQ reduce-add writer; it gives
// registers away), warpgroups 1.. are the MMA consumers (they take the registers). Every role
// walks the CTA's tiles in the same order (for_each_tile): one tile, or, persistent, one tile
// of each round of gridDim.x tiles (tile_scheduler.h); the pipelines' states carry over from
// tile to tile, and the producer loads a tile's K / V once the MMA warps release the last.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "bwd_epilogue.h"
#include "bwd_mainloop.h"
#include "tile_scheduler.h"

namespace sm90_sdpa {
namespace kernel {

using namespace cute;

enum class WarpRole : int { kLoad = 0, kStoredQ = 1, kIdle = 2, kMma = 3 };

template <class Mainloop_, class Epilogue_, class Scheduler_>
struct BwdKernel {
  using Mainloop = Mainloop_;
  using Epilogue = Epilogue_;
  using Scheduler = Scheduler_;

  static constexpr int kNumMmaWG = Mainloop::kNumMmaWG;
  static constexpr int kNumThreads = (kNumMmaWG + 1) * cutlass::NumThreadsPerWarpGroup;
  static constexpr uint32_t kLoadRegs = kNumMmaWG == 2 ? 24 : 32;
  static constexpr uint32_t kMmaRegs = kNumMmaWG == 2 ? 240 : 160;

  using PipelineQ = typename Mainloop::PipelineQ;
  using PipelinedO = typename Mainloop::PipelinedO;

  struct SharedStorage {
    union TensorStorage {
      typename Mainloop::TensorStorage mainloop;
      typename Epilogue::TensorStorage epilogue;
    } tensors;
    typename Mainloop::dQStorage dq;
    struct PipelineStorage {
      alignas(16) cutlass::arch::ClusterTransactionBarrier barrier_KV;
      // the MMA warps are done reading a tile's K / V: the producer may load the next tile's
      alignas(16) cutlass::arch::ClusterBarrier barrier_KV_empty;
      alignas(16) typename PipelineQ::SharedStorage pipeline_q;
      alignas(16) typename PipelinedO::SharedStorage pipeline_do;
    } pipelines;
  };
  static constexpr int kSharedStorageSize = sizeof(SharedStorage);
  static_assert(kSharedStorageSize <= 227 * 1024, "over the 227 KB of shared memory an SM90 CTA can have");
  // A CTA may take several tiles only when the epilogue's shared memory is not the mainloop's
  // (the producer loads the next tile's K, V, Q and dO while the epilogue runs).
  static constexpr bool kPersistentCapable = Epilogue::kTilesOutsideMainloop;

  struct Params {
    typename Mainloop::Params mainloop;
    typename Epilogue::Params epilogue;
    typename Scheduler::Params scheduler;
  };

  CUTE_DEVICE static WarpRole warp_role(int warp_idx) {
    if (warp_idx >= 4) { return WarpRole::kMma; }
    return warp_idx == 0 ? WarpRole::kLoad : (warp_idx == 1 ? WarpRole::kStoredQ : WarpRole::kIdle);
  }

  CUTE_DEVICE void operator()(Params const& params, char* smem_buf) {
    SharedStorage& ss = *reinterpret_cast<SharedStorage*>(smem_buf);
    // The postprocess may be scheduled once every CTA of this grid has started: its CTAs then
    // take the SMs this grid's last wave leaves (grid_dependency.h).
    allow_dependent_grids();
    int const warp_idx = cutlass::canonical_warp_idx_sync();
    int const warp_group_idx = cutlass::canonical_warp_group_idx();

    if (warp_idx == 0 && cute::elect_one_sync()) {
      Mainloop::prefetch_tma_descriptors(params.mainloop);
      Epilogue::prefetch_tma_descriptors(params.epilogue);
      ss.pipelines.barrier_KV.init(1);
      ss.pipelines.barrier_KV_empty.init(Mainloop::kNumMmaThreads);
    }

    using Category = typename PipelineQ::ThreadCategory;
    typename PipelineQ::Params pq;
    pq.role = warp_group_idx == 0 ? Category::Producer : Category::Consumer;
    pq.is_leader = threadIdx.x == 0;
    pq.num_consumers = Mainloop::kNumMmaThreads;
    pq.transaction_bytes = Mainloop::kTmaBytesQ + Mainloop::kBytesRowStat;
    PipelineQ pipeline_q(ss.pipelines.pipeline_q, pq, Shape<_1, _1, _1>{});

    using CategorydO = typename PipelinedO::ThreadCategory;
    typename PipelinedO::Params pdo;
    pdo.role = warp_group_idx == 0 ? CategorydO::Producer : CategorydO::Consumer;
    pdo.is_leader = threadIdx.x == 0;
    pdo.num_consumers = Mainloop::kNumMmaThreads;
    pdo.transaction_bytes = Mainloop::kTmaBytesQ + Mainloop::kBytesRowStat;
    PipelinedO pipeline_do(ss.pipelines.pipeline_do, pdo, Shape<_1, _1, _1>{});

    Mainloop mainloop;
    Epilogue epilogue;
    __syncthreads();  // barrier initialization visible to all

    // kv_loads: the tiles whose K / V this CTA loaded so far (a tile that sees no query loads
    // none), the phase of barrier_KV / barrier_KV_empty for the producer and the MMA warps alike
    int kv_loads = 0;

    if (warp_group_idx == 0) {
      cutlass::arch::warpgroup_reg_dealloc<kLoadRegs>();
      WarpRole const role = warp_role(warp_idx);
      if (role == WarpRole::kLoad) {
        auto write_q = cutlass::make_producer_start_state<PipelineQ>();
        auto write_do = cutlass::make_producer_start_state<PipelinedO>();
        for_each_tile(params, [&](int n_block, int bidh, int bidb) __attribute__((always_inline)) {
          mainloop.load(params.mainloop, pipeline_q, pipeline_do, write_q, write_do, ss, n_block, bidh, bidb,
                        kv_loads);
        });
      } else if (role == WarpRole::kStoredQ) {
        for_each_tile(params, [&](int n_block, int bidh, int bidb) __attribute__((always_inline)) {
          mainloop.store_dq(params.mainloop, ss, n_block, bidh, bidb);
        });
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<kMmaRegs>();
      int const thread_idx = int(threadIdx.x) - cutlass::NumThreadsPerWarpGroup;
      typename Mainloop::PipelineStateQ read_q;
      typename Mainloop::PipelineStatedO read_do;
      typename Mainloop::TiledMmadKV tiled_mma_dKV;
      for_each_tile(params, [&](int n_block, int bidh, int bidb) __attribute__((always_inline)) {
        Tensor tdKrdK = partition_fragment_C(tiled_mma_dKV, typename Mainloop::ShapedKV{});
        Tensor tdVrdV = partition_fragment_C(tiled_mma_dKV, typename Mainloop::ShapedKV{});
        bool const tile_valid = mainloop.mma(params.mainloop, pipeline_q, pipeline_do, read_q, read_do, tdKrdK,
                                             tdVrdV, thread_idx, n_block, bidh, bidb, ss, kv_loads);
        epilogue.store(params.epilogue, tdKrdK, tdVrdV, ss, thread_idx, n_block, bidh, bidb, tile_valid);
      });
    }
  }

  // Calls f(n_block, first q head, batch) for each of this CTA's tiles in order
  // (Scheduler::tile_of_round): one tile, or persistent, one per round until they run out.
  // The scheduler counts groups of heads_per_cta q heads (1, or a GQA group walked by one CTA).
  // A variant that cannot be persistent has no tile loop at all: one around its MMA warps' code
  // kept per-thread addresses live across it (d256: 356 B of spill).
  template <class F>
  CUTE_DEVICE static void for_each_tile(Params const& params, F&& f) {
    auto run = [&](int tile) __attribute__((always_inline)) {
      auto [n_block, head_group, bidb] = Scheduler::get_block(params.scheduler, tile);
      f(n_block, head_group * params.mainloop.heads_per_cta, bidb);
    };
    if constexpr (!kPersistentCapable) {
      run(static_cast<int>(blockIdx.x));
    } else {
      int const num_tiles = static_cast<int>(Scheduler::num_tiles(params.scheduler));
      CUTLASS_PRAGMA_NO_UNROLL
      for (int round = 0, tile = Scheduler::tile_of_round(0); tile < num_tiles;
           tile = Scheduler::tile_of_round(++round)) {
        run(tile);
      }
    }
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kNumThreads, 1)
    bwd_main_kernel(CUTE_GRID_CONSTANT typename Kernel::Params const params) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(1024) char smem_buf[];
  Kernel{}(params, smem_buf);
#endif
}

}  // namespace kernel
}  // namespace sm90_sdpa
