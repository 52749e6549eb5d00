// The device layer of the attention backward (in the manner of CUTLASS's device-level APIs):
// the one statement of what the SM90 kernels serve, the workspace they need, and running them.
// Free of torch and pybind11; everything above it (the torch op in torch_op.cpp, the Python
// binding in module.cpp, the compile-time policy through that binding) asks it instead of
// re-deriving its rules.
//
//   Decision can_implement(const BwdProblem&)    served / empty / unsupported (+ reason), and
//                                                which operands must be passed as copies
//   WorkspaceLayout workspace_layout(problem)    byte offsets of the fp32 workspaces
//   BwdParams make_params(problem, ptrs, scale)
//   void run(const BwdParams&, cudaStream_t)     preprocess, main kernel, postprocess
//
// Shapes: q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv], out / dout [B, Hq, Sq, Dv],
// lse [B, Hq, Sq] fp32; dq / dk / dv like q / k / v. Strides in elements.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bwd_params.h"

namespace sm90_sdpa {
namespace device {

// The tensors of one backward call, in the order of the op's schema where they appear there.
// kMask: the optional attention mask as a [B, Hq, Sq, Sk] view (stride 0 on broadcast dims).
enum Operand : int { kQ = 0, kK, kV, kOut, kDout, kLse, kDq, kDk, kDv, kMask, kNumOperands };
const char* operand_name(int operand);  // "q", "k", ... ("dout" for grad_out, "mask")

// What the contract needs to know of one [B, H, S, X] operand (lse: [B, H, S], col_stride 1).
// address_align: the largest power of two dividing the data address in bytes, capped at 16
// (at compile time: what the storage offset proves, with 16-byte aligned storages).
struct OperandLayout {
  int64_t batch_stride = 0, head_stride = 0, row_stride = 0, col_stride = 1;
  int address_align = 16;
};

struct BwdProblem {
  int batch = 0, heads_q = 0, heads_kv = 0, seqlen_q = 0, seqlen_k = 0;
  int head_dim = 0, head_dim_v = 0;
  int dtype = -1;  // DType code: 0 fp16, 1 bf16; anything else is not served
  bool is_causal = false;
  bool deterministic = false;
  int mask_kind = 0;  // MaskKind code: 0 none, 1 bool, 2 fp16, 3 bf16, 4 fp32 (layout[kMask])
  int cc_major = 0, cc_minor = 0;  // compute capability of the device the call runs on
  // multiprocessors of that device: the persistent grid the split tail is planned for
  // (split_tail_tiles); 0 (unknown) plans none
  int num_sms = 0;
  OperandLayout layout[kNumOperands];
};

enum class Verdict : int {
  kServed = 0,       // run() it (after copying the operands in copy_mask)
  kEmpty = 1,        // a size is 0: nothing to launch, the gradients are zeros (or empty)
  kUnsupported = 2,  // not served: `reason` (a stable short string) and `detail`
};

// Stable short reasons (the compile-time policy reports them as they are).
extern const char* const kReasonNotSm90;        // "not an SM90 GPU"
extern const char* const kReasonDtype;          // "dtype"
extern const char* const kReasonDv;             // "Dv != D"
extern const char* const kReasonHeads;          // "Hq not a multiple of Hkv"
extern const char* const kReasonVariant;        // "head dim not compiled"
extern const char* const kReasonLastDim;        // "last dim not contiguous"
extern const char* const kReasonTooLarge;       // "sizes exceed the kernel's int32 indexing"
extern const char* const kReasonMaskDtype;      // "attn_mask dtype"

struct Decision {
  Verdict verdict = Verdict::kUnsupported;
  // Inputs the main kernel's TMA cannot address as they are (a misaligned base, a stride that
  // is 0, negative or not a multiple of 16 bytes): pass a contiguous copy instead. Bit i is
  // Operand i. Only q, k, v and dout are ever set (out and lse are read with plain loads;
  // dq / dk / dv are allocated by the caller with dense strides).
  uint32_t copy_mask = 0;
  std::string reason;
  std::string detail;
};

Decision can_implement(const BwdProblem& problem);

// Whether the main kernel's TMA can address an operand of `elem_bytes` elements with this
// layout (modes of one element are never stepped and need nothing).
bool tma_addressable(const OperandLayout& layout, int elem_bytes, int batch, int heads,
                     int rows);

// The workspaces, as byte offsets into one allocation of `bytes` (16-byte aligned pieces):
//   fp32 dq_accum [B, Hq, Sq_rounded, D], dk_accum [B, Hkv, Sk_rounded, D] and dv_accum
//   [B, Hkv, Sk_rounded, Dv] (GQA with heads_per_cta == 1 only, else size 0; deterministic
//   GQA: Hq heads, one tile per q head), dpsum and lse_log2 [B, Hq, Sq_rounded]; with a mask, the tile classes (bytes)
//   [mask_batch, mask_heads, n_blocks, m_blocks], the int32 non-empty m-block ranges
//   [mask_batch, mask_heads, n_blocks, 2], the visibility bits of partial tiles (tile_m * tile_n
//   / 8 bytes per tile, every tile has room) and, additive masks, the fp32 score bounds of the
//   classification [mask_batch, mask_heads, 2 * m_blocks + n_blocks]; deterministic, the int32
//   turn semaphores dq_semaphore [B, Hq, m_blocks] (run() zeroes them); a split tail's
//   counts and fp32 sums (split_tail_tiles); last, the int32 tile_counter of persistent CTAs
//   (16 bytes; the preprocess zeroes it).
struct WorkspaceLayout {
  int64_t dq_accum = 0, dk_accum = 0, dv_accum = 0, dpsum = 0, lse_log2 = 0, tile_class = 0;
  int64_t tile_m_range = 0;  // masks: the non-empty m-block range per n-block (BwdParams)
  int64_t tile_bits = 0;     // masks: partial tiles as visibility bits (BwdParams)
  int64_t score_bounds = 0;  // additive masks: q_norm_max, lse_min, k_norm_max (BwdParams)
  int64_t dq_semaphore = 0;
  // split tail: split_count [split_tiles] int32 (padded to 16 bytes), then split_accum
  // [split_tiles, block_n * (D + Dv)] fp32 (BwdParams; the preprocess zeroes both)
  int64_t split_tail = 0;
  int split_tiles = 0;
  int split_slot_floats = 0;
  int64_t tile_counter = 0;
  int64_t bytes = 0;
  bool gqa = false;       // dk_accum / dv_accum are laid out (GQA, heads_per_cta == 1)
  int heads_per_cta = 1;  // BwdParams::heads_per_cta of this problem (gqa_heads_per_cta)
};

// With a mask: the distinct mask instances along B and Hq (1 where the view broadcasts).
int mask_instances_batch(const BwdProblem& problem);
int mask_instances_heads(const BwdProblem& problem);
WorkspaceLayout workspace_layout(const BwdProblem& problem);

// Data addresses of the operands (after any copies) and of the workspace allocation.
struct BwdPointers {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* out = nullptr;
  const void* dout = nullptr;
  const float* lse = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  const void* mask = nullptr;
  void* workspace = nullptr;
};

// The q heads one main-kernel CTA walks (BwdParams::heads_per_cta): the GQA group Hq / Hkv
// for a GQA problem in the default mode without a mask, whose kv heads' key blocks make at
// least kMinGroupWalkCtas CTAs (a CTA then does a group's work: with fewer the last wave would
// leave SMs idle) and whose group is at most kMaxWalkGroup; else 1. Switches::gqa_walk
// (TORCH_SM90_SDPA_GQA_WALK) overrides the rule: off keeps 1, on takes the group whatever the
// CTA count and group size, and also under a mask shared by the heads (masked calls do not
// walk by default: their walk measured inconsistently).
// Deterministic mode walks only when the switch forces it (any group, with no mask or one
// shared by the heads): the walk sums the group's dK / dV in registers in q-head order, as
// repeatable as the default way, which stores one fp32 tile per q head and sums them in the
// postprocess. It passed the deterministic GPU tests (H100); it becomes the rule once
// benchmarks/bench_deterministic.py --walk measures it faster.
constexpr int64_t kMinGroupWalkCtas = 512;  // about four waves on 132 SMs
// Groups of 8 measured slower walked than not (H200, d128 s8192 b2 is_causal, main kernel,
// GQA 32 / 4: 4.899 ms walked, 4.698 not; H100: 0.89-0.91x of cuDNN walked); groups of 2 and 4
// faster (16 / 8: 2.279 against 2.480; 32 / 8: 4.584 against 4.833). A 128-CTA section of two
// walked groups of 8 holds 67 MB of Q / dO at 8k keys, more than the 50 MB L2.
constexpr int kMaxWalkGroup = 4;
int gqa_heads_per_cta(const BwdProblem& problem);

// Whether the main kernel runs persistent CTAs (BwdParams::persistent: one CTA per SM, each
// taking tiles in turn, where the variant and the call allow it) when
// TORCH_SM90_SDPA_PERSISTENT (Switches::persistent) does not say.
constexpr bool kPersistentByDefault = true;

// Whether the pre- and postprocess walk the rows last (batch, head) first
// (BwdParams::prepost_reversed) when TORCH_SM90_SDPA_PREPOST_ORDER (Switches::prepost_reversed)
// does not say. Why: the main kernel's first tiles then read what the preprocess
// wrote last (dq_accum's zeros, dO), and the postprocess first reads what the main kernel
// added last, from L2 instead of HBM (at s = 512, d128 b32 h16, dq_accum alone is 134 MB
// against the 50 MB L2).
constexpr bool kPrepostReversedByDefault = true;

// The split tail of a problem (BwdParams::split_tiles): full attention's tiles all cost the
// same, so on P persistent CTAs (P = problem.num_sms) T tiles take ceil(T / P) tile times
// (H200, d128 s8192 full, main kernel: 31, 32 and 33 heads, 15.0 / 15.5 / 16.0 waves of work,
// 4.79 / 4.76 / 4.80 ms; the wave probe of commit 890d097). The last r = T mod P tiles are dealt as P equal
// pieces of their m-blocks instead. Returns r, or 0 for no split: causal, masked or
// deterministic calls, GQA with fp32 dK / dV accumulators, head dims without persistent CTAs,
// persistent CTAs off, T < 2 P, r = 0, fewer split m-blocks than P, or (the rule) less than
// kSplitMinSavedBlocks m-blocks saved per SM: (P - r) M / P, M = a tile's m-blocks (of the
// tile run_bwd_main picks). Switches::split_tail (TORCH_SM90_SDPA_SPLIT_TAIL) off splits none,
// on every problem the structure allows, whatever the saving.
// Measured (H200, bf16 full, main kernel, split / whole; the probe of commit 08ea738): d128
// b16 s1k (6 m-blocks saved per SM) 1.3% slower; b8 s2k (13) 1.1% faster; s4k (25) 3.6%;
// s8k (50) 3.0%.
constexpr int kSplitMinSavedBlocks = 10;
int split_tail_tiles(const BwdProblem& problem);

// Deterministic mode: the order the kernels add dQ tiles in (DeterministicOrder in
// bwd_params.h), chosen per problem; Switches::deterministic_order
// (TORCH_SM90_SDPA_DETERMINISTIC_ORDER) forces one.
DeterministicOrder deterministic_order(const BwdProblem& problem);

// The experiment switches: environment variables that change how the kernels run, for A/B
// measurements and tests. Read once, at the first call of switches(); reload_switches() reads
// them again (for a process that changes its environment: tests, interleaved benchmarks). An
// unset variable, or a value other than those listed, keeps the field's default.
enum class Override : int {
  kRule = 0,  // the device layer's rule decides (the default)
  kOff = 1,   // "0"
  kOn = 2,    // "1"
};
struct Switches {
  // TORCH_SM90_SDPA_GQA_WALK=0 / 1: no GQA CTA walks its group / every GQA CTA walks its whole
  // group, also under a mask shared by the heads (gqa_heads_per_cta). Default: the rule.
  Override gqa_walk = Override::kRule;
  // TORCH_SM90_SDPA_SPLIT_TAIL=0 / 1: no split tail / a split tail wherever the structure
  // allows it, whatever the saving (split_tail_tiles). Default: the rule.
  Override split_tail = Override::kRule;
  // TORCH_SM90_SDPA_DETERMINISTIC_ORDER=ascending / descending: the deterministic mode's dQ
  // order (deterministic_order). Default (empty): chosen per problem.
  std::optional<DeterministicOrder> deterministic_order;
  // TORCH_SM90_SDPA_PDL=1: the main kernel and the postprocess start while the kernel before
  // them drains (BwdParams::programmatic_launch, csrc/grid_dependency.h). Default: off
  // (measured 0.9-1.4% faster back to back only, the probe of commit 27e8992).
  bool programmatic_launch = false;
  // TORCH_SM90_SDPA_PERSISTENT=1 / 0: the main kernel's CTAs take several tiles each (one CTA
  // per SM) / one tile each (BwdParams::persistent). Default: kPersistentByDefault.
  bool persistent = kPersistentByDefault;
  // TORCH_SM90_SDPA_PREPOST_ORDER=reversed / forward: the pre- and postprocess walk the rows
  // from the last (batch, head) / from the first (BwdParams::prepost_reversed). Default:
  // kPrepostReversedByDefault.
  bool prepost_reversed = kPrepostReversedByDefault;
  // TORCH_SM90_SDPA_SECTION_HEADS=N (0 < N < 2^30): the main kernel's scheduling sections
  // hold N head groups each (BwdParams::heads_per_section, for A/B measurements).
  // Default: 0, the launch's rule.
  int heads_per_section = 0;
};
Switches switches();  // a copy (reload_switches() may run on another thread)
void reload_switches();

// The kernels' params of a served problem. `problem.layout` must describe the tensors behind
// `ptrs` (the copies' layouts where operands were copied).
BwdParams make_params(const BwdProblem& problem, const BwdPointers& ptrs, float scale);

// Preprocess, (with a mask) the tile classification, main kernel and postprocess on `stream`,
// on the current CUDA device. Checks what
// protects memory (non-null pointers, positive sizes, the compiled variant, TMA-addressable
// operands) and throws std::invalid_argument / std::runtime_error otherwise.
void run(const BwdParams& params, cudaStream_t stream);

// Parts of run(), for tests of the pre/post kernels and of the mask classification. Empty
// problems launch nothing.
void run_preprocess(const BwdParams& params, cudaStream_t stream);
void run_postprocess(const BwdParams& params, cudaStream_t stream);
void run_classification(const BwdParams& params, cudaStream_t stream);

// Facts of the current CUDA device, read once per device.
struct DeviceFacts {
  int index = -1, cc_major = 0, cc_minor = 0, num_sms = 0, l2_bytes = 0;
  std::string name;
};
const DeviceFacts& current_device_facts();

// The compiled main-kernel variants: (dtype code, head dim) with Dv == D, and the (D, Dv)
// pairs with Dv != D (TILES_DV in csrc/generate_instantiations.py).
bool main_kernel_compiled();
std::vector<std::pair<int, int>> compiled_variants();  // (dtype code, head dim)
struct DvVariant {
  int dtype = 0, head_dim = 0, head_dim_v = 0;
};
std::vector<DvVariant> compiled_dv_variants();
// head_dim_v < 0: head_dim (the variant of Dv == D)
bool has_variant(int head_dim, int dtype, int head_dim_v = -1);
const char* dtype_name(int dtype);  // "fp16", "bf16" or "unknown"

}  // namespace device
}  // namespace sm90_sdpa
