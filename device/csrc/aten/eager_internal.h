// What the files of the eager path (device/csrc/aten) share among themselves: pricing.cpp's
// clock, host_alias.cpp's aliases, generator_lending.cpp's generators, kernels.cpp's kernels
// for registration.cpp. Internal to device/csrc/aten (neuron.h is the core's interface).
#pragma once

#include "neuron.h"

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/Storage.h>
#include <torch/library.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace neuron {
namespace eager_detail {

// -- pricing.cpp: ops on the modelled clock -------------------------------------------------
// The cost model's figures, from install_eager (once).
void set_costs(const EagerCosts& costs, const std::vector<std::pair<int, std::string>>& converted);
// A copy of nbytes over HBM (a transfer to, from or between devices), in µs.
double transfer_us(double nbytes);
// A convolution's flags, read from its arguments before it runs (op_flops needs them after).
struct ConvFlags {
  bool transposed = false;
  bool grad_input = false, grad_weight = false;  // convolution_backward's output_mask
};
ConvFlags conv_flags(const c10::OperatorName& name, const torch::jit::Stack& stack, size_t first);
// FLOPs as torch.utils.flop_counter counts them; 0 for ops priced by the bytes they move.
double op_flops(const c10::OperatorName& name, c10::ArrayRef<at::Tensor> in, const ConvFlags& conv,
                const c10::IValue* out, size_t num_out);
// One op launched on d's clock at its roofline (and in the op log); its time.
double launch_op(c10::DeviceIndex d, const std::string& name, double flops, double nbytes, double elements,
                 at::ScalarType dtype);

// Note [Ops TorchNeuron runs on the host] (torchneuron_runs_on_host in neuron.h): their price,
// two transfers and no launch; the price in µs.
double charge_host_round_trip(c10::DeviceIndex d, double argument_bytes, double result_bytes);

// -- kernels.cpp: Note [Host reads in projection mode] --------------------------------------
// A value-dependent op ran on the placeholder values of projected tensors (zeros): counted with
// the host reads, warned once (Note [Value-dependent ops on placeholder values], run_on_host.cpp).
void note_placeholder_values(const std::string& op_name);

// -- host_alias.cpp: Note [Host aliases] ----------------------------------------------------
// A tensor with `like`'s dtype, geometry and math bits, on `storage`, for `key`'s backend.
at::Tensor tensor_like_on(c10::Storage storage, c10::DispatchKey key, const at::Tensor& like);
// t as a CPU tensor on `alias`, a host alias of t's storage (shared by an op's arguments on it).
at::Tensor host_alias_on(const c10::Storage& alias, const at::Tensor& t);
// t as a CPU tensor on a new host alias of its storage.
at::Tensor host_alias(const at::Tensor& t);
// A neuron storage that adopts a CPU storage's bytes, zero-copy, charged to device d.
c10::Storage adopt(const c10::Storage& cpu, c10::DeviceIndex d, bool new_result);
// A neuron tensor on `storage` with `geometry`'s dtype, geometry and math bits.
at::Tensor neuron_tensor_on(c10::Storage storage, const at::Tensor& geometry);

// -- collectives.cpp: Note [Reduce ops as NCCL computes them] ------------------------------
// What rewrite_reduce_op changed in a c10d collective's arguments (already host aliases), for
// finish_reduce_op to complete after gloo's kernel ran: the results to divide, by what.
struct ReduceRewrite {
  bool active = false;
  int64_t divide_by = 0;  // an integer AVG: the world size; 0: nothing to divide
  std::vector<at::Tensor> results;  // the op's results (host aliases)
  std::vector<at::Tensor> scratch;  // what gloo sums into instead, one per result
  c10::IValue returned;             // the results argument, as the op returns it
};
ReduceRewrite rewrite_reduce_op(const c10::OperatorHandle& op, torch::jit::Stack* stack, size_t first);
void finish_reduce_op(const ReduceRewrite& rewrite, torch::jit::Stack* stack, size_t num_returns);

// The index of the argument called `name` in a schema, or -1.
int argument_index(const c10::FunctionSchema& schema, const char* name);
// The tensors of a Tensor, Tensor[] or Tensor[][] argument.
std::vector<at::Tensor> tensors_of(const c10::IValue& v);
// Note [A collective's future holds device tensors]: gloo's Work, its future's value the
// neuron tensors the collective wrote (`written`).
c10::IValue work_with_device_tensors(const c10::IValue& work, const std::vector<at::Tensor>& written);
// Note [Projected collectives]: a c10d collective in projection mode, on the stack (arguments
// from `first`): nothing moves, its written tensors lose their values, a completed Work.
void project_collective(const c10::OperatorHandle& op, torch::jit::Stack* stack, size_t first);

// -- collective_pricing.cpp: Note [Collectives on the link] -----------------------------------
// Whether a c10d op is a collective the link prices (check_for_nan is not).
bool is_priced_collective(const c10::OperatorName& name);
// A collective's time on the link, from its arguments (before it runs); nullopt if it is none.
std::optional<double> collective_us(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first);
// One collective launched on d's clock (and in the op log); its time, launch overhead included.
double launch_collective(c10::DeviceIndex d, const std::string& name, double us);

// -- generator_lending.cpp: random ops draw from the device's generator ---------------------
// Whether a schema argument is a Generator or Generator?.
bool is_optional_generator(const c10::Argument& a);
// run_on_host.cpp: runs the op now, on the calling thread: its CPU kernel on host aliases of
// the device's bytes, its results mapped back, its time on the clock. The device's executor
// calls it (issue.cpp: Note [Eager ops run on the device]).
void run_on_host(const c10::OperatorHandle& op, torch::jit::Stack* stack);
// issue.cpp: issues the op to the device's executor, posted or waited for (Note [Eager ops run
// on the device]); on the executor itself, runs it (run_on_host).
void issue_eager(const c10::OperatorHandle& op, torch::jit::Stack* stack);
// Inside the block, torch's default CPU generator draws from `lender`'s state; on exit the
// state reached goes back to `lender` and the default gets its own back, exception or not.
struct DefaultGeneratorLent {
  at::Generator lender;
  at::Generator def;
  c10::intrusive_ptr<c10::TensorImpl> saved;

