// Epilogue of the SM90 attention backward: dK_j and dV_j from the MMA warpgroups' registers
// to global memory through shared memory and TMA.
//   MHA (Hq == Hkv): dK * scale and dV in the input dtype, TMA store into params.dk / params.dv
//                    (arbitrary batch/head/row strides; rows >= Sk are clipped by the tensor map).
//   GQA           : unscaled fp32 dK, dV, TMA reduce-add into dk_accum / dv_accum (summed over
//                    the q heads of the group by every CTA of the group). Deterministic mode:
//                    the q heads of a group add in ascending order, ordered by dkv_semaphore.
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
  static constexpr int kNumMmaThreads = Mainloop::kNumMmaThreads;
  static constexpr bool kdKVSwapAB = Cfg::kdKVSwapAB;
  using TiledMmadKV = typename Mainloop::TiledMmadKV;

  // (kBlockN, D) tiles, d contiguous, swizzled; transposed views for the swapped accumulators.
  using SmemLayoutdKV = decltype(tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kBlockN>, Int<kHeadDim>>(),
      make_shape(Int<kBlockN>{}, Int<kHeadDim>{})));
  using SmemLayoutdKVAccum = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<ElementAccum>{},
                                                    make_shape(Int<kBlockN>{}, Int<kHeadDim>{})));
  template <class L>
  using Transposed = decltype(composition(L{}, make_layout(make_shape(Int<kHeadDim>{}, Int<kBlockN>{}),
                                                           make_stride(Int<kBlockN>{}, _1{}))));

  struct TensorStorage {
    cute::array_aligned<ElementAccum, cute::cosize_v<SmemLayoutdKVAccum>, 1024> smem_dk;
    cute::array_aligned<ElementAccum, cute::cosize_v<SmemLayoutdKVAccum>, 1024> smem_dv;
  };
  static_assert(cute::cosize_v<SmemLayoutdKV> * sizeof(Element) <=
                cute::cosize_v<SmemLayoutdKVAccum> * sizeof(ElementAccum));

  using ShapeQKV = typename Mainloop::ShapeQKV;
  using StrideQKV = typename Mainloop::StrideQKV;
  using TMA_dKV = decltype(make_tma_copy(
      SM90_TMA_STORE{}, make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), ShapeQKV{}, StrideQKV{}),
      SmemLayoutdKV{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  using TMA_dKVAccum = decltype(make_tma_copy(
      SM90_TMA_REDUCE_ADD{}, make_tensor(make_gmem_ptr(static_cast<ElementAccum*>(nullptr)), ShapeQKV{}, StrideQKV{}),
      SmemLayoutdKVAccum{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));

  struct Params {
    ShapeQKV shape_dKV;  // MHA: (Sk, D, Hkv, B); GQA: (Sk_rounded, D, Hkv, B)
    TMA_dKV tma_store_dK;
    TMA_dKV tma_store_dV;
    TMA_dKVAccum tma_add_dK;
    TMA_dKVAccum tma_add_dV;
    float scale;
    int qhead_per_khead;
    bool gqa;
    // deterministic GQA: [B, Hkv, num_n_blocks] turns of the key blocks' dK / dV adds, else null
    int* dkv_semaphore;
    int heads_kv;
    int num_n_blocks;
  };

  static Params to_params(BwdParams const& p) {
    Params out{};
    out.scale = p.scale;
    out.qhead_per_khead = p.heads_q / p.heads_kv;
    out.gqa = p.heads_q != p.heads_kv;
    out.dkv_semaphore = (out.gqa && p.deterministic) ? p.dkv_semaphore : nullptr;
    out.heads_kv = p.heads_kv;
    out.num_n_blocks = (p.seqlen_k + kBlockN - 1) / kBlockN;
    if (!out.gqa) {
      out.shape_dKV = make_shape(p.seqlen_k, int32_t(kHeadDim), p.heads_kv, p.batch);
      auto mdK = make_tensor(make_gmem_ptr(static_cast<Element*>(p.dk)), out.shape_dKV,
                             make_stride(p.dk_row_stride, _1{}, p.dk_head_stride, p.dk_batch_stride));
      auto mdV = make_tensor(make_gmem_ptr(static_cast<Element*>(p.dv)), out.shape_dKV,
                             make_stride(p.dv_row_stride, _1{}, p.dv_head_stride, p.dv_batch_stride));
      out.tma_store_dK = make_tma_copy(SM90_TMA_STORE{}, mdK, SmemLayoutdKV{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{});
      out.tma_store_dV = make_tma_copy(SM90_TMA_STORE{}, mdV, SmemLayoutdKV{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{});
    } else {
      out.shape_dKV = make_shape(p.seqlen_k_rounded, int32_t(kHeadDim), p.heads_kv, p.batch);
      int64_t const hs = int64_t(p.seqlen_k_rounded) * kHeadDim;
      auto stride = make_stride(int64_t(kHeadDim), _1{}, hs, hs * p.heads_kv);
      auto mdK = make_tensor(make_gmem_ptr(p.dk_accum), out.shape_dKV, stride);
      auto mdV = make_tensor(make_gmem_ptr(p.dv_accum), out.shape_dKV, stride);
      out.tma_add_dK = make_tma_copy(SM90_TMA_REDUCE_ADD{}, mdK, SmemLayoutdKVAccum{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{});
      out.tma_add_dV = make_tma_copy(SM90_TMA_REDUCE_ADD{}, mdV, SmemLayoutdKVAccum{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{});
    }
    return out;
  }

  CUTE_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    if (!params.gqa) {
      cute::prefetch_tma_descriptor(params.tma_store_dK.get_tma_descriptor());
      cute::prefetch_tma_descriptor(params.tma_store_dV.get_tma_descriptor());
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
    auto thr = TiledMmadKV{}.get_thread_slice(thread_idx);
    Tensor t = thr.partition_C(as_position_independent_swizzle_tensor(s_view));
    static_assert(decltype(size(t))::value == decltype(size(acc))::value);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(acc); ++i) { t(i) = static_cast<T>(acc(i) * scale); }
  }

  // dK (times k_scale) and dV as T into the two smem tiles, then one thread issues the two TMA
  // copies (a store or a reduce-add, as the TMA objects say) and waits for them. With `turn`
  // (deterministic GQA), the copies wait for the CTA's turn and pass it on once complete.
  template <class T, class SmemLayout, class TmaCopy, class FrgdKV>
  CUTE_DEVICE static void store_tiles(TmaCopy const& tma_dk, TmaCopy const& tma_dv, T* sk, T* sv,
                                      FrgdKV const& tdKrdK, FrgdKV const& tdVrdV, float k_scale,
                                      ShapeQKV const& shape, int thread_idx, int n_block, int bidh_kv,
                                      int bidb, int* turn = nullptr, int turn_value = 0) {
    write_tile<T, SmemLayout>(sk, tdKrdK, thread_idx, k_scale);
    write_tile<T, SmemLayout>(sv, tdVrdV, thread_idx, 1.f);
    cutlass::arch::fence_view_async_shared();
    named_sync(kNumMmaThreads, BwdBarrier::kEpilogue);
    if (thread_idx == 0) {
      auto issue = [&](TmaCopy const& tma, T* smem) {
        Tensor sT = make_tensor(make_smem_ptr(smem), SmemLayout{});
        Tensor gT = local_tile(tma.get_tma_tensor(shape)(_, _, bidh_kv, bidb),
                               Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, _0{}));
        auto slice = tma.get_slice(_0{});
        copy(tma, slice.partition_S(sT), slice.partition_D(gT));
      };
      if (turn != nullptr) { wait_for_turn(turn, turn_value); }
      issue(tma_dk, sk);
      issue(tma_dv, sv);
      tma_store_arrive();
      tma_store_wait<0>();
      if (turn != nullptr) {
        bulk_wait_all_complete();
        pass_turn(turn);
      }
    }
  }

  // Called by every MMA thread (thread_idx in [0, kNumMmaThreads)).
  template <class SharedStorage, class FrgdKV>
  CUTE_DEVICE void store(Params const& params, FrgdKV const& tdKrdK, FrgdKV const& tdVrdV, SharedStorage& ss,
                         int thread_idx, int n_block, int bidh, int bidb, bool tile_valid) {
    // deterministic GQA: this (batch, kv head, key block)'s turn; q head i of the group is the
    // i-th to add
    int const bidh_kv = bidh / params.qhead_per_khead;
    int* turn = params.dkv_semaphore == nullptr
                    ? nullptr
                    : params.dkv_semaphore +
                          (int64_t(bidb) * params.heads_kv + bidh_kv) * params.num_n_blocks + n_block;
    int const turn_value = bidh - bidh_kv * params.qhead_per_khead;
    if (params.gqa && !tile_valid) {  // nothing to add (but a turn to pass on)
      if (turn != nullptr && thread_idx == 0) {
        wait_for_turn(turn, turn_value);
        pass_turn(turn);
      }
      return;
    }
    // Every warpgroup is done with the mainloop's shared memory, which the epilogue reuses.
    named_sync(kNumMmaThreads, BwdBarrier::kEpilogue);
    auto& st = ss.tensors.epilogue;
    if (!params.gqa) {  // MHA: dK * scale and dV in the input dtype, stored
      store_tiles<Element, SmemLayoutdKV>(params.tma_store_dK, params.tma_store_dV,
                                          reinterpret_cast<Element*>(st.smem_dk.data()),
                                          reinterpret_cast<Element*>(st.smem_dv.data()), tdKrdK, tdVrdV,
                                          params.scale, params.shape_dKV, thread_idx, n_block, bidh_kv, bidb);
    } else {  // GQA: unscaled fp32, added into the group's accumulators
      store_tiles<float, SmemLayoutdKVAccum>(params.tma_add_dK, params.tma_add_dV, st.smem_dk.data(),
                                             st.smem_dv.data(), tdKrdK, tdVrdV, 1.f, params.shape_dKV,
                                             thread_idx, n_block, bidh_kv, bidb, turn, turn_value);
    }
  }
};

}  // namespace kernel
}  // namespace sm90_sdpa
