// Element conversions and constants shared by the small CUDA kernels (prepost.cu,
// mask_classify.cu) and the main kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

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

// A finite additive-mask entry x is the clamped fill when x * log2(e) <= -FLT_MAX (the
// minimum of bf16 or fp32, as transformers fills its masks): the forward clamps its term to
// -FLT_MAX, so every score vanishes next to it. The largest log2-domain threshold below which
// such a product lies: the float next to -FLT_MAX.
constexpr float kFillDeadBelow = -3.4028232635611926e38f;

// A fill row sees no key but the clamped fill (FillRows): SDPA gives it uniform weights over
// the fill's n keys, which its lse (the fill plus log(n), rounded to the fill) cannot say. The
// backward's classification writes such a row's lse_log2 as a negative NaN carrying n (at most
// kFillRowMaxKeys); arithmetic never makes that NaN (the GPU's NaN results are 0x7FFFFFFF), and
// the main kernel gives the row P = 1 / n on its fill keys (bwd_mainloop.h).
constexpr uint32_t kFillRowTag = 0xFFC00000u;
constexpr uint32_t kFillRowMaxKeys = 0x3FFFFFu;
__device__ __forceinline__ float fill_row_lse_log2(uint32_t n) {
  return __uint_as_float(kFillRowTag | (n < kFillRowMaxKeys ? n : kFillRowMaxKeys));
}
__device__ __forceinline__ bool is_fill_row(float lse_log2) {
  return __float_as_uint(lse_log2) > kFillRowTag;  // (n >= 1)
}
// P of a fill key in a fill row
__device__ __forceinline__ float fill_row_weight(float lse_log2) {
  return 1.f / float(__float_as_uint(lse_log2) & kFillRowMaxKeys);
}

}  // namespace sm90_sdpa
