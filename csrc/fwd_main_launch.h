// Declaration of the SM90 forward kernel's launcher, one explicit instantiation per (dtype,
// head dim) in a generated file csrc/instantiations/fwd_main_<dtype>_hdim<D>.cu. The
// definition lives in fwd_main_launch_template.h.
#pragma once

#include <cuda_runtime.h>

#include "fwd_params.h"

namespace sm90_sdpa {

// out and lse of a served problem (registration/fwd_device.cpp checked it: positive sizes, no
// mask, this variant, TMA-addressable q / k / v).
template <DType kDType, int kHeadDim>
void run_fwd_main(const FwdParams& params, cudaStream_t stream);

}  // namespace sm90_sdpa
