// The kernels every backend must have, and those neuron's fallback would run wrong: allocation,
// views, resizes, copies and scalar reads between host and device, plus the few questions torch
// asks a backend (shallow-copy compatibility, the attention kernel's choice, record_stream).
// Registered at PrivateUse1 by registration.cpp; every other op takes the fallback
// (run_on_host.cpp).
#include "aten/eager_internal.h"

#include <ATen/Context.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/Resize.h>
#include <ATen/native/TensorFactories.h>
#include <ATen/ops/_fused_sdp_choice_ops.h>
#include <ATen/ops/_local_scalar_dense.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <typeinfo>
#include <utility>

namespace neuron {
namespace eager_detail {
namespace {

using c10::DeviceIndex;

void check_dense_unpinned(c10::optional<at::Layout> layout, c10::optional<bool> pin_memory) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided,
              "neuron tensors are dense (strided) only; keep sparse tensors on the CPU");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "Only dense CPU tensors can be pinned");
}

// Note [Deterministic empty]: under torch.use_deterministic_algorithms(True) with
// torch.utils.deterministic.fill_uninitialized_memory (on by default), every backend's empty
// and empty_strided kernel (CPU's, CUDA's, MPS's) fills the new tensor: NaN for floating and
// complex dtypes, the largest value for integers and bool (ATen's fill_empty_deterministic_).
// So must neuron's, or torch.empty, empty_like, new_empty and whatever is built on them return
// leftover bytes where CPU returns NaN. The fill is no op of the device's, though CPU's is a
// fill_ kernel: the allocating thread writes the value over the new bytes, as a runtime that
// clears what it allocates. An op would reach the adaptive engine, and every `.to('neuron')`
// (an empty_strided, then a copy into it) would find its destination held by a queued fill
// and cut the trace as a host read (HF Qwen3-MoE under deterministic algorithms went from one
// launch a step to 31), and every allocation would cost a launch in eager mode. The bytes are
// fresh (nothing queued holds them), so writing them now is safe; the value is computed by
// CPU's own fill_empty_deterministic_ on one host element, then repeated over the storage
// (serially, memcpy doubling: no OpenMP team on the allocating thread), over the whole
// storage: the gaps of an empty_strided too, which CPU leaves uninitialised.
// When the setting is off, the check is two flag reads.
void fill_if_deterministic(const at::Tensor& t) {
  if (C10_LIKELY(!at::globalContext().deterministicAlgorithms() ||
                 !at::globalContext().deterministicFillUninitializedMemory()) || is_projected(t.storage())) {
    return;  // off, or no bytes to fill (Note [Projected bytes])
  }
  const size_t nbytes = t.storage().nbytes();
  const size_t itemsize = t.dtype().itemsize();
  if (nbytes == 0 || itemsize == 0) {
    return;
  }
  at::Tensor value = at::detail::empty_cpu({}, t.scalar_type(), c10::nullopt, c10::nullopt, c10::nullopt, c10::nullopt);
  at::native::fill_empty_deterministic_(value);
  auto* bytes = static_cast<char*>(t.storage().mutable_data());
  std::memcpy(bytes, value.const_data_ptr(), itemsize);
  for (size_t filled = itemsize; filled < nbytes; filled *= 2) {
    std::memcpy(bytes + filled, bytes, std::min(filled, nbytes - filled));
  }
}

std::atomic<int64_t> g_placeholder_reads{0};

// Note [Host reads in projection mode]: a projected tensor has no values (Note [Projected
// bytes]). Inside projection mode a host read of one answers a placeholder, 0 or zeros, as the
// issue of the program goes on (`loss.item()` in a training loop, a GradScaler's inf check:
// 0 lets its step run); each is counted, and the first warns. Outside it, the read raises: a
// tensor made in projection mode has nothing to show.
void read_projected(const char* what) {
  TORCH_CHECK(projection_enabled(), what, " of a neuron tensor made in projection mode: it carries no values (only its "
              "shape, its memory and its cost were modelled). Read values of tensors computed outside "
              "adaptive_eager.projection().");
  g_placeholder_reads.fetch_add(1, std::memory_order_relaxed);
  TORCH_WARN_ONCE("projection mode: ", what, " of a neuron tensor returns a placeholder (0, or zeros): tensors carry no "
                  "values in projection mode. Control flow that depends on values may take another path than a run "
                  "with values would; adaptive_eager.stats().placeholder_reads counts these reads.");
}

}  // namespace

