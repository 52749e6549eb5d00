// Host entry points of torch_sm90_sdpa._C, free of pybind11 and torch: check a BwdParams,
// pick the compiled instantiation and launch on a stream. Errors are thrown as
// std::invalid_argument (bad parameters; Python ValueError) or std::runtime_error
// (unsupported device, variant not compiled, CUDA errors; Python RuntimeError).
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <utility>
#include <vector>

#include "bwd_params.h"

namespace sm90_sdpa {
namespace api {

// Each of these checks the fields it reads, checks the current CUDA device (compute
// capability 9.0), sets params.num_sms from it, launches on `stream` and checks
// cudaGetLastError() after each launch. preprocess / postprocess of an empty problem (a size
// of 0) return at once without launching or touching the device; backward refuses it (the
// caller zero-fills the outputs of empty problems).
void preprocess(BwdParams& params, cudaStream_t stream);
// dq always; dk / dv from dk_accum / dv_accum when dk_accum is non-null.
void postprocess(BwdParams& params, cudaStream_t stream);
// preprocess + run_bwd_main<dtype, head_dim> + postprocess.
void backward(BwdParams& params, cudaStream_t stream);

bool main_kernel_compiled();
// (dtype code, head dim) pairs compiled into this module
std::vector<std::pair<int, int>> compiled_variants();
bool has_variant(int head_dim, int dtype);
const char* dtype_name(int dtype);  // "fp16", "bf16" or "unknown"

}  // namespace api
}  // namespace sm90_sdpa
