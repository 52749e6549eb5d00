// The one host/device interface of the attention forward: the forward kernel reads its inputs
// from this struct. Filled by the device layer (registration/fwd_device.cpp) from plain
// integers; no torch types cross this line.
#pragma once

#include <cstdint>

#include "bwd_params.h"  // DType

namespace sm90_sdpa {

struct FwdParams {
  // ---- problem size ----
  int batch = 0;
  int heads_q = 0;   // Hq
  int heads_kv = 0;  // Hkv; Hq % Hkv == 0
  int seqlen_q = 0;  // Sq
  int seqlen_k = 0;  // Sk
  int head_dim = 0;  // D, for q, k, v and out
  DType dtype = DType::kBFloat16;

  // ---- semantics ----
  float scale_log2 = 0.f;  // softmax scale * log2(e)
  bool is_causal = false;  // SDPA top-left alignment: key j visible to query i iff j <= i
  // the kernel whose softmax overlaps the previous key block's P V inside each warpgroup
  // (FwdKernel's kOverlap); set from TORCH_SM90_SDPA_FWD_OVERLAP=1 (_cuda_backend.py)
  bool overlap = false;

  // ---- inputs: [B, H, S, D] views, element strides, last dim contiguous ----
  const void* q = nullptr;  // [B, Hq, Sq, D]
  int64_t q_batch_stride = 0, q_head_stride = 0, q_row_stride = 0;
  const void* k = nullptr;  // [B, Hkv, Sk, D]
  int64_t k_batch_stride = 0, k_head_stride = 0, k_row_stride = 0;
  const void* v = nullptr;  // [B, Hkv, Sk, D]
  int64_t v_batch_stride = 0, v_head_stride = 0, v_row_stride = 0;

  // ---- outputs ----
  void* out = nullptr;  // [B, Hq, Sq, D], input dtype, even strides
  int64_t out_batch_stride = 0, out_head_stride = 0, out_row_stride = 0;
  // [B, Hq, Sq] fp32, row stride 1: the natural-log logsumexp of each row's scaled scores,
  // the layout the backward reads; -inf (and out 0) for a row that sees no key
  float* lse = nullptr;
  int64_t lse_batch_stride = 0, lse_head_stride = 0;
};

}  // namespace sm90_sdpa
