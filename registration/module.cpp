// The pybind11 module torch_sm90_sdpa._C: torch-free (pybind11 + the CUDA runtime only).
// A typed binding of the device layer (bwd_device.h) plus the registration of the C++ CUDA
// kernel of torch_sm90_sdpa::sdpa_backward (torch_op.h).
//
//   _C.OperandLayout(batch_stride=, head_stride=, row_stride=, col_stride=1, address_align=16)
//   _C.OperandLayout.of(strides, data_ptr)            from a tensor's stride() and data_ptr()
//   _C.BwdProblem(batch=, heads_q=, ..., dtype=, is_causal=, deterministic=, cc_major=, cc_minor=,
//                 num_sms=0)
//       .q .k .v .out .dout .lse .dq .dk .dv          OperandLayout of each operand
//   _C.can_implement(problem) -> Decision             .verdict ("served" / "empty" /
//                                                     "unsupported"), .copy (operand names),
//                                                     .reason, .detail
//   _C.workspace_layout(problem) -> WorkspaceLayout   byte offsets and size of the fp32 workspace
//   _C.BwdPointers(q=, k=, ..., mask=, workspace=)     data addresses (ints)
//   _C.make_params(problem, pointers, scale) -> BwdParams
//   _C.run(params, stream) / _C.preprocess(params, stream) / _C.postprocess(params, stream) /
//   _C.classify(params, stream)
//   _C.register_torch_ops(libtorch_cpu, libtorch_cuda, cuda_kernel, probe) -> "" or why not
//   _C.cuda_kernel_registered(), _C.cuda_calls()
//   _C.has_variant(head_dim, dtype_code[, head_dim_v]), _C.compiled_variants(),
//   _C.compiled_dv_variants(), _C.build_info()
//   _C.switches() -> dict, _C.reload_switches()      the experiment switches (device::Switches)
//   _C.FwdParams() (the forward's fields, fwd_params.h), _C.run_fwd(params, stream),
//   _C.has_fwd_variant(head_dim, dtype_code), _C.compiled_fwd_variants(),
//   _C.fwd_mask_workspace_bytes(mask_batch, mask_heads, seqlen_q, seqlen_k)
//   _C.SEQ_ROUND, _C.DTYPE_CODES ({"fp16": 0, "bf16": 1})
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "bwd_device.h"
#include "bwd_params.h"
#include "fwd_device.h"
#include "fwd_params.h"
#include "torch_op.h"

#if __has_include("instantiations/build_info.h")
#include "instantiations/build_info.h"
#endif
#ifndef TORCH_SM90_SDPA_SOURCE_HASH
#define TORCH_SM90_SDPA_SOURCE_HASH "unknown"
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
using sm90_sdpa::FwdParams;
using sm90_sdpa::DType;
namespace dev = sm90_sdpa::device;

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
    << ", head_dim_v=" << p.head_dim_v << ", dtype=" << dev::dtype_name(dtype_code(p))
    << ", scale=" << p.scale << ", is_causal=" << (p.is_causal ? "True" : "False")
    << ", deterministic=" << (p.deterministic ? "True" : "False")
    << ", gqa_accum=" << (p.dk_accum != nullptr ? "True" : "False") << ")";
  return s.str();
}

py::list variants_list() {
  py::list out;
  for (const auto& v : dev::compiled_variants()) {
    out.append(py::make_tuple(dev::dtype_name(v.first), v.second));
  }
  return out;
}

// The (D, Dv) pairs with Dv != D: [(dtype name, head dim, v head dim)]
py::list dv_variants_list() {
  py::list out;
  for (const auto& v : dev::compiled_dv_variants()) {
    out.append(py::make_tuple(dev::dtype_name(v.dtype), v.head_dim, v.head_dim_v));
  }
  return out;
}

