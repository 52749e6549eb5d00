// The device layer of the attention forward: which forward kernels were compiled, and running
// one. Free of torch and pybind11. The caller (torch_sm90_sdpa/_cuda_backend.py,
// forward_unserved) has checked the call: an SM90 device, fp16 / bf16, a compiled head dim with
// Dv == D, positive sizes, TMA-addressable q / k / v, out [B, Hq, Sq, D] with even strides and
// lse [B, Hq, Sq] fp32 with row stride 1; a mask as a [B, Hq, Sq, Sk] view with
// mask_workspace of fwd_mask_workspace_bytes (fwd_params.h).
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <utility>
#include <vector>

#include "fwd_params.h"

namespace sm90_sdpa {
namespace device {

// Whether the forward kernel for (head_dim, dtype code 0 fp16 / 1 bf16) is compiled.
bool has_fwd_variant(int head_dim, int dtype);
std::vector<std::pair<std::string, int>> compiled_fwd_variants();  // [(dtype name, head dim)]

// out and lse of the call (the kernel only: throws std::invalid_argument for a variant that was
// not compiled or sizes that are not positive).
void run_fwd(const FwdParams& params, cudaStream_t stream);

}  // namespace device
}  // namespace sm90_sdpa
