// The device layer of the attention backward: see bwd_device.h.
#include "bwd_device.h"

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "bwd_main_launch.h"
#include "bwd_params.h"
#include "instantiations/variants.h"
#include "kernel/bwd_config.h"  // kFullTileMinQueries
#include "mask_classify.h"
#include "prepost.h"

namespace sm90_sdpa {

// The explicit instantiations live in the generated csrc/instantiations/bwd_main_*.cu files.
#define TORCH_SM90_SDPA_EXTERN_VARIANT(ENUM, NAME, CODE, HDIM) \
  extern template void run_bwd_main<DType::ENUM, HDIM>(const BwdParams&, cudaStream_t);
TORCH_SM90_SDPA_FOR_EACH_VARIANT(TORCH_SM90_SDPA_EXTERN_VARIANT)
#undef TORCH_SM90_SDPA_EXTERN_VARIANT
#define TORCH_SM90_SDPA_EXTERN_DV_VARIANT(ENUM, NAME, CODE, HDIM, HDIM_V) \
  extern template void run_bwd_main<DType::ENUM, HDIM, HDIM_V>(const BwdParams&, cudaStream_t);
TORCH_SM90_SDPA_FOR_EACH_DV_VARIANT(TORCH_SM90_SDPA_EXTERN_DV_VARIANT)
#undef TORCH_SM90_SDPA_EXTERN_DV_VARIANT

namespace device {

const char* const kReasonNotSm90 = "not an SM90 GPU";
const char* const kReasonDtype = "dtype";
const char* const kReasonDv = "Dv != D";
const char* const kReasonHeads = "Hq not a multiple of Hkv";
const char* const kReasonVariant = "head dim not compiled";
const char* const kReasonLastDim = "last dim not contiguous";
const char* const kReasonTooLarge = "sizes exceed the kernel's int32 indexing";
const char* const kReasonMaskDtype = "attn_mask dtype";

namespace {

[[noreturn]] void fail_value(const std::string& msg) {
  throw std::invalid_argument("torch_sm90_sdpa: " + msg);
}
[[noreturn]] void fail_runtime(const std::string& msg) {
  throw std::runtime_error("torch_sm90_sdpa: " + msg);
}

template <class... T>
std::string cat(const T&... parts) {
  std::ostringstream s;
  (s << ... << parts);
  return s.str();
}

int elem_bytes(int dtype) { return (dtype == 0 || dtype == 1) ? 2 : 0; }

std::string compiled_list() {
  std::ostringstream s;
  s << "[";
  bool first = true;
  for (const auto& v : compiled_variants()) {
    s << (first ? "" : ", ") << dtype_name(v.first) << "/" << v.second;
    first = false;
  }
  for (const auto& v : compiled_dv_variants()) {
    s << (first ? "" : ", ") << dtype_name(v.dtype) << "/" << v.head_dim << "x" << v.head_dim_v;
    first = false;
  }
  s << "]";
  return s.str();
}

Decision unsupported(const char* reason, std::string detail) {
  Decision d;
  d.verdict = Verdict::kUnsupported;
  d.reason = reason;
  d.detail = std::move(detail);
  return d;
}

// Each operand's [B, H, S] extents.
void extents(const BwdProblem& p, int op, int& b, int& h, int& s) {
  const bool q_side = op == kQ || op == kOut || op == kDout || op == kLse || op == kDq;
  b = p.batch;
  h = q_side ? p.heads_q : p.heads_kv;
  s = q_side ? p.seqlen_q : p.seqlen_k;
}

int64_t round_up(int64_t n, int64_t r) { return (n + r - 1) / r * r; }

// ---- compiled variants ----------------------------------------------------------------------

bool dispatch_main(const BwdParams& p, cudaStream_t stream) {
  (void)p;
  (void)stream;
#define TORCH_SM90_SDPA_CASE(ENUM, NAME, CODE, HDIM)                              \
  if (p.dtype == DType::ENUM && p.head_dim == HDIM && p.head_dim_v == HDIM) { \
    run_bwd_main<DType::ENUM, HDIM>(p, stream);                                  \
    return true;                                                                 \
  }
  TORCH_SM90_SDPA_FOR_EACH_VARIANT(TORCH_SM90_SDPA_CASE)
#undef TORCH_SM90_SDPA_CASE
#define TORCH_SM90_SDPA_DV_CASE(ENUM, NAME, CODE, HDIM, HDIM_V)                     \
  if (p.dtype == DType::ENUM && p.head_dim == HDIM && p.head_dim_v == HDIM_V) { \
    run_bwd_main<DType::ENUM, HDIM, HDIM_V>(p, stream);                            \
    return true;                                                                   \
  }
  TORCH_SM90_SDPA_FOR_EACH_DV_VARIANT(TORCH_SM90_SDPA_DV_CASE)
#undef TORCH_SM90_SDPA_DV_CASE
  return false;
}

void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    fail_runtime(cat(what, " launch failed: ", cudaGetErrorName(err), ": ",
                     cudaGetErrorString(err)));
  }
}

// ---- what run() protects --------------------------------------------------------------------

void require_ptr(const void* ptr, const char* name, const char* what) {
  if (ptr == nullptr) fail_value(cat(what, ": params.", name, " is null"));
}

bool is_empty(const BwdParams& p) {
  return p.batch == 0 || p.heads_q == 0 || p.heads_kv == 0 || p.seqlen_q == 0 ||
         p.seqlen_k == 0 || p.head_dim == 0 || p.head_dim_v == 0;
}

void check_sizes(const BwdParams& p, const char* what, bool allow_empty) {
  const int vals[] = {p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_k, p.head_dim,
                      p.head_dim_v};
  const char* names[] = {"batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k", "head_dim",
                         "head_dim_v"};
  for (int i = 0; i < 7; ++i) {
    if (vals[i] < 0 || (vals[i] == 0 && !allow_empty)) {
      fail_value(cat(what, ": params.", names[i], " = ", vals[i],
                     allow_empty ? " is negative" : " must be positive"));
    }
  }
  if (allow_empty && is_empty(p)) return;
  if (p.heads_q % p.heads_kv != 0) {
    fail_value(cat(what, ": heads_q (", p.heads_q, ") must be a multiple of heads_kv (",
                   p.heads_kv, ")"));
  }
  if (p.seqlen_q_rounded != round_up_seq(p.seqlen_q) ||
      p.seqlen_k_rounded != round_up_seq(p.seqlen_k)) {
    fail_value(cat(what, ": seqlen_q_rounded / seqlen_k_rounded (", p.seqlen_q_rounded, ", ",
                   p.seqlen_k_rounded, ") must be seqlen_q / seqlen_k (", p.seqlen_q, ", ",
                   p.seqlen_k, ") rounded up to a multiple of ", kSeqRound));
  }
  const int dt = static_cast<int>(p.dtype);
  if (dt != 0 && dt != 1) fail_value(cat(what, ": params.dtype must be 0 (fp16) or 1 (bf16)"));
  if ((p.dk_accum == nullptr) != (p.dv_accum == nullptr)) {
    fail_value(cat(what, ": dk_accum and dv_accum must be both set or both null"));
  }
}

void check_tma(const void* ptr, int64_t sb, int nb, int64_t sh, int nh, int64_t sr, int nr,
               const char* name, const char* what) {
  OperandLayout l;
  l.batch_stride = sb;
  l.head_stride = sh;
  l.row_stride = sr;
  l.address_align = (reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0) ? 16 : 1;
  if (!tma_addressable(l, 2, nb, nh, nr)) {
    fail_value(cat(what, ": ", name, " must have a 16-byte aligned base address and positive "
                   "batch/head/row strides that are multiples of 8 elements for the SM90 "
                   "kernel (got strides ", sb, ", ", sh, ", ", sr, "); pass a contiguous copy"));
  }
}

void prepare_device(BwdParams& p) {
  const DeviceFacts& d = current_device_facts();
  if (d.cc_major != 9 || d.cc_minor != 0) {
    fail_runtime(cat("the kernels are built for sm_90a and need a compute capability 9.0 GPU "
                     "(Hopper); current device ", d.index, " (", d.name, ") has compute "
                     "capability ", d.cc_major, ".", d.cc_minor));
  }
  p.num_sms = d.num_sms;
  p.l2_bytes = d.l2_bytes;
}

}  // namespace

