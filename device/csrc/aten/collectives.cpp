// Note [Reduce ops as NCCL computes them]: a c10d collective on neuron tensors runs gloo's
// CPU kernel on the host aliases (registration.cpp), but its reduce op must give what the
// device's own collectives give, which are NCCL's (TorchNeuron's tests say so: CUDA's results).
// Gloo differs from NCCL in two reduce ops, and for those the op is rewritten around gloo:
// - PREMUL_SUM (torch.distributed._make_nccl_premul_sum(factor)): gloo refuses it. NCCL
//   multiplies each rank's input by the factor in the input's dtype (the factor converted to
//   it first), then sums. So each input is scaled on the host, then gloo sums. An input that
//   is also the result (all_reduce; reduce on its root) is scaled in place, since the sum
//   overwrites it anyway; any other input (reduce_scatter's; reduce off its root) is scaled
//   in a copy, leaving the caller's tensor as NCCL leaves it.
// - AVG of integers: gloo divides the sum by the world size in the input's dtype and fails
//   ("result type Float can't be cast to the desired output type Long"); NCCL sums, then
//   divides rounding toward zero (its SumPostDiv). So gloo sums into scratch results (copies
//   of the results, which carry all_reduce's inputs), and once the sum is complete the results
//   get the scratch divided (rounding_mode='trunc'). Scratch, not the results themselves: gloo
//   writes reduce_scatter's result when its Work is waited for, again at each wait (the
//   caller's wait() too), which would overwrite a quotient written in place with the sum. The
//   op returns the real results. This waits for the collective's work on the device's
//   executor, so an async_op=True integer AVG returns when it is done (its Work's wait() then
//   returns at once). Floating AVG stays gloo's.
#include "aten/eager_internal.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <string>
#include <vector>

namespace neuron {
namespace eager_detail {
namespace {

using c10::IValue;

int argument_index(const c10::FunctionSchema& schema, const char* name) {
  const auto& args = schema.arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].name() == name) {
      return static_cast<int>(i);
    }
  }
  return -1;
}

// The tensors of a Tensor, Tensor[] or Tensor[][] argument.
std::vector<at::Tensor> tensors_of(const IValue& v) {
  std::vector<at::Tensor> out;
  if (v.isTensor()) {
    out.push_back(v.toTensor());
  } else if (v.isList()) {
    for (const IValue& e : v.toListRef()) {
      for (at::Tensor& t : tensors_of(e)) {
        out.push_back(std::move(t));
      }
    }
  }
  return out;
}

// v (a Tensor, Tensor[] or Tensor[][] argument) with each tensor replaced by f(tensor), in
// new lists (never the caller's: a boxed list shares its elements with the caller's).
template <typename F>
IValue map_tensors(const IValue& v, const F& f) {
  if (v.isTensor()) {
    return IValue(f(v.toTensor()));
  }
  const auto elements = v.toListRef();
  if (!elements.empty() && elements.front().isList()) {  // Tensor[][]
    c10::List<c10::List<at::Tensor>> out;
    for (const IValue& e : elements) {
      out.push_back(map_tensors(e, f).toTensorList());
    }
    return IValue(out);
  }
  c10::List<at::Tensor> out;
  for (const IValue& e : elements) {
    out.push_back(f(e.toTensor()));
  }
  return IValue(out);
}

// The factor of a PREMUL_SUM as a 0-dim host tensor of `dtype` (NCCL converts it to the
// input's dtype). A tensor factor may be a neuron tensor: its bytes are read through a host
// alias (this runs on the device's executor, in order, after the op that wrote them).
at::Tensor premul_factor(const c10d::ReduceOp& rop, at::ScalarType dtype) {
  const auto* sup = dynamic_cast<const c10d::PreMulSumSupplement*>(rop.supplement_.get());
  TORCH_CHECK(sup != nullptr, "ReduceOp.PREMUL_SUM without a factor: make it with "
              "torch.distributed._make_nccl_premul_sum(factor)");
  if (!sup->tensor_factor.defined()) {
    return at::scalar_tensor(sup->double_factor, at::TensorOptions().dtype(dtype));
  }
  const at::Tensor& f = sup->tensor_factor;
  const at::Tensor host = f.device().type() == kNeuron ? host_alias(f) : f;
  return host.reshape({}).to(dtype, /*non_blocking=*/false, /*copy=*/true);
}

}  // namespace

