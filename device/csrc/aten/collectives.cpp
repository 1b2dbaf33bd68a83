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

namespace {

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

// Note [A collective's future holds device tensors]: gloo runs on host aliases of the device's
// bytes, so its Work's result() and future hold those CPU aliases, and DDP's reducer copies its
// bucket back from `future.value()` (a host-to-device transfer the chip never makes), as a
// communication hook would read or write CPU tensors beside the device's queue. The op returns
// gloo's Work wrapped: waiting, completion and errors are gloo's; result() and the future's value
// are the neuron tensors the collective wrote. Some of gloo's Works have no future
// (reduce_scatter's "getFuture not implemented"): theirs completes when the Work is waited for.
namespace {

class DeviceTensorsWork final : public c10d::Work {
 public:
  DeviceTensorsWork(c10::intrusive_ptr<c10d::Work> host, std::vector<at::Tensor> written)
      : c10d::Work(-1, host->retrieveOpType()), host_(std::move(host)), written_(std::move(written)) {}

  bool isCompleted() override { return host_->isCompleted(); }
  bool isSuccess() const override { return host_->isSuccess(); }
  std::exception_ptr exception() const override { return host_->exception(); }
  int sourceRank() const override { return host_->sourceRank(); }
  std::vector<at::Tensor> result() override { return written_; }
  void synchronize() override { host_->synchronize(); }
  bool wait(std::chrono::milliseconds timeout) override { return host_->wait(timeout); }
  void abort() override { host_->abort(); }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    c10::intrusive_ptr<c10::ivalue::Future> host;
    try {
      host = host_->getFuture();
    } catch (const c10::Error&) {  // a Work without a future: done when waited for
      host_->wait();
      auto done = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
      done->markCompleted(IValue(written_));
      return done;
    }
    std::vector<at::Tensor> written = written_;
    return host->then([written](c10::ivalue::Future&) { return IValue(written); }, c10::ListType::ofTensors());
  }

 private:
  c10::intrusive_ptr<c10d::Work> host_;
  std::vector<at::Tensor> written_;
};

}  // namespace

c10::IValue work_with_device_tensors(const c10::IValue& work, const std::vector<at::Tensor>& written) {
  if (!work.isCustomClass()) {
    return work;
  }
  // As c10d's Work: an IValue knows a custom class by its static type, and only Work is registered.
  c10::intrusive_ptr<c10d::Work> wrapped = c10::make_intrusive<DeviceTensorsWork>(work.toCustomClass<c10d::Work>(), written);
  return IValue(std::move(wrapped));
}

