// The pybind11 module torch_sm90_sdpa._C: torch-free (pybind11 + the CUDA runtime only).
//
//   _C.BwdParams()                  every field of sm90_sdpa::BwdParams as a read/write property;
//                                   pointers as Python ints (tensor.data_ptr()), dtype as an int
//                                   (0 fp16, 1 bf16)
//   _C.preprocess(params, stream)   stream: int (torch.cuda.Stream.cuda_stream)
//   _C.postprocess(params, stream)
//   _C.backward(params, stream)
//   _C.has_variant(head_dim, dtype) -> bool
//   _C.compiled_variants() -> list[(dtype name, head dim)]
//   _C.build_info() -> dict
//   _C.SEQ_ROUND, _C.FP16, _C.BF16
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <sstream>
#include <string>

#include "bwd_api.h"
#include "bwd_params.h"

#if __has_include("instantiations/build_info.h")
#include "instantiations/build_info.h"
#endif
#ifndef TORCH_SM90_SDPA_NVCC_VERSION
#define TORCH_SM90_SDPA_NVCC_VERSION "unknown"
#endif
#ifndef TORCH_SM90_SDPA_CUTLASS_VERSION
#define TORCH_SM90_SDPA_CUTLASS_VERSION "unknown"
#endif
#ifndef TORCH_SM90_SDPA_NVCC_FLAGS
#define TORCH_SM90_SDPA_NVCC_FLAGS ""
#endif
#ifndef TORCH_SM90_SDPA_CXX_FLAGS
#define TORCH_SM90_SDPA_CXX_FLAGS ""
#endif
#ifndef TORCH_SM90_SDPA_ARCH
#define TORCH_SM90_SDPA_ARCH "sm_90a"
#endif

namespace py = pybind11;
using sm90_sdpa::BwdParams;
using sm90_sdpa::DType;

namespace {

cudaStream_t to_stream(std::uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

template <typename T>
std::uintptr_t ptr_to_int(T* p) {
  return reinterpret_cast<std::uintptr_t>(p);
}

int dtype_code(const BwdParams& p) { return static_cast<int>(p.dtype); }

void set_dtype(BwdParams& p, int code) {
  if (code != static_cast<int>(DType::kFloat16) && code != static_cast<int>(DType::kBFloat16)) {
    throw py::value_error("torch_sm90_sdpa: BwdParams.dtype must be 0 (fp16) or 1 (bf16), got " +
                          std::to_string(code));
  }
  p.dtype = static_cast<DType>(code);
}

std::string repr(const BwdParams& p) {
  std::ostringstream s;
  s << "BwdParams(batch=" << p.batch << ", heads_q=" << p.heads_q << ", heads_kv=" << p.heads_kv
    << ", seqlen_q=" << p.seqlen_q << ", seqlen_k=" << p.seqlen_k << ", head_dim=" << p.head_dim
    << ", head_dim_v=" << p.head_dim_v << ", dtype=" << sm90_sdpa::api::dtype_name(dtype_code(p))
    << ", scale=" << p.scale << ", is_causal=" << (p.is_causal ? "True" : "False")
    << ", deterministic=" << (p.deterministic ? "True" : "False")
    << ", gqa_accum=" << (p.dk_accum != nullptr ? "True" : "False") << ")";
  return s.str();
}

py::list variants_list() {
  py::list out;
  for (const auto& v : sm90_sdpa::api::compiled_variants()) {
    out.append(py::make_tuple(sm90_sdpa::api::dtype_name(v.first), v.second));
  }
  return out;
}

py::dict build_info() {
  py::dict d;
  d["main_kernel_compiled"] = sm90_sdpa::api::main_kernel_compiled();
  d["variants"] = variants_list();
  d["arch"] = TORCH_SM90_SDPA_ARCH;
  d["nvcc_version"] = TORCH_SM90_SDPA_NVCC_VERSION;
  d["cutlass_version"] = TORCH_SM90_SDPA_CUTLASS_VERSION;
  d["build_flags"] = TORCH_SM90_SDPA_NVCC_FLAGS;
  d["cxx_flags"] = TORCH_SM90_SDPA_CXX_FLAGS;
  d["cudart_version"] = CUDART_VERSION;  // the statically linked CUDA runtime
  d["seq_round"] = sm90_sdpa::kSeqRound;
  return d;
}

// ---- BwdParams.assign: one call instead of ~60 property writes (the per-call fast path) ----
// Order (34 positional values; strides as tuples whose first three items are used):
//   batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, head_dim_v, dtype, scale,
//   is_causal, deterministic,
//   q_ptr, q_strides, k_ptr, k_strides, v_ptr, v_strides, out_ptr, out_strides,
//   dout_ptr, dout_strides, lse_ptr, lse_strides, dq_ptr, dq_strides, dk_ptr, dk_strides,
//   dv_ptr, dv_strides,
//   dsum_ptr, lse_log2_ptr, dq_accum_ptr, dk_accum_ptr, dv_accum_ptr
// seqlen_*_rounded and scale_log2 are derived; num_sms is left to the launch.
constexpr int kAssignArgs = 11 + 2 * 9 + 5;

long long as_ll(PyObject* o, int i) {
  long long v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    throw py::type_error("torch_sm90_sdpa: BwdParams.assign argument " + std::to_string(i) +
                         " must be an int");
  }
  return v;
}

std::uintptr_t as_ptr(PyObject* o, int i) {
  unsigned long long v = PyLong_AsUnsignedLongLong(o);
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    throw py::type_error("torch_sm90_sdpa: BwdParams.assign argument " + std::to_string(i) +
                         " must be a non-negative int (a data_ptr())");
  }
  return static_cast<std::uintptr_t>(v);
}