void note_placeholder_values(const std::string& op_name) {
  g_placeholder_reads.fetch_add(1, std::memory_order_relaxed);
  TORCH_WARN_ONCE("projection mode: ", op_name, " depends on its inputs' values, which tensors in projection mode do "
                  "not have: it ran on zeros (the placeholder values host reads return too), so its result's size, "
                  "and the cost of what follows from it, is what zeros give. adaptive_eager.stats().placeholder_reads "
                  "counts these ops with the host reads.");
}

at::Tensor empty_memory_format(c10::IntArrayRef size, c10::optional<at::ScalarType> dtype,
                               c10::optional<at::Layout> layout, c10::optional<at::Device> device,
                               c10::optional<bool> pin_memory, c10::optional<at::MemoryFormat> memory_format) {
  check_dense_unpinned(layout, pin_memory);
  const c10::DeviceGuard guard(c10::device_or_default(device));  // the allocator takes the current device
  at::Tensor t = at::detail::empty_generic(size, c10::GetAllocator(kNeuron), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype), memory_format);
  note_fresh_storage(t.storage());
  fill_if_deterministic(t);  // Note [Deterministic empty]
  return t;
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, c10::optional<at::ScalarType> dtype,
                         c10::optional<at::Layout> layout, c10::optional<at::Device> device,
                         c10::optional<bool> pin_memory) {
  check_dense_unpinned(layout, pin_memory);
  const c10::DeviceGuard guard(c10::device_or_default(device));
  at::Tensor t = at::detail::empty_strided_generic(size, stride, c10::GetAllocator(kNeuron),
                                                   c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                   c10::dtype_or_default(dtype));
  note_fresh_storage(t.storage());
  fill_if_deterministic(t);  // Note [Deterministic empty]
  return t;
}

// Forward-mode AD and torch.func make tangents that are known zeros this way: a tensor with
// the ZeroTensor key and no bytes, which the ZeroTensor fallback turns into zeros where an op
// needs values. The host fallback made a CPU ZeroTensor and adopted it as a plain neuron
// tensor without bytes, which read as a failed deferred value. As CUDA makes it.
at::Tensor efficient_zero_tensor(c10::IntArrayRef size, c10::optional<at::ScalarType> dtype,
                                 c10::optional<at::Layout> layout, c10::optional<at::Device> device,
                                 c10::optional<bool> pin_memory) {
  check_dense_unpinned(layout, pin_memory);
  c10::Device on = c10::device_or_default(device);
  if (!on.has_index()) {
    on.set_index(current_device());
  }
  at::native::ZeroTensorAllocator allocator(on);
  const auto keys = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1) | c10::DispatchKeySet(c10::DispatchKey::ZeroTensor);
  return at::detail::empty_generic(size, &allocator, keys, c10::dtype_or_default(dtype), c10::nullopt);
}

at::Tensor as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      c10::optional<int64_t> storage_offset) {
  return at::native::as_strided_tensorimpl(self, size, stride, storage_offset);
}

at::Tensor view(const at::Tensor& self, c10::IntArrayRef size) { return at::native::view(self, size); }

at::Tensor reshape_alias(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride) {
  return at::native::_reshape_alias(self, size, stride);
}

// The views whose only ATen kernels are per device (CPU, CUDA, ...): on the eager fallback they
// would run on a host alias, and their output, a tensor sharing an input's bytes made by a
// kernel, is a barrier to the engine (`repeat` unfolds: Whisper's decoder ran as 4 launches
// a step). Their CPU kernels are metadata only, as view's are, and are device-agnostic.
at::Tensor unfold(const at::Tensor& self, int64_t dimension, int64_t size, int64_t step) {
  return at::native::unfold(self, dimension, size, step);
}

