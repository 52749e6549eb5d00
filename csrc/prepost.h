// The preprocess and postprocess kernels of the attention backward (csrc/prepost.cu).
// Both read everything from BwdParams; no torch types. They only launch: the caller checks
// the parameters beforehand and cudaGetLastError() afterwards.
#pragma once

#include <cuda_runtime.h>

#include "bwd_params.h"

namespace sm90_sdpa {

// For every (b, h, row) of the q side, row < seqlen_q_rounded:
//   row < Sq:  dpsum[b,h,row] = sum_d float(dout[b,h,row,d]) * float(out[b,h,row,d])  (fp32)
//              lse_log2[b,h,row] = lse[b,h,row] * log2(e)   (lse read through its strides;
//              +inf where lse = -inf: a row that sees no key)
//   padding:   dpsum = 0, lse_log2 = +inf
// and zeroes dq_accum [B, Hq, Sq_rounded, D] entirely; when dk_accum / dv_accum are non-null,
// zeroes them as well ([B, Hkv, Sk_rounded, D] and [B, Hkv, Sk_rounded, Dv]).
// With an additive mask (mask_kind fp16 / bf16 / fp32 and the score-bound arrays set), the same
// launch also writes the shares of the score bounds into bounds_partial (extra CTAs,
// mask_bounds.h; the classification folds them): they read q and k (+ strides) and lse.
// Reads: batch, heads_q, heads_kv, seqlen_q(_rounded), seqlen_k_rounded, head_dim(_v), dtype,
// out, dout, lse (+ strides), dpsum, lse_log2, dq_accum, dk_accum, dv_accum, num_sms (0: a
// default), and for the bounds the mask fields.
// Launches nothing when the work is empty (batch, heads or rows 0).
void run_bwd_preprocess(const BwdParams& params, cudaStream_t stream);

// dq[b,h,s,:] = scale * dq_accum[b,h,s,:] converted to params.dtype, for s < Sq, through the
// dq strides; with dq_accum_permuted, dq[b,h,s,c] reads dq_accum[b,h,s,c ^ ((s & 3) << 3)]
// (head_dim % 32 == 0). When dk_accum is non-null (GQA) also
//   dk[b,h,s,:] = scale * dk_accum[b,h,s,:]  and  dv[b,h,s,:] = dv_accum[b,h,s,:]  (s < Sk).
// One launch for all of them. Launches nothing when the work is empty.
void run_bwd_postprocess(const BwdParams& params, cudaStream_t stream);

}  // namespace sm90_sdpa
