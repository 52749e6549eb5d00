// Programmatic dependent launch (PDL, sm90) between the kernels of one backward call.
//
// The backward runs its kernels back to back on one stream: preprocess -> [mask
// classification] -> main -> postprocess. The main and postprocess kernels are launched with
// cudaLaunchAttributeProgrammaticStreamSerialization when BwdParams::programmatic_launch is set
// (TORCH_SM90_SDPA_PDL=1; off by default: tested on the H200, it measured 0.9-1.4% faster
// back to back only), so a kernel's CTAs may start while the kernel before it drains: the main
// kernel's prologue and its K / V loads overlap the preprocess's tail, and the postprocess's
// launch overlaps the main kernel's last wave. Each thread that reads anything the kernel
// before wrote first calls wait_for_prior_grid(), which returns once that kernel has completed
// and its writes are visible. The earlier kernels' CTAs are all resident before a dependent
// CTA starts (a CTA signals at its start, allow_dependent_grids()), so a waiting CTA never
// holds an SM that a CTA it waits on needs.
// Launched without the attribute, both instructions are no-ops.
// Invariant: the preprocess is launched plainly, so it starts only once everything before it
// in the stream (the kernels that wrote q, k, v, out, dout) has completed. That is what lets
// the main kernel read its inputs (K, V) before waiting; launching the preprocess
// programmatically too would break it.
#pragma once

#include <cuda_runtime.h>

namespace sm90_sdpa {

__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependent_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Launches kernel<<<grid, block, smem, stream>>>(args...), with programmatic stream
// serialization when `programmatic`. Returns the launch's error (the caller checks it).
template <class... Params, class... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                          cudaStream_t stream, bool programmatic, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = programmatic ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, static_cast<Args&&>(args)...);
}

}  // namespace sm90_sdpa
