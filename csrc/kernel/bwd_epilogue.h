// Epilogue of the SM90 attention backward: dK_j and dV_j from the MMA warpgroups' registers
// to global memory through shared memory and TMA.
// dK is (kBlockN, D), dV (kBlockN, Dv) (Dv == D but for the pairs of TILES_DV).
//   MHA (Hq == Hkv): dK * scale and dV in the input dtype, TMA store into params.dk / params.dv
//                    (arbitrary batch/head/row strides; rows >= Sk are clipped by the tensor map).
//                    Also GQA when one CTA walks the whole group (heads_per_cta > 1: dK, dV
//                    summed over the group's q heads in registers).
//   GQA           : unscaled fp32 dK, dV, TMA reduce-add into dk_accum / dv_accum (summed over
//                    the q heads of the group by every CTA of the group). Deterministic mode:
//                    TMA store into this q head's tile of dk_accum / dv_accum ([B, Hq, ...]);
//                    the postprocess sums the group in a fixed order.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>

#include "../bwd_params.h"
#include "bwd_config.h"
#include "utils.h"

namespace sm90_sdpa {
namespace kernel {

using namespace cute;

template <class Cfg, class Element_, class Mainloop>
struct BwdEpilogue {
  using Element = Element_;
  using ElementAccum = float;
  static constexpr int kBlockN = Cfg::kBlockN;
  static constexpr int kHeadDim = Cfg::kHeadDim;
  static constexpr int kHeadDimV = Cfg::kHeadDimV;
  static constexpr int kNumMmaThreads = Mainloop::kNumMmaThreads;
  static constexpr bool kdKVSwapAB = Cfg::kdKVSwapAB;
  static constexpr bool kdKVStmatrix = Cfg::kdKVStmatrix;
  using TiledMmadKV = typename Mainloop::TiledMmadKV;

  // (kBlockN, D) tiles, d contiguous, swizzled; transposed views for the swapped accumulators.
  // kDim: D (dK) or Dv (dV).
  template <class T, int kDim>
  using SmemLayoutTile = std::conditional_t<
      sizeof(T) == 2,
      decltype(tile_to_shape(
          cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kBlockN>, Int<kDim>>(),
          make_shape(Int<kBlockN>{}, Int<kDim>{}))),
      decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<ElementAccum>{}, make_shape(Int<kBlockN>{}, Int<kDim>{})))>;
  using SmemLayoutdKV = SmemLayoutTile<Element, kHeadDim>;  // dK's (and dV's where Dv == D)
  using SmemLayoutdV = SmemLayoutTile<Element, kHeadDimV>;
  using SmemLayoutdKVAccum = SmemLayoutTile<ElementAccum, kHeadDim>;
  using SmemLayoutdVAccum = SmemLayoutTile<ElementAccum, kHeadDimV>;
  // the tile's width: its layout's second extent
  template <class L>
  static constexpr int kTileCols = decltype(size<1>(L{}))::value;
  template <class L>
  using Transposed = decltype(composition(L{}, make_layout(make_shape(Int<kTileCols<L>>{}, Int<kBlockN>{}),
                                                           make_stride(Int<kBlockN>{}, _1{}))));

  // fp32 tiles (GQA's accumulators): in the mainloop's shared memory (a union with it), once
  // the MMA warps are done with it
  struct TensorStorage {
    cute::array_aligned<ElementAccum, cute::cosize_v<SmemLayoutdKVAccum>, 1024> smem_dk;
    cute::array_aligned<ElementAccum, cute::cosize_v<SmemLayoutdVAccum>, 1024> smem_dv;
  };
  static_assert(cute::cosize_v<SmemLayoutdKV> * sizeof(Element) <=
                cute::cosize_v<SmemLayoutdKVAccum> * sizeof(ElementAccum));
  static_assert(cute::cosize_v<SmemLayoutdV> * sizeof(Element) <=
                cute::cosize_v<SmemLayoutdVAccum> * sizeof(ElementAccum));

