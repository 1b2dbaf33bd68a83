// Note [Dense layouts only]: a neuron tensor is a strided tensor on the neuron allocator's
// memory. Sparse tensors (COO, CSR, CSC, BSR, BSC) and nested tensors of the strided layout
// are other TensorImpls, whose ops dispatch to SparsePrivateUse1, SparseCsrPrivateUse1 and
// NestedTensorPrivateUse1, where the device has no kernels: torch would let one be made (a CSR
// tensor's constructor is a composite of its dense parts) and then fail at every op, `.cpu()`
// included, with "Could not run ... 'SparseCsrneuron' backend". So the constructors refuse, at
// the call that would make one, and anything on those keys (a path this misses) refuses too,
// with the same message. Nested tensors of the jagged layout are dense tensors underneath
// (a Python subclass) and run on neuron as they are.
//
// Note [No quantized tensors]: a quantized tensor (torch.qint8, quint8, qint32, ...) is a
// QTensorImpl carrying its quantizer, whose ops dispatch to QuantizedPrivateUse1, where the
// device has no kernels. quantize_per_tensor on neuron ran CPU's kernel on the host alias and
// adopted its bytes as a plain neuron tensor of dtype qint8: is_quantized False, its scale lost,
// every later op and `.cpu()` failing ("aten::int_repr has no CPU kernel", "empty_strided not
// supported on quantized tensors"). Supporting them as CPU does would need a quantized neuron
// TensorImpl and every QuantizedCPU kernel routed to it; so they are refused where they would
// be made, as sparse tensors are: the quantizing constructors, anything on QuantizedPrivateUse1
// (`.to('neuron')` of a quantized CPU tensor, factories of a quantized dtype), and a quantized
// result of any other op (run_on_host.cpp's from_host).
#include "neuron.h"

#include <torch/library.h>

#include <regex>
#include <string>

namespace neuron {

const char* const kQuantizedInstead =
    "Quantize on the CPU (torch.quantize_per_tensor(x.cpu(), ...)) and keep quantized tensors there, "
    "or use torchao's quantization (torchao.quantization.quantize_), whose tensors are plain tensors "
    "underneath and run on neuron.";

namespace {

// Constructors from dense parts: sparse_csr_tensor, _sparse_compressed_tensor_unsafe,
// sparse_coo_tensor, _sparse_bsr_tensor_unsafe, _sparse_compressed_tensor_with_dims, ...
const std::regex kSparseConstructor("aten::_?sparse_(coo|compressed|csr|csc|bsr|bsc)_tensor(_unsafe|_with_dims.*)?");
// Constructors of strided nested tensors (NestedTensorImpl): from a list, a padded tensor, a
// mask, or a buffer view. Not _nested_view_from_jagged and the other jagged ops: their
// tensors are dense.
const std::regex kNestedConstructor(
    "aten::_nested_(tensor_from_tensor_list|tensor_from_mask(_left_aligned)?|from_padded(_and_nested_example)?|"
    "view_from_buffer(_copy)?)");

[[noreturn]] void refuse(const c10::OperatorHandle& op, const char* what, const char* instead) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "neuron tensors are dense (strided) only: ", op.schema().operator_name(),
                              " would make or use ", what, " on neuron. ", instead);
}

constexpr const char* kSparseInstead =
    "Keep sparse tensors on the CPU (x.cpu().to_sparse_csr()), or use a dense equivalent on neuron "
    "(to_dense(), torch.mm on dense tensors).";
constexpr const char* kNestedInstead =
    "Use the jagged layout, which is built of dense tensors and runs on neuron: "
    "torch.nested.nested_tensor(tensors, layout=torch.jagged, device='neuron').";

// The quantizing ops whose result is a quantized tensor (quantize_per_tensor and its
// overloads, quantize_per_tensor_dynamic, quantize_per_channel, _make_per_*_quantized_tensor).
const std::regex kQuantizedConstructor(
    "aten::(quantize_per_(tensor|channel)|quantize_per_tensor_dynamic|_make_per_(tensor|channel)_quantized_tensor)");

void refuse_sparse(const c10::OperatorHandle& op, torch::jit::Stack*) { refuse(op, "a sparse tensor", kSparseInstead); }

