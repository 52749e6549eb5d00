// Definition of run_bwd_main<DType, D> (declared in bwd_main_launch.h): checks the call,
// builds the TMA descriptors and launches the SM90 main backward kernel. Included by the
// generated csrc/instantiations/bwd_main_<dtype>_hdim<D>.cu, one explicit instantiation each.
#pragma once

// 64xNx16 wgmma shapes with N not a power of two (e.g. 48 for head dim 96 split in two).
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#endif

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>

#include <cutlass/numeric_types.h>

#include "bwd_main_launch.h"
#include "bwd_params.h"
#include "kernel/bwd_config.h"
#include "kernel/bwd_kernel.h"

namespace sm90_sdpa {

namespace detail {

template <DType kDType>
struct ElementOf;
template <>
struct ElementOf<DType::kFloat16> {
  using type = cutlass::half_t;
};
template <>
struct ElementOf<DType::kBFloat16> {
  using type = cutlass::bfloat16_t;
};

inline void bwd_check(bool ok, std::string const& what) {
  if (!ok) { throw std::invalid_argument("sm90_sdpa::run_bwd_main: " + what); }
}

inline void bwd_check_cuda(cudaError_t err, char const* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("sm90_sdpa::run_bwd_main: ") + what + ": " + cudaGetErrorString(err));
  }
}

inline bool aligned16(void const* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// A stride of a mode of size > 1 must be a positive multiple of 8 elements (16 bytes) for TMA.
// Modes of size 1 are never stepped: their stride is replaced by a harmless valid one.
inline int64_t tma_stride(int64_t stride, int64_t extent, int64_t fallback, char const* name) {
  if (extent <= 1) { return fallback; }
  bwd_check(stride > 0 && stride % 8 == 0,
            std::string(name) + " must be a positive multiple of 8 elements (got " + std::to_string(stride) + ")");
  return stride;
}

// dK = dV = 0 for an empty query sequence (MHA writes the outputs directly).
template <class Element>
__global__ void zero_dkv_kernel(Element* dk, Element* dv, int seqlen_k, int heads, int head_dim,
                                int64_t k_row, int64_t k_head, int64_t k_batch, int64_t v_row,
                                int64_t v_head, int64_t v_batch, int64_t total) {
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    int64_t r = idx;
    int const d = static_cast<int>(r % head_dim);
    r /= head_dim;
    int const s = static_cast<int>(r % seqlen_k);
    r /= seqlen_k;
    int const h = static_cast<int>(r % heads);
    int64_t const b = r / heads;
    dk[b * k_batch + h * k_head + s * k_row + d] = Element(0.f);
    dv[b * v_batch + h * v_head + s * v_row + d] = Element(0.f);
  }
}

}  // namespace detail

