// The SM90 attention-backward kernel: warp-specialized roles over (key block, head, batch)
// tiles. Warpgroup 0 is the producer (warp 0: TMA loads, warp 1: dQ reduce-add writer; it gives
// registers away), warpgroups 1.. are the MMA consumers (they take the registers). Every role
// walks the CTA's tiles in the same order: one tile, or, persistent, the tiles the producer
// warp takes from the scheduler's counter and hands on (produce_tiles / consume_tiles); the
// pipelines' states carry over from tile to tile, and the producer loads a tile's K / V once
// the MMA warps release the last tile's.
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

  using WorkTile = typename Scheduler::WorkTile;
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
      // persistent CTAs: the producer hands each tile index to the dQ writer and the MMA warps
      // through two slots (full: written; empty: read by all of them)
      alignas(16) cutlass::arch::ClusterBarrier tile_full[2];
      alignas(16) cutlass::arch::ClusterBarrier tile_empty[2];
      int tile_slot[2];
      int split_last;  // the epilogue's split-tail vote: this fragment finished its tile last
      alignas(16) typename PipelineQ::SharedStorage pipeline_q;
      alignas(16) typename PipelinedO::SharedStorage pipeline_do;
    } pipelines;
  };
  static constexpr int kSharedStorageSize = sizeof(SharedStorage);
  static_assert(kSharedStorageSize <= 227 * 1024, "over the 227 KB of shared memory an SM90 CTA can have");
  // A CTA may take several tiles only when the epilogue's shared memory is not the mainloop's
  // (the producer loads the next tile's K, V, Q and dO while the epilogue runs).
  static constexpr bool kPersistentCapable = Epilogue::kTilesOutsideMainloop;
  // Every variant's dK / dV epilogue tiles fit outside the mainloop's shared memory, so every
  // CTA can take tiles in turn (the tile loops below and the device layer's split tail assume it).
  static_assert(kPersistentCapable, "a main-kernel variant without persistent CTAs");
  // The split tail (tile_scheduler.h) is for full attention: not in the masked kernel, whose
  // scheduler code stays that of whole tiles.
  static constexpr bool kSplitTail = kPersistentCapable && !Mainloop::kMasked;
  // the threads that read each tile index the producer hands on: the dQ writer warp, the MMA warps
  static constexpr int kTileReaders = cutlass::NumThreadsPerWarp + Mainloop::kNumMmaThreads;

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
      for (int i = 0; i < 2; ++i) {
        ss.pipelines.tile_full[i].init(1);
        ss.pipelines.tile_empty[i].init(kTileReaders);
      }
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
    pdo.transaction_bytes = Mainloop::kTmaBytesdO + Mainloop::kBytesRowStat;
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
        produce_tiles(params, ss, [&](WorkTile const& w) __attribute__((always_inline)) {
          mainloop.load(params.mainloop, pipeline_q, pipeline_do, write_q, write_do, ss, w.n_block, w.head_group,
                        w.bidb, w.m_lo, w.m_hi, kv_loads);
        });
      } else if (role == WarpRole::kStoredQ) {
        consume_tiles(params, ss, [&](WorkTile const& w) __attribute__((always_inline)) {
          mainloop.store_dq(params.mainloop, ss, w.n_block, w.head_group, w.bidb, w.m_lo, w.m_hi);
        });
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<kMmaRegs>();
      int const thread_idx = int(threadIdx.x) - cutlass::NumThreadsPerWarpGroup;
      typename Mainloop::PipelineStateQ read_q;
      typename Mainloop::PipelineStatedO read_do;
      typename Mainloop::TiledMmadKV tiled_mma_dKV;
      consume_tiles(params, ss, [&](WorkTile const& w) __attribute__((always_inline)) {
        Tensor tdKrdK = partition_fragment_C(tiled_mma_dKV, typename Mainloop::ShapedKV{});
        Tensor tdVrdV = partition_fragment_C(tiled_mma_dKV, typename Mainloop::ShapedV{});
        bool const tile_valid = mainloop.mma(params.mainloop, pipeline_q, pipeline_do, read_q, read_do, tdKrdK,
                                             tdVrdV, thread_idx, w.n_block, w.head_group, w.bidb, w.m_lo, w.m_hi,
                                             ss, kv_loads);
        epilogue.store(params.epilogue, tdKrdK, tdVrdV, ss, thread_idx, w.n_block, w.head_group, w.bidb, tile_valid,
                       w.split_index, w.split_frags);
      });
    }
  }

  // ---- the CTA's tiles ----
  // f(work) of a work item: the scheduler counts groups of heads_per_cta q heads (1, or a GQA
  // group walked by one CTA); work.head_group becomes the group's first q head.
  template <class F>
  CUTE_DEVICE static void run_item(Params const& params, int item, F& f) {
    if constexpr (kSplitTail) {
      WorkTile work = Scheduler::get_work(params.scheduler, item);
      work.head_group *= params.mainloop.heads_per_cta;
      f(work);
    } else {
      auto [n_block, head_group, bidb] = Scheduler::get_block(params.scheduler, item);
      f(WorkTile{n_block, head_group * params.mainloop.heads_per_cta, bidb, 0, INT_MAX, -1, 1});
    }
  }
  // The first item of unit u, and the item after `item` in its unit (-1: none).
  CUTE_DEVICE static int first_item(Params const& params, int u) {
    if constexpr (kSplitTail) {
      return Scheduler::unit_first_item(params.scheduler, u);
    } else {
      return u;  // (a tile; from the tile count on, the end)
    }
  }
  CUTE_DEVICE static int next_item_in_unit(Params const& params, int item) {
    if constexpr (kSplitTail) {
      return Scheduler::unit_next_item(params.scheduler, item);
    } else {
      return -1;
    }
  }
  CUTE_DEVICE static int items_end(Params const& params) {
    if constexpr (kSplitTail) {
      return Scheduler::items_end(params.scheduler);
    } else {
      return static_cast<int>(Scheduler::num_tiles(params.scheduler));
    }
  }

  // The producer warp: tile blockIdx.x, then (persistent: fewer CTAs than tiles) the next unit
  // from the scheduler's counter each time it is done issuing an item's loads (a unit is a
  // tile, or a split-tail piece of one or two fragments: Scheduler), until the units run out;
  // each item id (and last, items_end: the end) goes to the two-slot ring before the item's
  // loads.
  template <class F>
  CUTE_DEVICE static void produce_tiles(Params const& params, SharedStorage& ss, F&& f) {
    {
      int const num_tiles = static_cast<int>(Scheduler::num_tiles(params.scheduler));
      int const end = items_end(params);
      bool const persistent = static_cast<int>(gridDim.x) < num_tiles;
      int item = first_item(params, static_cast<int>(blockIdx.x));
      CUTLASS_PRAGMA_NO_UNROLL
      for (int i = 0;; ++i) {
        int const slot = i & 1;
        if (i >= 2) { ss.pipelines.tile_empty[slot].wait(((i >> 1) - 1) & 1); }  // read i - 2
        if (cute::elect_one_sync()) {
          ss.pipelines.tile_slot[slot] = item;
          ss.pipelines.tile_full[slot].arrive();
        }
        __syncwarp();
        if (item >= end) { break; }
        run_item(params, item, f);
        int next = next_item_in_unit(params, item);
        if (next < 0) {
          next = end;
          if (persistent) {
            __syncwarp();
            if (cutlass::canonical_lane_idx() == 0) { next = atomicAdd(params.scheduler.tile_counter, 1) + int(gridDim.x); }
            next = first_item(params, __shfl_sync(0xffffffffu, next, 0));
          }
        }
        item = next;
      }
    }
  }

  // The dQ writer warp and the MMA warps: the items the producer hands on, in its order.
  template <class F>
  CUTE_DEVICE static void consume_tiles(Params const& params, SharedStorage& ss, F&& f) {
    {
      int const end = items_end(params);
      CUTLASS_PRAGMA_NO_UNROLL
      for (int i = 0;; ++i) {
        int const slot = i & 1;
        ss.pipelines.tile_full[slot].wait((i >> 1) & 1);
        int const item = ss.pipelines.tile_slot[slot];
        ss.pipelines.tile_empty[slot].arrive();
        if (item >= end) { break; }
        run_item(params, item, f);
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