py::dict build_info() {
  py::dict d;
  d["main_kernel_compiled"] = dev::main_kernel_compiled();
  d["variants"] = variants_list();
  d["dv_variants"] = dv_variants_list();
  py::list fwd;  // the forward kernels (sdpa_forward), [(dtype name, head dim)]
  for (const auto& v : dev::compiled_fwd_variants()) { fwd.append(py::make_tuple(v.first, v.second)); }
  d["fwd_variants"] = fwd;
  d["arch"] = TORCH_SM90_SDPA_ARCH;
  d["source_hash"] = TORCH_SM90_SDPA_SOURCE_HASH;  // the C++ / CUDA sources built
  d["nvcc_version"] = TORCH_SM90_SDPA_NVCC_VERSION;
  d["cutlass_version"] = TORCH_SM90_SDPA_CUTLASS_VERSION;
  d["build_flags"] = TORCH_SM90_SDPA_NVCC_FLAGS;
  d["cxx_flags"] = TORCH_SM90_SDPA_CXX_FLAGS;
  d["cudart_version"] = CUDART_VERSION;  // the statically linked CUDA runtime
  d["seq_round"] = sm90_sdpa::kSeqRound;
  d["persistent_by_default"] = dev::kPersistentByDefault;  // TORCH_SM90_SDPA_PERSISTENT unset
  d["prepost_reversed_by_default"] = dev::kPrepostReversedByDefault;  // TORCH_SM90_SDPA_PREPOST_ORDER unset
  return d;
}

const char* override_name(dev::Override o) {
  switch (o) {
    case dev::Override::kOff: return "off";
    case dev::Override::kOn: return "on";
    default: return "rule";
  }
}

// device::Switches as {field: value} (overrides as "rule" / "off" / "on").
py::dict switches_dict() {
  const dev::Switches s = dev::switches();
  py::dict d;
  d["gqa_walk"] = override_name(s.gqa_walk);
  d["split_tail"] = override_name(s.split_tail);
  d["deterministic_order"] =
      !s.deterministic_order ? "per problem"
      : *s.deterministic_order == sm90_sdpa::DeterministicOrder::kKeysAscending ? "ascending" : "descending";
  d["programmatic_launch"] = s.programmatic_launch;
  d["persistent"] = s.persistent;
  d["prepost_reversed"] = s.prepost_reversed;
  d["heads_per_section"] = s.heads_per_section;
  return d;
}

const char* verdict_name(dev::Verdict v) {
  switch (v) {
    case dev::Verdict::kServed: return "served";
    case dev::Verdict::kEmpty: return "empty";
    default: return "unsupported";
  }
}

int address_align(std::uintptr_t a) {
  int align = 1;
  while (align < 16 && a % (2 * align) == 0) align *= 2;
  return align;
}

// OperandLayout.of(strides, data_ptr): a [B, H, S(, X)] tensor's layout from stride() (a tuple
// of 3 or 4 ints) and data_ptr().
dev::OperandLayout layout_of(const py::tuple& strides, std::uintptr_t data_ptr) {
  if (strides.size() < 3 || strides.size() > 4) {
    throw py::value_error("torch_sm90_sdpa: OperandLayout.of needs 3 or 4 strides");
  }
  dev::OperandLayout l;
  l.batch_stride = strides[0].cast<int64_t>();
  l.head_stride = strides[1].cast<int64_t>();
  l.row_stride = strides[2].cast<int64_t>();
  l.col_stride = strides.size() == 4 ? strides[3].cast<int64_t>() : 1;
  l.address_align = address_align(data_ptr);
  return l;
}

template <int kOp>
void bind_operand(py::class_<dev::BwdProblem>& c, const char* name) {
  c.def_property(
      name, [](const dev::BwdProblem& p) { return p.layout[kOp]; },
      [](dev::BwdProblem& p, const dev::OperandLayout& l) { p.layout[kOp] = l; });
}

}  // namespace

// read/write properties of BwdParams (tests of the pre/post kernels set them one by one)
#define FIELD(name) .def_readwrite(#name, &BwdParams::name)
#define PTR_FIELD(name, T)                                                            \
  .def_property(                                                                      \
      #name, [](const BwdParams& p) { return ptr_to_int(p.name); },                   \
      [](BwdParams& p, std::uintptr_t v) { p.name = reinterpret_cast<T>(v); })
