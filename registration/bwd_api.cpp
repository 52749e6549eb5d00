// Checks, dispatch and launches behind torch_sm90_sdpa._C (see bwd_api.h).
#include "bwd_api.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "bwd_main_launch.h"
#include "bwd_params.h"
#include "instantiations/compiled_variants.h"
#include "prepost.h"

namespace sm90_sdpa {

// The explicit instantiations live in the generated csrc/instantiations/bwd_main_*.cu files.
#define TORCH_SM90_SDPA_EXTERN_VARIANT(ENUM, NAME, CODE, HDIM) \
  extern template void run_bwd_main<DType::ENUM, HDIM>(const BwdParams&, cudaStream_t);
TORCH_SM90_SDPA_FOR_EACH_VARIANT(TORCH_SM90_SDPA_EXTERN_VARIANT)
#undef TORCH_SM90_SDPA_EXTERN_VARIANT

namespace api {
namespace {

[[noreturn]] void fail_value(const std::string& msg) {
  throw std::invalid_argument("torch_sm90_sdpa: " + msg);
}
[[noreturn]] void fail_runtime(const std::string& msg) {
  throw std::runtime_error("torch_sm90_sdpa: " + msg);
}

std::string variant_name(int dtype, int head_dim) {
  std::ostringstream s;
  s << "(dtype=" << dtype_name(dtype) << ", head_dim=" << head_dim << ")";
  return s.str();
}

std::string compiled_list() {
  std::ostringstream s;
  s << "[";
  bool first = true;
  for (const auto& v : compiled_variants()) {
    s << (first ? "" : ", ") << dtype_name(v.first) << "/" << v.second;
    first = false;
  }
  s << "]";
  return s.str();
}

// ---- device -------------------------------------------------------------------------------

struct DeviceInfo {
  int major = 0, minor = 0, num_sms = 0;
  std::string name;
};

const DeviceInfo& current_device_info() {
  int dev = -1;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) {
    cudaGetLastError();
    fail_runtime(std::string("no usable CUDA device: ") + cudaGetErrorString(err));
  }
  static std::mutex mu;
  static std::unordered_map<int, DeviceInfo> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(dev);
  if (it != cache.end()) return it->second;
  cudaDeviceProp prop;
  err = cudaGetDeviceProperties(&prop, dev);
  if (err != cudaSuccess) {
    cudaGetLastError();
    fail_runtime(std::string("cudaGetDeviceProperties failed: ") + cudaGetErrorString(err));
  }
  DeviceInfo info;
  info.major = prop.major;
  info.minor = prop.minor;
  info.num_sms = prop.multiProcessorCount;
  info.name = prop.name;
  return cache.emplace(dev, info).first->second;
}

// The kernels are compiled for sm_90a only: they run on compute capability 9.0 and nowhere else.
void check_device(BwdParams& p) {
  const DeviceInfo& d = current_device_info();
  if (d.major != 9 || d.minor != 0) {
    int dev = -1;
    cudaGetDevice(&dev);
    std::ostringstream s;
    s << "the kernels are built for sm_90a and need a compute capability 9.0 GPU (Hopper); "
      << "current device " << dev << " (" << d.name << ") has compute capability " << d.major
      << "." << d.minor;
    fail_runtime(s.str());
  }
  p.num_sms = d.num_sms;
}

void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    fail_runtime(std::string(what) + " launch failed: " + cudaGetErrorName(err) + ": " +
                 cudaGetErrorString(err));
  }
}

// ---- parameters ---------------------------------------------------------------------------

void require_ptr(const void* ptr, const char* name, const char* what) {
  if (ptr == nullptr) fail_value(std::string(what) + ": params." + name + " is null");
}

void check_non_negative(const BwdParams& p, const char* what) {
  const int vals[] = {p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_k, p.head_dim,
                      p.head_dim_v};
  const char* names[] = {"batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k", "head_dim",
                         "head_dim_v"};
  for (int i = 0; i < 7; ++i) {
    if (vals[i] < 0) {
      std::ostringstream s;
      s << what << ": params." << names[i] << " = " << vals[i] << " is negative";
      fail_value(s.str());
    }
  }
}

// An empty problem (a zero size): the pre/post kernels have nothing to do.
bool is_empty(const BwdParams& p) {
  return p.batch == 0 || p.heads_q == 0 || p.heads_kv == 0 || p.seqlen_q == 0 ||
         p.seqlen_k == 0 || p.head_dim == 0 || p.head_dim_v == 0;
}

