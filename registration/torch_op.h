// The C++ CUDA kernel of torch_sm90_sdpa::sdpa_backward, registered with torch's dispatcher
// through torch's stable C ABI (see torch_op.cpp). Free of torch headers.
#pragma once

#include <cstdint>
#include <string>

namespace sm90_sdpa {
namespace torch_op {

// Registers, once per process, the CUDA kernel of torch_sm90_sdpa::sdpa_backward (cuda_kernel)
// and the CPU kernel of the test op torch_sm90_sdpa::_stable_abi_probe (probe). The ops' schemas
// must be defined already (torch_sm90_sdpa/ops.py). libtorch_cpu / libtorch_cuda: paths of the
// libraries the running torch loaded (libtorch_cuda empty for a CPU-only torch). Returns "" on
// success, else why nothing (more) was registered; never throws.
std::string register_ops(const std::string& libtorch_cpu, const std::string& libtorch_cuda,
                         bool cuda_kernel, bool probe);

bool cuda_kernel_registered();

// Calls of the registered CUDA kernel in this process (served or empty; refused calls are not
// counted).
uint64_t cuda_calls();

}  // namespace torch_op
}  // namespace sm90_sdpa