void refuse_quantized(const c10::OperatorHandle& op, torch::jit::Stack*) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "neuron has no quantized tensors: ", op.schema().operator_name(),
                              " would make or use a quantized tensor on neuron. ", kQuantizedInstead);
}

void refuse_nested(const c10::OperatorHandle& op, torch::jit::Stack*) {
  refuse(op, "a nested tensor of the strided layout", kNestedInstead);
}

}  // namespace

void refuse_sparse_and_nested(std::vector<std::unique_ptr<torch::Library>>& libraries) {
  auto& dispatcher = c10::Dispatcher::singleton();
  // Every op of a tensor on these keys (a path that made one anyway).
  for (const auto key : {c10::DispatchKey::SparsePrivateUse1, c10::DispatchKey::SparseCsrPrivateUse1,
                         c10::DispatchKey::NestedTensorPrivateUse1}) {
    auto all = std::make_unique<torch::Library>(torch::Library::IMPL, "_", key, __FILE__, __LINE__);
    all->fallback(key == c10::DispatchKey::NestedTensorPrivateUse1
                      ? torch::CppFunction::makeFromBoxedFunction<&refuse_nested>()
                      : torch::CppFunction::makeFromBoxedFunction<&refuse_sparse>());
    libraries.push_back(std::move(all));
  }
  // `.to('neuron')` of a CSR, CSC, BSR or BSC tensor dispatches here (the device's key ranks
  // above the CPU's), to the composite _to_copy, which would build the result from its parts
  // in at::native, below the dispatcher, where no constructor of ours is asked.
  auto compressed = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::SparseCsrPrivateUse1,
                                                     __FILE__, __LINE__);
  compressed->impl("_to_copy", torch::CppFunction::makeFromBoxedFunction<&refuse_sparse>());
  libraries.push_back(std::move(compressed));
  // The constructors, called with neuron parts: at PrivateUse1 (below autograd, as under
  // inference_mode) and at AutogradPrivateUse1, where the composite would run otherwise.
  const std::vector<c10::OperatorName> names = dispatcher.getAllOpNames();
  for (const auto key : {c10::DispatchKey::PrivateUse1, c10::DispatchKey::AutogradPrivateUse1}) {
    auto aten = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", key, __FILE__, __LINE__);
    for (const c10::OperatorName& name : names) {
      if (name.name.find("_tensor") == std::string::npos && name.name.find("_nested_") == std::string::npos) {
        continue;  // std::regex is slow: most names are out at once
      }
      const bool sparse = std::regex_match(name.name, kSparseConstructor);
      if ((sparse || std::regex_match(name.name, kNestedConstructor)) && !dispatcher.findOp(name)->hasKernelForDispatchKey(key)) {
        aten->impl(c10::toString(name).c_str(), sparse ? torch::CppFunction::makeFromBoxedFunction<&refuse_sparse>()
                                                       : torch::CppFunction::makeFromBoxedFunction<&refuse_nested>());
      }
    }
    libraries.push_back(std::move(aten));
  }
}

void refuse_quantized_tensors(std::vector<std::unique_ptr<torch::Library>>& libraries) {
  // Every op of a quantized neuron tensor, and every factory of a quantized dtype on neuron.
  auto all = std::make_unique<torch::Library>(torch::Library::IMPL, "_", c10::DispatchKey::QuantizedPrivateUse1,
                                              __FILE__, __LINE__);
  all->fallback(torch::CppFunction::makeFromBoxedFunction<&refuse_quantized>());
  libraries.push_back(std::move(all));
  // The constructors, called with a neuron input: at PrivateUse1, before the eager path runs
  // CPU's kernel (their autograd kernels redispatch here).
  auto aten = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1,
                                               __FILE__, __LINE__);
  for (const c10::OperatorName& name : c10::Dispatcher::singleton().getAllOpNames()) {
    if (name.name.find("quantiz") != std::string::npos && std::regex_match(name.name, kQuantizedConstructor)) {
      aten->impl(c10::toString(name).c_str(), torch::CppFunction::makeFromBoxedFunction<&refuse_quantized>());
    }
  }
  libraries.push_back(std::move(aten));
}

}  // namespace neuron