// What the main kernel's TMA loads / stores need: a 16-byte aligned base, and for every mode
// of more than one element a stride that is a positive multiple of 8 elements (16 bytes).
// (csrc/bwd_main_launch_template.h checks the same; checking here first keeps a bad call
// from launching the preprocess at all.)
void check_tma_operand(const void* ptr, int64_t sb, int nb, int64_t sh, int nh, int64_t sr,
                       int nr, const char* name, const char* what) {
  auto ok = [](int64_t stride, int n) { return n <= 1 || (stride > 0 && stride % 8 == 0); };
  if (reinterpret_cast<std::uintptr_t>(ptr) % 16 != 0 || !ok(sb, nb) || !ok(sh, nh) ||
      !ok(sr, nr)) {
    std::ostringstream s;
    s << what << ": " << name << " must have a 16-byte aligned base address and positive "
      << "batch/head/row strides that are multiples of 8 elements for the SM90 kernel (got "
      << "strides " << sb << ", " << sh << ", " << sr << "); pass a contiguous copy";
    fail_value(s.str());
  }
}

void check_sizes(const BwdParams& p, const char* what) {
  auto positive = [&](int v, const char* name) {
    if (v <= 0) {
      std::ostringstream s;
      s << what << ": params." << name << " = " << v
        << " must be positive (empty problems launch nothing and are handled by the caller)";
      fail_value(s.str());
    }
  };
  positive(p.batch, "batch");
  positive(p.heads_q, "heads_q");
  positive(p.heads_kv, "heads_kv");
  positive(p.seqlen_q, "seqlen_q");
  positive(p.seqlen_k, "seqlen_k");
  positive(p.head_dim, "head_dim");
  positive(p.head_dim_v, "head_dim_v");
  if (p.heads_q % p.heads_kv != 0) {
    std::ostringstream s;
    s << what << ": heads_q (" << p.heads_q << ") must be a multiple of heads_kv (" << p.heads_kv
      << ")";
    fail_value(s.str());
  }
  if (p.seqlen_q_rounded != round_up_seq(p.seqlen_q) ||
      p.seqlen_k_rounded != round_up_seq(p.seqlen_k)) {
    std::ostringstream s;
    s << what << ": seqlen_q_rounded / seqlen_k_rounded (" << p.seqlen_q_rounded << ", "
      << p.seqlen_k_rounded << ") must be seqlen_q / seqlen_k (" << p.seqlen_q << ", "
      << p.seqlen_k << ") rounded up to a multiple of " << kSeqRound;
    fail_value(s.str());
  }
  const int dt = static_cast<int>(p.dtype);
  if (dt != static_cast<int>(DType::kFloat16) && dt != static_cast<int>(DType::kBFloat16)) {
    fail_value(std::string(what) + ": params.dtype must be 0 (fp16) or 1 (bf16)");
  }
  if ((p.dk_accum == nullptr) != (p.dv_accum == nullptr)) {
    fail_value(std::string(what) + ": dk_accum and dv_accum must be both set or both null");
  }
}

void check_preprocess(const BwdParams& p, const char* what) {
  require_ptr(p.out, "out", what);
  require_ptr(p.dout, "dout", what);
  require_ptr(p.lse, "lse", what);
  require_ptr(p.dsum, "dsum", what);
  require_ptr(p.lse_log2, "lse_log2", what);
  require_ptr(p.dq_accum, "dq_accum", what);
}

void check_postprocess(const BwdParams& p, const char* what) {
  require_ptr(p.dq_accum, "dq_accum", what);
  require_ptr(p.dq, "dq", what);
  if (p.dk_accum != nullptr) {
    require_ptr(p.dk, "dk", what);
    require_ptr(p.dv, "dv", what);
  }
}

void launch_preprocess(const BwdParams& p, cudaStream_t stream) {
  run_bwd_preprocess(p, stream);
  check_launch("preprocess kernel");
}

void launch_postprocess(const BwdParams& p, cudaStream_t stream) {
  run_bwd_postprocess(p, stream);
  check_launch("postprocess kernel");
}

// static switch over the compiled variants only
bool dispatch_main(const BwdParams& p, cudaStream_t stream) {
  (void)p;
  (void)stream;
#define TORCH_SM90_SDPA_CASE(ENUM, NAME, CODE, HDIM)       \
  if (p.dtype == DType::ENUM && p.head_dim == HDIM) {     \
    run_bwd_main<DType::ENUM, HDIM>(p, stream);           \
    return true;                                          \
  }
  TORCH_SM90_SDPA_FOR_EACH_VARIANT(TORCH_SM90_SDPA_CASE)
#undef TORCH_SM90_SDPA_CASE
  return false;
}

}  // namespace

const char* dtype_name(int dtype) {
  switch (dtype) {
    case static_cast<int>(DType::kFloat16): return "fp16";
    case static_cast<int>(DType::kBFloat16): return "bf16";
    default: return "unknown";
  }
}

bool main_kernel_compiled() { return TORCH_SM90_SDPA_MAIN_KERNEL_COMPILED != 0; }

