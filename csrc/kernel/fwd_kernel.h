// The SM90 attention-forward kernel: tiles of one (query block, q head, batch), warp-specialized;
// persistent CTAs (one per SM) walk the tiles in a fixed order (FwdKernel::tile_at), the
// producer loading the next tile's Q and K / V while the MMA warpgroups finish the last one.
//
//   producer warp      : Q_i once, then K_j and V_j for every key block j the block sees, last
//                        to first, through two TMA pipelines (K and V apart: S = Q K^T starts
//                        when K_j lands, V_j may still be in flight)
//   MMA warpgroups     : 64 query rows each; per key block S = Q K^T (wgmma, both operands in
//                        shared memory), the causal cut and the key tail on the blocks that
//                        cross them, the online softmax in registers, O += P V (wgmma with P
//                        from registers); then O / rowsum and lse written from registers
//
// Key blocks go last to first, so the blocks that need the causal cut or the key tail come
// first and every later block runs without any masking code.
//
// kMasked: with an attention mask. The classification (mask_classify.h) has written the class
// of every kFwdTile x kFwdTile tile (a query block and kFwdTile keys): the producer and the MMA
// warpgroups walk the same sequence of key blocks whose tile is not empty (next_block), blocks
// of full tiles run unmasked, blocks of partial tiles read the classification's visibility bits
// or, for other biases, the mask itself. A key block smaller than kFwdTile is a slice of one
// tile and takes that tile's class and its share of the bits. Only the in-turn kernel reads a
// mask's elements (kReadsMaskElements); with a float mask the overlap kernel runs the query
// blocks whose partial tiles are all bits and the in-turn kernel the others (run_fwd_main,
// Params::block_elements).
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/pipeline.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>

#include "../fwd_params.h"
#include "../numeric.h"
#include "fwd_config.h"
#include "mask_elements.h"
#include "utils.h"

namespace sm90_sdpa {
namespace kernel {

using namespace cute;

// An accumulator fragment ((2, 2, V), MMA_M, MMA_N) of a wgmma C tile viewed as (rows, cols):
// ((2, MMA_M), (2, V, MMA_N)). Per thread, row r holds the values of one query row (rows 8
// apart), and columns 2c, 2c + 1 are adjacent keys (or head-dim columns).
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_layout_rowcol(Layout const& acc) {
  static_assert(decltype(rank(acc))::value == 3);
  return make_layout(make_layout(layout<0, 1>(acc), layout<1>(acc)),
                     make_layout(layout<0, 0>(acc), layout<0, 2>(acc), layout<2>(acc)));
}

// The four threads of a quad hold the same rows of a wgmma accumulator.
CUTE_DEVICE float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
CUTE_DEVICE float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// kOverlap: block n's softmax overlaps the previous block's P V inside each warpgroup (see
// mma()); else each block's S, softmax and P V run in turn. kMasked: see above.
template <class Cfg, class Element_, bool kOverlap_ = false, bool kMasked_ = false>
struct FwdKernel {
  using Element = Element_;
  static constexpr bool kOverlap = kOverlap_;
  static constexpr bool kMasked = kMasked_;
  // The element path holds the mask's pointer and strides across the loop; in the overlap
  // kernel, where the previous block's P is live too, that made d256 spill in its hot loop.
  static constexpr bool kReadsMaskElements = kMasked && !kOverlap;
  static constexpr int kHeadDim = Cfg::kHeadDim;
  static constexpr int kBlockM = Cfg::kBlockM;
  static constexpr int kBlockN = Cfg::kBlockN;
  static constexpr int kStages = Cfg::kStages;
  static constexpr int kNumMmaWG = kBlockM / 64;
  static constexpr int kNumMmaThreads = kNumMmaWG * cutlass::NumThreadsPerWarpGroup;
  static constexpr int kNumThreads = kNumMmaThreads + cutlass::NumThreadsPerWarpGroup;
  // kMasked: key block n lies in classified tile n / kBlocksPerTile and covers words
  // (n % kBlocksPerTile) * kBlockRowWords onwards of each of that tile's bit rows.
  static_assert(!kMasked || (kBlockM == kFwdTile && kFwdTile % kBlockN == 0 && kBlockN % 32 == 0),
                "a masked key block is a slice of one kFwdTile x kFwdTile classified tile, whole "
                "32-key words of its bits");
  static constexpr int kBlocksPerTile = kFwdTile / kBlockN;
  static constexpr int kTileBitWords = kFwdTile * kFwdTile / 32;  // per classified tile
  static constexpr int kTileRowWords = kFwdTile / 32;             // per row of a classified tile
  static constexpr int kBlockRowWords = kBlockN / 32;             // a key block's share of them
  // (fwd_config.h: two MMA warpgroups) 24 + 2 x 240 registers per thread of a warp trio
  static constexpr uint32_t kLoadRegs = 24;
  static constexpr uint32_t kMmaRegs = 240;