at::Tensor view_as_real(const at::Tensor& self) { return at::native::view_as_real(self); }

at::Tensor view_as_complex(const at::Tensor& self) { return at::native::view_as_complex(self); }

// Both may grow the storage through its allocator, the neuron one, which allocates on the
// current device: hence the guard. New bytes are charged, old ones released.
const at::Tensor& resize(const at::Tensor& self, c10::IntArrayRef size, c10::optional<at::MemoryFormat> format) {
  sync_before_host_access();  // queued ops hold the old bytes' geometry; they run first
  const c10::DeviceGuard guard(self.device());
  const c10::Storage& storage = self.storage();
  const size_t needed = static_cast<size_t>(c10::multiply_integers(size) + self.storage_offset()) * self.dtype().itemsize();
  if (needed > storage.nbytes()) {
    // Grown, its values are copied into new bytes, which read as made: a value whose op failed
    // raises that op's error instead (Note [A deferred output's bytes exist at issue]).
    check_computed(storage);
  }
  if (is_projected(storage) || (projection_enabled() && storage.nbytes() > 0)) {
    // CPU's resize copies the old bytes into the new ones: projected bytes are grown here,
    // without a copy, and charged as the allocator would (Note [Projected bytes]).
    if (needed > storage.nbytes()) {
      project_in_place(storage, needed, /*grown=*/true);
    }
  }
  return at::native::resize_(self, size, format);
}

at::Tensor& set_storage(at::Tensor& self, at::Storage source, int64_t offset, c10::IntArrayRef size,
                        c10::IntArrayRef stride) {
  sync_before_host_access();
  const c10::DeviceGuard guard(self.device());
  return at::native::set_storage_cpu_(self, std::move(source), offset, size, stride);
}

at::Tensor& set_empty(at::Tensor& self) {
  const c10::DeviceGuard guard(self.device());
  c10::Storage empty(c10::Storage::use_byte_size_t(), 0, c10::GetAllocator(kNeuron)->allocate(0),
                     c10::GetAllocator(kNeuron), /*resizable=*/true);
  return set_storage(self, std::move(empty), 0, {0}, {});
}

// A copy that crosses the host/device boundary (or devices) is a transfer on the clock; one
// within a device is a kernel launch, priced by the bytes it reads and writes.
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  const bool src_neuron = self.device().type() == kNeuron;
  const bool dst_neuron = dst.device().type() == kNeuron;
  if (src_neuron && dst_neuron && self.device() == dst.device()) {
    if (!on_device_thread()) {
      // A kernel on one device: the adaptive engine may defer it, as any other op, and else it
      // is issued to the device (Note [Eager ops run on the device]). Offered as the copy_ it
      // comes from, whose schema says which tensor it writes (_copy_from's does not); copy_
      // reaches this kernel again on the device's executor, which runs it below.
      static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("aten::copy_", "");
      torch::jit::Stack stack{dst, self, non_blocking};
      if (!route_op(op, &stack)) {
        issue_eager(op, &stack);
      }
      return dst;
    }
  } else if (src_neuron || bytes_shared(dst.storage()) || !value_made(dst.storage())) {
    // A transfer reads or writes device memory now: what is queued runs first. A copy into
    // bytes only dst holds (`.to('neuron')` right after its allocation), or into no bytes at
    // all (`torch.tensor([], device='neuron')`, as HF's DynamicCache makes per layer and
    // step), waits for nothing, and is no sync point.
    sync_before_host_access();
    if (src_neuron && !dst_neuron && is_projected(self.storage())) {  // known once what made it has run
      read_projected("a copy to the host");  // Note [Host reads in projection mode]
    }
  } else if (!on_device_thread() && run_beside_streamed_launch([&] { copy_now(self, dst, non_blocking); })) {
    // Nor does it wait for a launch the engine streams (Note [Streamed launches] in
    // engine/queue.cpp): it runs between that launch's ops, which the host is still issuing.
    return dst;
  }
  if (!on_device_thread()) {
    // A transfer is the device's DMA: on the executor, while the host waits (a copy from
    // pageable host memory, as CUDA's). Its kernel's thread team is the executor's.
    run_on_device([&] { copy_now(self, dst, non_blocking); });
    return dst;
  }
  copy_now(self, dst, non_blocking);
  return dst;
}