template <DType kDType, int kHeadDim>
void run_bwd_main(const BwdParams& params, cudaStream_t stream) {
  using Element = typename detail::ElementOf<kDType>::type;
  using Cfg = kernel::DefaultBwdConfig<kHeadDim>;
  using Mainloop = kernel::BwdMainloop<Cfg, Element>;
  using Epilogue = kernel::BwdEpilogue<Cfg, Element, Mainloop>;
  using Scheduler = kernel::SingleTileScheduler;
  using Kernel = kernel::BwdKernel<Mainloop, Epilogue, Scheduler>;
  using detail::bwd_check;

  BwdParams p = params;
  bwd_check(p.dtype == kDType, "dtype does not match the instantiation");
  bwd_check(p.head_dim == kHeadDim && p.head_dim_v == kHeadDim,
            "head_dim / head_dim_v must both be " + std::to_string(kHeadDim));
  bwd_check(!p.deterministic, "deterministic mode is not implemented by the SM90 main kernel");
  bwd_check(p.batch >= 0 && p.heads_q >= 0 && p.heads_kv >= 0 && p.seqlen_q >= 0 && p.seqlen_k >= 0,
            "negative size");
  if (p.batch == 0 || p.heads_q == 0 || p.seqlen_k == 0) { return; }
  bwd_check(p.heads_kv > 0 && p.heads_q % p.heads_kv == 0, "heads_q must be a multiple of heads_kv");
  bool const gqa = p.heads_q != p.heads_kv;

  if (p.seqlen_q == 0) {
    if (!gqa) {
      int64_t const total = int64_t(p.batch) * p.heads_kv * p.seqlen_k * kHeadDim;
      int const blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 4096));
      detail::zero_dkv_kernel<Element><<<blocks, 256, 0, stream>>>(
          static_cast<Element*>(p.dk), static_cast<Element*>(p.dv), p.seqlen_k, p.heads_kv, kHeadDim,
          p.dk_row_stride, p.dk_head_stride, p.dk_batch_stride, p.dv_row_stride, p.dv_head_stride,
          p.dv_batch_stride, total);
      detail::bwd_check_cuda(cudaGetLastError(), "zero-fill launch");
    }
    return;
  }

  bwd_check(p.seqlen_q_rounded == round_up_seq(p.seqlen_q) && p.seqlen_k_rounded == round_up_seq(p.seqlen_k),
            "seqlen_*_rounded must be round_up_seq(seqlen_*)");
  bwd_check(p.q && p.k && p.v && p.dout && p.dsum && p.lse_log2 && p.dq_accum, "null input pointer");
  bwd_check(detail::aligned16(p.q) && detail::aligned16(p.k) && detail::aligned16(p.v) &&
                detail::aligned16(p.dout) && detail::aligned16(p.dsum) && detail::aligned16(p.lse_log2) &&
                detail::aligned16(p.dq_accum),
            "q, k, v, dout and the fp32 workspaces must be 16-byte aligned");
  if (gqa) {
    bwd_check(p.dk_accum && p.dv_accum && detail::aligned16(p.dk_accum) && detail::aligned16(p.dv_accum),
              "GQA needs 16-byte aligned dk_accum / dv_accum");
  } else {
    bwd_check(p.dk && p.dv && detail::aligned16(p.dk) && detail::aligned16(p.dv),
              "dk / dv must be non-null and 16-byte aligned");
  }

  // Strides of modes of size 1 are replaced; the rest must suit TMA.
  int64_t const fb = 8;
  p.q_row_stride = detail::tma_stride(p.q_row_stride, p.seqlen_q, fb, "q row stride");
  p.q_head_stride = detail::tma_stride(p.q_head_stride, p.heads_q, fb, "q head stride");
  p.q_batch_stride = detail::tma_stride(p.q_batch_stride, p.batch, fb, "q batch stride");
  p.dout_row_stride = detail::tma_stride(p.dout_row_stride, p.seqlen_q, fb, "dout row stride");
  p.dout_head_stride = detail::tma_stride(p.dout_head_stride, p.heads_q, fb, "dout head stride");
  p.dout_batch_stride = detail::tma_stride(p.dout_batch_stride, p.batch, fb, "dout batch stride");
  p.k_row_stride = detail::tma_stride(p.k_row_stride, p.seqlen_k, fb, "k row stride");
  p.k_head_stride = detail::tma_stride(p.k_head_stride, p.heads_kv, fb, "k head stride");
  p.k_batch_stride = detail::tma_stride(p.k_batch_stride, p.batch, fb, "k batch stride");
  p.v_row_stride = detail::tma_stride(p.v_row_stride, p.seqlen_k, fb, "v row stride");
  p.v_head_stride = detail::tma_stride(p.v_head_stride, p.heads_kv, fb, "v head stride");
  p.v_batch_stride = detail::tma_stride(p.v_batch_stride, p.batch, fb, "v batch stride");
  if (!gqa) {
    p.dk_row_stride = detail::tma_stride(p.dk_row_stride, p.seqlen_k, fb, "dk row stride");
    p.dk_head_stride = detail::tma_stride(p.dk_head_stride, p.heads_kv, fb, "dk head stride");
    p.dk_batch_stride = detail::tma_stride(p.dk_batch_stride, p.batch, fb, "dk batch stride");
    p.dv_row_stride = detail::tma_stride(p.dv_row_stride, p.seqlen_k, fb, "dv row stride");
    p.dv_head_stride = detail::tma_stride(p.dv_head_stride, p.heads_kv, fb, "dv head stride");
    p.dv_batch_stride = detail::tma_stride(p.dv_batch_stride, p.batch, fb, "dv batch stride");
  }

  // Heads per scheduling section: their Q and dO (and K/V) take about half of the L2.
  int l2_bytes = 50 << 20;
  {
    int dev = 0;
    if (cudaGetDevice(&dev) == cudaSuccess) {
      int v = 0;
      if (cudaDeviceGetAttribute(&v, cudaDevAttrL2CacheSize, dev) == cudaSuccess && v > 0) { l2_bytes = v; }
    }
  }
  int64_t const bytes_per_head =
      int64_t(kHeadDim) * sizeof(Element) * (2 * int64_t(p.seqlen_q) + 2 * int64_t(p.seqlen_k) * p.heads_kv / p.heads_q);
  int64_t const hps = std::max<int64_t>(1, (int64_t(l2_bytes) / 2) / std::max<int64_t>(bytes_per_head, 1));
  int const total_heads = p.heads_q * p.batch;
  typename Scheduler::Params sched{(p.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN, p.heads_q, p.batch,
                                   static_cast<int>(std::min<int64_t>(hps, total_heads)), p.is_causal};
  bwd_check(int64_t(sched.num_n_blocks) * sched.num_heads * sched.num_batch <= int64_t(INT_MAX),
            "too many tiles for one launch");

  typename Kernel::Params kparams{Mainloop::to_params(p), Epilogue::to_params(p), sched};

  auto kernel_fn = kernel::bwd_main_kernel<Kernel>;
  int const smem_size = Kernel::kSharedStorageSize;
  detail::bwd_check_cuda(
      cudaFuncSetAttribute(kernel_fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_size),
      "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  dim3 const grid = Scheduler::grid_shape(sched);
  kernel_fn<<<grid, Kernel::kNumThreads, smem_size, stream>>>(kparams);
  detail::bwd_check_cuda(cudaGetLastError(), "kernel launch");
}

}  // namespace sm90_sdpa
