// The device layer of the attention forward: see fwd_device.h.
#include "fwd_device.h"

#include <stdexcept>
#include <string>

#include "fwd_main_launch.h"
#include "instantiations/variants.h"

namespace sm90_sdpa {
namespace device {

bool has_fwd_variant(int head_dim, int dtype) {
#define TORCH_SM90_SDPA_HAS(ENUM, NAME, CODE, HDIM) \
  if (dtype == CODE && head_dim == HDIM) return true;
  TORCH_SM90_SDPA_FOR_EACH_FWD_VARIANT(TORCH_SM90_SDPA_HAS)
#undef TORCH_SM90_SDPA_HAS
  (void)head_dim;
  (void)dtype;
  return false;
}

std::vector<std::pair<std::string, int>> compiled_fwd_variants() {
  std::vector<std::pair<std::string, int>> out;
#define TORCH_SM90_SDPA_LIST(ENUM, NAME, CODE, HDIM) out.emplace_back(NAME, HDIM);
  TORCH_SM90_SDPA_FOR_EACH_FWD_VARIANT(TORCH_SM90_SDPA_LIST)
#undef TORCH_SM90_SDPA_LIST
  return out;
}

void run_fwd(const FwdParams& p, cudaStream_t stream) {
  if (p.batch <= 0 || p.heads_q <= 0 || p.heads_kv <= 0 || p.seqlen_q <= 0 || p.seqlen_k <= 0 ||
      p.heads_q % p.heads_kv != 0) {
    throw std::invalid_argument("sm90_sdpa::run_fwd: sizes must be positive and Hq a multiple of Hkv");
  }
  if (p.mask_kind != MaskKind::kNone) {
    const int kind = static_cast<int>(p.mask_kind);
    if (kind < static_cast<int>(MaskKind::kBool) || kind > static_cast<int>(MaskKind::kFloat32)) {
      throw std::invalid_argument("sm90_sdpa::run_fwd: mask kind code " + std::to_string(kind) +
                                  " (expected 1 bool, 2 fp16, 3 bf16 or 4 fp32)");
    }
    if (p.mask == nullptr || p.mask_workspace == nullptr) {
      throw std::invalid_argument("sm90_sdpa::run_fwd: a mask needs its pointer and mask_workspace "
                                  "(fwd_mask_workspace_bytes bytes)");
    }
    if ((p.mask_batch != 1 && p.mask_batch != p.batch) || (p.mask_heads != 1 && p.mask_heads != p.heads_q) ||
        p.mask_batch > 65535 || p.mask_heads > 65535) {
      throw std::invalid_argument("sm90_sdpa::run_fwd: mask_batch / mask_heads must be 1 or B / Hq (at most 65535)");
    }
  }
  const int dtype = static_cast<int>(p.dtype);
#define TORCH_SM90_SDPA_RUN(ENUM, NAME, CODE, HDIM)  \
  if (dtype == CODE && p.head_dim == HDIM) {         \
    run_fwd_main<DType::ENUM, HDIM>(p, stream);      \
    return;                                          \
  }
  TORCH_SM90_SDPA_FOR_EACH_FWD_VARIANT(TORCH_SM90_SDPA_RUN)
#undef TORCH_SM90_SDPA_RUN
  throw std::invalid_argument("sm90_sdpa::run_fwd: no forward kernel for head dim " +
                              std::to_string(p.head_dim) + " and dtype code " + std::to_string(dtype));
}

}  // namespace device
}  // namespace sm90_sdpa