// The copy itself, on the device's executor.
void copy_now(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  const bool src_neuron = self.device().type() == kNeuron;
  const bool dst_neuron = dst.device().type() == kNeuron;
  cover_third_party_composites();  // Note [Third-party composite ops]: weights moving to the device
  const bool within_device = src_neuron && dst_neuron && self.device() == dst.device();
  std::optional<Range> range;
  if (profiling() && !(within_device && in_fused_launch())) {
    range.emplace(within_device ? "neuron::aten::copy_" : transfer_range_name(src_neuron, dst_neuron));
  }
  const bool src_projected = src_neuron && is_projected(self.storage());
  if (src_projected || (dst_neuron && is_projected(dst.storage()))) {
    // No bytes move (Note [Projected bytes]): a device destination's values are unknown from
    // now on, a host one gets the placeholder (Note [Host reads in projection mode]). Priced
    // below as the copy with bytes is. Known values into bytes (a small storage made in
    // projection mode, or one made before it) are copied: they stay known.
    if (!dst_neuron) {
      dst.zero_();
    } else if (!is_projected(dst.storage())) {
      project_in_place(dst.storage(), dst.storage().nbytes(), /*grown=*/false);
    }
  } else {
    at::Tensor src_host = src_neuron ? host_alias(self) : self;
    // One alias storage for both when they share one (Note: overlap is found by storage identity).
    at::Tensor dst_host = !dst_neuron ? dst
                          : src_neuron && same_bytes(dst.storage(), self.storage()) ? host_alias_on(src_host.storage(), dst)
                                                                                   : host_alias(dst);
    dst_host.copy_(src_host, non_blocking);
  }
  const double nbytes = static_cast<double>(dst.numel()) * dst.element_size();
  if (within_device) {  // reads the source, writes the destination (a cast's two differ)
    static const std::string kCopy = "aten::copy_";
    const double moved = nbytes + static_cast<double>(self.numel()) * self.element_size();
    const double us = launch_op(dst.device().index(), kCopy, 0, moved, static_cast<double>(dst.numel()), dst.scalar_type());
    if (range) {
      mark_device_time(us, "ops", 1, dst.device().index());
    }
  } else {
    const DeviceIndex d = dst_neuron ? dst.device().index() : self.device().index();
    transfer(d, static_cast<int64_t>(nbytes), transfer_us(nbytes));
    if (range) {
      mark_device_time(transfer_us(nbytes), "bytes", static_cast<int64_t>(nbytes), d);
    }
  }
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  at::native::resize_(dst, self.sizes(), c10::nullopt);
  return copy_from(self, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  sync_before_host_access("sync: aten._local_scalar_dense.default");  // the profiler range of every host read of a scalar
  std::optional<Range> range;
  if (profiling()) {
    range.emplace(transfer_range_name(true, false));
  }
  const bool projected = self.device().type() == kNeuron && is_projected(self.storage());
  if (projected) {
    read_projected("a read of a scalar (.item())");  // Note [Host reads in projection mode]
  }
  const double us = transfer_us(static_cast<double>(self.element_size()));
  transfer(self.device().index(), static_cast<int64_t>(self.element_size()), us);
  if (range) {
    mark_device_time(us, "bytes", static_cast<int64_t>(self.element_size()), self.device().index());
  }
  if (projected) {
    return at::_local_scalar_dense(at::zeros({}, self.options().device(c10::kCPU)));
  }
  const at::Tensor host = self.device().type() == kNeuron ? host_alias(self) : self;
  return at::_local_scalar_dense(host);
}

// `cpu_param.data = cpu_param.to('neuron')` (FSDP2 moving a module, nn.Module code) asks
// whether the two tensors' impls are interchangeable. torch's own answer lists the dense
// backends it knows (CPU, CUDA, XPU, ...), not PrivateUse1, and so says no. Dense strided
// tensors of the host and the device are the same TensorImpl type, as CPU and CUDA ones are.
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto plain = [](const at::Tensor& t) {
    return t.layout() == c10::kStrided && !t.is_quantized() && !t.is_nested() &&
           (t.device().type() == kNeuron || t.device().type() == c10::kCPU) &&
           typeid(*t.unsafeGetTensorImpl()) == typeid(c10::TensorImpl);
  };
  if (plain(self) && plain(from)) {
    return true;
  }
  return self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set());
}

