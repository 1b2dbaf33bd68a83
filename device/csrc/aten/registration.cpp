// Registration of the eager path: install_eager sets the cost model's figures (pricing.cpp)
// and registers, at PrivateUse1, kernels.cpp's kernels, the fallback (run_on_host.cpp) for
// every other op, the kernels that send an op to the fallback whole (Note [CPU kernels
// whole]), and dropout's (Note [Dropout takes CPU's path] in dropout.cpp). The libraries
// that hold the registrations live as long as the process.
#include "aten/eager_internal.h"

#include <ATen/native/transformers/attention.h>
#include <ATen/ops/set_native.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <memory>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace neuron {
namespace eager_detail {
namespace {

// Functional ops whose CPU kernel is a composite computing through their out= variant (found by
// running OpInfo's samples in adaptive mode): run whole, as the CPU runs them. Decomposed on
// neuron, the out= op would be a sync point of the adaptive engine (an out= op may resize its
// output), cutting every trace they sit in; torchao's float8 casts take the abs of each
// tensor they scale, for one.
const std::unordered_set<std::string> kRunWhole = {
    "aten::abs", "aten::complex", "aten::deg2rad", "aten::rad2deg", "aten::frexp.Tensor", "aten::logical_not",
    "aten::logical_and", "aten::logical_or", "aten::logical_xor", "aten::logsumexp", "aten::nan_to_num",
    "aten::polar"};

std::vector<std::unique_ptr<torch::Library>> g_libraries;

struct SilentWarnings final : public c10::WarningHandler {
  void process(const c10::Warning& /*warning*/) override {}
};

// Note [CPU kernels whole]: an op with a CPU kernel and a composite one (CompositeExplicit-
// AutogradNonFunctional: the functional and in-place forms of the ~400 structured ops;
// CompositeExplicitAutograd: native_layer_norm, addr, ...; CompositeImplicitAutograd:
// silu_backward, mish_backward) would run the composite on PrivateUse1: another route than
// CPU's (mse_loss through mse_loss.out, which resizes its output and warns) or other bits
// (silu_backward's decomposition). A PrivateUse1 kernel of its own sends it to the fallback
// whole, so it runs CPU's own kernel, and autograd treats it as it does on CPU.
void register_cpu_kernels_whole(torch::Library& aten) {
  // Composites that choose a backend by device type, and know only CPU/CUDA: run on the host
  // aliases, they take CPU's path (convolution would call convolution_overrideable).
  // Factories whose composite makes an empty tensor and resizes it in an out= kernel: whole,
  // each is one new tensor (the engine can hand it out before it runs), not an out= resize.
  for (const char* name : {"aten::convolution", "aten::convolution_backward", "aten::mode.values",
                           "aten::arange", "aten::arange.start", "aten::arange.start_step", "aten::linspace",
                           "aten::logspace", "aten::eye", "aten::eye.m", "aten::randperm", "aten::randperm.generator",
                           "aten::range", "aten::range.step"}) {
    aten.impl(name, torch::CppFunction::makeFromBoxedFunction<&eager_fallback>());
  }
  static const c10::DispatchKey composites[] = {
      c10::DispatchKey::CompositeExplicitAutogradNonFunctional, c10::DispatchKey::CompositeExplicitAutograd,
      c10::DispatchKey::CompositeImplicitAutograd};
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) {
      continue;
    }
    auto op = dispatcher.findOp(name);
    if (!op || op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) {
      continue;  // a kernel of ours (empty, views, copies) registered above
    }
    if ((name.name.rfind("aten::_foreach_", 0) == 0 || name.name == "aten::_grouped_mm" ||
         kRunWhole.count(c10::toString(name)) != 0) &&
        op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd)) {
      // CPU's foreach kernels are these composites (per-tensor loops); run whole, a foreach op
      // is one op for the engine to defer, not one out= op per tensor. So is _grouped_mm, whose
      // CPU kernel is a loop of mm over the groups: on the chip, one grouped GEMM (one launch,
      // priced by all its FLOPs). And kRunWhole's.
      aten.impl(c10::toString(name).c_str(), torch::CppFunction::makeFromBoxedFunction<&eager_fallback>());
      continue;
    }
    if (!op->hasKernelForDispatchKey(c10::DispatchKey::CPU)) {
      continue;
    }
    for (const auto key : composites) {
      if (op->hasKernelForDispatchKey(key)) {
        aten.impl(c10::toString(name).c_str(), torch::CppFunction::makeFromBoxedFunction<&eager_fallback>());
        break;
      }
    }
  }
}

}  // namespace
}  // namespace eager_detail