// Note [Projected collectives]: in projection mode (Note [Projected ops]) a collective moves
// nothing and the ranks do not meet: gloo is not called. Every other rank is taken to hold what
// this one holds (a symmetric program: data parallelism's ranks, tensor parallelism's replicated
// values), as torch's FakeProcessGroup takes it. So where every tensor it reads and writes has
// values (small ones copied from the host keep theirs: Note [Projected bytes]), an all-gather
// fills each rank's slot with this rank's input, a broadcast leaves this rank's values (the
// root's), an all-reduce gives N times its tensors for SUM and its tensors for AVG, MIN and MAX:
// what DDP's check that every rank holds the same parameters reads, and what object collectives
// (all_gather_object's sizes and pickled bytes) exchange. Otherwise what it writes (its first
// argument: the tensors, outputs or output lists; never send's, nor a barrier's) loses any values
// it had, as every written tensor does in projection. It returns what gloo's kernel returns, its
// results and a Work already completed, whose future holds the written tensors (DDP's
// communication hooks chain on it: `fut.value()[0]`), so `wait()`, functional collectives'
// `wait_tensor` and hooks all go on at once. Its price is the link's (Note [Collectives on the
// link]), the same as with bytes.
namespace {

bool has_values(const IValue& v) {
  for (const at::Tensor& t : tensors_of(v)) {
    if (t.defined() && t.device().type() == kNeuron && is_projected(t.storage())) {
      return false;
    }
  }
  return true;
}

at::Tensor on_host(const at::Tensor& t) { return t.device().type() == kNeuron ? host_alias(t) : t; }

// What the collective gives when every rank holds this rank's values; false where this file
// does not say (the written tensors then lose their values).
bool exchange_as_if_symmetric(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first) {
  const c10::FunctionSchema& schema = op.schema();
  const std::string& name = schema.operator_name().name;
  for (size_t i = first; i < stack.size(); ++i) {
    if (!has_values(stack[i])) {
      return false;
    }
  }
  const int64_t n = stack[first + argument_index(schema, "process_group")].toCustomClass<c10d::ProcessGroup>()->getSize();
  if (name == "c10d::broadcast_") {
    return true;
  }
  if (name == "c10d::allgather_") {  // output_tensors[i][rank] = input_tensors[i]
    const auto outputs = stack[first].toListRef();
    const std::vector<at::Tensor> inputs = tensors_of(stack[first + 1]);
    for (size_t i = 0; i < inputs.size() && i < outputs.size(); ++i) {
      for (const at::Tensor& slot : tensors_of(outputs[i])) {
        on_host(slot).copy_(on_host(inputs[i]));
      }
    }
    return true;
  }
  if (name == "c10d::_allgather_base_" || name == "c10d::allgather_into_tensor_coalesced_") {
    const std::vector<at::Tensor> outputs = tensors_of(stack[first]);
    const std::vector<at::Tensor> inputs = tensors_of(stack[first + 1]);
    for (size_t i = 0; i < inputs.size() && i < outputs.size(); ++i) {
      if (inputs[i].numel() == 0) {
        continue;
      }
      if (!outputs[i].is_contiguous() || outputs[i].numel() != n * inputs[i].numel()) {
        return false;
      }
      on_host(outputs[i]).view({n, -1}).copy_(on_host(inputs[i]).reshape({1, -1}));
    }
    return true;
  }
  if (name == "c10d::allreduce_" || name == "c10d::allreduce_coalesced_") {
    const auto rop = stack[first + argument_index(schema, "reduce_op")].toCustomClass<c10d::ReduceOp>();
    if (rop->op_ == c10d::ReduceOp::SUM) {
      for (const at::Tensor& t : tensors_of(stack[first])) {
        at::Tensor host = on_host(t);
        host.mul_(n);
      }
      return true;
    }
    return rop->op_ == c10d::ReduceOp::AVG || rop->op_ == c10d::ReduceOp::MIN || rop->op_ == c10d::ReduceOp::MAX;
  }
  return false;
}

}  // namespace

void project_collective(const c10::OperatorHandle& op, torch::jit::Stack* stack, size_t first) {
  const c10::FunctionSchema& schema = op.schema();
  const std::string& name = schema.operator_name().name;
  const bool writes_first = name != "c10d::send" && name != "c10d::barrier" && name != "c10d::monitored_barrier_";
  std::optional<c10::DeviceIndex> device;
  for (size_t i = first; i < stack->size(); ++i) {
    for (const at::Tensor& t : tensors_of((*stack)[i])) {
      if (t.defined() && t.device().type() == kNeuron) {
        device = t.device().index();
        break;
      }
    }
    if (device) {
      break;
    }
  }
  const c10::DeviceIndex d = device.value_or(current_device());
  const double us = collective_us(op, *stack, first).value_or(0.0);
  const IValue results = (*stack)[first];
  std::vector<at::Tensor> written;
  if (writes_first) {
    written = tensors_of(results);
  }
  if (writes_first && !exchange_as_if_symmetric(op, *stack, first)) {
    for (const at::Tensor& t : written) {
      if (t.defined() && t.device().type() == kNeuron && !is_projected(t.storage())) {
        project_in_place(t.storage(), t.storage().nbytes(), /*grown=*/false);
      }
    }
  }
  std::optional<Range> range;
  if (profiling()) {
    range.emplace("neuron::" + name);
  }
  const double spent = launch_collective(d, name, us);
  if (range) {
    mark_device_time(spent, "ops", 1, d);
  }
  stack->resize(first);
  const size_t num_returns = schema.returns().size();
  if (num_returns == 0) {
    return;
  }
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
  future->markCompleted(IValue(written));
  if (num_returns == 2) {  // (results, Work)
    stack->push_back(results);
  }
  stack->push_back(IValue(c10d::Work::create_from_future(future)));
}

}  // namespace eager_detail
}  // namespace neuron