// ---- names ----------------------------------------------------------------------------------

const char* operand_name(int operand) {
  static const char* const names[kNumOperands] = {"q",  "k",  "v",  "out", "dout",
                                                  "lse", "dq", "dk", "dv", "mask"};
  return (operand >= 0 && operand < kNumOperands) ? names[operand] : "?";
}

const char* dtype_name(int dtype) {
  switch (dtype) {
    case 0: return "fp16";
    case 1: return "bf16";
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

std::vector<DvVariant> compiled_dv_variants() {
  std::vector<DvVariant> out;
#define TORCH_SM90_SDPA_LIST_DV(ENUM, NAME, CODE, HDIM, HDIM_V) out.push_back(DvVariant{CODE, HDIM, HDIM_V});
  TORCH_SM90_SDPA_FOR_EACH_DV_VARIANT(TORCH_SM90_SDPA_LIST_DV)
#undef TORCH_SM90_SDPA_LIST_DV
  return out;
}

bool has_variant(int head_dim, int dtype, int head_dim_v) {
  if (head_dim_v < 0) head_dim_v = head_dim;
#define TORCH_SM90_SDPA_HAS(ENUM, NAME, CODE, HDIM) \
  if (dtype == CODE && head_dim == HDIM && head_dim_v == HDIM) return true;
  TORCH_SM90_SDPA_FOR_EACH_VARIANT(TORCH_SM90_SDPA_HAS)
#undef TORCH_SM90_SDPA_HAS
#define TORCH_SM90_SDPA_HAS_DV(ENUM, NAME, CODE, HDIM, HDIM_V) \
  if (dtype == CODE && head_dim == HDIM && head_dim_v == HDIM_V) return true;
  TORCH_SM90_SDPA_FOR_EACH_DV_VARIANT(TORCH_SM90_SDPA_HAS_DV)
#undef TORCH_SM90_SDPA_HAS_DV
  (void)head_dim;
  (void)dtype;
  (void)head_dim_v;
  return false;
}

// ---- the contract ---------------------------------------------------------------------------

bool tma_addressable(const OperandLayout& l, int elem_bytes_, int batch, int heads, int rows) {
  if (l.address_align < 16) return false;
  const int64_t unit = 16 / (elem_bytes_ > 0 ? elem_bytes_ : 1);  // elements per 16 bytes
  auto ok = [&](int64_t stride, int n) { return n <= 1 || (stride > 0 && stride % unit == 0); };
  return ok(l.batch_stride, batch) && ok(l.head_stride, heads) && ok(l.row_stride, rows);
}

Decision can_implement(const BwdProblem& p) {
  const int sizes[] = {p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_k, p.head_dim,
                       p.head_dim_v};
  for (int s : sizes) {
    if (s < 0) return unsupported("unexpected shapes", "a negative size");
  }
  // Nothing to compute (no query, no key, no head, no value dim: every score's gradient is 0):
  // zero gradients on any GPU, as stock SDPA gives. (D = 0 with Dv > 0 is not this case: the
  // uniform probabilities still give dV.)
  if (p.batch == 0 || p.heads_q == 0 || p.heads_kv == 0 || p.seqlen_q == 0 || p.seqlen_k == 0 ||
      p.head_dim_v == 0) {
    Decision d;
    d.verdict = Verdict::kEmpty;
    return d;
  }
  if (p.cc_major != 9 || p.cc_minor != 0) {
    return unsupported(kReasonNotSm90, cat("compute capability ", p.cc_major, ".", p.cc_minor,
                                           " (the kernels are built for sm_90a)"));
  }
  if (elem_bytes(p.dtype) == 0) {
    return unsupported(kReasonDtype, cat("dtype code ", p.dtype, "; served: fp16, bf16"));
  }
  // Dv != D: the (D, Dv) pairs compiled (TILES_DV), else refused as such
  if (p.head_dim_v != p.head_dim && !has_variant(p.head_dim, p.dtype, p.head_dim_v)) {
    return unsupported(kReasonDv, cat("D = ", p.head_dim, ", Dv = ", p.head_dim_v, ": no kernel for the pair ",
                                      p.head_dim, "x", p.head_dim_v, " ", dtype_name(p.dtype), "; compiled: ",
                                      compiled_list()));
  }
  if (p.heads_kv == 0 ? p.heads_q != 0 : p.heads_q % p.heads_kv != 0) {
    return unsupported(kReasonHeads, cat("Hq = ", p.heads_q, ", Hkv = ", p.heads_kv));
  }
  if (!has_variant(p.head_dim, p.dtype, p.head_dim_v)) {
    return unsupported(kReasonVariant, cat("no kernel for head dim ", p.head_dim, " ",
                                           dtype_name(p.dtype), "; compiled: ",
                                           compiled_list()));
  }
  if (p.mask_kind < 0 || p.mask_kind > static_cast<int>(MaskKind::kFloat32)) {
    return unsupported(kReasonMaskDtype, cat("mask kind code ", p.mask_kind,
                                             "; served: bool, fp16, bf16, fp32"));
  }
  for (int op = 0; op < kNumOperands; ++op) {
    if (op == kLse || op == kMask) continue;  // lse: [B, H, S]; the mask: plain loads
    const int last = (op == kV || op == kOut || op == kDout || op == kDv) ? p.head_dim_v
                                                                          : p.head_dim;
    if (last > 1 && p.layout[op].col_stride != 1) {
      return unsupported(kReasonLastDim, cat(operand_name(op), " has last-dim stride ",
                                             p.layout[op].col_stride));
    }
  }
  // int32 indexing in the kernels: rounded lengths, and key blocks x heads x batch in one grid
  // dimension (64 keys per block at least).
  const int64_t sq_r = round_up(p.seqlen_q, kSeqRound), sk_r = round_up(p.seqlen_k, kSeqRound);
  const int64_t tiles = round_up(p.seqlen_k, 64) / 64 * int64_t(p.heads_q) * p.batch;
  // (and the tile classes of every mask instance: the main kernel indexes them with an int)
  const int64_t mask_tiles = int64_t(mask_instances_batch(p)) * mask_instances_heads(p) *
                             (round_up(p.seqlen_q, 64) / 64) * (round_up(p.seqlen_k, 64) / 64);
  const bool mask_grid_too_large = p.mask_kind != 0 && (mask_instances_batch(p) > 65535 ||
                                                        mask_instances_heads(p) > 65535 ||
                                                        mask_tiles > INT_MAX);
  if (sq_r > INT_MAX || sk_r > INT_MAX || tiles > INT_MAX || mask_grid_too_large) {
    return unsupported(kReasonTooLarge, cat("B = ", p.batch, ", Hq = ", p.heads_q, ", Sq = ",
                                            p.seqlen_q, ", Sk = ", p.seqlen_k));
  }
  Decision d;
  d.verdict = Verdict::kServed;
  const int eb = elem_bytes(p.dtype);
  for (int op : {kQ, kK, kV, kDout}) {
    int b, h, s;
    extents(p, op, b, h, s);
    if (!tma_addressable(p.layout[op], eb, b, h, s)) d.copy_mask |= 1u << op;
  }
  return d;
}

int gqa_heads_per_cta(const BwdProblem& p) {
  if (p.heads_kv <= 0 || p.heads_q <= 0 || p.heads_q == p.heads_kv ||
      p.heads_q % p.heads_kv != 0) {
    return 1;
  }
  const int bn = tile_block_n(p.head_dim);
  if (bn <= 0) return 1;
  const Override walk = switches().gqa_walk;
  if (walk == Override::kOff) return 1;
  if (p.deterministic) {  // walked only when forced, until measured (see the header)
    if (walk != Override::kOn || (p.mask_kind != 0 && mask_instances_heads(p) != 1)) return 1;
    return p.heads_q / p.heads_kv;
  }
  // Masked calls walk only when forced, and only under a mask shared by the heads (a per-head
  // mask gives the group's heads different walks). The masked kernel's walk measured both
  // faster and slower (H200, d128 s8192 causal bias, main kernel: GQA 16 / 8 2.455 -> 2.273 ms,
  // GQA 32 / 8 4.61-4.76 -> 4.58 and 5.03 in two measurements).
  if (p.mask_kind != 0 && (walk != Override::kOn || mask_instances_heads(p) != 1)) return 1;
  const int group = p.heads_q / p.heads_kv;
  if (walk == Override::kOn) return group;
  const int64_t ctas = int64_t(p.batch) * p.heads_kv * ((p.seqlen_k + bn - 1) / bn);
  return (group <= kMaxWalkGroup && ctas >= kMinGroupWalkCtas) ? group : 1;
}

int split_tail_tiles(const BwdProblem& p) {
  if (p.num_sms <= 0 || p.is_causal || p.deterministic || p.mask_kind != 0) return 0;
  const Switches s = switches();
  if (!s.persistent || s.split_tail == Override::kOff) return 0;
  const int heads_per_cta = gqa_heads_per_cta(p);
  if (p.heads_q != p.heads_kv && heads_per_cta == 1) return 0;  // fp32 dK / dV: one tile per CTA
  // the dense kernel's tile (run_bwd_main: a head dim's full tile past kFullTileMinQueries)
  const int bm = p.seqlen_q > kFullTileMinQueries ? full_tile_block_m(p.head_dim) : tile_block_m(p.head_dim);
  const int bn = tile_block_n(p.head_dim);
  if (bm <= 0 || bn <= 0 || p.heads_q % heads_per_cta != 0) return 0;
  const int64_t P = p.num_sms;
  const int64_t tiles = int64_t((p.seqlen_k + bn - 1) / bn) * (p.heads_q / heads_per_cta) * p.batch;
  const int64_t r = tiles % P;
  // (launch_bwd_main checks the same counts with its kernel's tile before it splits)
  const int64_t m_blocks = (p.seqlen_q + bm - 1) / bm;
  if (tiles < 2 * P || r == 0 || r * m_blocks < P) return 0;
  if (s.split_tail != Override::kOn && (P - r) * m_blocks < kSplitMinSavedBlocks * P) return 0;
  return static_cast<int>(r);
}

WorkspaceLayout workspace_layout(const BwdProblem& p) {
  WorkspaceLayout w;
  w.heads_per_cta = gqa_heads_per_cta(p);
  // a CTA that walks its whole group stores dK / dV itself: no accumulators
  w.gqa = p.heads_q != p.heads_kv && w.heads_per_cta == 1;
  const int64_t sq_r = round_up(p.seqlen_q, kSeqRound), sk_r = round_up(p.seqlen_k, kSeqRound);
  const int64_t n_dq = int64_t(p.batch) * p.heads_q * sq_r * p.head_dim;
  // deterministic GQA keeps one dK / dV tile per q head (summed by the postprocess)
  const int64_t kv_heads = p.deterministic ? p.heads_q : p.heads_kv;
  const int64_t n_dk = w.gqa ? int64_t(p.batch) * kv_heads * sk_r * p.head_dim : 0;
  const int64_t n_dv = w.gqa ? int64_t(p.batch) * kv_heads * sk_r * p.head_dim_v : 0;
  const int64_t n_row = int64_t(p.batch) * p.heads_q * sq_r;
  // every piece is a multiple of kSeqRound floats (512 bytes): all offsets stay 16-byte aligned
  int64_t o = 0;
  w.dq_accum = o;
  o += 4 * n_dq;
  w.dk_accum = o;
  o += 4 * n_dk;
  w.dv_accum = o;
  o += 4 * n_dv;
  w.dpsum = o;
  o += 4 * n_row;
  w.lse_log2 = o;
  o += 4 * n_row;
  w.tile_class = o;
  if (p.mask_kind != 0) {
    const int bm = tile_block_m(p.head_dim), bn = tile_block_n(p.head_dim);
    if (bm > 0 && bn > 0) {
      const int64_t tiles = int64_t(mask_instances_batch(p)) * mask_instances_heads(p) *
                            ((p.seqlen_q + bm - 1) / bm) * ((p.seqlen_k + bn - 1) / bn);
      o += round_up(tiles, 16);
    }
  }
  w.tile_m_range = o;
  if (p.mask_kind != 0) {
    const int bn = tile_block_n(p.head_dim);
    if (bn > 0) {
      const int64_t inst = int64_t(mask_instances_batch(p)) * mask_instances_heads(p);
      o += round_up(8 * inst * ((p.seqlen_k + bn - 1) / bn), 16);
    }
  }
  w.tile_bits = o;
  if (p.mask_kind != 0) {
    const int bm = tile_block_m(p.head_dim), bn = tile_block_n(p.head_dim);
    if (bm > 0 && bn > 0) {  // (bm * bn / 8 bytes per tile: a multiple of 16)
      const int64_t tiles = int64_t(mask_instances_batch(p)) * mask_instances_heads(p) *
                            ((p.seqlen_q + bm - 1) / bm) * ((p.seqlen_k + bn - 1) / bn);
      o += tiles * (bm * bn / 8);
    }
  }
  w.score_bounds = o;
  if (p.mask_kind > static_cast<int>(MaskKind::kBool)) {  // additive: fp32 bounds per block
    const int bm = tile_block_m(p.head_dim), bn = tile_block_n(p.head_dim);
    if (bm > 0 && bn > 0) {
      const int64_t inst = int64_t(mask_instances_batch(p)) * mask_instances_heads(p);
      // the bounds, then kMaxBoundSplits shares of them (the bounds kernel's scratch)
      o += round_up(4 * inst * (2 * ((p.seqlen_q + bm - 1) / bm) + (p.seqlen_k + bn - 1) / bn), 16) *
           (1 + kMaxBoundSplits);
    }
  }
  w.dq_semaphore = o;
  if (p.deterministic) {
    const int bm = tile_block_m(p.head_dim);
    if (bm > 0) o += round_up(4 * int64_t(p.batch) * p.heads_q * ((p.seqlen_q + bm - 1) / bm), 16);
  }
  w.split_tail = o;
  w.split_tiles = split_tail_tiles(p);
  if (w.split_tiles > 0) {
    w.split_slot_floats = tile_block_n(p.head_dim) * (p.head_dim + p.head_dim_v);  // dK, then dV
    o += round_up(4 * int64_t(w.split_tiles), 16) + 4 * int64_t(w.split_tiles) * w.split_slot_floats;
  }
  w.tile_counter = o;
  o += 16;
  w.bytes = o;
  return w;
}

int mask_instances_batch(const BwdProblem& p) {
  return (p.batch > 1 && p.layout[kMask].batch_stride != 0) ? p.batch : 1;
}

int mask_instances_heads(const BwdProblem& p) {
  return (p.heads_q > 1 && p.layout[kMask].head_stride != 0) ? p.heads_q : 1;
}

DeterministicOrder deterministic_order(const BwdProblem& p) {
  if (const std::optional<DeterministicOrder> forced = switches().deterministic_order) return *forced;
  // On the H200 (BENCHMARKS.md): descending was the faster order for MHA, ascending for the
  // GQA rows measured.
  return p.heads_q != p.heads_kv ? DeterministicOrder::kKeysAscending
                                 : DeterministicOrder::kKeysDescending;
}

namespace {

// The value `choices` pairs with the environment variable `name`, or `fallback` when it is
// unset or has another value.
template <class T>
T env_choice(const char* name, T fallback,
             std::initializer_list<std::pair<const char*, T>> choices) {
  const char* env = std::getenv(name);
  if (env == nullptr) return fallback;
  for (const auto& choice : choices) {
    if (std::strcmp(env, choice.first) == 0) return choice.second;
  }
  return fallback;
}

// The environment variable `name` as an int in 0 < N < 2^30, else 0.
int env_positive_int(const char* name) {
  const char* env = std::getenv(name);
  if (env == nullptr) return 0;
  char* end = nullptr;
  const long v = std::strtol(env, &end, 10);
  return (end != env && *end == '\0' && v > 0 && v < (1L << 30)) ? static_cast<int>(v) : 0;
}

Switches read_switches() {
  using Order = std::optional<DeterministicOrder>;
  Switches s;
  const std::initializer_list<std::pair<const char*, Override>> off_on = {
      {"0", Override::kOff}, {"1", Override::kOn}};
  s.gqa_walk = env_choice("TORCH_SM90_SDPA_GQA_WALK", Override::kRule, off_on);
  s.split_tail = env_choice("TORCH_SM90_SDPA_SPLIT_TAIL", Override::kRule, off_on);
  s.deterministic_order = env_choice<Order>(
      "TORCH_SM90_SDPA_DETERMINISTIC_ORDER", std::nullopt,
      {{"ascending", DeterministicOrder::kKeysAscending},
       {"descending", DeterministicOrder::kKeysDescending}});
  s.programmatic_launch = env_choice("TORCH_SM90_SDPA_PDL", false, {{"1", true}});
  s.persistent = env_choice("TORCH_SM90_SDPA_PERSISTENT", kPersistentByDefault,
                            {{"1", true}, {"0", false}});
  s.prepost_reversed = env_choice("TORCH_SM90_SDPA_PREPOST_ORDER", kPrepostReversedByDefault,
                                  {{"reversed", true}, {"forward", false}});
  s.heads_per_section = env_positive_int("TORCH_SM90_SDPA_SECTION_HEADS");
  return s;
}

std::mutex g_switches_mutex;
std::optional<Switches> g_switches;  // read at the first switches()

}  // namespace

Switches switches() {
  std::lock_guard<std::mutex> lock(g_switches_mutex);
  if (!g_switches) g_switches = read_switches();
  return *g_switches;
}

void reload_switches() {
  const Switches s = read_switches();
  std::lock_guard<std::mutex> lock(g_switches_mutex);
  g_switches = s;
}

BwdParams make_params(const BwdProblem& p, const BwdPointers& ptrs, float scale) {
  BwdParams n;
  const Switches s = switches();
  n.programmatic_launch = s.programmatic_launch;
  n.persistent = s.persistent;
  n.heads_per_section = s.heads_per_section;
  n.prepost_reversed = s.prepost_reversed;
  n.batch = p.batch;
  n.heads_q = p.heads_q;
  n.heads_kv = p.heads_kv;
  n.seqlen_q = p.seqlen_q;
  n.seqlen_k = p.seqlen_k;
  n.head_dim = p.head_dim;
  n.head_dim_v = p.head_dim_v;
  n.seqlen_q_rounded = round_up_seq(p.seqlen_q);
  n.seqlen_k_rounded = round_up_seq(p.seqlen_k);
  n.dtype = static_cast<DType>(p.dtype);
  n.scale = scale;
  n.scale_log2 = static_cast<float>(double(scale) * 1.4426950408889634);
  n.is_causal = p.is_causal;
  n.deterministic = p.deterministic;
  if (p.deterministic) n.deterministic_order = deterministic_order(p);
  // each operand's address and batch / head / row strides
  auto set = [&](int op, auto& ptr, auto value, int64_t& sb, int64_t& sh, int64_t& sr) {
    ptr = value;
    sb = p.layout[op].batch_stride;
    sh = p.layout[op].head_stride;
    sr = p.layout[op].row_stride;
  };
  set(kQ, n.q, ptrs.q, n.q_batch_stride, n.q_head_stride, n.q_row_stride);
  set(kK, n.k, ptrs.k, n.k_batch_stride, n.k_head_stride, n.k_row_stride);
  set(kV, n.v, ptrs.v, n.v_batch_stride, n.v_head_stride, n.v_row_stride);
  set(kOut, n.out, ptrs.out, n.out_batch_stride, n.out_head_stride, n.out_row_stride);
  set(kDout, n.dout, ptrs.dout, n.dout_batch_stride, n.dout_head_stride, n.dout_row_stride);
  set(kLse, n.lse, ptrs.lse, n.lse_batch_stride, n.lse_head_stride, n.lse_row_stride);
  set(kDq, n.dq, ptrs.dq, n.dq_batch_stride, n.dq_head_stride, n.dq_row_stride);
  set(kDk, n.dk, ptrs.dk, n.dk_batch_stride, n.dk_head_stride, n.dk_row_stride);
  set(kDv, n.dv, ptrs.dv, n.dv_batch_stride, n.dv_head_stride, n.dv_row_stride);
  n.mask_kind = static_cast<MaskKind>(p.mask_kind);
  if (p.mask_kind != 0) {
    const OperandLayout& m = p.layout[kMask];
    n.mask = ptrs.mask;
    n.mask_batch_stride = m.batch_stride;
    n.mask_head_stride = m.head_stride;
    n.mask_row_stride = m.row_stride;
    n.mask_col_stride = m.col_stride;
    n.mask_batch = mask_instances_batch(p);
    n.mask_heads = mask_instances_heads(p);
    n.tile_m = tile_block_m(p.head_dim);
    n.tile_n = tile_block_n(p.head_dim);
    if (n.tile_m > 0 && n.tile_n > 0) {
      n.num_m_blocks = (p.seqlen_q + n.tile_m - 1) / n.tile_m;
      n.num_n_blocks = (p.seqlen_k + n.tile_n - 1) / n.tile_n;
    }
  }
  const WorkspaceLayout w = workspace_layout(p);
  n.heads_per_cta = w.heads_per_cta;
  char* base = static_cast<char*>(ptrs.workspace);
  auto at = [&](int64_t off) { return base == nullptr ? nullptr : reinterpret_cast<float*>(base + off); };
  n.dq_accum = at(w.dq_accum);
  n.dq_accum_permuted = dq_accum_permuted_for(p.head_dim);
  n.dk_accum = w.gqa ? at(w.dk_accum) : nullptr;
  n.dv_accum = w.gqa ? at(w.dv_accum) : nullptr;
  n.dpsum = at(w.dpsum);
  n.lse_log2 = at(w.lse_log2);
  if (p.mask_kind != 0 && base != nullptr) {
    n.tile_class = reinterpret_cast<unsigned char*>(base + w.tile_class);
    n.tile_m_range = reinterpret_cast<int*>(base + w.tile_m_range);
    n.tile_bits = reinterpret_cast<uint32_t*>(base + w.tile_bits);
  }
  if (p.mask_kind > static_cast<int>(MaskKind::kBool) && base != nullptr && n.num_m_blocks > 0) {
    const int64_t inst = int64_t(n.mask_batch) * n.mask_heads;
    float* bounds = reinterpret_cast<float*>(base + w.score_bounds);
    n.q_norm_max = bounds;
    n.lse_min = bounds + inst * n.num_m_blocks;
    n.k_norm_max = bounds + 2 * inst * n.num_m_blocks;
    const int64_t count = inst * (2 * n.num_m_blocks + n.num_n_blocks);
    n.bounds_partial = reinterpret_cast<float*>(base + w.score_bounds + round_up(4 * count, 16));
  }
  if (p.deterministic && base != nullptr) {
    n.dq_semaphore = reinterpret_cast<int*>(base + w.dq_semaphore);
  }
  if (base != nullptr) n.tile_counter = reinterpret_cast<int*>(base + w.tile_counter);
  if (w.split_tiles > 0 && base != nullptr) {
    n.split_tiles = w.split_tiles;
    n.split_slot_floats = w.split_slot_floats;
    n.split_count = reinterpret_cast<int*>(base + w.split_tail);
    n.split_accum = reinterpret_cast<float*>(base + w.split_tail + round_up(4 * int64_t(w.split_tiles), 16));
  }
  return n;
}

// ---- running --------------------------------------------------------------------------------

const DeviceFacts& current_device_facts() {
  int dev = -1;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) {
    cudaGetLastError();
    fail_runtime(cat("no usable CUDA device: ", cudaGetErrorString(err)));
  }
  static std::mutex mu;
  static std::unordered_map<int, DeviceFacts> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(dev);
  if (it != cache.end()) return it->second;
  cudaDeviceProp prop;
  err = cudaGetDeviceProperties(&prop, dev);
  if (err != cudaSuccess) {
    cudaGetLastError();
    fail_runtime(cat("cudaGetDeviceProperties failed: ", cudaGetErrorString(err)));
  }
  DeviceFacts f;
  f.index = dev;
  f.cc_major = prop.major;
  f.cc_minor = prop.minor;
  f.num_sms = prop.multiProcessorCount;
  f.l2_bytes = prop.l2CacheSize;
  f.name = prop.name;
  return cache.emplace(dev, f).first->second;
}

void run_preprocess(const BwdParams& params, cudaStream_t stream) {
  const char* what = "preprocess";
  check_sizes(params, what, /*allow_empty=*/true);
  if (is_empty(params)) return;
  require_ptr(params.out, "out", what);
  require_ptr(params.dout, "dout", what);
  require_ptr(params.lse, "lse", what);
  require_ptr(params.dpsum, "dpsum", what);
  require_ptr(params.lse_log2, "lse_log2", what);
  require_ptr(params.dq_accum, "dq_accum", what);
  BwdParams p = params;
  prepare_device(p);
  cudaGetLastError();  // do not blame this launch for an earlier error
  run_bwd_preprocess(p, stream);
  check_launch("preprocess kernel");
}

void run_postprocess(const BwdParams& params, cudaStream_t stream) {
  const char* what = "postprocess";
  check_sizes(params, what, /*allow_empty=*/true);
  if (is_empty(params)) return;
  require_ptr(params.dq_accum, "dq_accum", what);
  require_ptr(params.dq, "dq", what);
  if (params.dq_accum_permuted && params.head_dim % 32 != 0) {
    fail_value(cat(what, ": dq_accum_permuted needs head_dim % 32 == 0 (got ", params.head_dim,
                   ")"));
  }
  if (params.dk_accum != nullptr) {
    require_ptr(params.dk, "dk", what);
    require_ptr(params.dv, "dv", what);
  }
  BwdParams p = params;
  prepare_device(p);
  cudaGetLastError();
  run_bwd_postprocess(p, stream);
  check_launch("postprocess kernel");
}

void run_classification(const BwdParams& params, cudaStream_t stream) {
  const char* what = "classification";
  check_sizes(params, what, /*allow_empty=*/true);
  if (is_empty(params) || params.mask_kind == MaskKind::kNone) return;
  require_ptr(params.mask, "mask", what);
  require_ptr(params.tile_class, "tile_class", what);
  require_ptr(params.tile_m_range, "tile_m_range", what);
  require_ptr(params.tile_bits, "tile_bits", what);
  BwdParams p = params;
  prepare_device(p);
  cudaGetLastError();
  run_mask_classify(p, stream, nullptr, /*backward_fill_rows=*/true);
  check_launch("mask classification kernel");
}

void run(const BwdParams& params, cudaStream_t stream) {
  const char* what = "backward";
  const BwdParams& p0 = params;
  check_sizes(p0, what, /*allow_empty=*/false);
  const char* names[] = {"q", "k", "v", "out", "dout", "lse", "dpsum", "lse_log2", "dq_accum",
                         "dq", "dk", "dv"};
  const void* ptrs[] = {p0.q, p0.k, p0.v, p0.out, p0.dout, p0.lse, p0.dpsum, p0.lse_log2,
                        p0.dq_accum, p0.dq, p0.dk, p0.dv};
  for (int i = 0; i < 12; ++i) require_ptr(ptrs[i], names[i], what);
  if (p0.head_dim_v != p0.head_dim && !has_variant(p0.head_dim, static_cast<int>(p0.dtype), p0.head_dim_v)) {
    fail_value(cat(what, ": the SM90 kernel needs head_dim_v == head_dim or a compiled (head_dim, "
                   "head_dim_v) pair (got ", p0.head_dim_v, " and ", p0.head_dim, "; compiled: ",
                   compiled_list(), ")"));
  }
  const bool gqa = p0.heads_q != p0.heads_kv;
  const int group = gqa ? p0.heads_q / p0.heads_kv : 1;
  if (p0.heads_per_cta != 1 &&
      (!gqa || p0.heads_per_cta != group ||
       (p0.mask_kind != MaskKind::kNone && p0.mask_heads != 1))) {
    fail_value(cat(what, ": heads_per_cta (", p0.heads_per_cta, ") must be 1, or the GQA group (",
                   group, ") with no mask or one shared by the heads (fill it with make_params)"));
  }
  // dK / dV through the fp32 accumulators: GQA with one q head per CTA
  const bool dkv_accum = gqa && p0.heads_per_cta == 1;
  if (dkv_accum != (p0.dk_accum != nullptr)) {
    fail_value(cat(what, dkv_accum ? ": GQA (heads_q != heads_kv) with one q head per CTA needs "
                                     "the fp32 workspaces dk_accum and dv_accum"
                                   : ": dk_accum / dv_accum must be null when heads_q == heads_kv "
                                     "or a CTA walks its GQA group (the main kernel writes dk "
                                     "and dv directly)"));
  }
  if (p0.split_tiles < 0 || (p0.split_tiles > 0 && (p0.split_count == nullptr || p0.split_accum == nullptr ||
                                                     p0.split_slot_floats <= 0))) {
    fail_value(cat(what, ": a split tail (split_tiles = ", p0.split_tiles, ") needs its split_count and "
                   "split_accum workspaces and split_slot_floats (fill them with make_params)"));
  }
  if (p0.deterministic && p0.dq_semaphore == nullptr) {
    fail_value(cat(what, ": deterministic mode needs the dq_semaphore workspace (fill it with "
                         "make_params)"));
  }
  if (p0.mask_kind != MaskKind::kNone) {
    require_ptr(p0.mask, "mask", what);
    require_ptr(p0.tile_class, "tile_class", what);
    require_ptr(p0.tile_m_range, "tile_m_range", what);
    require_ptr(p0.tile_bits, "tile_bits", what);
    if (p0.tile_m != tile_block_m(p0.head_dim) || p0.tile_n != tile_block_n(p0.head_dim) ||
        p0.num_m_blocks != (p0.seqlen_q + p0.tile_m - 1) / p0.tile_m ||
        p0.num_n_blocks != (p0.seqlen_k + p0.tile_n - 1) / p0.tile_n ||
        (p0.mask_batch != 1 && p0.mask_batch != p0.batch) ||
        (p0.mask_heads != 1 && p0.mask_heads != p0.heads_q)) {
      fail_value(cat(what, ": the mask's tile grid or instance counts do not match the problem "
                     "(fill them with make_params)"));
    }
  }
  const int B = p0.batch, Hq = p0.heads_q, Hkv = p0.heads_kv, Sq = p0.seqlen_q, Sk = p0.seqlen_k;
  check_tma(p0.q, p0.q_batch_stride, B, p0.q_head_stride, Hq, p0.q_row_stride, Sq, "q", what);
  check_tma(p0.k, p0.k_batch_stride, B, p0.k_head_stride, Hkv, p0.k_row_stride, Sk, "k", what);
  check_tma(p0.v, p0.v_batch_stride, B, p0.v_head_stride, Hkv, p0.v_row_stride, Sk, "v", what);
  check_tma(p0.dout, p0.dout_batch_stride, B, p0.dout_head_stride, Hq, p0.dout_row_stride, Sq,
            "dout", what);
  if (!dkv_accum) {  // the main kernel writes dk and dv itself
    check_tma(p0.dk, p0.dk_batch_stride, B, p0.dk_head_stride, Hkv, p0.dk_row_stride, Sk, "dk",
              what);
    check_tma(p0.dv, p0.dv_batch_stride, B, p0.dv_head_stride, Hkv, p0.dv_row_stride, Sk, "dv",
              what);
  }
  const int dt = static_cast<int>(p0.dtype);
  if (!has_variant(p0.head_dim, dt, p0.head_dim_v)) {
    fail_runtime(cat("backward variant (dtype=", dtype_name(dt), ", head_dim=", p0.head_dim,
                     p0.head_dim_v != p0.head_dim ? cat(", head_dim_v=", p0.head_dim_v) : std::string(),
                     ") is not compiled into torch_sm90_sdpa._C; compiled variants: ",
                     compiled_list(), " (see TORCH_SM90_SDPA_HEAD_DIMS / TORCH_SM90_SDPA_DTYPES)"));
  }
  BwdParams p = params;
  prepare_device(p);
  // the order the variant's main kernel writes, whatever the caller filled in
  p.dq_accum_permuted = dq_accum_permuted_for(p.head_dim);
  cudaGetLastError();
  // Before the preprocess, so that the kernels run back to back: the main kernel's
  // programmatic launch (grid_dependency.h) depends on the kernel right before it.
  if (p.deterministic) {  // every m-block's count of added dQ tiles starts at 0
    const int bm = tile_block_m(p.head_dim);
    const int64_t count = int64_t(p.batch) * p.heads_q * ((p.seqlen_q + bm - 1) / bm);
    const cudaError_t err = cudaMemsetAsync(p.dq_semaphore, 0, 4 * count, stream);
    if (err != cudaSuccess) {
      fail_runtime(cat("cudaMemsetAsync(dq_semaphore) failed: ", cudaGetErrorString(err)));
    }
  }
  run_bwd_preprocess(p, stream);
  check_launch("preprocess kernel");
  if (p.mask_kind != MaskKind::kNone) {
    run_mask_classify(p, stream, nullptr, /*backward_fill_rows=*/true);
    check_launch("mask classification kernel");
  }
  dispatch_main(p, stream);
  check_launch("main backward kernel");
  // GQA with accumulators: dq, dk and dv from them; else (dk_accum is null): dq only, the
  // main kernel wrote dk and dv itself
  run_bwd_postprocess(p, stream);
  check_launch("postprocess kernel");
}

}  // namespace device
}  // namespace sm90_sdpa
