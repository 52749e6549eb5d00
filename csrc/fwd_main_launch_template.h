// Definition of run_fwd_main<DType, D> (declared in fwd_main_launch.h) and of its launcher
// launch_fwd_main<DType, D, kOverlap> (FwdParams::overlap picks): builds the TMA
// descriptors and launches the SM90 forward kernel, one CTA per (query block, q head, batch).
// Included by the generated csrc/instantiations/fwd_main_<dtype>_hdim<D>.cu.
#pragma once

#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#endif

#include <cuda_runtime.h>

#include "fwd_main_launch.h"
#include "fwd_params.h"
#include "kernel/fwd_kernel.h"
#include "launch_utils.h"

namespace sm90_sdpa {

template <DType kDType, int kHeadDim, bool kOverlap>
void launch_fwd_main(const FwdParams& params, cudaStream_t stream) {
  using Element = typename detail::ElementOf<kDType>::type;
  using Kernel = kernel::FwdKernel<kernel::DefaultFwdConfig<kHeadDim>, Element, kOverlap>;
  FwdParams p = params;
  p.q_batch_stride = detail::tma_stride(p.q_batch_stride, p.batch);
  p.q_head_stride = detail::tma_stride(p.q_head_stride, p.heads_q);
  p.q_row_stride = detail::tma_stride(p.q_row_stride, p.seqlen_q);
  p.k_batch_stride = detail::tma_stride(p.k_batch_stride, p.batch);
  p.k_head_stride = detail::tma_stride(p.k_head_stride, p.heads_kv);
  p.k_row_stride = detail::tma_stride(p.k_row_stride, p.seqlen_k);
  p.v_batch_stride = detail::tma_stride(p.v_batch_stride, p.batch);
  p.v_head_stride = detail::tma_stride(p.v_head_stride, p.heads_kv);
  p.v_row_stride = detail::tma_stride(p.v_row_stride, p.seqlen_k);
  typename Kernel::Params kparams = Kernel::to_params(p);

  auto kernel_fn = kernel::fwd_main_kernel<Kernel>;
  int const smem_size = Kernel::kSharedStorageSize;
  detail::set_smem_attribute_once(kernel_fn, smem_size);
  dim3 const grid((p.seqlen_q + Kernel::kBlockM - 1) / Kernel::kBlockM, p.heads_q, p.batch);
  kernel_fn<<<grid, Kernel::kNumThreads, smem_size, stream>>>(kparams);
  detail::check_cuda(cudaGetLastError(), "forward kernel launch");
}

template <DType kDType, int kHeadDim>
void run_fwd_main(const FwdParams& params, cudaStream_t stream) {
  if (params.overlap) {
    launch_fwd_main<kDType, kHeadDim, true>(params, stream);
  } else {
    launch_fwd_main<kDType, kHeadDim, false>(params, stream);
  }
}

}  // namespace sm90_sdpa
