// Declaration of the main SM90 backward kernel's launcher, one explicit instantiation per
// (dtype, head dim) in a generated file csrc/instantiations/bwd_main_<dtype>_hdim<D>.cu (its
// masked kernel in bwd_main_<dtype>_hdim<D>_masked.cu, a full-tile kernel in
// bwd_main_<dtype>_hdim<D>_full.cu); a (D, Dv) pair with Dv != D (TILES_DV) in
// bwd_main_<dtype>_hdim<D>x<Dv>[_masked].cu.
// The definition lives in bwd_main_launch_template.h.
#pragma once

#include <cuda_runtime.h>

#include "bwd_params.h"

namespace sm90_sdpa {

// Runs the main backward kernel only: expects the preprocess to have filled dpsum,
// lse_log2 and zeroed dq_accum (and dk_accum / dv_accum for GQA). Adds unscaled dQ
// into dq_accum. MHA (Hq == Hkv): writes dk (scaled by params.scale) and dv to the outputs.
// GQA: adds unscaled dK and dV into dk_accum / dv_accum; the postprocess converts them.
// kHeadDimV: v / out / dO's head dim (params.head_dim_v).
template <DType kDType, int kHeadDim, int kHeadDimV = kHeadDim>
void run_bwd_main(const BwdParams& params, cudaStream_t stream);

// One of run_bwd_main's kernels: with (kMasked) or without a mask, with the tile Cfg
// (kernel::DefaultBwdConfig<D> or kernel::FullBwdConfig<D>, or kernel::DefaultBwdConfigDv<D, Dv>,
// kernel/bwd_config.h).
template <DType kDType, int kHeadDim, bool kMasked, class Cfg>
void launch_bwd_main(const BwdParams& params, cudaStream_t stream);

}  // namespace sm90_sdpa
