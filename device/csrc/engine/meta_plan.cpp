// Note [Plans from shape functions]: a shape-generic trace (adaptive_eager/engine/generic.py) defers
// ops whose sizes change from one repetition to the next (a KV cache growing a position per
// token), so no recorded geometry fits its outputs. Its DeferPlan says `from_meta`: at issue,
// the op runs here first on meta tensors of its arguments' exact geometry (the shape function
// every ATen op has, the same one torch.compile traces with), and the plan is what that
// returns: the outputs' sizes, strides, offset, dtype and bytes, for this call. The launch
// then runs the real kernel and checks its result against this plan (fill in queue.cpp), as
// for any deferred op. No shape function, or one that raises (the arguments do not fit
// together): no plan, and the op is not deferred; eager mode's kernel then runs it, and
// raises its own error where it would.
#include "neuron.h"

#include <ATen/ATen.h>
#include <ATen/TensorIterator.h>
#include <ATen/ops/_log_softmax_backward_data_meta_dispatch.h>
#include <ATen/ops/_log_softmax_meta_dispatch.h>
#include <ATen/ops/_softmax_backward_data_meta_dispatch.h>
#include <ATen/ops/_softmax_meta_dispatch.h>
#include <ATen/ops/addmm_meta_dispatch.h>
#include <ATen/ops/baddbmm_meta_dispatch.h>
#include <ATen/ops/bmm_meta_dispatch.h>
#include <ATen/ops/cat_meta_dispatch.h>
#include <ATen/ops/mean_meta_dispatch.h>
#include <ATen/ops/mm_meta_dispatch.h>
#include <ATen/ops/nll_loss_backward_meta_dispatch.h>
#include <ATen/ops/nll_loss_forward_meta_dispatch.h>
#include <ATen/ops/sum_meta_dispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/hash.h>

#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <unordered_map>
#include <memory>
#include <vector>

namespace neuron {
namespace {

using c10::IValue;

// A meta tensor with t's geometry on a storage as large as t's, so any offset fits.
at::Tensor meta_like(const at::Tensor& t) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), t.storage().nbytes(), c10::DataPtr(nullptr, c10::Device(c10::kMeta)),
                       /*allocator=*/nullptr, /*resizable=*/false);
  auto m = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::Meta), t.dtype());
  m.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  return m;
}

// Device tensors become meta tensors and the neuron device the meta one; host scalars stay.
IValue to_meta(const IValue& v) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    return t.defined() && t.device().type() == kNeuron ? IValue(meta_like(t)) : v;
  }
  if (v.isList()) {
    return map_list(v, [](const IValue& e, size_t) { return to_meta(e); });
  }
  if (v.isDevice() && v.toDevice().type() == kNeuron) {
    return IValue(c10::Device(c10::kMeta));
  }
  return v;
}

OutputSpec spec_of(const at::Tensor& t) {
  if (!t.defined()) {
    return OutputSpec{{}, {}, 0, at::ScalarType::Undefined, 0, /*defined=*/false};
  }
  return OutputSpec{t.sizes().vec(), t.strides().vec(), t.storage_offset(), t.scalar_type(),
                    static_cast<int64_t>(t.storage().nbytes())};
}

// What a shape function's answer depends on, as a flat key: each tensor's geometry, dtype
// and device, every other argument's value. False for an argument it cannot key.
// float_values: a float's (or complex's) bits are part of the key; else only that it is one.
bool append_key(const IValue& v, std::vector<int64_t>& key, bool float_values = true) {
  key.push_back(static_cast<int64_t>(v.tag));
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) {
      key.push_back(-1);
      return true;
    }
    key.push_back(t.dim());
    key.insert(key.end(), t.sizes().begin(), t.sizes().end());
    key.insert(key.end(), t.strides().begin(), t.strides().end());
    key.push_back(t.storage_offset());
    key.push_back(static_cast<int64_t>(t.scalar_type()));
    key.push_back(static_cast<int64_t>(t.device().type()));
    key.push_back(t.device().index());
    return true;
  }
  if (v.isInt()) {
    key.push_back(v.toInt());
  } else if (v.isBool()) {
    key.push_back(v.toBool());
  } else if (v.isDouble() && !float_values) {
    key.push_back(0);
  } else if (v.isDouble()) {  // its bits: an arange's float end decides its length
    const double d = v.toDouble();
    int64_t bits = 0;
    static_assert(sizeof(bits) == sizeof(d));
    std::memcpy(&bits, &d, sizeof(d));
    key.push_back(bits);
  } else if (v.isDevice()) {
    key.push_back(static_cast<int64_t>(v.toDevice().type()));
    key.push_back(v.toDevice().index());
  } else if (v.isList()) {
    const c10::List<IValue> list = v.toList();
    key.push_back(static_cast<int64_t>(list.size()));
    for (size_t i = 0; i < list.size(); ++i) {
      if (!append_key(list.get(i), key, float_values)) {
        return false;
      }
    }
  } else if (v.isString()) {
    key.push_back(static_cast<int64_t>(std::hash<std::string>()(v.toStringRef())));
  } else if (v.isComplexDouble() && !float_values) {
    key.push_back(0);
  } else if (!v.isNone()) {
    return false;  // a complex number, an object: not keyed, the shape function runs each time
  }
  return true;
}