void install_eager(const EagerCosts& costs, const std::vector<std::pair<int, std::string>>& converted) {
  using namespace eager_detail;  // kernels.cpp's kernels, set_costs, this file's libraries
  TORCH_CHECK(g_libraries.empty(), "the neuron eager kernels are installed once per process");
  set_costs(costs, converted);
  auto aten = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1,
                                               __FILE__, __LINE__);
  aten->impl("empty.memory_format", TORCH_FN(empty_memory_format));
  aten->impl("empty_strided", TORCH_FN(empty_strided));
  aten->impl("as_strided", TORCH_FN(as_strided));
  aten->impl("view", TORCH_FN(view));
  aten->impl("_reshape_alias", TORCH_FN(reshape_alias));
  aten->impl("unfold", TORCH_FN(unfold));
  aten->impl("view_as_real", TORCH_FN(view_as_real));
  aten->impl("view_as_complex", TORCH_FN(view_as_complex));
  aten->impl("resize_", TORCH_FN(resize));
  aten->impl("set_.source_Storage_storage_offset", TORCH_FN(set_storage));
  aten->impl("set_.source_Storage", static_cast<at::Tensor& (*)(at::Tensor&, at::Storage)>(&at::native::set_));
  aten->impl("set_.source_Tensor", TORCH_FN(at::native::set_tensor_));
  aten->impl("set_", TORCH_FN(set_empty));
  aten->impl("_copy_from", TORCH_FN(copy_from));
  aten->impl("_copy_from_and_resize", TORCH_FN(copy_from_and_resize));
  aten->impl("_local_scalar_dense", TORCH_FN(local_scalar_dense));
  aten->impl("_has_compatible_shallow_copy_type", TORCH_FN(has_compatible_shallow_copy_type));
  aten->impl("record_stream", TORCH_FN(record_stream));
  aten->impl("_efficientzerotensor", TORCH_FN(efficient_zero_tensor));
  register_cpu_kernels_whole(*aten);
  refuse_sparse_and_nested(g_libraries);
  refuse_quantized_tensors(g_libraries);  // Note [No quantized tensors]
  register_autograd_layouts(g_libraries);  // Note [Backward formulas that pick a layout by device]
  register_cpu_dropout(g_libraries);  // Note [Dropout takes CPU's path]
  // c10d's collectives: their PrivateUse1 kernels ask the group for a neuron backend, whose
  // gloo rejects neuron tensors. Run on the host aliases, c10d's CPU kernels hand gloo the
  // device's bytes: gloo reads and writes them in place, async work included.
  // Overriding their kernels warns once per process; the override is the point, so silence it.
  SilentWarnings silent;
  c10::WarningUtils::WarningHandlerGuard quiet(&silent);
  auto c10d = std::make_unique<torch::Library>(torch::Library::IMPL, "c10d", c10::DispatchKey::PrivateUse1,
                                               __FILE__, __LINE__);
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("c10d::", 0) != 0) {
      continue;
    }
    auto op = dispatcher.findOp(name);
    if (op && op->hasKernelForDispatchKey(c10::DispatchKey::CPU)) {
      c10d->impl(c10::toString(name).c_str(), torch::CppFunction::makeFromBoxedFunction<&eager_fallback>());
    }
  }
  g_libraries.push_back(std::move(c10d));
  auto all = std::make_unique<torch::Library>(torch::Library::IMPL, "_", c10::DispatchKey::PrivateUse1,
                                              __FILE__, __LINE__);
  all->fallback(torch::CppFunction::makeFromBoxedFunction<&eager_fallback>());
  g_libraries.push_back(std::move(aten));
  g_libraries.push_back(std::move(all));
  at::native::_fused_sdp_choice_stub.set_privateuse1_dispatch_ptr(&fused_sdp_choice);
  watch_third_party_composites();
  // copy_ hands a conj/neg source to _copy_from, which the Conjugate and Negative fallbacks
  // would resolve first, by a clone whose copy_ reaches _copy_from again: endless recursion.
  // copy_from reads the bits itself (its host aliases carry them, Note [Host aliases]).
  for (const auto key : {c10::DispatchKey::Conjugate, c10::DispatchKey::Negative}) {
    auto bits = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", key, __FILE__, __LINE__);
    bits->impl("_copy_from", torch::CppFunction::makeFallthrough());
    bits->impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
    g_libraries.push_back(std::move(bits));
  }
}

}  // namespace neuron