  explicit DefaultGeneratorLent(at::Generator g);
  ~DefaultGeneratorLent();
};
// Before an op on the stack (arguments from `first`) runs on the host: its generator argument
// (index generator_arg, -1 if none) becomes the host generator it draws from; a deferred op
// without one that draws gets torch's default lent the state it was issued with (kept until the
// kernel returns). Note [Deferred random ops draw at issue].
std::unique_ptr<DefaultGeneratorLent> lend_generator(const c10::OperatorHandle& op, torch::jit::Stack* stack,
                                                     size_t first, int generator_arg);

// -- dropout.cpp: aten::dropout computes CPU's arithmetic (Note [Dropout takes CPU's path]) --
void register_cpu_dropout(std::vector<std::unique_ptr<torch::Library>>& libraries);

// -- kernels.cpp: the kernels every backend must have, registered by registration.cpp ------
at::Tensor empty_memory_format(c10::IntArrayRef size, c10::optional<at::ScalarType> dtype,
                               c10::optional<at::Layout> layout, c10::optional<at::Device> device,
                               c10::optional<bool> pin_memory, c10::optional<at::MemoryFormat> memory_format);
at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, c10::optional<at::ScalarType> dtype,
                         c10::optional<at::Layout> layout, c10::optional<at::Device> device,
                         c10::optional<bool> pin_memory);
at::Tensor efficient_zero_tensor(c10::IntArrayRef size, c10::optional<at::ScalarType> dtype,
                                 c10::optional<at::Layout> layout, c10::optional<at::Device> device,
                                 c10::optional<bool> pin_memory);
at::Tensor as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      c10::optional<int64_t> storage_offset);
at::Tensor view(const at::Tensor& self, c10::IntArrayRef size);
at::Tensor reshape_alias(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride);
at::Tensor unfold(const at::Tensor& self, int64_t dimension, int64_t size, int64_t step);
at::Tensor view_as_real(const at::Tensor& self);
at::Tensor view_as_complex(const at::Tensor& self);
const at::Tensor& resize(const at::Tensor& self, c10::IntArrayRef size, c10::optional<at::MemoryFormat> format);
at::Tensor& set_storage(at::Tensor& self, at::Storage source, int64_t offset, c10::IntArrayRef size,
                        c10::IntArrayRef stride);
at::Tensor& set_empty(at::Tensor& self);
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking);
void copy_now(const at::Tensor& self, const at::Tensor& dst, bool non_blocking);
at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst);
at::Scalar local_scalar_dense(const at::Tensor& self);
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from);
void record_stream(at::Tensor& self, c10::Stream stream);
// scaled_dot_product_attention's kernel choice, as CPU makes it (_fused_sdp_choice_stub).
int64_t fused_sdp_choice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const c10::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                         c10::optional<double> scale, bool enable_gqa);

}  // namespace eager_detail
}  // namespace neuron