std::vector<std::pair<int, int>> compiled_variants() {
  std::vector<std::pair<int, int>> out;
#define TORCH_SM90_SDPA_LIST(ENUM, NAME, CODE, HDIM) out.emplace_back(CODE, HDIM);
  TORCH_SM90_SDPA_FOR_EACH_VARIANT(TORCH_SM90_SDPA_LIST)
#undef TORCH_SM90_SDPA_LIST
  return out;
}

bool has_variant(int head_dim, int dtype) {
#define TORCH_SM90_SDPA_HAS(ENUM, NAME, CODE, HDIM) \
  if (dtype == CODE && head_dim == HDIM) return true;
  TORCH_SM90_SDPA_FOR_EACH_VARIANT(TORCH_SM90_SDPA_HAS)
#undef TORCH_SM90_SDPA_HAS
  (void)head_dim;
  (void)dtype;
  return false;
}

void preprocess(BwdParams& p, cudaStream_t stream) {
  const char* what = "preprocess";
  check_non_negative(p, what);
  if (is_empty(p)) return;  // nothing to launch
  check_sizes(p, what);
  check_preprocess(p, what);
  check_device(p);
  cudaGetLastError();  // do not blame this launch for an earlier error
  launch_preprocess(p, stream);
}

void postprocess(BwdParams& p, cudaStream_t stream) {
  const char* what = "postprocess";
  check_non_negative(p, what);
  if (is_empty(p)) return;  // nothing to launch
  check_sizes(p, what);
  check_postprocess(p, what);
  check_device(p);
  cudaGetLastError();
  launch_postprocess(p, stream);
}

void backward(BwdParams& p, cudaStream_t stream) {
  const char* what = "backward";
  check_sizes(p, what);
  require_ptr(p.q, "q", what);
  require_ptr(p.k, "k", what);
  require_ptr(p.v, "v", what);
  check_preprocess(p, what);
  require_ptr(p.dq, "dq", what);
  require_ptr(p.dk, "dk", what);
  require_ptr(p.dv, "dv", what);
  if (p.head_dim_v != p.head_dim) {
    std::ostringstream s;
    s << what << ": the SM90 kernel needs head_dim_v == head_dim (got " << p.head_dim_v
      << " and " << p.head_dim << ")";
    fail_value(s.str());
  }
  const bool gqa = p.heads_q != p.heads_kv;
  if (gqa && p.dk_accum == nullptr) {
    fail_value(std::string(what) +
               ": GQA (heads_q != heads_kv) needs the fp32 workspaces dk_accum and dv_accum");
  }
  if (!gqa && p.dk_accum != nullptr) {
    fail_value(std::string(what) +
               ": dk_accum / dv_accum must be null when heads_q == heads_kv (the main kernel "
               "writes dk and dv directly)");
  }
  const int B = p.batch, Hq = p.heads_q, Hkv = p.heads_kv, Sq = p.seqlen_q, Sk = p.seqlen_k;
  check_tma_operand(p.q, p.q_batch_stride, B, p.q_head_stride, Hq, p.q_row_stride, Sq, "q", what);
  check_tma_operand(p.k, p.k_batch_stride, B, p.k_head_stride, Hkv, p.k_row_stride, Sk, "k",
                    what);
  check_tma_operand(p.v, p.v_batch_stride, B, p.v_head_stride, Hkv, p.v_row_stride, Sk, "v",
                    what);
  check_tma_operand(p.dout, p.dout_batch_stride, B, p.dout_head_stride, Hq, p.dout_row_stride,
                    Sq, "dout", what);
  if (!gqa) {  // the main kernel writes dk and dv itself
    check_tma_operand(p.dk, p.dk_batch_stride, B, p.dk_head_stride, Hkv, p.dk_row_stride, Sk,
                      "dk", what);
    check_tma_operand(p.dv, p.dv_batch_stride, B, p.dv_head_stride, Hkv, p.dv_row_stride, Sk,
                      "dv", what);
  }
  const int dt = static_cast<int>(p.dtype);
  if (!main_kernel_compiled()) {
    fail_runtime("the main backward kernel is not compiled into this build of "
                 "torch_sm90_sdpa._C (pre/post kernels only); cannot run variant " +
                 variant_name(dt, p.head_dim));
  }
  if (!has_variant(p.head_dim, dt)) {
    fail_runtime("backward variant " + variant_name(dt, p.head_dim) +
                 " is not compiled into torch_sm90_sdpa._C; compiled variants: " +
                 compiled_list() + " (see TORCH_SM90_SDPA_HEAD_DIMS / TORCH_SM90_SDPA_DTYPES)");
  }
  check_device(p);
  cudaGetLastError();
  launch_preprocess(p, stream);
  dispatch_main(p, stream);
  check_launch("main backward kernel");
  // GQA: dq, dk and dv from the accumulators; MHA (dk_accum is null): dq only, the main
  // kernel wrote dk and dv itself
  launch_postprocess(p, stream);
}

}  // namespace api
}  // namespace sm90_sdpa
