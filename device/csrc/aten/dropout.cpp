// Note [Dropout takes CPU's path]: aten::dropout (F.dropout, nn.Dropout) is a composite that
// chooses its arithmetic by device type (Dropout.cpp, is_fused_kernel_acceptable): on CUDA,
// XPU, Lazy and PrivateUse1 it returns native_dropout's output, input * mask * (1 / (1 - p)),
// the scale rounded from a double to the input's dtype; on CPU it computes
// input * (noise / (1 - p)), noise the Bernoulli draws in the input's dtype, the division
// rounded in that dtype. The draws are the same (CPU's bernoulli_ draws a bool and a float
// tensor alike), the products are not: in float32, 15 of the 99 values p = 0.01 ... 0.99 give
// other last bits, forward and backward (native_dropout_backward scales the same way).
// Neuron promises CPU's bits, so its dropout is CPU's path, op for op: a kernel at
// AutogradPrivateUse1 (and at PrivateUse1, which inference_mode reaches) in place of the
// composite, computing what CPU's composite computes. Its ops (empty_like, bernoulli_, div_,
// mul) are ordinary neuron ops: the engine sees and defers each, autograd differentiates them
// as on CPU (the gradient is grad * noise), and bernoulli_ draws from the device's generator
// where CPU's draws, so the stream stays aligned. native_dropout itself, called by name, stays
// CPU's native_dropout kernel, as on CPU. Under torch.compile the Python dispatcher also takes
// this kernel (a direct registration ranks above the decomposition to native_dropout): the
// graph draws what eager mode draws.
#include "aten/eager_internal.h"

#include <ATen/ops/dropout_native.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <memory>
#include <utility>
#include <vector>

namespace neuron {
namespace eager_detail {
namespace {

at::Tensor dropout(const at::Tensor& input, double p, bool train) {
  // ATen's is_fused_kernel_acceptable for an accelerator: only then would the paths differ.
  const bool fused_on_accelerator = train && p > 0 && p < 1 && input.sym_numel() > 0;
  if (input.is_nested() || !fused_on_accelerator) {
    return at::native::dropout(input, p, train);  // CPU's own composite: its checks, no draw
  }
  // As CPU's _dropout_impl (Dropout.cpp), line for line; the noise in the input's layout, as
  // torch 2.13's (a transposed input draws its mask in its memory order).
  at::Tensor noise = at::empty_like(input);
  noise.bernoulli_(1 - p);
  noise.div_(1 - p);
  return input.mul(noise);
}

}  // namespace

void register_cpu_dropout(std::vector<std::unique_ptr<torch::Library>>& libraries) {
  for (const auto key : {c10::DispatchKey::AutogradPrivateUse1, c10::DispatchKey::PrivateUse1}) {
    auto aten = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", key, __FILE__, __LINE__);
    aten->impl("dropout", TORCH_FN(dropout));
    libraries.push_back(std::move(aten));
  }
}

}  // namespace eager_detail
}  // namespace neuron