using KeyHash = GeometryKeyHash;

}  // namespace

size_t GeometryKeyHash::operator()(const std::vector<int64_t>& key) const {
  size_t h = key.size();
  for (const int64_t x : key) {
    h = c10::hash_combine(h, std::hash<int64_t>()(x));
  }
  return h;
}

bool geometry_key(const c10::OperatorHandle& op, const torch::jit::Stack& stack, c10::DeviceIndex device,
                  std::vector<int64_t>* key, bool float_values) {
  const size_t n = op.schema().arguments().size();
  key->push_back(reinterpret_cast<intptr_t>(&op.schema()));  // one schema object per operator, for the process's life
  key->push_back(device);
  for (size_t i = stack.size() - n; i < stack.size(); ++i) {
    if (!append_key(stack[i], *key, float_values)) {
      return false;
    }
  }
  return true;
}

// Note [Pointwise shape functions]: an elementwise op's output is what TensorIterator makes
// of its tensor inputs (broadcast sizes, strides following the inputs' layout), the same
// TensorIterator its CPU kernel allocates its result with. Its meta kernel in torch 2.13 is
// a Python ref (~100 µs); this is ~5 µs. The engine asks for it only where it checked it
// against both recorded runs of the position (adaptive_eager/engine/generic.py): TensorIterator's
// flags and an op's own allocation (clone's memory format) may differ from op to op.
at::Tensor pointwise_output(const std::vector<at::Tensor>& inputs, at::ScalarType dtype) {
  at::TensorIteratorConfig config;
  config.set_check_mem_overlap(false).check_all_same_dtype(false).allow_cpu_scalars(true).declare_static_dtype(dtype);
  config.add_owned_output(at::Tensor());
  for (const auto& t : inputs) {
    config.add_owned_const_input(t);
  }
  at::TensorIterator iter = config.build();
  return iter.output(0);
}

namespace {

// Answers by key. Many calls of one token share their sizes (every layer of a decoder runs
// the same cache update and attention), and so do the tokens of repeated calls; a Python
// shape function (elementwise ops' own, in torch 2.13) costs ~100 µs, the lookup ~1 µs.
// Cleared when full: a stream of ever new sizes keeps bounded memory.
std::unordered_map<std::vector<int64_t>, std::shared_ptr<const DeferPlan>, KeyHash> g_plans;
constexpr size_t kPlansKept = 1 << 14;

std::shared_ptr<const DeferPlan> run_shape_function(const c10::OperatorHandle& op, const torch::jit::Stack& stack,
                                                    c10::DeviceIndex device, at::ScalarType pointwise_dtype);

}  // namespace

std::shared_ptr<const DeferPlan> plan_from_meta(const c10::OperatorHandle& op, const torch::jit::Stack& stack,
                                                const DeferPlan& generic) {
  const c10::DeviceIndex device = generic.device;
  std::vector<int64_t> key;
  key.reserve(64);
  const bool keyed = geometry_key(op, stack, device, &key);
  if (keyed) {
    auto found = g_plans.find(key);
    if (found != g_plans.end()) {
      return found->second;
    }
  }
  auto plan = run_shape_function(op, stack, device, generic.pointwise_dtype);
  if (keyed && plan) {
    if (g_plans.size() >= kPlansKept) {
      g_plans.clear();
    }
    g_plans.emplace(std::move(key), plan);
  }
  return plan;
}

