// Element conversions and constants shared by the small CUDA kernels (prepost.cu,
// mask_classify.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace sm90_sdpa {

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }

}  // namespace sm90_sdpa
