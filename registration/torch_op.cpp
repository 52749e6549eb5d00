// The CUDA kernel of torch_sm90_sdpa::sdpa_backward, registered with torch's dispatcher in C++
// through torch's stable C ABI (the aoti_torch_* shim functions), so that a call from Python or
// from compiled code reaches the kernels without running any Python.
//
// _C stays free of torch at build and link time: the few shim functions used here are looked
// up at registration in the libtorch libraries the running torch already loaded (dlopen with
// RTLD_NOLOAD), and only functions and value encodings of torch 2.9's stable ABI are used
// (ints, doubles and bools in the low bytes of a StableIValue, tensors as AtenTensorHandles
// that the kernel owns), which later torch versions keep serving.
//
// The schema, the CPU reference, the fake kernel and the (absent) autograd formula are defined
// in Python (torch_sm90_sdpa/ops.py), which calls register_torch_ops() when _C loads.
#include "torch_op.h"

#include <cuda_runtime.h>
#include <dlfcn.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>

#include "bwd_device.h"

namespace sm90_sdpa {
namespace torch_op {
namespace {

// ---- the stable C ABI, as torch 2.9 defines it ----------------------------------------------

using AOTITorchError = int32_t;
struct AtenTensorOpaque;
using AtenTensorHandle = AtenTensorOpaque*;
struct TorchLibraryOpaque;
using TorchLibraryHandle = TorchLibraryOpaque*;
using StableIValue = uint64_t;
using BoxedKernel = void (*)(StableIValue*, uint64_t, uint64_t);

struct Shim {
  int32_t (*device_type_cuda)();
  int32_t (*device_type_cpu)();
  int32_t (*dtype_float16)();
  int32_t (*dtype_bfloat16)();
  int32_t (*dtype_float32)();
  int32_t (*dtype_float64)();
  int32_t (*dtype_int64)();
  int32_t (*dtype_bool)();
  AOTITorchError (*get_data_ptr)(AtenTensorHandle, void**);
  AOTITorchError (*get_dim)(AtenTensorHandle, int64_t*);
  AOTITorchError (*get_sizes)(AtenTensorHandle, int64_t**);
  AOTITorchError (*get_strides)(AtenTensorHandle, int64_t**);
  AOTITorchError (*get_dtype)(AtenTensorHandle, int32_t*);
  AOTITorchError (*get_device_type)(AtenTensorHandle, int32_t*);
  AOTITorchError (*get_device_index)(AtenTensorHandle, int32_t*);
  AOTITorchError (*empty_strided)(int64_t, const int64_t*, const int64_t*, int32_t, int32_t,
                                  int32_t, AtenTensorHandle*);
  AOTITorchError (*delete_tensor_object)(AtenTensorHandle);
  AOTITorchError (*clone)(AtenTensorHandle, AtenTensorHandle*);
  AOTITorchError (*zero_)(AtenTensorHandle);
  AOTITorchError (*library_init_impl)(const char*, const char*, const char*, uint32_t,
                                      TorchLibraryHandle*);
  AOTITorchError (*library_impl)(TorchLibraryHandle, const char*, BoxedKernel);
  // from libtorch_cuda (null for a CPU-only torch)
  AOTITorchError (*get_current_cuda_stream)(int32_t, void**);
  // dtype / device codes, read once
  int32_t cuda = -1, cpu = -1, f16 = -1, bf16 = -1, f32 = -1, f64 = -1, i64 = -1, b8 = -1;
};

Shim g_shim;
std::mutex g_mu;
bool g_loaded = false;
bool g_cuda_registered = false;
bool g_probe_registered = false;
std::atomic<uint64_t> g_cuda_calls{0};
TorchLibraryHandle g_cuda_lib = nullptr;
TorchLibraryHandle g_cpu_lib = nullptr;

template <class... T>
std::string cat(const T&... parts) {
  std::ostringstream s;
  (s << ... << parts);
  return s.str();
}

[[noreturn]] void fail(const std::string& msg) { throw std::runtime_error(msg); }

void check(AOTITorchError err, const char* what) {
  if (err != 0) fail(cat("torch_sm90_sdpa: torch's ", what, " failed"));
}

template <class Fn>
bool find(void* lib, const char* name, Fn& fn, std::string& missing) {
  void* sym = lib ? dlsym(lib, name) : nullptr;
  if (sym == nullptr) {
    missing += missing.empty() ? name : cat(", ", name);
    return false;
  }
  fn = reinterpret_cast<Fn>(sym);
  return true;
}

// Looks the shim up in the loaded libtorch_cpu (and libtorch_cuda, when given). Never loads a
// library that the running torch has not loaded itself.
void load_shim(const std::string& cpu_lib, const std::string& cuda_lib) {
  if (g_loaded) return;
  void* cpu = dlopen(cpu_lib.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (cpu == nullptr) fail(cat("libtorch_cpu is not loaded from ", cpu_lib));
  void* cuda = cuda_lib.empty() ? nullptr : dlopen(cuda_lib.c_str(), RTLD_NOW | RTLD_NOLOAD);
  std::string missing;
  Shim s{};
  find(cpu, "aoti_torch_device_type_cuda", s.device_type_cuda, missing);
  find(cpu, "aoti_torch_device_type_cpu", s.device_type_cpu, missing);
  find(cpu, "aoti_torch_dtype_float16", s.dtype_float16, missing);
  find(cpu, "aoti_torch_dtype_bfloat16", s.dtype_bfloat16, missing);
  find(cpu, "aoti_torch_dtype_float32", s.dtype_float32, missing);
  find(cpu, "aoti_torch_dtype_float64", s.dtype_float64, missing);
  find(cpu, "aoti_torch_dtype_int64", s.dtype_int64, missing);
  find(cpu, "aoti_torch_dtype_bool", s.dtype_bool, missing);
  find(cpu, "aoti_torch_get_data_ptr", s.get_data_ptr, missing);
  find(cpu, "aoti_torch_get_dim", s.get_dim, missing);
  find(cpu, "aoti_torch_get_sizes", s.get_sizes, missing);
  find(cpu, "aoti_torch_get_strides", s.get_strides, missing);
  find(cpu, "aoti_torch_get_dtype", s.get_dtype, missing);
  find(cpu, "aoti_torch_get_device_type", s.get_device_type, missing);
  find(cpu, "aoti_torch_get_device_index", s.get_device_index, missing);
  find(cpu, "aoti_torch_empty_strided", s.empty_strided, missing);
  find(cpu, "aoti_torch_delete_tensor_object", s.delete_tensor_object, missing);
  find(cpu, "aoti_torch_clone", s.clone, missing);
  find(cpu, "aoti_torch_zero_", s.zero_, missing);
  find(cpu, "aoti_torch_library_init_impl", s.library_init_impl, missing);
  find(cpu, "aoti_torch_library_impl", s.library_impl, missing);
  if (!missing.empty()) fail(cat("libtorch_cpu lacks the stable ABI functions ", missing));
  if (cuda != nullptr) {
    std::string missing_cuda;
    find(cuda, "aoti_torch_get_current_cuda_stream", s.get_current_cuda_stream, missing_cuda);
  }
  s.cuda = s.device_type_cuda();
  s.cpu = s.device_type_cpu();
  s.f16 = s.dtype_float16();
  s.bf16 = s.dtype_bfloat16();
  s.f32 = s.dtype_float32();
  s.f64 = s.dtype_float64();
  s.i64 = s.dtype_int64();
  s.b8 = s.dtype_bool();
  g_shim = s;
  g_loaded = true;
}

// ---- StableIValue (torch 2.9 encoding: the value's bytes, zero-extended) ---------------------

template <class T>
T from_stack(StableIValue v) {
  static_assert(sizeof(T) <= sizeof(StableIValue));
  T out;
  std::memcpy(&out, &v, sizeof(T));
  return out;
}

template <class T>
StableIValue to_stack(T v) {
  StableIValue out = 0;
  std::memcpy(&out, &v, sizeof(T));
  return out;
}

// A `Tensor?` argument (torch 2.9 encoding: null for None, else a heap-allocated StableIValue
// holding the tensor handle, which the kernel owns and frees).
AtenTensorHandle optional_tensor(StableIValue v) {
  StableIValue* boxed = from_stack<StableIValue*>(v);
  if (boxed == nullptr) return nullptr;
  AtenTensorHandle h = from_stack<AtenTensorHandle>(*boxed);
  delete boxed;
  return h;
}

// A `float?` argument (the same encoding as `Tensor?`): false for None, else true and *value.
bool optional_double(StableIValue v, double* value) {
  StableIValue* boxed = from_stack<StableIValue*>(v);
  if (boxed == nullptr) return false;
  *value = from_stack<double>(*boxed);
  delete boxed;
  return true;
}

// An owned tensor handle: deleted when it goes out of scope unless released to the stack.
class Owned {
 public:
  Owned() = default;
  explicit Owned(AtenTensorHandle h) : h_(h) {}
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  Owned(Owned&& o) noexcept : h_(o.h_) { o.h_ = nullptr; }
  Owned& operator=(Owned&& o) noexcept {
    reset();
    h_ = o.h_;
    o.h_ = nullptr;
    return *this;
  }
  ~Owned() { reset(); }
  AtenTensorHandle get() const { return h_; }
  AtenTensorHandle release() {
    AtenTensorHandle h = h_;
    h_ = nullptr;
    return h;
  }

 private:
  void reset() {
    if (h_ != nullptr) g_shim.delete_tensor_object(h_);
    h_ = nullptr;
  }
  AtenTensorHandle h_ = nullptr;
};

// Metadata of one tensor argument, read through the shim.
struct TensorInfo {
  const char* name = "";
  int64_t dim = 0;
  const int64_t* sizes = nullptr;
  const int64_t* strides = nullptr;
  int32_t dtype = -1, device_type = -1, device_index = -1;
  void* data = nullptr;
};

TensorInfo read(AtenTensorHandle h, const char* name) {
  TensorInfo t;
  t.name = name;
  int64_t* sizes = nullptr;
  int64_t* strides = nullptr;
  check(g_shim.get_dim(h, &t.dim), "aoti_torch_get_dim");
  check(g_shim.get_sizes(h, &sizes), "aoti_torch_get_sizes");
  check(g_shim.get_strides(h, &strides), "aoti_torch_get_strides");
  check(g_shim.get_dtype(h, &t.dtype), "aoti_torch_get_dtype");
  check(g_shim.get_device_type(h, &t.device_type), "aoti_torch_get_device_type");
  check(g_shim.get_device_index(h, &t.device_index), "aoti_torch_get_device_index");
  check(g_shim.get_data_ptr(h, &t.data), "aoti_torch_get_data_ptr");
  t.sizes = sizes;
  t.strides = strides;
  return t;
}

std::string dtype_str(int32_t code) {
  const Shim& s = g_shim;
  if (code == s.f16) return "torch.float16";
  if (code == s.bf16) return "torch.bfloat16";
  if (code == s.f32) return "torch.float32";
  if (code == s.f64) return "torch.float64";
  if (code == s.b8) return "torch.bool";
  return cat("dtype code ", code);
}

// "(a, b, c)" as Python prints a tuple of ints
std::string tuple_str(const int64_t* v, int64_t n) {
  std::ostringstream s;
  s << "(";
  for (int64_t i = 0; i < n; ++i) s << (i ? ", " : "") << v[i];
  s << (n == 1 ? ",)" : ")");
  return s.str();
}

std::string shape_str(const TensorInfo& t) { return tuple_str(t.sizes, t.dim); }
std::string strides_str(const TensorInfo& t) { return tuple_str(t.strides, t.dim); }

// The strides torch.empty_like gives: a non-overlapping and dense tensor keeps its strides;
// any other strided tensor (a view of a packed projection, expanded or padded rows) gets dense
// strides in the same order of dimensions as its own (c10's infer_dense_strides: stride-0
// dimensions keep their place, equal strides put the smaller size first).
void empty_like_strides(const TensorInfo& t, int64_t* out) {
  const int n = static_cast<int>(t.dim);
  // non-overlapping and dense? (dims sorted by stride, those of size < 2 last)
  int perm[8];
  for (int i = 0; i < n; ++i) perm[i] = i;
  for (int i = 1; i < n; ++i) {
    for (int j = i; j > 0; --j) {
      const int a = perm[j - 1], b = perm[j];
      const bool a_small = t.sizes[a] < 2, b_small = t.sizes[b] < 2;
      const bool swap = a_small ? !b_small : (!b_small && t.strides[b] < t.strides[a]);
      if (!swap) break;
      perm[j - 1] = b;
      perm[j] = a;
    }
  }
  bool dense = true;
  int64_t require = 1;
  for (int i = 0; i < n; ++i) {
    const int64_t size = t.sizes[perm[i]];
    if (size < 2) break;
    if (t.strides[perm[i]] != require) {
      dense = false;
      break;
    }
    require *= size;
  }
  if (dense) {
    for (int i = 0; i < n; ++i) out[i] = t.strides[i];
    return;
  }
  // dense strides in the input's order: innermost first, from the last dim backwards
  for (int i = 0; i < n; ++i) perm[i] = n - 1 - i;
  auto compare = [&](int d0, int d1) {  // > 0: d0 goes after d1
    const int64_t s0 = t.strides[d0], s1 = t.strides[d1];
    if (s0 == 0 || s1 == 0) return 0;  // ambiguous: keep the contiguous order
    if (s0 != s1) return s0 < s1 ? -1 : 1;
    return t.sizes[d0] > t.sizes[d1] ? 1 : 0;
  };
  for (int i = 1; i < n; ++i) {
    int d1 = i;
    for (int d0 = i - 1; d0 >= 0; --d0) {
      const int c = compare(perm[d0], perm[d1]);
      if (c > 0) {
        const int tmp = perm[d0];
        perm[d0] = perm[d1];
        perm[d1] = tmp;
        d1 = d0;
      } else if (c < 0) {
        break;
      }
    }
  }
  int64_t acc = 1;
  for (int i = 0; i < n; ++i) {
    out[perm[i]] = acc;
    if (t.sizes[perm[i]] > 1) acc *= t.sizes[perm[i]];
  }
}

Owned empty_like(const TensorInfo& t) {
  int64_t strides[8];
  empty_like_strides(t, strides);
  AtenTensorHandle h = nullptr;
  check(g_shim.empty_strided(t.dim, t.sizes, strides, t.dtype, t.device_type, t.device_index, &h),
        "aoti_torch_empty_strided");
  return Owned(h);
}

int address_align(const void* p) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  int align = 1;
  while (align < 16 && a % (2 * align) == 0) align *= 2;
  return align;
}

device::OperandLayout layout_of(const TensorInfo& t) {
  device::OperandLayout l;
  l.batch_stride = t.strides[0];
  l.head_stride = t.strides[1];
  l.row_stride = t.strides[2];
  l.col_stride = t.dim > 3 ? t.strides[3] : 1;
  l.address_align = address_align(t.data);
  return l;
}

// ---- argument checks: the same rules and messages as torch_sm90_sdpa/_validation.py -----------

void expect_dim(const TensorInfo& t, int64_t dim) {
  if (t.dim != dim) {
    fail(cat(t.name, ": expected a ", dim, "-D tensor, got shape ", shape_str(t)));
  }
}

void expect_size(const TensorInfo& t, int dim, int64_t want, const char* what, const char* source) {
  if (t.sizes[dim] != want) {
    fail(cat(t.name, ": expected ", what, " ", want, " (as ", source, "), got ", t.sizes[dim],
             " (shape ", shape_str(t), ")"));
  }
}

void expect_last_dim_contiguous(const TensorInfo& t) {
  int64_t numel = 1;
  for (int64_t i = 0; i < t.dim; ++i) numel *= t.sizes[i];
  // (an empty tensor has no element to read: any strides do)
  if (t.sizes[t.dim - 1] > 1 && t.strides[t.dim - 1] != 1 && numel != 0) {
    fail(cat(t.name, ": expected a contiguous last dimension (stride(-1) == 1), got strides ",
             strides_str(t), "; call .contiguous() first"));
  }
}

void check_args(const TensorInfo& go, const TensorInfo& q, const TensorInfo& k,
                const TensorInfo& v, const TensorInfo& out, const TensorInfo& lse, double scale) {
  for (const TensorInfo* t : {&q, &k, &v, &go, &out}) expect_dim(*t, 4);
  expect_dim(lse, 3);
  for (const TensorInfo* t : {&k, &v, &go, &out, &lse}) {
    if (t->device_type != q.device_type || t->device_index != q.device_index) {
      fail(cat(t->name, ": expected a tensor on the device of query (cuda:", q.device_index,
               ")"));
    }
  }
  if (q.dtype != g_shim.f16 && q.dtype != g_shim.bf16) {
    fail(cat("query: the SM90 CUDA kernel expects dtype torch.float16 or torch.bfloat16, got ",
             dtype_str(q.dtype)));
  }
  for (const TensorInfo* t : {&k, &v, &go, &out}) {
    if (t->dtype != q.dtype) {
      fail(cat(t->name, ": expected dtype ", dtype_str(q.dtype), " (the dtype of query), got ",
               dtype_str(t->dtype)));
    }
  }
  const int64_t B = q.sizes[0], Hq = q.sizes[1], Sq = q.sizes[2], D = q.sizes[3];
  const int64_t Hkv = k.sizes[1], Sk = k.sizes[2];
  expect_size(k, 0, B, "batch size", "query.size(0)");
  expect_size(v, 0, B, "batch size", "query.size(0)");
  expect_size(k, 3, D, "head dim", "query.size(-1)");
  if (Hkv != 0 && Hq % Hkv != 0) {  // Hkv = 0: no key at all, every gradient is zero
    fail(cat("key: expected a number of heads that divides query's ", Hq,
             " heads (grouped-query attention), got ", Hkv));
  }
  expect_size(v, 1, Hkv, "number of heads", "key.size(1)");
  expect_size(v, 2, Sk, "sequence length", "key.size(2)");
  for (const TensorInfo* t : {&q, &k, &v}) expect_last_dim_contiguous(*t);
  const int64_t Dv = v.sizes[3];
  for (const TensorInfo* t : {&out, &go}) {
    if (t->sizes[0] != B || t->sizes[1] != Hq || t->sizes[2] != Sq || t->sizes[3] != Dv) {
      fail(cat(t->name, ": expected shape (", B, ", ", Hq, ", ", Sq, ", ", Dv,
               ") ([B, Hq, Sq, Dv] from query and value), got ", shape_str(*t)));
    }
    expect_last_dim_contiguous(*t);
  }
  if (lse.sizes[0] != B || lse.sizes[1] != Hq || lse.sizes[2] != Sq) {
    fail(cat("lse: expected shape (", B, ", ", Hq, ", ", Sq, ") ([B, Hq, Sq] from query), got ",
             shape_str(lse)));
  }
  if (lse.dtype != g_shim.f32) {
    fail(cat("lse: expected dtype torch.float32, got ", dtype_str(lse.dtype)));
  }
  if (!std::isfinite(scale)) fail(cat("scale: expected a finite float, got ", scale));
  const int64_t limit = INT32_MAX;
  if (B > limit || Hq > limit || Sq > limit || Sk > limit || D > limit || Dv > limit) {
    fail(cat("query: sizes beyond int32 are not supported by the SM90 kernel, got shape ",
             shape_str(q)));
  }
}

// The mask as a [B, Hq, Sq, Sk] view: its dims right-aligned to those, each 1 (broadcast,
// stride 0) or equal. Returns the MaskKind code.
int check_mask(const TensorInfo& m, const TensorInfo& q, const TensorInfo& k,
               device::OperandLayout& layout) {
  const Shim& s = g_shim;
  if (m.device_type != q.device_type || m.device_index != q.device_index) {
    fail(cat("attn_mask: expected a tensor on the device of query (cuda:", q.device_index, ")"));
  }
  const int kind = m.dtype == s.b8 ? 1 : m.dtype == s.f16 ? 2 : m.dtype == s.bf16 ? 3
                   : m.dtype == s.f32 ? 4 : 0;
  if (kind == 0) {
    fail(cat("attn_mask: expected dtype torch.bool (True = attend) or an additive float mask "
             "(torch.float32, torch.float16, torch.bfloat16), got ", dtype_str(m.dtype)));
  }
  const int64_t target[4] = {q.sizes[0], q.sizes[1], q.sizes[2], k.sizes[2]};
  if (m.dim > 4) {
    fail(cat("attn_mask: expected at most 4 dims, broadcastable to [B, Hq, Sq, Sk] = ",
             tuple_str(target, 4), ", got shape ", shape_str(m)));
  }
  int64_t strides[4] = {0, 0, 0, 0};
  for (int i = 0; i < 4; ++i) {
    const int64_t d = int64_t(i) - (4 - m.dim);  // the mask's dim aligned to target dim i
    if (d < 0) continue;
    if (m.sizes[d] == target[i]) {
      strides[i] = target[i] == 1 ? 0 : m.strides[d];
    } else if (m.sizes[d] != 1) {
      fail(cat("attn_mask: expected a shape broadcastable to [B, Hq, Sq, Sk] = ",
               tuple_str(target, 4), ", got shape ", shape_str(m)));
    }
  }
  layout.batch_stride = strides[0];
  layout.head_stride = strides[1];
  layout.row_stride = strides[2];
  layout.col_stride = strides[3];
  layout.address_align = address_align(m.data);
  return kind;
}

// ---- the kernel -------------------------------------------------------------------------------

class DeviceScope {  // the tensors' device current in this CUDA runtime, restored on exit
 public:
  explicit DeviceScope(int index) {
    if (cudaGetDevice(&prev_) != cudaSuccess) {
      cudaGetLastError();
      prev_ = -1;
    }
    if (prev_ != index) {
      if (cudaSetDevice(index) != cudaSuccess) {
        cudaGetLastError();
        fail(cat("torch_sm90_sdpa: cannot make cuda:", index, " current"));
      }
    } else {
      prev_ = -1;  // nothing to restore
    }
  }
  ~DeviceScope() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }

 private:
  int prev_ = -1;
};

// sdpa_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
//               bool is_causal=False, float? scale=None, bool deterministic=False,
//               Tensor? attn_mask=None) -> (Tensor, Tensor, Tensor)
// scale None: 1/sqrt(D) (1 for D = 0, where every score is 0 whatever the scale).
void sdpa_backward_cuda(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  if (num_args != 10 || num_outputs != 3) {
    fail(cat("torch_sm90_sdpa::sdpa_backward: the registered kernel expects 10 arguments and 3 "
             "results, got ", num_args, " and ", num_outputs));
  }
  Owned h_mask(optional_tensor(stack[9]));
  Owned h_go(from_stack<AtenTensorHandle>(stack[0])), h_q(from_stack<AtenTensorHandle>(stack[1])),
      h_k(from_stack<AtenTensorHandle>(stack[2])), h_v(from_stack<AtenTensorHandle>(stack[3])),
      h_out(from_stack<AtenTensorHandle>(stack[4])), h_lse(from_stack<AtenTensorHandle>(stack[5]));
  const bool is_causal = from_stack<bool>(stack[6]);
  double scale = 0.0;
  const bool scale_given = optional_double(stack[7], &scale);
  const bool deterministic = from_stack<bool>(stack[8]);

  TensorInfo go = read(h_go.get(), "grad_out"), q = read(h_q.get(), "query"),
             k = read(h_k.get(), "key"), v = read(h_v.get(), "value"),
             out = read(h_out.get(), "out"), lse = read(h_lse.get(), "lse");
  if (!scale_given) {
    const int64_t d = q.dim == 4 ? q.sizes[3] : 0;
    scale = d > 0 ? 1.0 / std::sqrt(static_cast<double>(d)) : 1.0;
  }
  check_args(go, q, k, v, out, lse, scale);
  TensorInfo mask;
  device::OperandLayout mask_layout;
  int mask_kind = 0;
  if (h_mask.get() != nullptr) {
    mask = read(h_mask.get(), "attn_mask");
    mask_kind = check_mask(mask, q, k, mask_layout);
  }

  device::BwdProblem p;
  p.batch = int(q.sizes[0]);
  p.heads_q = int(q.sizes[1]);
  p.heads_kv = int(k.sizes[1]);
  p.seqlen_q = int(q.sizes[2]);
  p.seqlen_k = int(k.sizes[2]);
  p.head_dim = int(q.sizes[3]);
  p.head_dim_v = int(v.sizes[3]);
  p.dtype = q.dtype == g_shim.f16 ? 0 : 1;
  p.is_causal = is_causal;
  p.deterministic = deterministic;
  p.mask_kind = mask_kind;
  p.layout[device::kMask] = mask_layout;
  DeviceScope scope(q.device_index);
  const device::DeviceFacts& facts = device::current_device_facts();
  p.cc_major = facts.cc_major;
  p.cc_minor = facts.cc_minor;
  p.num_sms = facts.num_sms;
  const TensorInfo* in[] = {&q, &k, &v, &out, &go, &lse};
  for (int i = 0; i < 6; ++i) p.layout[i] = layout_of(*in[i]);

  Owned dq = empty_like(q), dk = empty_like(k), dv = empty_like(v);
  TensorInfo dq_i = read(dq.get(), "dq"), dk_i = read(dk.get(), "dk"), dv_i = read(dv.get(), "dv");
  p.layout[device::kDq] = layout_of(dq_i);
  p.layout[device::kDk] = layout_of(dk_i);
  p.layout[device::kDv] = layout_of(dv_i);

  const device::Decision d = device::can_implement(p);
  if (d.verdict == device::Verdict::kUnsupported) {
    fail(cat("torch_sm90_sdpa::sdpa_backward on CUDA: ", d.reason, ": ", d.detail));
  }
  g_cuda_calls.fetch_add(1, std::memory_order_relaxed);
  if (d.verdict == device::Verdict::kEmpty) {
    for (const Owned* t : {&dq, &dk, &dv}) check(g_shim.zero_(t->get()), "aoti_torch_zero_");
  } else {
    // Operands TMA cannot address (misaligned views, stride-0 heads, padded rows) are copied.
    Owned copies[4];
    device::BwdPointers ptrs;
    const void** targets[] = {&ptrs.q, &ptrs.k, &ptrs.v, nullptr, &ptrs.dout};
    const TensorInfo* sources[] = {&q, &k, &v, nullptr, &go};
    for (int op : {device::kQ, device::kK, device::kV, device::kDout}) {
      if (d.copy_mask & (1u << op)) {
        Owned& c = copies[op == device::kDout ? 3 : op];
        AtenTensorHandle h = nullptr;
        check(g_shim.clone(op == device::kQ ? h_q.get() : op == device::kK ? h_k.get()
                           : op == device::kV ? h_v.get() : h_go.get(), &h),
              "aoti_torch_clone");
        c = Owned(h);
        TensorInfo ci = read(c.get(), sources[op]->name);
        p.layout[op] = layout_of(ci);
        *targets[op] = ci.data;
      } else {
        *targets[op] = sources[op]->data;
      }
    }
    ptrs.out = out.data;
    ptrs.lse = static_cast<const float*>(lse.data);
    ptrs.mask = mask_kind != 0 ? mask.data : nullptr;
    ptrs.dq = dq_i.data;
    ptrs.dk = dk_i.data;
    ptrs.dv = dv_i.data;
    const device::WorkspaceLayout w = device::workspace_layout(p);
    const int64_t ws_size = w.bytes / 4, ws_stride = 1;
    AtenTensorHandle ws_h = nullptr;
    check(g_shim.empty_strided(1, &ws_size, &ws_stride, g_shim.f32, q.device_type,
                               q.device_index, &ws_h),
          "aoti_torch_empty_strided");
    Owned ws(ws_h);
    check(g_shim.get_data_ptr(ws.get(), &ptrs.workspace), "aoti_torch_get_data_ptr");
    void* stream = nullptr;
    check(g_shim.get_current_cuda_stream(q.device_index, &stream),
          "aoti_torch_get_current_cuda_stream");
    device::run(device::make_params(p, ptrs, static_cast<float>(scale)),
                static_cast<cudaStream_t>(stream));
    // The workspace and copies are freed here: torch's caching allocator hands their memory
    // out again only in stream order, after the kernels queued on this (current) stream.
  }
  stack[0] = to_stack(dq.release());
  stack[1] = to_stack(dk.release());
  stack[2] = to_stack(dv.release());
}

// _stable_abi_probe(Tensor t, bool flag, float x, Tensor? maybe=None) -> (Tensor, Tensor): on
// CPU, for tests of this file's plumbing without a GPU. Returns (info, like): info is int64
// [3 + 2 * dim + 3] = [dim, dtype is float16/bfloat16/float32/float64/bool (0..4, else -1), flag,
// sizes..., strides..., round(x * 1000) or INT64_MIN for x None, the byte alignment of t's
// address, maybe's dim or -1 for None], and like = empty_like(t) as this file computes it.
void stable_abi_probe(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  if (num_args != 4 || num_outputs != 2) fail("_stable_abi_probe: bad arity");
  Owned h(from_stack<AtenTensorHandle>(stack[0]));
  const bool flag = from_stack<bool>(stack[1]);
  double x = 0.0;
  const bool x_given = optional_double(stack[2], &x);
  Owned maybe(optional_tensor(stack[3]));
  TensorInfo t = read(h.get(), "t");
  int64_t maybe_dim = -1;
  if (maybe.get() != nullptr) check(g_shim.get_dim(maybe.get(), &maybe_dim), "aoti_torch_get_dim");
  const int64_t n = 3 + 2 * t.dim + 3, one = 1;
  AtenTensorHandle info_h = nullptr;
  check(g_shim.empty_strided(1, &n, &one, g_shim.i64, g_shim.cpu, 0, &info_h),
        "aoti_torch_empty_strided");
  Owned info(info_h);
  void* raw = nullptr;
  check(g_shim.get_data_ptr(info.get(), &raw), "aoti_torch_get_data_ptr");
  int64_t* o = static_cast<int64_t*>(raw);
  const Shim& s = g_shim;
  o[0] = t.dim;
  o[1] = t.dtype == s.f16 ? 0 : t.dtype == s.bf16 ? 1 : t.dtype == s.f32 ? 2 : t.dtype == s.f64 ? 3
        : t.dtype == s.b8 ? 4 : -1;
  o[2] = flag ? 1 : 0;
  for (int64_t i = 0; i < t.dim; ++i) {
    o[3 + i] = t.sizes[i];
    o[3 + t.dim + i] = t.strides[i];
  }
  o[3 + 2 * t.dim] = x_given ? static_cast<int64_t>(std::llround(x * 1000.0)) : INT64_MIN;
  o[4 + 2 * t.dim] = address_align(t.data);
  o[5 + 2 * t.dim] = maybe_dim;
  Owned like = empty_like(t);
  stack[0] = to_stack(info.release());
  stack[1] = to_stack(like.release());
}

}  // namespace

std::string register_ops(const std::string& libtorch_cpu, const std::string& libtorch_cuda,
                         bool cuda_kernel, bool probe) {
  std::lock_guard<std::mutex> lock(g_mu);
  try {
    load_shim(libtorch_cpu, libtorch_cuda);
  } catch (const std::exception& e) {
    return e.what();
  }
  if (cuda_kernel && !g_cuda_registered) {
    if (g_shim.get_current_cuda_stream == nullptr) {
      return "libtorch_cuda (aoti_torch_get_current_cuda_stream) is not loaded: a CPU-only torch";
    }
    if (g_shim.library_init_impl("torch_sm90_sdpa", "CUDA", __FILE__, __LINE__, &g_cuda_lib) != 0 ||
        g_shim.library_impl(g_cuda_lib, "sdpa_backward", &sdpa_backward_cuda) != 0) {
      return "torch rejected the CUDA kernel of torch_sm90_sdpa::sdpa_backward";
    }
    g_cuda_registered = true;
  }
  if (probe && !g_probe_registered) {
    if (g_shim.library_init_impl("torch_sm90_sdpa", "CPU", __FILE__, __LINE__, &g_cpu_lib) != 0 ||
        g_shim.library_impl(g_cpu_lib, "_stable_abi_probe", &stable_abi_probe) != 0) {
      return "torch rejected the CPU kernel of torch_sm90_sdpa::_stable_abi_probe";
    }
    g_probe_registered = true;
  }
  return "";
}

bool cuda_kernel_registered() { return g_cuda_registered; }

uint64_t cuda_calls() { return g_cuda_calls.load(std::memory_order_relaxed); }

}  // namespace torch_op
}  // namespace sm90_sdpa