namespace {

// Note [C++ shape functions]: torch 2.13 overrides many ops' C++ meta kernels with Python
// decompositions (addmm's costs ~0.9 ms, nll_loss_forward's ~1.7 ms). The C++ ones still
// exist as at::meta:: functions, the very meta step their CPU (structured) kernels run
// before computing, so they give the CPU kernel's geometry exactly. The hot ones of training
// and decoding are called directly here; every other op asks the dispatcher.
using CppMeta = std::vector<at::Tensor> (*)(torch::jit::Stack&);

std::optional<std::vector<int64_t>> int_list(const IValue& v) {
  return v.isNone() ? std::nullopt : std::optional<std::vector<int64_t>>(v.toIntVector());
}

const std::unordered_map<std::string, CppMeta>& cpp_meta() {
  static const auto* table = new std::unordered_map<std::string, CppMeta>{
      {"aten::addmm", [](torch::jit::Stack& s) -> std::vector<at::Tensor> {
         return {at::meta::addmm(s[0].toTensor(), s[1].toTensor(), s[2].toTensor(), s[3].toScalar(), s[4].toScalar())};
       }},
      {"aten::mm", [](torch::jit::Stack& s) -> std::vector<at::Tensor> {
         return {at::meta::mm(s[0].toTensor(), s[1].toTensor())};
       }},
      {"aten::bmm", [](torch::jit::Stack& s) -> std::vector<at::Tensor> {
         return {at::meta::bmm(s[0].toTensor(), s[1].toTensor())};
       }},
      {"aten::baddbmm", [](torch::jit::Stack& s) -> std::vector<at::Tensor> {
         return {at::meta::baddbmm(s[0].toTensor(), s[1].toTensor(), s[2].toTensor(), s[3].toScalar(), s[4].toScalar())};
       }},
      {"aten::_softmax", [](torch::jit::Stack& s) -> std::vector<at::Tensor> {
         return {at::meta::_softmax(s[0].toTensor(), s[1].toInt(), s[2].toBool())};
       }},
      {"aten::_log_softmax", [](torch::jit::Stack& s) -> std::vector<at::Tensor> {
         return {at::meta::_log_softmax(s[0].toTensor(), s[1].toInt(), s[2].toBool())};
       }},
      {"aten::_softmax_backward_data", [](torch::jit::Stack& s) -> std::vector<at::Tensor> {
         return {at::meta::_softmax_backward_data(s[0].toTensor(), s[1].toTensor(), s[2].toInt(), s[3].toScalarType())};
       }},
      {"aten::_log_softmax_backward_data", [](torch::jit::Stack& s) -> std::vector<at::Tensor> {
         return {at::meta::_log_softmax_backward_data(s[0].toTensor(), s[1].toTensor(), s[2].toInt(),
                                                      s[3].toScalarType())};
       }},
      {"aten::nll_loss_forward", [](torch::jit::Stack& s) -> std::vector<at::Tensor> {
         auto [out, total] = at::meta::nll_loss_forward(s[0].toTensor(), s[1].toTensor(), s[2].toOptional<at::Tensor>(),
                                                        s[3].toInt(), s[4].toInt());
         return {out, total};
       }},
      {"aten::nll_loss_backward", [](torch::jit::Stack& s) -> std::vector<at::Tensor> {
         return {at::meta::nll_loss_backward(s[0].toTensor(), s[1].toTensor(), s[2].toTensor(),
                                             s[3].toOptional<at::Tensor>(), s[4].toInt(), s[5].toInt(), s[6].toTensor())};
       }},
      {"aten::cat", [](torch::jit::Stack& s) -> std::vector<at::Tensor> {
         const std::vector<at::Tensor> tensors = s[0].toTensorVector();
         return {at::meta::cat(at::ITensorListRef(tensors), s[1].toInt())};
       }},
      {"aten::sum.dim_IntList", [](torch::jit::Stack& s) -> std::vector<at::Tensor> {
         const auto dims = int_list(s[1]);
         return {at::meta::sum(s[0].toTensor(), at::OptionalIntArrayRef(dims), s[2].toBool(),
                               s[3].toOptional<at::ScalarType>())};
       }},
      {"aten::mean.dim", [](torch::jit::Stack& s) -> std::vector<at::Tensor> {
         const auto dims = int_list(s[1]);
         return {at::meta::mean(s[0].toTensor(), at::OptionalIntArrayRef(dims), s[2].toBool(),
                                s[3].toOptional<at::ScalarType>())};
       }},
  };
  return *table;
}

// Runs a C++ shape function of the table on the meta arguments, leaving its results on the
// stack as the dispatcher would. False if the op has none.
bool call_cpp_meta(const c10::OperatorHandle& op, torch::jit::Stack& meta) {
  const c10::OperatorName& name = op.operator_name();
  const auto& table = cpp_meta();
  auto it = table.find(name.overload_name.empty() ? name.name : name.name + "." + name.overload_name);
  if (it == table.end()) {
    return false;
  }
  std::vector<at::Tensor> out = it->second(meta);
  meta.clear();
  for (auto& t : out) {
    meta.emplace_back(std::move(t));
  }
  return true;
}

// The plan of an elementwise op the engine checked (Note [Pointwise shape functions]).
std::shared_ptr<const DeferPlan> pointwise_plan(const torch::jit::Stack& stack, size_t n, c10::DeviceIndex device,
                                                at::ScalarType dtype) {
  std::vector<at::Tensor> inputs;
  for (size_t i = stack.size() - n; i < stack.size(); ++i) {
    const IValue m = to_meta(stack[i]);
    if (m.isTensor() && m.toTensor().defined()) {
      inputs.push_back(m.toTensor());
    }
  }
  try {
    auto plan = std::make_shared<DeferPlan>();
    plan->device = device;
    plan->outputs.push_back(spec_of(pointwise_output(inputs, dtype)));
    return plan;
  } catch (const std::exception&) {
    return nullptr;  // the op's own shape function decides
  }
}

std::shared_ptr<const DeferPlan> run_shape_function(const c10::OperatorHandle& op, const torch::jit::Stack& stack,
                                                    c10::DeviceIndex device, at::ScalarType pointwise_dtype) {
  const c10::FunctionSchema& schema = op.schema();
  const size_t n = schema.arguments().size();
  if (pointwise_dtype != at::ScalarType::Undefined) {
    if (auto plan = pointwise_plan(stack, n, device, pointwise_dtype)) {
      return plan;
    }
  }
  torch::jit::Stack meta;
  meta.reserve(n);
  std::vector<const c10::StorageImpl*> inputs;
  for (size_t i = stack.size() - n; i < stack.size(); ++i) {
    meta.push_back(to_meta(stack[i]));
    if (meta.back().isTensor() && meta.back().toTensor().defined()) {
      inputs.push_back(meta.back().toTensor().storage().unsafeGetStorageImpl());
    }
  }
  try {
    if (!call_cpp_meta(op, meta)) {
      op.callBoxed(meta);
    }
  } catch (const std::exception&) {
    return nullptr;  // no shape function, or the arguments do not fit: eager mode's kernel decides
  }
  auto plan = std::make_shared<DeferPlan>();
  plan->device = device;
  const auto& returns = schema.returns();
  if (meta.size() != returns.size()) {
    return nullptr;
  }
  auto add = [&](const IValue& v) {
    const at::Tensor t = v.isNone() ? at::Tensor() : v.toTensor();
    if (t.defined()) {
      const c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
      for (const auto* input : inputs) {
        if (input == storage) {
          return false;  // a view of an argument: not an output a plan can hand out
        }
      }
      inputs.push_back(storage);  // two outputs on one storage are views of each other too
    }
    plan->outputs.push_back(spec_of(t));
    return true;
  };
  for (size_t r = 0; r < returns.size(); ++r) {
    const auto* alias_info = returns[r].alias_info();
    if (alias_info != nullptr && alias_info->isWrite()) {
      continue;  // an in-place or out= result: the input itself (enqueue)
    }
    if (is_tensor_list(returns[r].type())) {
      const auto list = meta[r].toTensorVector();
      plan->list_lengths.push_back(static_cast<int64_t>(list.size()));
      for (const auto& t : list) {
        if (!add(t)) {
          return nullptr;
        }
      }
    } else if (!meta[r].isTensor() && !meta[r].isNone()) {
      return nullptr;  // a Python value result: never deferred
    } else if (!add(meta[r])) {
      return nullptr;
    }
  }
  return plan;
}

}  // namespace
}  // namespace neuron