ReduceRewrite rewrite_reduce_op(const c10::OperatorHandle& op, torch::jit::Stack* stack, size_t first) {
  ReduceRewrite rewrite;
  const c10::FunctionSchema& schema = op.schema();
  const int rop_arg = argument_index(schema, "reduce_op");
  if (rop_arg < 0) {
    return rewrite;
  }
  IValue& rop_value = (*stack)[first + rop_arg];
  const auto rop = rop_value.toCustomClass<c10d::ReduceOp>();
  if (rop->op_ != c10d::ReduceOp::PREMUL_SUM && rop->op_ != c10d::ReduceOp::AVG) {
    return rewrite;
  }
  const std::string& name = schema.name();
  const bool scatter = name.find("reduce_scatter") != std::string::npos;
  // Which argument holds the inputs and which the results; reduce_ writes its root's only.
  const char* in_name = scatter ? (name == "c10d::_reduce_scatter_base_" ? "input_tensor"
                                    : name == "c10d::reduce_scatter_" ? "input_tensors" : "inputs")
                                : "tensors";
  const char* out_name = scatter ? (name == "c10d::_reduce_scatter_base_" ? "output_tensor"
                                     : name == "c10d::reduce_scatter_" ? "output_tensors" : "outputs")
                                 : "tensors";
  const int in_arg = argument_index(schema, in_name);
  const int out_arg = argument_index(schema, out_name);
  const int group_arg = argument_index(schema, "process_group");
  TORCH_CHECK(in_arg >= 0 && out_arg >= 0 && group_arg >= 0, "internal error: ", schema.operator_name(),
              " has no '", in_name, "', '", out_name, "' or 'process_group' argument");
  const auto group = (*stack)[first + group_arg].toCustomClass<c10d::ProcessGroup>();
  bool writes_result = true;
  if (name == "c10d::reduce_") {
    writes_result = (*stack)[first + argument_index(schema, "root_rank")].toInt() == group->getRank();
  }
  const std::vector<at::Tensor> inputs = tensors_of((*stack)[first + in_arg]);
  if (inputs.empty()) {
    return rewrite;
  }
  const at::ScalarType dtype = inputs.front().scalar_type();
  if (rop->op_ == c10d::ReduceOp::AVG) {
    if (!at::isIntegralType(dtype, /*includeBool=*/false)) {
      return rewrite;  // gloo's own AVG
    }
    rewrite.divide_by = group->getSize();
    if (writes_result) {
      IValue& out = (*stack)[first + out_arg];
      rewrite.results = tensors_of(out);
      rewrite.returned = out;
      out = map_tensors(out, [](const at::Tensor& t) { return t.clone(); });
      rewrite.scratch = tensors_of(out);
    }
  } else {
    const at::Tensor factor = premul_factor(*rop, dtype);
    if (in_arg == out_arg && writes_result) {
      for (const at::Tensor& t : inputs) {
        at::Tensor(t).mul_(factor);
      }
    } else {
      (*stack)[first + in_arg] = map_tensors((*stack)[first + in_arg], [&](const at::Tensor& t) { return t.mul(factor); });
    }
  }
  rop_value = IValue(c10::make_intrusive<c10d::ReduceOp>(c10d::ReduceOp::SUM));
  rewrite.active = true;
  return rewrite;
}

void finish_reduce_op(const ReduceRewrite& rewrite, torch::jit::Stack* stack, size_t num_returns) {
  if (rewrite.divide_by == 0 || rewrite.results.empty()) {
    return;
  }
  const IValue& last = (*stack)[stack->size() - 1];  // every one of these ops returns its Work last
  TORCH_CHECK(num_returns > 0 && last.isCustomClass(), "internal error: a reduce op without its Work");
  last.toCustomClass<c10d::Work>()->wait();
  for (size_t i = 0; i < rewrite.results.size(); ++i) {
    at::Tensor(rewrite.results[i]).copy_(rewrite.scratch[i].div(rewrite.divide_by, "trunc"));
  }
  if (num_returns == 2) {  // (results, Work): the real results, not the scratch
    (*stack)[stack->size() - 2] = rewrite.returned;
  }
}

}  // namespace eager_detail
}  // namespace neuron