#define TENSOR_FIELDS(name, T) \
  PTR_FIELD(name, T) FIELD(name##_batch_stride) FIELD(name##_head_stride) FIELD(name##_row_stride)
#define FWD_FIELD(name) .def_readwrite(#name, &FwdParams::name)
#define FWD_PTR_FIELD(name, T)                                                        \
  .def_property(                                                                      \
      #name, [](const FwdParams& p) { return ptr_to_int(p.name); },                   \
      [](FwdParams& p, std::uintptr_t v) { p.name = reinterpret_cast<T>(v); })
#define FWD_TENSOR_FIELDS(name, T)                                                              \
  FWD_PTR_FIELD(name, T) FWD_FIELD(name##_batch_stride) FWD_FIELD(name##_head_stride) \
      FWD_FIELD(name##_row_stride)

// The backward's call description and verdict: OperandLayout, BwdProblem, Decision,
// can_implement, tma_addressable, WorkspaceLayout, workspace_layout.
static void bind_problem(py::module_& m) {
  py::class_<dev::OperandLayout>(m, "OperandLayout")
      .def(py::init([](int64_t batch_stride, int64_t head_stride, int64_t row_stride,
                       int64_t col_stride, int address_align) {
             dev::OperandLayout l;
             l.batch_stride = batch_stride;
             l.head_stride = head_stride;
             l.row_stride = row_stride;
             l.col_stride = col_stride;
             l.address_align = address_align;
             return l;
           }),
           py::kw_only(), py::arg("batch_stride"), py::arg("head_stride"), py::arg("row_stride"),
           py::arg("col_stride") = 1, py::arg("address_align") = 16)
      .def_static("of", &layout_of, py::arg("strides"), py::arg("data_ptr"),
                  "The layout of a tensor from its stride() and data_ptr().")
      .def_readwrite("batch_stride", &dev::OperandLayout::batch_stride)
      .def_readwrite("head_stride", &dev::OperandLayout::head_stride)
      .def_readwrite("row_stride", &dev::OperandLayout::row_stride)
      .def_readwrite("col_stride", &dev::OperandLayout::col_stride)
      .def_readwrite("address_align", &dev::OperandLayout::address_align)
      .def("__repr__", [](const dev::OperandLayout& l) {
        std::ostringstream s;
        s << "OperandLayout(strides=(" << l.batch_stride << ", " << l.head_stride << ", "
          << l.row_stride << ", " << l.col_stride << "), address_align=" << l.address_align
          << ")";
        return s.str();
      });

  py::class_<dev::BwdProblem> problem(m, "BwdProblem");
  problem
      .def(py::init([](int batch, int heads_q, int heads_kv, int seqlen_q, int seqlen_k,
                       int head_dim, int head_dim_v, int dtype, bool is_causal,
                       bool deterministic, int cc_major, int cc_minor, int num_sms) {
             dev::BwdProblem p;
             p.batch = batch;
             p.heads_q = heads_q;
             p.heads_kv = heads_kv;
             p.seqlen_q = seqlen_q;
             p.seqlen_k = seqlen_k;
             p.head_dim = head_dim;
             p.head_dim_v = head_dim_v;
             p.dtype = dtype;
             p.is_causal = is_causal;
             p.deterministic = deterministic;
             p.cc_major = cc_major;
             p.cc_minor = cc_minor;
             p.num_sms = num_sms;
             return p;
           }),
           py::kw_only(), py::arg("batch"), py::arg("heads_q"), py::arg("heads_kv"),
           py::arg("seqlen_q"), py::arg("seqlen_k"), py::arg("head_dim"), py::arg("head_dim_v"),
           py::arg("dtype"), py::arg("is_causal") = false, py::arg("deterministic") = false,
           py::arg("cc_major") = 9, py::arg("cc_minor") = 0, py::arg("num_sms") = 0)
      .def_readwrite("batch", &dev::BwdProblem::batch)
      .def_readwrite("heads_q", &dev::BwdProblem::heads_q)
      .def_readwrite("heads_kv", &dev::BwdProblem::heads_kv)
      .def_readwrite("seqlen_q", &dev::BwdProblem::seqlen_q)
      .def_readwrite("seqlen_k", &dev::BwdProblem::seqlen_k)
      .def_readwrite("head_dim", &dev::BwdProblem::head_dim)
      .def_readwrite("head_dim_v", &dev::BwdProblem::head_dim_v)
      .def_readwrite("dtype", &dev::BwdProblem::dtype)
      .def_readwrite("is_causal", &dev::BwdProblem::is_causal)
      .def_readwrite("deterministic", &dev::BwdProblem::deterministic)
      .def_readwrite("mask_kind", &dev::BwdProblem::mask_kind)
      .def_readwrite("cc_major", &dev::BwdProblem::cc_major)
      .def_readwrite("cc_minor", &dev::BwdProblem::cc_minor)
      .def_readwrite("num_sms", &dev::BwdProblem::num_sms);
  bind_operand<dev::kQ>(problem, "q");
  bind_operand<dev::kK>(problem, "k");
  bind_operand<dev::kV>(problem, "v");
  bind_operand<dev::kOut>(problem, "out");
  bind_operand<dev::kDout>(problem, "dout");
  bind_operand<dev::kLse>(problem, "lse");
  bind_operand<dev::kDq>(problem, "dq");
  bind_operand<dev::kDk>(problem, "dk");
  bind_operand<dev::kDv>(problem, "dv");
  bind_operand<dev::kMask>(problem, "mask");

  py::class_<dev::Decision>(m, "Decision")
      .def_property_readonly("verdict", [](const dev::Decision& d) { return verdict_name(d.verdict); })
      .def_property_readonly("copy", [](const dev::Decision& d) {
        std::vector<std::string> names;
        for (int op = 0; op < dev::kNumOperands; ++op) {
          if (d.copy_mask & (1u << op)) names.emplace_back(dev::operand_name(op));
        }
        return names;
      })
      .def_readonly("reason", &dev::Decision::reason)
      .def_readonly("detail", &dev::Decision::detail)
      .def("__repr__", [](const dev::Decision& d) {
        return std::string("Decision(") + verdict_name(d.verdict) + ", reason='" + d.reason +
               "', detail='" + d.detail + "')";
      });
  m.def("can_implement", &dev::can_implement, py::arg("problem"),
        "Whether the SM90 kernels serve this problem (the one statement of their contract).");
  m.def("tma_addressable",
        [](const dev::OperandLayout& l, int elem_bytes, int batch, int heads, int rows) {
          return dev::tma_addressable(l, elem_bytes, batch, heads, rows);
        },
        py::arg("layout"), py::arg("elem_bytes"), py::arg("batch"), py::arg("heads"),
        py::arg("rows"));

  py::class_<dev::WorkspaceLayout>(m, "WorkspaceLayout")
      .def_readonly("dq_accum", &dev::WorkspaceLayout::dq_accum)
      .def_readonly("dk_accum", &dev::WorkspaceLayout::dk_accum)
      .def_readonly("dv_accum", &dev::WorkspaceLayout::dv_accum)
      .def_readonly("dpsum", &dev::WorkspaceLayout::dpsum)
      .def_readonly("lse_log2", &dev::WorkspaceLayout::lse_log2)
      .def_readonly("tile_class", &dev::WorkspaceLayout::tile_class)
      .def_readonly("tile_m_range", &dev::WorkspaceLayout::tile_m_range)
      .def_readonly("tile_bits", &dev::WorkspaceLayout::tile_bits)
      .def_readonly("score_bounds", &dev::WorkspaceLayout::score_bounds)
      .def_readonly("dq_semaphore", &dev::WorkspaceLayout::dq_semaphore)
      .def_readonly("split_tail", &dev::WorkspaceLayout::split_tail)
      .def_readonly("split_tiles", &dev::WorkspaceLayout::split_tiles)
      .def_readonly("split_slot_floats", &dev::WorkspaceLayout::split_slot_floats)
      .def_readonly("tile_counter", &dev::WorkspaceLayout::tile_counter)
      .def_readonly("bytes", &dev::WorkspaceLayout::bytes)
      .def_readonly("gqa", &dev::WorkspaceLayout::gqa)
      .def_readonly("heads_per_cta", &dev::WorkspaceLayout::heads_per_cta);
  m.def("workspace_layout", &dev::workspace_layout, py::arg("problem"));
}

// The backward's parameters and kernels: BwdPointers, make_params, BwdParams and the runs.
static void bind_backward(py::module_& m) {
  py::class_<dev::BwdPointers>(m, "BwdPointers")
      .def(py::init([](std::uintptr_t q, std::uintptr_t k, std::uintptr_t v, std::uintptr_t out,
                       std::uintptr_t dout, std::uintptr_t lse, std::uintptr_t dq,
                       std::uintptr_t dk, std::uintptr_t dv, std::uintptr_t mask,
                       std::uintptr_t workspace) {
             dev::BwdPointers p;
             p.q = reinterpret_cast<const void*>(q);
             p.k = reinterpret_cast<const void*>(k);
             p.v = reinterpret_cast<const void*>(v);
             p.out = reinterpret_cast<const void*>(out);
             p.dout = reinterpret_cast<const void*>(dout);
             p.lse = reinterpret_cast<const float*>(lse);
             p.dq = reinterpret_cast<void*>(dq);
             p.dk = reinterpret_cast<void*>(dk);
             p.dv = reinterpret_cast<void*>(dv);
             p.mask = reinterpret_cast<const void*>(mask);
             p.workspace = reinterpret_cast<void*>(workspace);
             return p;
           }),
           py::kw_only(), py::arg("q") = 0, py::arg("k") = 0, py::arg("v") = 0,
           py::arg("out") = 0, py::arg("dout") = 0, py::arg("lse") = 0, py::arg("dq") = 0,
           py::arg("dk") = 0, py::arg("dv") = 0, py::arg("mask") = 0, py::arg("workspace") = 0);
  m.def("make_params", &dev::make_params, py::arg("problem"), py::arg("pointers"),
        py::arg("scale"), "The kernels' BwdParams of a problem, its tensors and its workspace.");

  py::class_<BwdParams>(m, "BwdParams")
      .def(py::init<>())
      .def("copy", [](const BwdParams& p) { return BwdParams(p); })
      .def("__repr__", &repr)
      // problem size
      FIELD(batch) FIELD(heads_q) FIELD(heads_kv) FIELD(seqlen_q) FIELD(seqlen_k)
      FIELD(head_dim) FIELD(head_dim_v) FIELD(seqlen_q_rounded) FIELD(seqlen_k_rounded)
      .def_property("dtype", &dtype_code, &set_dtype)
      // semantics
      FIELD(scale) FIELD(scale_log2) FIELD(is_causal) FIELD(deterministic) FIELD(heads_per_cta)
      // inputs
      TENSOR_FIELDS(q, const void*) TENSOR_FIELDS(k, const void*) TENSOR_FIELDS(v, const void*)
      TENSOR_FIELDS(out, const void*) TENSOR_FIELDS(dout, const void*)
      TENSOR_FIELDS(lse, const float*)
      // fp32 workspaces
      PTR_FIELD(dpsum, float*) PTR_FIELD(lse_log2, float*) PTR_FIELD(dq_accum, float*)
      PTR_FIELD(dk_accum, float*) PTR_FIELD(dv_accum, float*) FIELD(dq_accum_permuted)
      // outputs
      TENSOR_FIELDS(dq, void*) TENSOR_FIELDS(dk, void*) TENSOR_FIELDS(dv, void*)
      FIELD(num_sms) FIELD(l2_bytes) FIELD(heads_per_section) FIELD(programmatic_launch) FIELD(persistent)
      FIELD(prepost_reversed)
      // mask (read-only here: make_params fills them consistently)
      .def_property_readonly("mask_kind", [](const BwdParams& p) { return static_cast<int>(p.mask_kind); })
      .def_property_readonly("tile_class", [](const BwdParams& p) { return ptr_to_int(p.tile_class); })
      .def_property_readonly("dq_semaphore", [](const BwdParams& p) { return ptr_to_int(p.dq_semaphore); })
      .def_property_readonly("tile_counter", [](const BwdParams& p) { return ptr_to_int(p.tile_counter); })
      .def_readonly("split_tiles", &BwdParams::split_tiles)
      .def_readonly("split_slot_floats", &BwdParams::split_slot_floats)
      .def_property_readonly("split_count", [](const BwdParams& p) { return ptr_to_int(p.split_count); })
      .def_property_readonly("split_accum", [](const BwdParams& p) { return ptr_to_int(p.split_accum); })
      .def_property_readonly("deterministic_order", [](const BwdParams& p) {
        return p.deterministic_order == sm90_sdpa::DeterministicOrder::kKeysAscending ? "ascending" : "descending";
      })
      .def_readonly("mask_batch", &BwdParams::mask_batch)
      .def_readonly("mask_heads", &BwdParams::mask_heads)
      .def_readonly("num_m_blocks", &BwdParams::num_m_blocks)
      .def_readonly("num_n_blocks", &BwdParams::num_n_blocks)
      .def_readonly("tile_m", &BwdParams::tile_m)
      .def_readonly("tile_n", &BwdParams::tile_n);

  m.def(
      "preprocess",
      [](const BwdParams& p, std::uintptr_t stream) {
        py::gil_scoped_release nogil;
        dev::run_preprocess(p, to_stream(stream));
      },
      py::arg("params"), py::arg("stream"),
      "dpsum = rowsum(dout * out), lse_log2 = lse * log2(e) (+inf / 0 in the padding rows), "
      "zero dq_accum (and dk_accum / dv_accum when set).");
  m.def(
      "postprocess",
      [](const BwdParams& p, std::uintptr_t stream) {
        py::gil_scoped_release nogil;
        dev::run_postprocess(p, to_stream(stream));
      },
      py::arg("params"), py::arg("stream"),
      "dq = scale * dq_accum in the output dtype and strides; when dk_accum is set also "
      "dk = scale * dk_accum and dv = dv_accum.");
  m.def(
      "classify",
      [](const BwdParams& p, std::uintptr_t stream) {
        py::gil_scoped_release nogil;
        dev::run_classification(p, to_stream(stream));
      },
      py::arg("params"), py::arg("stream"),
      "The mask's tile classes (0 empty, 1 partial, 2 full, 3 partial as bits) into params.tile_class.");
  m.def(
      "run",
      [](const BwdParams& p, std::uintptr_t stream) {
        py::gil_scoped_release nogil;
        dev::run(p, to_stream(stream));
      },
      py::arg("params"), py::arg("stream"),
      "preprocess + main SM90 backward kernel + postprocess, on the given stream.");
}

// The forward: FwdParams, fwd_mask_workspace_bytes, run_fwd, its variants.
static void bind_forward(py::module_& m) {
  py::class_<FwdParams>(m, "FwdParams")
      .def(py::init<>())
      FWD_FIELD(batch) FWD_FIELD(heads_q) FWD_FIELD(heads_kv) FWD_FIELD(seqlen_q) FWD_FIELD(seqlen_k)
      FWD_FIELD(head_dim)
      .def_property(
          "dtype", [](const FwdParams& p) { return static_cast<int>(p.dtype); },
          [](FwdParams& p, int code) {
            if (code != static_cast<int>(DType::kFloat16) && code != static_cast<int>(DType::kBFloat16)) {
              throw py::value_error("torch_sm90_sdpa: FwdParams.dtype must be 0 (fp16) or 1 (bf16), got " +
                                    std::to_string(code));
            }
            p.dtype = static_cast<DType>(code);
          })
      FWD_FIELD(scale_log2) FWD_FIELD(rescale_slack) FWD_FIELD(is_causal) FWD_FIELD(overlap) FWD_FIELD(persistent)
      FWD_TENSOR_FIELDS(q, const void*) FWD_TENSOR_FIELDS(k, const void*) FWD_TENSOR_FIELDS(v, const void*)
      FWD_TENSOR_FIELDS(out, void*)
      FWD_PTR_FIELD(lse, float*) FWD_FIELD(lse_batch_stride) FWD_FIELD(lse_head_stride)
      .def_property(
          "mask_kind", [](const FwdParams& p) { return static_cast<int>(p.mask_kind); },
          [](FwdParams& p, int code) {
            if (code < 0 || code > static_cast<int>(sm90_sdpa::MaskKind::kFloat32)) {
              throw py::value_error("torch_sm90_sdpa: FwdParams.mask_kind must be 0 (none) .. 4 (fp32), got " +
                                    std::to_string(code));
            }
            p.mask_kind = static_cast<sm90_sdpa::MaskKind>(code);
          })
      FWD_PTR_FIELD(mask, const void*) FWD_FIELD(mask_batch_stride) FWD_FIELD(mask_head_stride)
      FWD_FIELD(mask_row_stride) FWD_FIELD(mask_col_stride) FWD_FIELD(mask_batch) FWD_FIELD(mask_heads)
      FWD_PTR_FIELD(mask_workspace, void*) FWD_FIELD(num_sms);
  m.def("fwd_mask_workspace_bytes", &sm90_sdpa::fwd_mask_workspace_bytes, py::arg("mask_batch"),
        py::arg("mask_heads"), py::arg("seqlen_q"), py::arg("seqlen_k"),
        "Bytes of FwdParams.mask_workspace for a mask of mask_batch x mask_heads instances.");
  m.def(
      "run_fwd",
      [](const FwdParams& p, std::uintptr_t stream) {
        py::gil_scoped_release nogil;
        dev::run_fwd(p, to_stream(stream));
      },
      py::arg("params"), py::arg("stream"), "The SM90 forward kernel: out and lse, on the given stream.");
  m.def("has_fwd_variant", &dev::has_fwd_variant, py::arg("head_dim"), py::arg("dtype"),
        "Whether the forward kernel for (head_dim, dtype code 0 fp16 / 1 bf16) is compiled.");
  m.def("compiled_fwd_variants", &dev::compiled_fwd_variants,
        "[(dtype name, head dim), ...] with a forward kernel.");
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_sm90_sdpa CUDA kernels (SM90 attention backward and forward); torch-free";
  bind_problem(m);
  bind_backward(m);
  bind_forward(m);

  m.def("register_torch_ops", &sm90_sdpa::torch_op::register_ops, py::arg("libtorch_cpu"),
        py::arg("libtorch_cuda"), py::arg("cuda_kernel") = true, py::arg("probe") = false,
        "Register the C++ CUDA kernel of torch_sm90_sdpa::sdpa_backward (and the CPU test op "
        "_stable_abi_probe) with torch's dispatcher; '' on success, else why not.");
  m.def("cuda_kernel_registered", &sm90_sdpa::torch_op::cuda_kernel_registered);
  m.def("cuda_calls", &sm90_sdpa::torch_op::cuda_calls,
        "Calls of the C++ CUDA kernel of sdpa_backward in this process.");

  m.def("has_variant", &dev::has_variant, py::arg("head_dim"), py::arg("dtype"), py::arg("head_dim_v") = -1,
        "Whether the main kernel for (head_dim, dtype code 0 fp16 / 1 bf16, head_dim_v: v's head "
        "dim, default head_dim) is compiled.");
  m.def("compiled_variants", &variants_list, "[(dtype name, head dim), ...] compiled (Dv == D).");
  m.def("compiled_dv_variants", &dv_variants_list,
        "[(dtype name, head dim, v head dim), ...] compiled with Dv != D.");
  m.def("build_info", &build_info, "How this module was built.");
  m.def("switches", &switches_dict,
        "The experiment switches as read from the environment (bwd_device.h, Switches).");
  m.def("reload_switches", &dev::reload_switches,
        "Read the experiment switches from the environment again (they are read once).");
  m.attr("SEQ_ROUND") = sm90_sdpa::kSeqRound;
  m.attr("SPLIT_MIN_SAVED_BLOCKS") = dev::kSplitMinSavedBlocks;
  py::dict codes;
  codes["fp16"] = static_cast<int>(DType::kFloat16);
  codes["bf16"] = static_cast<int>(DType::kBFloat16);
  m.attr("DTYPE_CODES") = codes;
}
