// The op a compiled graph calls to run a linear layer on a oneDNN-packed weight, without a
// Python call per layer.
//
// The packed weights live in a process-wide table keyed by an int handle (llmserve.model.packed
// registers each one, and releases it when its module goes), so a graph holds a handle, never the
// opaque weight itself. onednn_linear(x [T, in], handle) -> [T, out] runs
// mkldnn::_linear_pointwise(x, weight, bias, "none", [], ""), or, for at most gemv_row_limit()
// rows of a layer registered with its plain weight, llmserve::gemv.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>

#include "gemv.h"
#include "handles.h"
#include "ops.h"

namespace llmserve {
at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias);  // gemv.cpp
}

namespace {

struct Packed {
  at::Tensor weight;  // opaque oneDNN layout
  std::optional<at::Tensor> bias;
  std::optional<at::Tensor> plain;  // [out, in], for steps of at most gemv_row_limit() rows (gemv.cpp)
};

llmserve::HandleTable<Packed> table;

void packed_register(int64_t handle, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& plain) {
  table.put(handle, Packed{weight, bias, plain});
}

void packed_release(int64_t handle) { table.erase(handle); }

}  // namespace

namespace llmserve {

at::Tensor onednn_linear(const at::Tensor& x, int64_t handle) {
  const Packed p = table.get(handle, "onednn_linear");
  if (p.plain && x.dim() == 2 && x.size(0) <= llmserve::gemv_row_limit()) return llmserve::gemv(x, *p.plain, p.bias);
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(p.weight);
  stack.emplace_back(p.bias);
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

}  // namespace llmserve

TORCH_LIBRARY_FRAGMENT(llmserve, m) {
  m.def("packed_register(int handle, Tensor weight, Tensor? bias, Tensor? plain) -> ()");
  m.def("packed_release(int handle) -> ()");
  m.def("onednn_linear(Tensor x, int handle) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve, CPU, m) { m.impl("onednn_linear", &llmserve::onednn_linear); }
TORCH_LIBRARY_IMPL(llmserve, CatchAll, m) {
  m.impl("packed_register", &packed_register);
  m.impl("packed_release", &packed_release);
}
