// Development-only shim: a torch-free shared library exposing run_bwd_main through a C ABI,
// so the kernel can be tested from Python (ctypes) before / independently of the extension.
// Not part of the product build. Build: csrc/kernel/dev/build_dev.sh "-DDEV_D128 [-DDEV_D64 ...]"
// (-DDEV_NO_FP16: bf16 only). Used by dev_test.py / gpu_run.sh / gpu_bench.sh.
#include <cstdio>
#include <cstring>
#include <exception>

#include "bwd_main_launch_template.h"

using namespace sm90_sdpa;

#ifdef DEV_NO_FP16
#define INSTANTIATE(D) template void sm90_sdpa::run_bwd_main<DType::kBFloat16, D>(const BwdParams&, cudaStream_t);
#else
#define INSTANTIATE(D)                                                                       \
  template void sm90_sdpa::run_bwd_main<DType::kBFloat16, D>(const BwdParams&, cudaStream_t); \
  template void sm90_sdpa::run_bwd_main<DType::kFloat16, D>(const BwdParams&, cudaStream_t);
#endif

#ifdef DEV_D64
INSTANTIATE(64)
#endif
#ifdef DEV_D96
INSTANTIATE(96)
#endif
#ifdef DEV_D128
INSTANTIATE(128)
#endif
#ifdef DEV_D192
INSTANTIATE(192)
#endif
#ifdef DEV_D256
INSTANTIATE(256)
#endif

template <DType T>
static bool dispatch_d(const BwdParams& p, cudaStream_t s) {
  switch (p.head_dim) {
#ifdef DEV_D64
    case 64: run_bwd_main<T, 64>(p, s); return true;
#endif
#ifdef DEV_D96
    case 96: run_bwd_main<T, 96>(p, s); return true;
#endif
#ifdef DEV_D128
    case 128: run_bwd_main<T, 128>(p, s); return true;
#endif
#ifdef DEV_D192
    case 192: run_bwd_main<T, 192>(p, s); return true;
#endif
#ifdef DEV_D256
    case 256: run_bwd_main<T, 256>(p, s); return true;
#endif
    default: return false;
  }
}

// ptrs: q k v out dout lse dsum lse_log2 dq_accum dk_accum dv_accum dq dk dv (14)
// strides (batch, head, row) for: q k v out dout dq dk dv (24)
extern "C" int sm90_dev_bwd_main(int dtype, int batch, int heads_q, int heads_kv, int seqlen_q, int seqlen_k,
                                 int head_dim, float scale, int is_causal, int deterministic,
                                 const long long* ptrs, const long long* strides, void* stream, char* err,
                                 int errlen) {
  BwdParams p;
  p.batch = batch;
  p.heads_q = heads_q;
  p.heads_kv = heads_kv;
  p.seqlen_q = seqlen_q;
  p.seqlen_k = seqlen_k;
  p.head_dim = head_dim;
  p.head_dim_v = head_dim;
  p.seqlen_q_rounded = round_up_seq(seqlen_q);
  p.seqlen_k_rounded = round_up_seq(seqlen_k);
  p.dtype = dtype == 0 ? DType::kFloat16 : DType::kBFloat16;
  p.scale = scale;
  p.scale_log2 = scale * 1.4426950408889634f;
  p.is_causal = is_causal != 0;
  p.deterministic = deterministic != 0;
  auto P = [&](int i) { return reinterpret_cast<void*>(static_cast<uintptr_t>(ptrs[i])); };
  p.q = P(0); p.k = P(1); p.v = P(2); p.out = P(3); p.dout = P(4);
  p.lse = static_cast<const float*>(P(5));
  p.dsum = static_cast<float*>(P(6));
  p.lse_log2 = static_cast<float*>(P(7));
  p.dq_accum = static_cast<float*>(P(8));
  p.dk_accum = static_cast<float*>(P(9));
  p.dv_accum = static_cast<float*>(P(10));
  p.dq = P(11); p.dk = P(12); p.dv = P(13);
  const long long* s = strides;
  p.q_batch_stride = s[0]; p.q_head_stride = s[1]; p.q_row_stride = s[2];
  p.k_batch_stride = s[3]; p.k_head_stride = s[4]; p.k_row_stride = s[5];
  p.v_batch_stride = s[6]; p.v_head_stride = s[7]; p.v_row_stride = s[8];
  p.out_batch_stride = s[9]; p.out_head_stride = s[10]; p.out_row_stride = s[11];
  p.dout_batch_stride = s[12]; p.dout_head_stride = s[13]; p.dout_row_stride = s[14];
  p.dq_batch_stride = s[15]; p.dq_head_stride = s[16]; p.dq_row_stride = s[17];
  p.dk_batch_stride = s[18]; p.dk_head_stride = s[19]; p.dk_row_stride = s[20];
  p.dv_batch_stride = s[21]; p.dv_head_stride = s[22]; p.dv_row_stride = s[23];
  p.num_sms = 132;
  try {
#ifdef DEV_NO_FP16
    bool ok = p.dtype == DType::kBFloat16 && dispatch_d<DType::kBFloat16>(p, static_cast<cudaStream_t>(stream));
#else
    bool ok = p.dtype == DType::kFloat16 ? dispatch_d<DType::kFloat16>(p, static_cast<cudaStream_t>(stream))
                                         : dispatch_d<DType::kBFloat16>(p, static_cast<cudaStream_t>(stream));
#endif
    if (!ok) {
      snprintf(err, errlen, "head_dim %d not compiled in the dev shim", head_dim);
      return 2;
    }
  } catch (std::invalid_argument const& e) {
    snprintf(err, errlen, "%s", e.what());
    return 3;
  } catch (std::exception const& e) {
    snprintf(err, errlen, "%s", e.what());
    return 1;
  }
  return 0;
}