  // Tiles in the input dtype (MHA, a walked GQA group) go where the next tile's loads do not:
  // both into the dQ staging tile, or dK into the dS buffers and dV into the dQ staging tile,
  // or (d256: 32 KB tiles, 16 KB of dS) one after the other into the staging tile, the second
  // once the first one's store has read it, whichever fits first (kPlacement); the last one
  // only where a CTA takes several tiles (Params::one_tile_per_cta: else both into the union
  // at once). Else into the union, and a CTA takes one tile only (BwdKernel::kPersistentCapable).
  static constexpr int kTileBytes = kBlockN * kHeadDim * int(sizeof(Element));    // dK's
  static constexpr int kTileBytesV = kBlockN * kHeadDimV * int(sizeof(Element));  // dV's
  static constexpr int kStagingBytes = cute::cosize_v<typename Mainloop::SmemLayoutdQ> * int(sizeof(ElementAccum));
  static constexpr int kdSBytes = cute::cosize_v<typename Mainloop::SmemLayoutPdS> * int(sizeof(Element));
  enum : int { kInUnion = 0, kBothInStaging = 1, kdKIndSdVInStaging = 2, kInTurnInStaging = 3 };
  static constexpr int kPlacement =
      kStagingBytes >= kTileBytes + kTileBytesV                               ? kBothInStaging
      : (kStagingBytes >= kTileBytesV && kdSBytes >= kTileBytes)              ? kdKIndSdVInStaging
      : (kStagingBytes >= kTileBytes && kStagingBytes >= kTileBytesV)         ? kInTurnInStaging
                                                                              : kInUnion;
  static constexpr bool kTilesOutsideMainloop = kPlacement != kInUnion;
  static_assert(kTileBytes % 1024 == 0, "a tile placed after another keeps the swizzle's 1 KB alignment");

  using ShapeQKV = typename Mainloop::ShapeQKV;
  using StrideQKV = typename Mainloop::StrideQKV;
  // TMA copies of a tile: CopyOp (store or reduce-add) of T elements, (kBlockN, kDim)
  template <class CopyOp, class T, int kDim>
  using TmaTile = decltype(make_tma_copy(
      CopyOp{}, make_tensor(make_gmem_ptr(static_cast<T*>(nullptr)), ShapeQKV{}, StrideQKV{}),
      SmemLayoutTile<T, kDim>{}, Shape<Int<kBlockN>, Int<kDim>>{}, _1{}));
  using TMA_dKV = TmaTile<SM90_TMA_STORE, Element, kHeadDim>;
  using TMA_dV = TmaTile<SM90_TMA_STORE, Element, kHeadDimV>;
  using TMA_dKVAccum = TmaTile<SM90_TMA_REDUCE_ADD, ElementAccum, kHeadDim>;
  using TMA_dVAccum = TmaTile<SM90_TMA_REDUCE_ADD, ElementAccum, kHeadDimV>;
  using TMA_dKVAccumStore = TmaTile<SM90_TMA_STORE, ElementAccum, kHeadDim>;
  using TMA_dVAccumStore = TmaTile<SM90_TMA_STORE, ElementAccum, kHeadDimV>;

  struct Params {
    // MHA: (Sk, D, Hkv, B); GQA: (Sk_rounded, D, Hkv or, deterministic, Hq, B); dV's: shape_dV()
    ShapeQKV shape_dKV;
    TMA_dKV tma_store_dK;
    TMA_dV tma_store_dV;
    TMA_dKVAccum tma_add_dK;
    TMA_dVAccum tma_add_dV;
    TMA_dKVAccumStore tma_store_dK_per_qhead;  // deterministic GQA
    TMA_dVAccumStore tma_store_dV_per_qhead;
    float scale;
    int qhead_per_khead;
    bool one_tile_per_cta;  // set by the launch: the grid has a CTA per tile
    bool gqa;        // dK / dV go to the fp32 accumulators (GQA, one q head per CTA)
    bool per_qhead;  // deterministic GQA: one fp32 tile per q head, stored
    // split tail (BwdParams): per split tile, its fragments' count and fp32 dK / dV sums
    int* split_count;
    float* split_accum;
  };