namespace {

// scaled_dot_product_attention asks this stub which kernel to take; unset for PrivateUse1 it
// takes the math decomposition, where CPU takes _scaled_dot_product_flash_attention_for_cpu:
// other bits. Asking CPU's stub takes CPU's kernel, run by the fallback.
//
// The choice reads metadata only (sizes, strides, dtype, requires_grad), so CPU's stub gets
// shadows on storages without bytes, never host aliases: aliasing a deferred value would sync
// (cutting an adaptive trace at every attention whose mask needs a gradient), and a fake tensor
// (torch.compile tracing T5's position bias) has no bytes to alias at all. The CPU kernel is
// reached by redispatch, past the Python keys: an active fake mode would take the CPU shadows.
at::Tensor host_shadow(const at::Tensor& t) {
  // Sized from the geometry: a wrapper subclass (DTensor's local view, functionalization's
  // wrapper) may have no storage to ask.
  const size_t nbytes = at::detail::computeStorageNbytes(t.sizes(), t.strides(), t.dtype().itemsize(),
                                                         t.storage_offset());
  c10::Storage no_bytes(c10::Storage::use_byte_size_t(), nbytes,
                        c10::DataPtr(nullptr, c10::Device(c10::kCPU)), /*allocator=*/nullptr, /*resizable=*/false);
  at::Tensor shadow = tensor_like_on(std::move(no_bytes), c10::DispatchKey::CPU, t);
  if (t.requires_grad()) {  // a mask that needs a gradient rules out flash
    shadow.set_requires_grad(true);
  }
  return shadow;
}

}  // namespace

int64_t fused_sdp_choice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const c10::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                         c10::optional<double> scale, bool enable_gqa) {
  auto on_host = [](const at::Tensor& t) { return t.device().type() == kNeuron ? host_shadow(t) : t; };
  const c10::optional<at::Tensor> host_mask = mask.has_value() && mask->defined()
                                                 ? c10::optional<at::Tensor>(on_host(*mask)) : mask;
  return host_sdp_choice(on_host(q), on_host(k), on_host(v), host_mask, dropout_p, is_causal, scale, enable_gqa);
}

// FSDP1 (and CUDA-style code) calls t.record_stream(s) so that a caching allocator does not
// hand t's block to another stream while s may still use it. Every stream of the device is
// one queue (Note [One queue per device] in streams.cpp), and a launch on the device stream
// holds its arguments' storages until it ends, so nothing is left to record: checked, and
// done. Without this kernel the fallback ran it on the host aliases, where CPU has none.
void record_stream(at::Tensor& self, c10::Stream stream) {
  TORCH_CHECK(stream.device_type() == kNeuron && stream.device_index() == self.device().index(),
              "record_stream: the stream is on ", stream.device(), " but the tensor is on ", self.device(),
              "; record a stream of the tensor's own device");
}

}  // namespace eager_detail

int64_t placeholder_reads() { return eager_detail::g_placeholder_reads.load(); }