int as_int(PyObject* o, int i) {
  long long v = as_ll(o, i);
  if (v < INT32_MIN || v > INT32_MAX) {
    throw py::value_error("torch_sm90_sdpa: BwdParams.assign argument " + std::to_string(i) +
                          " does not fit in int32");
  }
  return static_cast<int>(v);
}

void as_strides(PyObject* o, int i, int64_t& sb, int64_t& sh, int64_t& sr) {
  if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) < 3) {
    throw py::type_error("torch_sm90_sdpa: BwdParams.assign argument " + std::to_string(i) +
                         " must be a stride tuple of length >= 3");
  }
  sb = as_ll(PyTuple_GET_ITEM(o, 0), i);
  sh = as_ll(PyTuple_GET_ITEM(o, 1), i);
  sr = as_ll(PyTuple_GET_ITEM(o, 2), i);
}

void assign(BwdParams& p, const py::args& args) {
  if (static_cast<int>(args.size()) != kAssignArgs) {
    throw py::type_error("torch_sm90_sdpa: BwdParams.assign takes " +
                         std::to_string(kAssignArgs) + " arguments, got " +
                         std::to_string(args.size()));
  }
  PyObject* const* a = &PyTuple_GET_ITEM(args.ptr(), 0);
  BwdParams n;
  int i = 0;
  n.batch = as_int(a[i], i); ++i;
  n.heads_q = as_int(a[i], i); ++i;
  n.heads_kv = as_int(a[i], i); ++i;
  n.seqlen_q = as_int(a[i], i); ++i;
  n.seqlen_k = as_int(a[i], i); ++i;
  n.head_dim = as_int(a[i], i); ++i;
  n.head_dim_v = as_int(a[i], i); ++i;
  set_dtype(n, as_int(a[i], i)); ++i;
  const double scale = PyFloat_AsDouble(a[i]);
  if (scale == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    throw py::type_error("torch_sm90_sdpa: BwdParams.assign: scale must be a float");
  }
  ++i;
  n.scale = static_cast<float>(scale);
  n.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  n.is_causal = PyObject_IsTrue(a[i]) == 1; ++i;
  n.deterministic = PyObject_IsTrue(a[i]) == 1; ++i;
  n.seqlen_q_rounded = sm90_sdpa::round_up_seq(n.seqlen_q);
  n.seqlen_k_rounded = sm90_sdpa::round_up_seq(n.seqlen_k);
#define ASSIGN_TENSOR(name, T)                                                          \
  n.name = reinterpret_cast<T>(as_ptr(a[i], i)); ++i;                                   \
  as_strides(a[i], i, n.name##_batch_stride, n.name##_head_stride, n.name##_row_stride); \
  ++i;
  ASSIGN_TENSOR(q, const void*)
  ASSIGN_TENSOR(k, const void*)
  ASSIGN_TENSOR(v, const void*)
  ASSIGN_TENSOR(out, const void*)
  ASSIGN_TENSOR(dout, const void*)
  ASSIGN_TENSOR(lse, const float*)
  ASSIGN_TENSOR(dq, void*)
  ASSIGN_TENSOR(dk, void*)
  ASSIGN_TENSOR(dv, void*)
#undef ASSIGN_TENSOR
  n.dsum = reinterpret_cast<float*>(as_ptr(a[i], i)); ++i;
  n.lse_log2 = reinterpret_cast<float*>(as_ptr(a[i], i)); ++i;
  n.dq_accum = reinterpret_cast<float*>(as_ptr(a[i], i)); ++i;
  n.dk_accum = reinterpret_cast<float*>(as_ptr(a[i], i)); ++i;
  n.dv_accum = reinterpret_cast<float*>(as_ptr(a[i], i)); ++i;
  n.num_sms = p.num_sms;
  p = n;
}

}  // namespace

