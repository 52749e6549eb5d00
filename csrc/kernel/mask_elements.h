// Reading an attention mask's elements where the kernels add it to the scores (fwd_kernel.h,
// bwd_mainloop.h): one dispatch on the mask's dtype for both.
#pragma once

#include <cmath>
#include <cstdint>

#include <cutlass/numeric_types.h>

#include "../bwd_params.h"  // MaskKind

namespace sm90_sdpa {
namespace kernel {

// Calls apply(element) once, where element(offset) -> float is the mask's value at that
// element offset in the log2 domain: 0 (attend) or -inf for a bool mask, bias_log2(value) for
// a float one. kHasNone: a kind that is none of bool / fp16 / bf16 / fp32 means no mask
// (element() is 0); without it (the forward, which runs this step only with a mask) any other
// kind is read as fp32.
template <bool kHasNone, class BiasLog2, class Apply>
CUTLASS_DEVICE void with_mask_elements(MaskKind kind, void const* mask, BiasLog2 bias_log2,
                                       Apply apply) {
  switch (kind) {
    case MaskKind::kBool: {
      auto m = static_cast<uint8_t const*>(mask);
      apply([&](int64_t o) { return m[o] ? 0.f : -INFINITY; });
      break;
    }
    case MaskKind::kFloat16: {
      auto m = static_cast<cutlass::half_t const*>(mask);
      apply([&](int64_t o) { return bias_log2(float(m[o])); });
      break;
    }
    case MaskKind::kBFloat16: {
      auto m = static_cast<cutlass::bfloat16_t const*>(mask);
      apply([&](int64_t o) { return bias_log2(float(m[o])); });
      break;
    }
    case MaskKind::kFloat32:
      if constexpr (kHasNone) {
        auto m = static_cast<float const*>(mask);
        apply([&](int64_t o) { return bias_log2(m[o]); });
        break;
      }
      [[fallthrough]];
    default:
      if constexpr (kHasNone) {
        apply([](int64_t) { return 0.f; });
      } else {
        auto m = static_cast<float const*>(mask);
        apply([&](int64_t o) { return bias_log2(m[o]); });
      }
      break;
  }
}

}  // namespace kernel
}  // namespace sm90_sdpa