  // dV's (S, Dv, H, B): shape_dKV with the value head dim (kept out of Params, whose layout
  // the kernels of Dv == D keep)
  CUTE_HOST_DEVICE static ShapeQKV shape_dV(Params const& params) {
    if constexpr (kHeadDimV == kHeadDim) {
      return params.shape_dKV;
    } else {
      auto const& s = params.shape_dKV;
      return make_shape(get<0>(s), int32_t(kHeadDimV), get<2>(s), get<3>(s));
    }
  }

  static Params to_params(BwdParams const& p) {
    Params out{};
    out.scale = p.scale;
    out.qhead_per_khead = p.heads_q / p.heads_kv;
    // (a CTA that walks its whole GQA group stores the group's dK / dV as MHA's)
    out.gqa = p.heads_q != p.heads_kv && p.heads_per_cta == 1;
    out.per_qhead = out.gqa && p.deterministic;
    out.split_count = p.split_count;
    out.split_accum = p.split_accum;
    if (!out.gqa) {
      out.shape_dKV = make_shape(p.seqlen_k, int32_t(kHeadDim), p.heads_kv, p.batch);
      auto mdK = make_tensor(make_gmem_ptr(static_cast<Element*>(p.dk)), out.shape_dKV,
                             make_stride(p.dk_row_stride, _1{}, p.dk_head_stride, p.dk_batch_stride));
      auto mdV = make_tensor(make_gmem_ptr(static_cast<Element*>(p.dv)), shape_dV(out),
                             make_stride(p.dv_row_stride, _1{}, p.dv_head_stride, p.dv_batch_stride));
      out.tma_store_dK = make_tma_copy(SM90_TMA_STORE{}, mdK, SmemLayoutdKV{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{});
      out.tma_store_dV = make_tma_copy(SM90_TMA_STORE{}, mdV, SmemLayoutdV{}, Shape<Int<kBlockN>, Int<kHeadDimV>>{}, _1{});
    } else {
      int const heads = out.per_qhead ? p.heads_q : p.heads_kv;
      out.shape_dKV = make_shape(p.seqlen_k_rounded, int32_t(kHeadDim), heads, p.batch);
      // dk_accum [.., Sk_rounded, D], dv_accum [.., Sk_rounded, Dv], contiguous
      auto accum_stride = [&](int dim) {
        int64_t const hs = int64_t(p.seqlen_k_rounded) * dim;
        return make_stride(int64_t(dim), _1{}, hs, hs * heads);
      };
      auto mdK = make_tensor(make_gmem_ptr(p.dk_accum), out.shape_dKV, accum_stride(kHeadDim));
      auto mdV = make_tensor(make_gmem_ptr(p.dv_accum), shape_dV(out), accum_stride(kHeadDimV));
      auto tile = Shape<Int<kBlockN>, Int<kHeadDim>>{};
      auto tile_v = Shape<Int<kBlockN>, Int<kHeadDimV>>{};
      if (out.per_qhead) {
        out.tma_store_dK_per_qhead = make_tma_copy(SM90_TMA_STORE{}, mdK, SmemLayoutdKVAccum{}, tile, _1{});
        out.tma_store_dV_per_qhead = make_tma_copy(SM90_TMA_STORE{}, mdV, SmemLayoutdVAccum{}, tile_v, _1{});
      } else {
        out.tma_add_dK = make_tma_copy(SM90_TMA_REDUCE_ADD{}, mdK, SmemLayoutdKVAccum{}, tile, _1{});
        out.tma_add_dV = make_tma_copy(SM90_TMA_REDUCE_ADD{}, mdV, SmemLayoutdVAccum{}, tile_v, _1{});
      }
    }
    return out;
  }

  CUTE_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    if (!params.gqa) {
      cute::prefetch_tma_descriptor(params.tma_store_dK.get_tma_descriptor());
      cute::prefetch_tma_descriptor(params.tma_store_dV.get_tma_descriptor());
    } else if (params.per_qhead) {
      cute::prefetch_tma_descriptor(params.tma_store_dK_per_qhead.get_tma_descriptor());
      cute::prefetch_tma_descriptor(params.tma_store_dV_per_qhead.get_tma_descriptor());
    } else {
      cute::prefetch_tma_descriptor(params.tma_add_dK.get_tma_descriptor());
      cute::prefetch_tma_descriptor(params.tma_add_dV.get_tma_descriptor());
    }
  }

