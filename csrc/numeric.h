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

// A row's lse_log2 (what the main kernel subtracts): lse * log2(e). A row that sees no key
// (its whole mask row masked) has lse = -inf: +inf gives P = exp2(s - inf) = 0 there instead
// of NaN, so its gradients are 0 (as stock's). The preprocess writes it; the score-bound CTAs
// of the same launch compute it again from lse (mask_bounds.h) and must agree.
__device__ __forceinline__ float lse_log2_of(float lse) {
  const float l2 = lse * kLog2e;
  return l2 == -INFINITY ? INFINITY : l2;
}

}  // namespace sm90_sdpa
