// Host helpers shared by the main kernels' launchers (bwd_main_launch_template.h,
// fwd_main_launch_template.h): the CUTLASS element type of a DType, CUDA error checks, TMA
// strides, the dynamic shared-memory attribute.
#pragma once

#include <cuda_runtime.h>

#include <bitset>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>

#include <cutlass/numeric_types.h>

#include "bwd_params.h"

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

inline void check_cuda(cudaError_t err, char const* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("sm90_sdpa: ") + what + ": " + cudaGetErrorString(err));
  }
}

// The stride of a mode of one element is never stepped; TMA still wants a valid one.
inline int64_t tma_stride(int64_t stride, int64_t extent) { return extent <= 1 ? 8 : stride; }

// cudaFuncSetAttribute once per (kernel, device): the attribute is per device.
template <class KernelFn>
void set_smem_attribute_once(KernelFn kernel_fn, int smem_size) {
  static std::mutex mu;
  static std::bitset<64> done;
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  std::lock_guard<std::mutex> lock(mu);
  if (dev >= 0 && dev < 64 && done[dev]) { return; }
  check_cuda(cudaFuncSetAttribute(kernel_fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_size),
             "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  if (dev >= 0 && dev < 64) { done[dev] = true; }
}

}  // namespace detail
}  // namespace sm90_sdpa