// Note [SDPA's input checks]: CPU's scaled_dot_product_attention checks its inputs in its
// composite body (validate_sdpa_input, attention.cpp) before it picks a kernel. On neuron the
// op's kernel is our own (dispatch/attention.py), which never runs that body: without these
// checks a float32 query with a half key ran (the math path promotes), a CPU query with neuron
// key and value reached a kernel's device check, a 1-D key an IndexError. The checks and their
// words are CPU's, in CPU's order, so the same inputs raise the same RuntimeError.
void validate_sdpa_input(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const c10::optional<at::Tensor>& attn_mask) {
  TORCH_CHECK(query.dtype() == key.dtype() && query.dtype() == value.dtype(),
              "Expected query, key, and value to have the same dtype, but got query.dtype: ", query.dtype(),
              " key.dtype: ", key.dtype(), " and value.dtype: ", value.dtype(), " instead.");
  TORCH_CHECK(query.device() == key.device() && query.device() == value.device(),
              "Expected query, key, and value to have the same device type, but got query.device: ",
              query.device(), " key.device: ", key.device(), " and value.device: ", value.device(), " instead.");
  TORCH_CHECK(query.dim() >= 2 && key.dim() >= 2 && value.dim() >= 2,
              "Expected query, key, and value to all be  at least 2 dimensional, but got query.dim: ",
              query.dim(), " key.dim: ", key.dim(), " and value.dim: ", value.dim(), " instead.");
  if (attn_mask.has_value() && attn_mask->defined()) {
    const auto mask_dtype = attn_mask->dtype();
    TORCH_CHECK(mask_dtype == at::kBool || mask_dtype == at::kFloat || mask_dtype == query.dtype(),
                "Expected attn_mask dtype to be bool or float or to match query dtype, but got attn_mask.dtype: ",
                mask_dtype, " and  query.dtype: ", query.dtype(), " instead.");
    TORCH_CHECK(!query.is_nested() && !key.is_nested(),
                "Scaled_dot_product_attention: Nested tensors for query / key are not supported "
                "when an explicit attn_mask is set");
  }
}

namespace {

// Sets the process's SDPA backend flags for a scope and restores them on the way out, thrown
// errors included.
class HostBackendsGuard {
 public:
  HostBackendsGuard() : ctx_(at::globalContext()), flash_(ctx_.userEnabledFlashSDP()), math_(ctx_.userEnabledMathSDP()) {
    ctx_.setSDPUseFlash(true);
    ctx_.setSDPUseMath(true);
  }
  ~HostBackendsGuard() {
    ctx_.setSDPUseFlash(flash_);
    ctx_.setSDPUseMath(math_);
  }
  HostBackendsGuard(const HostBackendsGuard&) = delete;
  HostBackendsGuard& operator=(const HostBackendsGuard&) = delete;

 private:
  at::Context& ctx_;
  bool flash_;
  bool math_;
};

}  // namespace

// Note [The overrideable SDPA backend]: torch lets a PrivateUse1 backend bring its own fused
// attention kernel (SDPBackend.OVERRIDEABLE, `_scaled_dot_product_fused_attention_overrideable`);
// TorchNeuron's choice picks it for every 4-D neuron input, and code written for TorchNeuron runs
// under `sdpa_kernel(SDPBackend.OVERRIDEABLE)`. CPU has no such kernel: asked with flash and math
// both disabled, its choice finds no viable backend. The emulated device's fused kernel is the
// host's own pick, so with math disabled and the overrideable backend enabled, the choice is what
// CPU picks with its backends enabled (flash where it applies, else math): CPU's bits, as CPU runs
// the same call by default. Wherever math is enabled, CPU's choice under the user's flags stands
// (it always finds a backend). The guard flips the process-wide flags for this one call, as
// `sdpa_kernel` itself sets them process-wide; a CPU SDPA on another thread in that window
// would see flash and math enabled.
int64_t host_sdp_choice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const c10::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                        c10::optional<double> scale, bool enable_gqa) {
  const auto choose = [&] {
    return at::_ops::_fused_sdp_choice::redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), q, k, v, mask,
                                                   dropout_p, is_causal, scale, enable_gqa);
  };
  const at::Context& ctx = at::globalContext();
  if (ctx.userEnabledMathSDP() || !ctx.userEnabledOverrideableSDP()) {
    return choose();
  }
  HostBackendsGuard host_backends;
  return choose();
}

// A plain neuron tensor's choice, its shadows made here (dispatch/attention.py's fast path).
int64_t device_sdp_choice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const c10::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                          c10::optional<double> scale, bool enable_gqa) {
  return eager_detail::fused_sdp_choice(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa);
}

}  // namespace neuron