  // S = Q K^T: each warpgroup its 64 rows, all kBlockN keys.
  using TiledMmaS = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockN>, Int<kHeadDim>>>(),
      Layout<Shape<Int<kNumMmaWG>, _1, _1>>{}));
  // O += P V: P from registers (K-major), V^T (head dim, keys) from shared memory, MN-major.
  using TiledMmaO = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<Int<kNumMmaWG>, _1, _1>>{}));

  using SmemAtomQ = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                             GMMA::Major::K, Element, Int<kBlockM>, Int<kHeadDim>>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomQ{}, make_shape(Int<kBlockM>{}, Int<kHeadDim>{})));
  using SmemAtomKV = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                              GMMA::Major::K, Element, Int<kBlockN>, Int<kHeadDim>>());
  using SmemLayoutKV = decltype(tile_to_shape(
      SmemAtomKV{}, make_shape(Int<kBlockN>{}, Int<kHeadDim>{}, Int<kStages>{})));
  // V^T: the same memory as (head dim, keys, stage)
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_layout(make_shape(Int<kHeadDim>{}, Int<kBlockN>{}, Int<kStages>{}),
                                  make_stride(Int<kBlockN>{}, _1{}, Int<kBlockN * kHeadDim>{}))));

  using ShapeQKV = Shape<int32_t, int32_t, int32_t, int32_t>;  // (S, D, H, B)
  using StrideQKV = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{},
                                          StrideQKV{}));
  using TMA_Q = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQ{},
                                       Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TMA_KV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutKV{}),
                                        Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesKV = kBlockN * kHeadDim * sizeof(Element);

  using PipelineKV = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename PipelineKV::PipelineState;

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>> smem_q;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>> smem_k;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>> smem_v;
    alignas(16) cutlass::arch::ClusterTransactionBarrier barrier_q;
    // the MMA threads' S = Q K^T of a tile are complete: sQ may take the next tile's Q
    alignas(16) cutlass::arch::ClusterBarrier barrier_q_empty;
    alignas(16) typename PipelineKV::SharedStorage pipeline_k;
    alignas(16) typename PipelineKV::SharedStorage pipeline_v;
  };
  static constexpr int kSharedStorageSize = sizeof(SharedStorage);
  static_assert(kSharedStorageSize <= 227 * 1024, "over the 227 KB of shared memory an SM90 CTA can have");

  struct Params {
    ShapeQKV shape_q;  // (Sq, D, Hq, B)
    ShapeQKV shape_k;  // (Sk, D, Hkv, B)
    TMA_Q tma_q;
    TMA_KV tma_k;
    TMA_KV tma_v;
    Element* out;
    int64_t out_batch_stride, out_head_stride, out_row_stride;
    float* lse;
    int64_t lse_batch_stride, lse_head_stride;
    int seqlen_q, seqlen_k, qhead_per_khead;
    // the tiles: num_m_blocks x Hq x B of them (tile_at); longest_first: query-block major
    int num_m_blocks;
    bool longest_first;
    float scale_log2;
    float rescale_slack;  // FwdParams::rescale_slack
    bool is_causal;
    // ---- kMasked only ----
    MaskKind mask_kind;
    void const* mask;
    int64_t mask_batch_stride, mask_head_stride, mask_row_stride, mask_col_stride;
    int mask_batch, mask_heads;
    int num_m_tiles, num_n_tiles;     // the classification's grid of kFwdTile x kFwdTile tiles
    unsigned char const* tile_class;  // [mask_batch, mask_heads, num_n_tiles, num_m_tiles]
    uint32_t const* tile_bits;        // kTileBitWords per tile, in tile_class order
    // [mask_batch, mask_heads, num_m_tiles]: each query block's non-empty key tiles [lo, hi)
    // (run_fwd_key_ranges; {0, 0}: none)
    int2 const* key_range;
    // [mask_batch, mask_heads, num_m_tiles, num_n_tiles]: tile_class query-block major, the
    // classes the walk reads (run_fwd_key_ranges): a query block's are consecutive bytes
    unsigned char const* block_classes;
    // [mask_batch, mask_heads, num_m_tiles]: 1 where a query block needs the mask's elements
    // (a float mask's kTilePartial tile); the kernel runs only the blocks where this equals
    // kReadsMaskElements. Null: every block (a boolean mask, or the in-turn kernel alone)
    unsigned char const* block_elements;
    // (with block_elements) how many of its bytes are 1: a kernel of the pair that has no block
    // returns before its prologue (1.7 us), where walking every tile's byte in turn took 8.8 us
    // (d128, H100)
    int const* element_count;
  };

  // p: strides already fit for TMA (launch_fwd_main); tile_class / tile_bits: the
  // classification's output in p.mask_workspace (null without a mask)
  static Params to_params(FwdParams const& p, bool longest_first, unsigned char const* tile_class = nullptr,
                          uint32_t const* tile_bits = nullptr, int2 const* key_range = nullptr,
                          unsigned char const* block_classes = nullptr,
                          unsigned char const* block_elements = nullptr,
                          int const* element_count = nullptr) {
    auto gmem = [](void const* ptr, int s, int h, int b, int64_t rs, int64_t hs, int64_t bs) {
      return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)),
                         make_shape(s, int32_t(kHeadDim), h, b), make_stride(rs, _1{}, hs, bs));
    };
    auto mQ = gmem(p.q, p.seqlen_q, p.heads_q, p.batch, p.q_row_stride, p.q_head_stride, p.q_batch_stride);
    auto mK = gmem(p.k, p.seqlen_k, p.heads_kv, p.batch, p.k_row_stride, p.k_head_stride, p.k_batch_stride);
    auto mV = gmem(p.v, p.seqlen_k, p.heads_kv, p.batch, p.v_row_stride, p.v_head_stride, p.v_batch_stride);
    return Params{
        make_shape(p.seqlen_q, int32_t(kHeadDim), p.heads_q, p.batch),
        make_shape(p.seqlen_k, int32_t(kHeadDim), p.heads_kv, p.batch),
        make_tma_copy(SM90_TMA_LOAD{}, mQ, SmemLayoutQ{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}),
        make_tma_copy(SM90_TMA_LOAD{}, mK, take<0, 2>(SmemLayoutKV{}), Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}),
        make_tma_copy(SM90_TMA_LOAD{}, mV, take<0, 2>(SmemLayoutKV{}), Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}),
        static_cast<Element*>(p.out),
        p.out_batch_stride,
        p.out_head_stride,
        p.out_row_stride,
        p.lse,
        p.lse_batch_stride,
        p.lse_head_stride,
        p.seqlen_q,
        p.seqlen_k,
        p.heads_q / p.heads_kv,
        (p.seqlen_q + kBlockM - 1) / kBlockM,
        longest_first,
        p.scale_log2,
        p.rescale_slack,
        p.is_causal,
        p.mask_kind,
        p.mask,
        p.mask_batch_stride,
        p.mask_head_stride,
        p.mask_row_stride,
        p.mask_col_stride,
        p.mask_batch,
        p.mask_heads,
        (p.seqlen_q + kFwdTile - 1) / kFwdTile,
        (p.seqlen_k + kFwdTile - 1) / kFwdTile,
        tile_class,
        tile_bits,
        key_range,
        block_classes,
        block_elements,
        element_count};
  }

  // The index of tile (m_block, 0) of (bidh, bidb)'s mask instance in tile_class (m_block is
  // also the tile row: kBlockM == kFwdTile); tile column t's is this + t * num_m_tiles.
  CUTE_DEVICE static int64_t first_tile_index(Params const& params, int m_block, int bidh, int bidb) {
    return mask_instance(params, bidh, bidb) * params.num_n_tiles * int64_t(params.num_m_tiles) + m_block;
  }
  // (bidh, bidb)'s mask instance (broadcast dims: instance 0 along them)
  CUTE_DEVICE static int64_t mask_instance(Params const& params, int bidh, int bidb) {
    int const mb = params.mask_batch == 1 ? 0 : bidb;
    int const mh = params.mask_heads == 1 ? 0 : bidh;
    return int64_t(mb) * params.mask_heads + mh;
  }

  // The query block's row of block_classes: the class of its key tile t is row[t].
  CUTE_DEVICE static unsigned char const* class_row(Params const& params, int m_block, int bidh, int bidb) {
    return params.block_classes +
           (mask_instance(params, bidh, bidb) * params.num_m_tiles + m_block) * int64_t(params.num_n_tiles);
  }
  // The class of the classified tile that key block n (n >= 0) lies in (classes: class_row).
  CUTE_DEVICE static unsigned char block_class(unsigned char const* classes, int n) {
    return classes[n / kBlocksPerTile];
  }

  // A key block of the walk and the class of its tile (kTileFull without a mask); n < 0: none.
  struct Block {
    int n;
    unsigned char cls;
  };

  // The highest key block <= n that the query block sees (n < 0: none): n itself without a
  // mask, else the first at or above n_lo (KeyBlocks) whose tile is not empty (an empty tile is
  // passed over whole). The producer and the MMA warps walk the same blocks.
  CUTE_DEVICE static Block next_block(unsigned char const* classes, int n, int n_lo) {
    if constexpr (kMasked) {
      for (; n >= n_lo; n = n / kBlocksPerTile * kBlocksPerTile - 1) {
        unsigned char const cls = block_class(classes, n);
        if (cls != kTileEmpty) { return {n, cls}; }
      }
      return {-1, kTileEmpty};
    }
    return {n, kTileFull};
  }

  // ---- the tiles: (m_block, q head, batch), num_tiles of them ----
  struct Tile {
    int m_block, bidh, bidb;
  };
  CUTE_DEVICE static int num_tiles(Params const& params) {
    return params.num_m_blocks * get<2>(params.shape_q) * get<3>(params.shape_q);
  }
  // Tile t of the order, query blocks last to first (the blocks under the causal cut that see
  // the most keys first):
  //  * longest_first (causal or masked): query-block major, every (q head, batch) of a query
  //    block before the next (longest-processing-time first over the whole grid);
  //  * else (equal tiles): (q head, batch) major, so the CTAs running together read the same
  //    heads' K / V from L2.
  CUTE_DEVICE static Tile tile_at(Params const& params, int t) {
    int const M = params.num_m_blocks;
    int const H = get<2>(params.shape_q);
    int const HB = H * get<3>(params.shape_q);
    int m, bh;
    if (params.longest_first) {
      m = t / HB;
      bh = t - m * HB;
    } else {
      bh = t / M;
      m = t - bh * M;
    }
    return {M - 1 - m, bh % H, bh / H};
  }
  // The k-th tile of this CTA (>= num_tiles: none left): round k of gridDim.x tiles, dealt to
  // the CTAs forward in even rounds and backward in odd ones, so that over the rounds of a
  // longest-first order every CTA gets about the same work. One CTA per tile (gridDim.x ==
  // num_tiles): tile blockIdx.x.
  CUTE_DEVICE static int cta_tile(int k) {
    int const G = int(gridDim.x), i = int(blockIdx.x);
    return k * G + ((k & 1) ? G - 1 - i : i);
  }
  // kMasked with block_elements: does this kernel of the pair run the tile (run_fwd_main)?
  CUTE_DEVICE static bool runs_tile(Params const& params, Tile const& tile) {
    if constexpr (kMasked) {
      if (params.block_elements != nullptr) {
        int64_t const inst = mask_instance(params, tile.bidh, tile.bidb);
        return (params.block_elements[inst * params.num_m_tiles + tile.m_block] != 0) == kReadsMaskElements;
      }
    }
    return true;
  }

  // The key blocks query block m_block sees: [0, n_end). Causal (top-left): keys up to the
  // block's last row.
  CUTE_DEVICE static int n_block_end(Params const& params, int m_block) {
    int keys = params.seqlen_k;
    if (params.is_causal) { keys = cute::min(keys, (m_block + 1) * kBlockM); }
    return (keys + kBlockN - 1) / kBlockN;
  }

  // The key blocks [lo, end) a tile walks, last to first: [0, n_block_end) without a mask; with
  // one, cut to the query block's non-empty key tiles (key_range). One read per tile, where the
  // walk down from n_block_end read the class of every empty tile above the first non-empty
  // one in turn (a causal-shaped mask: most of a query block's tiles), in the producer before
  // its first K / V load and in the MMA warps before their first S.
  struct KeyBlocks {
    int lo, end;
  };
  CUTE_DEVICE static KeyBlocks key_blocks(Params const& params, Tile const& tile) {
    int const end = n_block_end(params, tile.m_block);
    if constexpr (kMasked) {
      int2 const r =
          params.key_range[mask_instance(params, tile.bidh, tile.bidb) * params.num_m_tiles + tile.m_block];
      return {r.x * kBlocksPerTile, cute::min(end, r.y * kBlocksPerTile)};
    }
    return {0, end};
  }

  // The producer's share of one tile, the CTA's iter-th (its K / V stages continue the last
  // tile's: write_k, write_v).
  CUTE_DEVICE void load(Params const& params, SharedStorage& ss, PipelineKV& pipeline_k, PipelineKV& pipeline_v,
                        PipelineState& write_k, PipelineState& write_v, int iter, int m_block, int bidh, int bidb,
                        KeyBlocks blocks) {
    int const n_lo = blocks.lo, n_end = blocks.end;
    Tensor sQ = make_tensor(make_smem_ptr(ss.smem_q.data()), SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(ss.smem_k.data()), SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(ss.smem_v.data()), SmemLayoutKV{});
    Tensor mQ = params.tma_q.get_tma_tensor(params.shape_q)(_, _, bidh, bidb);
    Tensor gQ = local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, _0{}));  // (M, D)
    int const bidh_kv = bidh / params.qhead_per_khead;
    Tensor mK = params.tma_k.get_tma_tensor(params.shape_k)(_, _, bidh_kv, bidb);
    Tensor mV = params.tma_v.get_tma_tensor(params.shape_k)(_, _, bidh_kv, bidb);
    Tensor gK = local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));  // (N, D, n)
    Tensor gV = local_tile(mV, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));  // (N, D, n)

    auto tma_q = params.tma_q.get_slice(_0{});
    auto tma_k = params.tma_k.get_slice(_0{});
    auto tma_v = params.tma_v.get_slice(_0{});
    Tensor tQgQ = tma_q.partition_S(gQ);
    Tensor tQsQ = tma_q.partition_D(sQ);
    Tensor tKgK = tma_k.partition_S(gK);  // (TMA, TMA_N, TMA_D, n)
    Tensor tKsK = tma_k.partition_D(sK);  // (TMA, TMA_N, TMA_D, stage)
    Tensor tVgV = tma_v.partition_S(gV);
    Tensor tVsV = tma_v.partition_D(sV);

    using BarrierT = cutlass::arch::ClusterTransactionBarrier::ValueType;
    // (the first block's class read before the wait: its latency off the path to the first load)
    unsigned char const* classes = kMasked ? class_row(params, m_block, bidh, bidb) : nullptr;
    int const first = next_block(classes, n_end - 1, n_lo).n;
    if (iter > 0) { ss.barrier_q_empty.wait((iter - 1) & 1); }  // the last tile's S are done
    ss.barrier_q.arrive_and_expect_tx(kTmaBytesQ);
    copy(params.tma_q.with(reinterpret_cast<BarrierT&>(ss.barrier_q), 0), tQgQ, tQsQ);
    CUTLASS_PRAGMA_NO_UNROLL
    for (int n = first; n >= 0; n = next_block(classes, n - 1, n_lo).n) {
      pipeline_k.producer_acquire(write_k);
      copy(params.tma_k.with(*pipeline_k.producer_get_barrier(write_k), 0), tKgK(_, _, _, n),
           tKsK(_, _, _, write_k.index()));
      ++write_k;
      pipeline_v.producer_acquire(write_v);
      copy(params.tma_v.with(*pipeline_v.producer_get_barrier(write_v), 0), tVgV(_, _, _, n),
           tVsV(_, _, _, write_v.index()));
      ++write_v;
    }
  }

  // The MMA warpgroups' share of one tile, the CTA's iter-th, epilogue included (read_k,
  // read_v: the K / V stages, continued from the last tile). thread_idx: 0 .. kNumMmaThreads - 1.
  CUTE_DEVICE void mma(Params const& params, SharedStorage& ss, PipelineKV& pipeline_k, PipelineKV& pipeline_v,
                       PipelineState& read_k, PipelineState& read_v, int iter, int thread_idx, int m_block,
                       int bidh, int bidb, KeyBlocks blocks) {
    int const n_lo = blocks.lo, n_end = blocks.end;
    TiledMmaS tiled_mma_s;
    TiledMmaO tiled_mma_o;
    auto thr_s = tiled_mma_s.get_thread_slice(thread_idx);
    auto thr_o = tiled_mma_o.get_thread_slice(thread_idx);
    Tensor sQ = make_tensor(make_smem_ptr(ss.smem_q.data()), SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(ss.smem_k.data()), SmemLayoutKV{});
    Tensor sVt = make_tensor(make_smem_ptr(ss.smem_v.data()), SmemLayoutVt{});
    Tensor tSrQ = thr_s.partition_fragment_A(sQ);   // (MMA, MMA_M, MMA_K)
    Tensor tSrK = thr_s.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, stage)
    Tensor tOrV = thr_o.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, stage)

    Tensor tOrO = partition_fragment_C(tiled_mma_o, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    clear(tOrO);
    Tensor O = make_tensor(tOrO.data(), acc_layout_rowcol(tOrO.layout()));
    // (row, key) coordinates of the thread's S values within the tile
    Tensor tScS = thr_s.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
    Tensor cS = make_tensor(tScS.data(), acc_layout_rowcol(tScS.layout()));
    constexpr int kRows = decltype(size<0>(cS))::value;
    static_assert(kRows == decltype(size<0>(O))::value, "S and O hold the same rows");
    // running max of the scaled (log2) scores, and the row sums of this thread's values
    float row_max[kRows], row_sum[kRows];
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.f;
    }

    int const m0 = m_block * kBlockM;
    int const seqlen_k = params.seqlen_k;
    bool const is_causal = params.is_causal;
    float const scale_log2 = params.scale_log2;
    int64_t const tile0 = kMasked ? first_tile_index(params, m_block, bidh, bidb) : 0;
    unsigned char const* classes = kMasked ? class_row(params, m_block, bidh, bidb) : nullptr;
    // (read before the wait for Q: its latency off the path to the first S)
    Block const first = next_block(classes, n_end - 1, n_lo);
    ss.barrier_q.wait(iter & 1);
    // every S = Q K^T of the tile is complete: the producer may load the next tile's Q
    auto release_q = [&]() __attribute__((always_inline)) { ss.barrier_q_empty.arrive(); };

    // kMasked, a kTilePartialBits tile: this thread's rows' words of the tile's bits (row-major:
    // bit k % 32 of word k / 32 of a row, mask_classify.cu), this key block's share (from word
    // (n % kBlocksPerTile) * kBlockRowWords of a row). The overlap kernel loads them at the start
    // of the block's step, before its S = Q K^T: the softmax finds them in registers, not an L2
    // round trip after S. (The in-turn kernel, which holds the mask's pointer and strides too,
    // spilled with them live across S: it loads them in mask_scores.)
    constexpr bool kPrefetchBits = kOverlap;
    uint32_t bits[kRows][kBlockRowWords];
    auto load_bits = [&](Block b) __attribute__((always_inline)) {
      if constexpr (kMasked) {
        if (b.cls != kTilePartialBits) { return; }
        uint32_t const* words = params.tile_bits +
                                (tile0 + int64_t(b.n / kBlocksPerTile) * params.num_m_tiles) * kTileBitWords +
                                (b.n % kBlocksPerTile) * kBlockRowWords;
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < kRows; ++r) {
          uint32_t const* row_words = words + get<0>(cS(r, 0)) * kTileRowWords;
          if constexpr (kBlockRowWords == 4) {  // (16-byte aligned: rows of 4 words, blocks of 4)
            uint4 const v = *reinterpret_cast<uint4 const*>(row_words);
            bits[r][0] = v.x, bits[r][1] = v.y, bits[r][2] = v.z, bits[r][3] = v.w;
          } else {
            CUTLASS_PRAGMA_UNROLL
            for (int w = 0; w < kBlockRowWords; ++w) { bits[r][w] = row_words[w]; }
          }
        }
      }
    };

    // kMasked, a partial tile: S scaled into the log2 domain with the mask added (-inf where
    // hidden, the causal cut and the key tail included).
    auto mask_scores = [&](auto& S, int n, unsigned char cls) __attribute__((always_inline)) {
      if (cls == kTilePartialBits) {
        if constexpr (!kPrefetchBits) { load_bits(Block{n, cls}); }
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < kRows; ++r) {
          CUTLASS_PRAGMA_UNROLL
          for (int c = 0; c < size<1>(S); ++c) {
            int const col = get<1>(cS(r, c));  // within the key block
            uint32_t word = bits[r][0];
            CUTLASS_PRAGMA_UNROLL
            for (int w = 1; w < kBlockRowWords; ++w) { word = col >= 32 * w ? bits[r][w] : word; }
            S(r, c) = (word >> (col % 32)) & 1u ? S(r, c) : -INFINITY;  // (unscaled)
          }
        }
        return;
      }
      if constexpr (kReadsMaskElements) {
        int const n0 = n * kBlockN;
        // the mask's [B, Hq] offset (stride 0 on broadcast dims)
        int64_t const mask_offset = int64_t(bidb) * params.mask_batch_stride + int64_t(bidh) * params.mask_head_stride;
        // bias(offset): the element's additive term in the log2 domain, -inf where masked. A
        // finite bias stays finite (the product may overflow fp32, e.g. the dtype's min): a row
        // whose every key carries it gets uniform weights, as in stock SDPA.
        auto apply = [&](auto bias) __attribute__((always_inline)) {
          CUTLASS_PRAGMA_UNROLL
          for (int r = 0; r < kRows; ++r) {
            int const row = m0 + get<0>(cS(r, 0));
            CUTLASS_PRAGMA_UNROLL
            for (int c = 0; c < size<1>(S); ++c) {
              int const col = n0 + get<1>(cS(r, c));
              float add = -INFINITY;
              if (row < params.seqlen_q && col < seqlen_k && !(is_causal && col > row)) {
                add = bias(mask_offset + int64_t(row) * params.mask_row_stride + int64_t(col) * params.mask_col_stride);
              }
              S(r, c) = S(r, c) * scale_log2 + add;
            }
          }
        };
        auto finite_log2 = [](float b) __attribute__((always_inline)) {
          return b == -INFINITY ? b : fmaxf(b * kLog2e, -FLT_MAX);
        };
        with_mask_elements</*kHasNone=*/false>(params.mask_kind, params.mask, finite_log2, apply);
      }
    };

    // The online softmax of key block n: S (the wgmma accumulator) scaled, masked where the key
    // tail or the causal cut cross the block, and turned into P = 2^(S - ref) in place; the
    // reference max and the sum updated, and correction[r] = 2^(old ref - new ref), by which
    // O's row r must be scaled before P V is added. The reference (row_max) moves only where
    // the block's max passes it by more than params.rescale_slack (log2 units; 0: wherever it
    // grows): P stays below 2^slack, and while no row of a warp moves, the warp skips O's
    // rescale (rescale_o: D / 2 multiplies per thread and block).
    float correction[kRows];
    bool rescale = false;  // warp-uniform: a row of the warp moved its reference
    float const rescale_slack = params.rescale_slack;
    auto softmax = [&](auto& tSrS, Block b) __attribute__((always_inline)) {
      Tensor S = make_tensor(tSrS.data(), acc_layout_rowcol(tSrS.layout()));
      int const n0 = b.n * kBlockN;
      bool cut = false, scaled = false;
      if constexpr (kMasked) {
        // full tiles: no masking at all (the classification folded the key tail and the cut in)
        if (b.cls != kTileFull) {
          mask_scores(S, b.n, b.cls);
          scaled = b.cls != kTilePartialBits;  // the element path adds the bias in the log2 domain
        }
      } else {
        cut = n0 + kBlockN > seqlen_k || (is_causal && n0 + kBlockN - 1 > m0);
      }
      // One branch per block, not per score: tested inside the loops, `cut` became a branch
      // around every score's test (64 per block and thread at d128, most of the kernel's
      // branches, each taken jump a fetch bubble).
      if (!scaled && cut) {
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < kRows; ++r) {
          int const row = m0 + get<0>(cS(r, 0));
          CUTLASS_PRAGMA_UNROLL
          for (int c = 0; c < size<1>(S); ++c) {
            int const col = n0 + get<1>(cS(r, c));
            if (col >= seqlen_k || (is_causal && col > row)) { S(r, c) = -INFINITY; }
          }
        }
      }
      // S's factor into the log2 domain, folded into the exponent's FFMA: the max of S times
      // a factor > 0 (the host makes scale > 0: sdpa_forward_cuda) is the factor times S's max
      float const mul = scaled ? 1.f : scale_log2;
      bool moved = false;
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows; ++r) {
        float mx = -INFINITY;
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < size<1>(S); ++c) { mx = fmaxf(mx, S(r, c)); }
        float const block_max = quad_max(mx) * mul;
        // (an unset reference, -inf, moves to any finite max)
        bool const moves = block_max > row_max[r] + rescale_slack;
        moved |= moves;
        float const new_max = moves ? block_max : row_max[r];
        // a row that has seen no visible key yet keeps exp2(-inf - 0) = 0 everywhere
        float const m_use = new_max == -INFINITY ? 0.f : new_max;
        correction[r] = moves ? exp2_ftz(row_max[r] - m_use) : 1.f;
        row_max[r] = new_max;
        float sum = 0.f;
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < size<1>(S); ++c) {
          float const p = exp2_ftz(fmaf(S(r, c), mul, -m_use));
          S(r, c) = p;
          sum += p;
        }
        row_sum[r] = row_sum[r] * correction[r] + sum;
      }
      rescale = __any_sync(0xffffffffu, moved);
    };
    auto rescale_o = [&]() __attribute__((always_inline)) {
      if (!rescale) { return; }
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows; ++r) {
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < size<1>(O); ++c) { O(r, c) *= correction[r]; }
      }
    };
    // The stage a wgmma reads. kMasked: the walk's steps depend on loaded classes and ranges, so
    // ptxas kept the pipeline state in per-thread registers and built every wgmma descriptor
    // there (an R2UR per descriptor word, 48 per key block at d128); the stage through REDUX is a
    // uniform register, from which the descriptors are uniform adds (18). The loop is shorter;
    // its time measured level (docs/FORWARD.md).
    auto stage_of = [](PipelineState const& st) __attribute__((always_inline)) {
      if constexpr (kMasked) { return int(__reduce_or_sync(0xffffffffu, unsigned(st.index()))); }
      return int(st.index());
    };
    auto gemm_s = [&](auto& tSrS, auto wait) __attribute__((always_inline)) {
      pipeline_k.consumer_wait(read_k);
      wg_gemm<true, decltype(wait)::value>(tiled_mma_s, tSrQ, tSrK(_, _, _, stage_of(read_k)), tSrS);
    };
    auto release_k = [&]() __attribute__((always_inline)) {
      pipeline_k.consumer_release(read_k);
      ++read_k;
    };
    auto gemm_pv = [&](auto& rP, auto wait) __attribute__((always_inline)) {
      Tensor tOrP = make_tensor(rP.data(), acc_layout_as_A_operand(rP.layout()));
      pipeline_v.consumer_wait(read_v);
      wg_gemm<false, decltype(wait)::value>(tiled_mma_o, tOrP, tOrV(_, _, _, stage_of(read_v)), tOrO);
    };
    auto release_v = [&]() __attribute__((always_inline)) {
      pipeline_v.consumer_release(read_v);
      ++read_v;
    };

    if constexpr (!kOverlap) {
      // each block in turn: S, softmax, P V
      CUTLASS_PRAGMA_NO_UNROLL
      for (Block b = first; b.n >= 0; b = next_block(classes, b.n - 1, n_lo)) {
        Tensor tSrS = partition_fragment_C(tiled_mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
        gemm_s(tSrS, cute::Int<0>{});
        release_k();
        softmax(tSrS, b);
        rescale_o();
        Tensor rP = make_tensor_like<Element>(tSrS);
        convert_fragment(tSrS, rP);
        gemm_pv(rP, cute::Int<0>{});
        release_v();
      }
      release_q();
    } else {
      // Within the warpgroup, block n's softmax runs while the tensor cores add the previous
      // block's P V: S_n and P_{n+1} V_{n+1} are issued back to back, the wait for S_n leaves
      // P V in flight, and O is rescaled only after it completes.
      // (kMasked: a query block without a non-empty tile has nothing to compute)
      if (!kMasked || first.n >= 0) {
        Tensor tSrS = partition_fragment_C(tiled_mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
        Tensor rP = make_tensor_like<Element>(tSrS);
        load_bits(first);
        gemm_s(tSrS, cute::Int<0>{});
        release_k();
        softmax(tSrS, first);  // (O is zero: nothing to rescale)
        convert_fragment(tSrS, rP);
        CUTLASS_PRAGMA_NO_UNROLL
        for (Block b = next_block(classes, first.n - 1, n_lo); b.n >= 0; b = next_block(classes, b.n - 1, n_lo)) {
          load_bits(b);
          gemm_s(tSrS, cute::Int<-1>{});
          gemm_pv(rP, cute::Int<-1>{});
          warpgroup_wait<1>();  // S_n is complete; P V may still run
          warpgroup_fence_operand(tSrS);
          release_k();
          softmax(tSrS, b);
          // The wait for P V in each arm of the branch on `rescale` (the softmax's last result):
          // ptxas moves a wgmma wait to the top of its basic block, and in the softmax's block
          // it ran the whole softmax after P V instead of beside it.
          if (rescale) {
            warpgroup_wait<0>();  // P V is complete: O and rP are free
            warpgroup_fence_operand(tOrO);
            rescale_o();
          } else {
            warpgroup_wait<0>();
            warpgroup_fence_operand(tOrO);
          }
          release_v();
          convert_fragment(tSrS, rP);
        }
        release_q();
        gemm_pv(rP, cute::Int<0>{});
        release_v();
      }
      if (kMasked && first.n < 0) { release_q(); }
    }

    // ---- epilogue: O / rowsum and lse, from registers ----
    Tensor tOcO = thr_o.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    Tensor cO = make_tensor(tOcO.data(), acc_layout_rowcol(tOcO.layout()));
    Element* out = params.out + bidb * params.out_batch_stride + bidh * params.out_head_stride;
    float* lse = params.lse + bidb * params.lse_batch_stride + bidh * params.lse_head_stride;
    bool const lse_writer = (thread_idx % 4) == 0;
    constexpr float kLn2 = 0.6931471805599453f;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float const sum = quad_sum(row_sum[r]);
      float const inv = sum > 0.f ? 1.f / sum : 0.f;
      int const row = m0 + get<0>(cO(r, 0));
      if (row < params.seqlen_q) {
        Element* out_row = out + int64_t(row) * params.out_row_stride;
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < size<1>(O); c += 2) {
          int const col = get<1>(cO(r, c));  // even: columns c, c + 1 are adjacent
          cutlass::Array<Element, 2> pair;
          pair[0] = static_cast<Element>(O(r, c) * inv);
          pair[1] = static_cast<Element>(O(r, c + 1) * inv);
          *reinterpret_cast<cutlass::Array<Element, 2>*>(out_row + col) = pair;
        }
        if (lse_writer) {
          lse[row] = sum > 0.f ? (row_max[r] + __log2f(sum)) * kLn2 : -INFINITY;
        }
      }
    }
  }

  // kMasked with block_elements: none of the query blocks is this kernel's (every thread reads
  // the same count: the whole CTA returns or none of it).
  CUTE_DEVICE static bool no_tile_here(Params const& params) {
    if constexpr (kMasked) {
      if (params.block_elements != nullptr) {
        int const count = *params.element_count;
        return kReadsMaskElements ? count == 0 : count == params.mask_batch * params.mask_heads * params.num_m_tiles;
      }
    }
    return false;
  }

  CUTE_DEVICE void operator()(Params const& params, char* smem_buf) {
    if (no_tile_here(params)) { return; }
    SharedStorage& ss = *reinterpret_cast<SharedStorage*>(smem_buf);
    int const warp_idx = cutlass::canonical_warp_idx_sync();
    int const warp_group_idx = cutlass::canonical_warp_group_idx();

    if (warp_idx == 0 && cute::elect_one_sync()) {
      cute::prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
      cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
      cute::prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
      ss.barrier_q.init(1);
      ss.barrier_q_empty.init(kNumMmaThreads);
    }
    using Category = typename PipelineKV::ThreadCategory;
    typename PipelineKV::Params pp;
    pp.role = warp_group_idx == 0 ? Category::Producer : Category::Consumer;
    pp.is_leader = threadIdx.x == 0;
    pp.num_consumers = kNumMmaThreads;
    pp.transaction_bytes = kTmaBytesKV;
    PipelineKV pipeline_k(ss.pipeline_k, pp, Shape<_1, _1, _1>{});
    PipelineKV pipeline_v(ss.pipeline_v, pp, Shape<_1, _1, _1>{});
    __syncthreads();  // barrier initialization visible to all

    // Both roles walk the same tiles (cta_tile, tile_at, runs_tile); iter counts the ones run.
    int const tiles = num_tiles(params);
    if (warp_group_idx == 0) {
      cutlass::arch::warpgroup_reg_dealloc<kLoadRegs>();
      if (warp_idx == 0 && cute::elect_one_sync()) {
        PipelineState write_k = cutlass::make_producer_start_state<PipelineKV>();
        PipelineState write_v = cutlass::make_producer_start_state<PipelineKV>();
        int iter = 0;
        CUTLASS_PRAGMA_NO_UNROLL
        for (int k = 0, t = cta_tile(0); t < tiles; t = cta_tile(++k)) {
          Tile const tile = tile_at(params, t);
          if (!runs_tile(params, tile)) { continue; }
          load(params, ss, pipeline_k, pipeline_v, write_k, write_v, iter++, tile.m_block, tile.bidh, tile.bidb,
               key_blocks(params, tile));
        }
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<kMmaRegs>();
      int const thread_idx = int(threadIdx.x) - cutlass::NumThreadsPerWarpGroup;
      PipelineState read_k, read_v;
      int iter = 0;
      CUTLASS_PRAGMA_NO_UNROLL
      for (int k = 0, t = cta_tile(0); t < tiles; t = cta_tile(++k)) {
        Tile const tile = tile_at(params, t);
        if (!runs_tile(params, tile)) { continue; }
        mma(params, ss, pipeline_k, pipeline_v, read_k, read_v, iter++, thread_idx, tile.m_block, tile.bidh,
            tile.bidb, key_blocks(params, tile));
      }
    }
  }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kNumThreads, 1)
    fwd_main_kernel(CUTE_GRID_CONSTANT typename Kernel::Params const params) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(1024) char smem_buf[];
  Kernel{}(params, smem_buf);
#endif
}

}  // namespace kernel
}  // namespace sm90_sdpa