// read/write properties
#define FIELD(name) .def_readwrite(#name, &BwdParams::name)
#define PTR_FIELD(name, T)                                                            \
  .def_property(                                                                      \
      #name, [](const BwdParams& p) { return ptr_to_int(p.name); },                   \
      [](BwdParams& p, std::uintptr_t v) { p.name = reinterpret_cast<T>(v); })
#define TENSOR_FIELDS(name, T) \
  PTR_FIELD(name, T) FIELD(name##_batch_stride) FIELD(name##_head_stride) FIELD(name##_row_stride)

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_sm90_sdpa CUDA kernels (SM90 attention backward); torch-free";

  py::class_<BwdParams>(m, "BwdParams")
      .def(py::init<>())
      .def("copy", [](const BwdParams& p) { return BwdParams(p); })
      .def("__repr__", &repr)
      .def("assign", &assign,
           "Set every field in one call (the fast path of _cuda_backend); see module.cpp "
           "for the argument order.")
      // problem size
      FIELD(batch) FIELD(heads_q) FIELD(heads_kv) FIELD(seqlen_q) FIELD(seqlen_k)
      FIELD(head_dim) FIELD(head_dim_v) FIELD(seqlen_q_rounded) FIELD(seqlen_k_rounded)
      .def_property("dtype", &dtype_code, &set_dtype)
      // semantics
      FIELD(scale) FIELD(scale_log2) FIELD(is_causal) FIELD(deterministic)
      // inputs
      TENSOR_FIELDS(q, const void*) TENSOR_FIELDS(k, const void*) TENSOR_FIELDS(v, const void*)
      TENSOR_FIELDS(out, const void*) TENSOR_FIELDS(dout, const void*)
      TENSOR_FIELDS(lse, const float*)
      // fp32 workspaces
      PTR_FIELD(dsum, float*) PTR_FIELD(lse_log2, float*) PTR_FIELD(dq_accum, float*)
      PTR_FIELD(dk_accum, float*) PTR_FIELD(dv_accum, float*)
      // outputs
      TENSOR_FIELDS(dq, void*) TENSOR_FIELDS(dk, void*) TENSOR_FIELDS(dv, void*)
      FIELD(num_sms);

  m.def(
      "preprocess",
      [](BwdParams& p, std::uintptr_t stream) {
        py::gil_scoped_release nogil;
        sm90_sdpa::api::preprocess(p, to_stream(stream));
      },
      py::arg("params"), py::arg("stream"),
      "dsum = rowsum(dout * out), lse_log2 = lse * log2(e) (+inf / 0 in the padding rows), "
      "zero dq_accum (and dk_accum / dv_accum when set).");
  m.def(
      "postprocess",
      [](BwdParams& p, std::uintptr_t stream) {
        py::gil_scoped_release nogil;
        sm90_sdpa::api::postprocess(p, to_stream(stream));
      },
      py::arg("params"), py::arg("stream"),
      "dq = scale * dq_accum in the output dtype and strides; when dk_accum is set also "
      "dk = scale * dk_accum and dv = dv_accum.");
  m.def(
      "backward",
      [](BwdParams& p, std::uintptr_t stream) {
        py::gil_scoped_release nogil;
        sm90_sdpa::api::backward(p, to_stream(stream));
      },
      py::arg("params"), py::arg("stream"),
      "preprocess + main SM90 backward kernel + postprocess, on the given stream.");
  m.def("has_variant", &sm90_sdpa::api::has_variant, py::arg("head_dim"), py::arg("dtype"),
        "Whether the main kernel for (head_dim, dtype code 0 fp16 / 1 bf16) is compiled.");
  m.def("compiled_variants", &variants_list, "[(dtype name, head dim), ...] compiled.");
  m.def("build_info", &build_info, "How this module was built.");
  m.attr("SEQ_ROUND") = sm90_sdpa::kSeqRound;
  m.attr("FP16") = static_cast<int>(DType::kFloat16);
  m.attr("BF16") = static_cast<int>(DType::kBFloat16);
}