  template <class T, class SmemLayout, class FrgdKV>
  CUTE_DEVICE static void write_tile(T* smem, FrgdKV const& acc, int thread_idx, float scale) {
    Tensor s = make_tensor(make_smem_ptr(smem), SmemLayout{});
    Tensor s_view = [&] {
      if constexpr (kdKVSwapAB) {
        return make_tensor(make_smem_ptr(smem), Transposed<SmemLayout>{});
      } else {
        return s;
      }
    }();
    if constexpr (kdKVStmatrix && sizeof(T) == 2) {
      // dK^T / dV^T (head dim x keys) into the (keys, head dim) tile: stmatrix .trans writes
      // each warp's four 8 x 8 blocks transposed, a row of 8 head-dim elements (16 bytes) at a
      // time, instead of one 16-bit STS per element (d256: main kernel up to 22% faster at 512
      // keys, where a tile's fixed work weighs most; d192 measured level without it).
      auto tiled_store = make_tiled_copy_C(Copy_Atom<SM90_U16x8_STSM_T, T>{}, TiledMmadKV{});
      auto thr_store = tiled_store.get_thread_slice(thread_idx);
      Tensor converted = make_fragment_like<T>(acc);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(acc); ++i) { converted(i) = static_cast<T>(acc(i) * scale); }
      copy(tiled_store, thr_store.retile_S(converted),
           thr_store.partition_D(as_position_independent_swizzle_tensor(s_view)));
    } else {
      auto thr = TiledMmadKV{}.get_thread_slice(thread_idx);
      Tensor t = thr.partition_C(as_position_independent_swizzle_tensor(s_view));
      static_assert(decltype(size(t))::value == decltype(size(acc))::value);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(acc); ++i) { t(i) = static_cast<T>(acc(i) * scale); }
    }
  }

  // dK (times k_scale) and dV as T into the two smem tiles, then one thread issues the two TMA
  // copies (a store or a reduce-add, as the TMA objects say) into head `head` and waits until
  // they have read shared memory. kOneBuffer (sk == sv, kInTurnInStaging): dK's copy has read
  // the tile before dV is written into it.
  // SmemLayout / SmemLayoutV: dK's (kBlockN, D) and dV's (kBlockN, Dv) tiles; shape: dK's
  // (S, D, H, B) (dV's: its value head dim).
  template <bool kOneBuffer, class T, class SmemLayout, class SmemLayoutV, class TmaCopyK, class TmaCopyV,
            class FrgdK, class FrgdV>
  CUTE_DEVICE static void store_tiles(TmaCopyK const& tma_dk, TmaCopyV const& tma_dv, T* sk, T* sv,
                                      FrgdK const& tdKrdK, FrgdV const& tdVrdV, float k_scale,
                                      ShapeQKV const& shape, int thread_idx, int n_block, int head,
                                      int bidb) {
    auto issue = [&](auto const& tma, T* smem, auto layout) {
      using Layout = decltype(layout);
      ShapeQKV shape_t = shape;
      if constexpr (kTileCols<Layout> != kHeadDim) {
        shape_t = make_shape(get<0>(shape), int32_t(kTileCols<Layout>), get<2>(shape), get<3>(shape));
      }
      Tensor sT = make_tensor(make_smem_ptr(smem), Layout{});
      Tensor gT = local_tile(tma.get_tma_tensor(shape_t)(_, _, head, bidb),
                             Shape<Int<kBlockN>, Int<kTileCols<Layout>>>{}, make_coord(n_block, _0{}));
      auto slice = tma.get_slice(_0{});
      copy(tma, slice.partition_S(sT), slice.partition_D(gT));
    };
    write_tile<T, SmemLayout>(sk, tdKrdK, thread_idx, k_scale);
    if constexpr (kOneBuffer) {
      cutlass::arch::fence_view_async_shared();
      named_sync(kNumMmaThreads, BwdBarrier::kEpilogue);
      if (thread_idx == 0) {
        issue(tma_dk, sk, SmemLayout{});
        tma_store_arrive();
        tma_store_wait<0>();
      }
      named_sync(kNumMmaThreads, BwdBarrier::kEpilogue);  // dK's copy has read the buffer
    }
    write_tile<T, SmemLayoutV>(sv, tdVrdV, thread_idx, 1.f);
    cutlass::arch::fence_view_async_shared();
    named_sync(kNumMmaThreads, BwdBarrier::kEpilogue);
    if (thread_idx == 0) {
      if constexpr (!kOneBuffer) { issue(tma_dk, sk, SmemLayout{}); }
      issue(tma_dv, sv, SmemLayoutV{});
      tma_store_arrive();
      tma_store_wait<0>();
    }
  }

  // Split tail: a fragment adds its unscaled fp32 dK / dV into its tile's slot of split_accum,
  // laid out by register and thread (every fragment of a tile has the same MMA partition:
  // coalesced 16-byte adds, no layout to agree on), then counts itself in; the fragment that
  // brings the count to split_frags reads the sums back into its registers and returns true
  // (it stores the tile); the others return false. No fragment waits for another.
  // (a slot: kBlockN * (D + Dv) floats, BwdParams::split_slot_floats)
  template <class SharedStorage, class FrgdK, class FrgdV>
  CUTE_DEVICE static bool sum_split_fragments(Params const& params, FrgdK& tdKrdK, FrgdV& tdVrdV,
                                              SharedStorage& ss, int thread_idx, int split_index,
                                              int split_frags) {
    constexpr int kVecs = decltype(size(tdKrdK))::value / 4;
    constexpr int kVecsV = decltype(size(tdVrdV))::value / 4;
    static_assert(kVecs * 4 == decltype(size(tdKrdK))::value && kVecsV * 4 == decltype(size(tdVrdV))::value);
    float4* slot_dk = reinterpret_cast<float4*>(params.split_accum) +
                      int64_t(split_index) * (kVecs + kVecsV) * kNumMmaThreads;
    float4* slot_dv = slot_dk + kVecs * kNumMmaThreads;
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < kVecs; ++v) {
      atomicAdd(slot_dk + v * kNumMmaThreads + thread_idx,
                make_float4(tdKrdK(4 * v), tdKrdK(4 * v + 1), tdKrdK(4 * v + 2), tdKrdK(4 * v + 3)));
      if (v < kVecsV) {
        atomicAdd(slot_dv + v * kNumMmaThreads + thread_idx,
                  make_float4(tdVrdV(4 * v), tdVrdV(4 * v + 1), tdVrdV(4 * v + 2), tdVrdV(4 * v + 3)));
      }
    }
    static_assert(kVecsV <= kVecs, "dV's fragment is no larger than dK's (Dv <= D)");
    __threadfence();  // this thread's adds before the count (release)
    named_sync(kNumMmaThreads, BwdBarrier::kEpilogue);
    if (thread_idx == 0) {
      ss.pipelines.split_last = atomicAdd(params.split_count + split_index, 1) == split_frags - 1;
    }
    named_sync(kNumMmaThreads, BwdBarrier::kEpilogue);
    if (!ss.pipelines.split_last) { return false; }
    __threadfence();  // the other fragments' adds, counted before ours (acquire)
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < kVecs; ++v) {
      float4 const k = __ldcg(slot_dk + v * kNumMmaThreads + thread_idx);
      tdKrdK(4 * v) = k.x, tdKrdK(4 * v + 1) = k.y, tdKrdK(4 * v + 2) = k.z, tdKrdK(4 * v + 3) = k.w;
      if (v < kVecsV) {
        float4 const d = __ldcg(slot_dv + v * kNumMmaThreads + thread_idx);
        tdVrdV(4 * v) = d.x, tdVrdV(4 * v + 1) = d.y, tdVrdV(4 * v + 2) = d.z, tdVrdV(4 * v + 3) = d.w;
      }
    }
    return true;
  }

  // Called by every MMA thread (thread_idx in [0, kNumMmaThreads)) after the tile's mainloop.
  // tile_valid: the tile saw a query (the mainloop handed dQ tiles to the writer warp).
  // split_frags > 1: the work item was one of that many fragments of split tile split_index
  // (the scheduler's split tail; MHA or a walked GQA group only).
  template <class SharedStorage, class FrgdK, class FrgdV>
  CUTE_DEVICE void store(Params const& params, FrgdK& tdKrdK, FrgdV& tdVrdV, SharedStorage& ss,
                         int thread_idx, int n_block, int bidh, int bidb, bool tile_valid, int split_index,
                         int split_frags) {
    // nothing to add (a per-q-head tile is stored even so: the postprocess reads every tile)
    if (params.gqa && !params.per_qhead && !tile_valid) { return; }
    int const bidh_kv = bidh / params.qhead_per_khead;
    // Every warpgroup is done with the mainloop's shared memory (the dS buffers, the union).
    named_sync(kNumMmaThreads, BwdBarrier::kEpilogue);
    if (!params.gqa) {  // MHA: dK * scale and dV in the input dtype, stored
      if (split_frags > 1 && !sum_split_fragments(params, tdKrdK, tdVrdV, ss, thread_idx, split_index, split_frags)) {
        // another fragment stores the tile; the dQ writer's last arrival is taken all the same
        if constexpr (kTilesOutsideMainloop) {
          if (tile_valid) { named_sync(kNumMmaThreads + cutlass::NumThreadsPerWarp, BwdBarrier::kdQEmpty); }
        }
        return;
      }
      // Both tiles at once into the union where nothing loads after the mainloop: kInUnion, and
      // kInTurnInStaging's launches of one tile per CTA
      bool in_union = !kTilesOutsideMainloop;
      if constexpr (kPlacement == kInTurnInStaging) { in_union = params.one_tile_per_cta; }
      if (in_union) {
        store_tiles<false, Element, SmemLayoutdKV, SmemLayoutdV>(
            params.tma_store_dK, params.tma_store_dV, reinterpret_cast<Element*>(ss.tensors.epilogue.smem_dk.data()),
            reinterpret_cast<Element*>(ss.tensors.epilogue.smem_dv.data()), tdKrdK, tdVrdV, params.scale,
            params.shape_dKV, thread_idx, n_block, bidh_kv, bidb);
      } else if constexpr (kTilesOutsideMainloop) {
        Element* staging = reinterpret_cast<Element*>(ss.dq.smem_dq.data());
        Element* sk = kPlacement == kdKIndSdVInStaging ? ss.tensors.mainloop.smem_ds.data() : staging;
        Element* sv = kPlacement == kBothInStaging ? staging + kTileBytes / int(sizeof(Element)) : staging;
        // the dQ writer is done reading the staging tile (its arrival after the last reduce-add;
        // the mainloop takes the first turn again at its next tile)
        if (tile_valid) { named_sync(kNumMmaThreads + cutlass::NumThreadsPerWarp, BwdBarrier::kdQEmpty); }
        store_tiles<kPlacement == kInTurnInStaging, Element, SmemLayoutdKV, SmemLayoutdV>(
            params.tma_store_dK, params.tma_store_dV, sk, sv, tdKrdK, tdVrdV, params.scale, params.shape_dKV,
            thread_idx, n_block, bidh_kv, bidb);
        // the stores have read the tiles: the next tile's dS and dQ may take the buffers
        named_sync(kNumMmaThreads, BwdBarrier::kEpilogue);
      }
    } else if (params.per_qhead) {  // deterministic GQA: unscaled fp32, this q head's tile
      auto& st = ss.tensors.epilogue;
      store_tiles<false, float, SmemLayoutdKVAccum, SmemLayoutdVAccum>(params.tma_store_dK_per_qhead, params.tma_store_dV_per_qhead,
                                                    st.smem_dk.data(), st.smem_dv.data(), tdKrdK, tdVrdV, 1.f,
                                                    params.shape_dKV, thread_idx, n_block, bidh, bidb);
    } else {  // GQA: unscaled fp32, added into the group's accumulators
      auto& st = ss.tensors.epilogue;
      store_tiles<false, float, SmemLayoutdKVAccum, SmemLayoutdVAccum>(params.tma_add_dK, params.tma_add_dV, st.smem_dk.data(),
                                                    st.smem_dv.data(), tdKrdK, tdVrdV, 1.f, params.shape_dKV,
                                                    thread_idx, n_block, bidh_kv, bidb);
    }
  }
};

}  // namespace kernel
}  // namespace sm90_sdpa
