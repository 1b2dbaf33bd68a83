// Note [Backward formulas that pick a layout by device]: a few of torch's derivative formulas
// (tools/autograd/derivatives.yaml) choose the memory format of their kernel's arguments by
// device type, and know only CPU and XPU. native_group_norm's backward, outside double
// backward, runs
//   native_group_norm_backward(grad.contiguous(F), input.contiguous(F), mean, rstd, ...)
// with F = input.suggest_memory_format() on CPU and Contiguous on any other device. CPU's
// kernel has a channels-last path that reduces in another order than its contiguous one, so
// on neuron a channels-last GroupNorm's grads came out contiguous and up to a few ulp away
// from CPU's (input, weight and bias alike). The forward composite (group_norm) already
// counts PrivateUse1 with CPU; the backward formula does not, and it is compiled into torch's
// autograd node (NativeGroupNormBackward0), beneath anything the eager path sees: its kernel
// gets contiguous copies, the input's layout already lost.
//
// So native_group_norm has an autograd kernel of ours at AutogradPrivateUse1. It runs torch's
// own autograd kernel (the one every autograd key shares, reached at AutogradOther), which
// saves what CPU saves, records forward-mode tangents and takes the sequence number CPU
// takes; then it moves the node's state into a subclass whose backward takes CPU's branch
// (F = input.suggest_memory_format()) and hangs the outputs on it. The subclass keeps the
// node's name, and Python sees it as torch's type (module.cpp registers it), so
// `y.grad_fn` and its `_saved_*` attributes read as on CPU. Double backward (grad mode on,
// or a gradient for mean or rstd) keeps torch's formula: ATen ops, the same on any device.
// Not covered: compiled autograd lifts the node through torch's own functional form
// (apply_with_saved), which keeps the device check.
#include "neuron.h"

#include <ATen/RedispatchFunctions.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/generated/Functions.h>
#include <torch/library.h>

#include <array>
#include <memory>
#include <mutex>
#include <tuple>
#include <typeinfo>
#include <utility>
#include <vector>

namespace neuron {
namespace {

using torch::autograd::variable_list;
using torch::autograd::generated::NativeGroupNormBackward0;

struct GroupNormBackward final : NativeGroupNormBackward0 {
  using NativeGroupNormBackward0::NativeGroupNormBackward0;

  variable_list apply(variable_list&& grads) override {
    if (at::GradMode::is_enabled() || grads[1].defined() || grads[2].defined() || !grads[0].defined()) {
      return NativeGroupNormBackward0::apply(std::move(grads));  // no device check on this branch
    }
    std::lock_guard<std::mutex> lock(mutex_);  // as the generated apply: saved values are read under it
    const at::Tensor input = input_.unpack();
    const at::Tensor mean = result1_.unpack(getptr());
    const at::Tensor rstd = result2_.unpack(getptr());
    const at::Tensor weight = weight_.unpack();
    const std::array<bool, 3> mask = {task_should_compute_output(0), task_should_compute_output(1),
                                      task_should_compute_output(2)};
    variable_list grad_inputs(3);
    if (!(mask[0] || mask[1] || mask[2])) {
      return grad_inputs;
    }
    const auto format = input.suggest_memory_format();  // CPU's branch of the formula
    auto [dx, dw, db] = at::native_group_norm_backward_symint(grads[0].contiguous(format), input.contiguous(format),
                                                              mean, rstd, weight, N, C, HxW, group, mask);
    if (mask[0]) {
      grad_inputs[0] = std::move(dx);
    }
    if (mask[1]) {
      grad_inputs[1] = std::move(dw);
    }
    if (mask[2]) {
      grad_inputs[2] = std::move(db);
    }
    return grad_inputs;
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> native_group_norm_autograd(
    c10::DispatchKeySet ks, const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, c10::SymInt N, c10::SymInt C, c10::SymInt HxW, int64_t group,
    double eps) {
  const auto torch_autograd = (ks & c10::after_autograd_keyset) | c10::DispatchKeySet(c10::DispatchKey::AutogradOther);
  auto out = at::redispatch::native_group_norm_symint(torch_autograd, input, weight, bias, std::move(N), std::move(C),
                                                      std::move(HxW), group, eps);
  auto [y, mean, rstd] = out;
  const auto torch_node = torch::autograd::impl::gradient_edge(y).function;
  auto* old = dynamic_cast<NativeGroupNormBackward0*>(torch_node.get());
  if (old == nullptr) {
    return out;  // nothing required a gradient
  }
  // The same sequence number and edges: the backward runs where CPU's would, in the same order.
  auto node = c10::make_intrusive<GroupNormBackward>(old->sequence_nr(), torch::autograd::edge_list(old->next_edges()));
  node->C = old->C;
  node->HxW = old->HxW;
  node->N = old->N;
  node->eps = old->eps;
  node->group = old->group;
  node->input_ = std::move(old->input_);
  node->weight_ = std::move(old->weight_);
  node->result1_ = std::move(old->result1_);  // saved as outputs: unpacked with the node that holds them
  node->result2_ = std::move(old->result2_);
  for (const at::Tensor& t : {y, mean, rstd}) {
    torch::autograd::set_history(t, node);
  }
  return out;
}

}  // namespace

const std::type_info& group_norm_backward_type() { return typeid(GroupNormBackward); }

void register_autograd_layouts(std::vector<std::unique_ptr<torch::Library>>& libraries) {
  auto aten = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::AutogradPrivateUse1,
                                               __FILE__, __LINE__);
  aten->impl("native_group_norm", TORCH_FN(native_group_norm_autograd));
  libraries.push_back(std::move(aten));
}

}  // namespace neuron
