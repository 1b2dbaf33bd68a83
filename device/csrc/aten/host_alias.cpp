// Note [Host aliases]: a neuron tensor's bytes are host memory from the neuron allocator
// (memory.cpp). To run an op, each neuron argument is replaced by a CPU tensor that aliases
// those bytes (same sizes, strides, offset and math bits; its storage owns nothing; one per
// tensor: Note [One tensor, one alias] in run_on_host.cpp), the op's CPU kernel runs, and
// each result is mapped back:
//   - a result whose storage is an alias's storage is a view: a neuron tensor on the
//     original storage, with the result's geometry;
//   - a written argument (in-place, out=) is returned as the very input; if the kernel
//     resized it, the original takes the new geometry, and new bytes if it reallocated;
//   - any other result is new: its CPU storage is adopted, zero-copy, by a neuron storage,
//     and charged to the device (torch.OutOfMemoryError if it does not fit).
// Same CPU kernels as CPU itself, so CPU's bits. This file makes the aliases and adoptions; the
// mapping of one op's arguments and results with them is run_on_host.cpp's (HostCall), and
// copy_from (kernels.cpp) copies between aliases.
#include "aten/eager_internal.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/TensorImpl.h>
#include <ATen/EmptyTensor.h>

#include <utility>

namespace neuron {
namespace eager_detail {
namespace {

[[noreturn]] void refuse_projected() {
  TORCH_CHECK(false, "a neuron tensor made in projection mode has no bytes for a kernel to read (Note [Projected bytes]); "
              "this op's kernel reads them directly (a kernel written in Python, an NKI kernel, a collective), which "
              "projection mode cannot run. Run it outside adaptive_eager.projection().");
}

c10::Storage alias_storage(const c10::Storage& storage) {
  if (is_projected(storage)) {
    refuse_projected();
  }
  check_computed(storage);  // a deferred value whose launch failed has no bytes to alias
  // Resizable with the CPU allocator: an out= kernel may resize its output (then it gets new
  // CPU bytes, which sync_written adopts). The alias never frees the device's bytes.
  return c10::Storage(c10::Storage::use_byte_size_t(), storage.nbytes(),
                      c10::DataPtr(const_cast<void*>(storage.data()), c10::Device(c10::kCPU)),
                      c10::GetCPUAllocator(), /*resizable=*/true);
}

}  // namespace

// A tensor with `like`'s dtype, geometry and math bits, on `storage`, for `key`'s backend.
at::Tensor tensor_like_on(c10::Storage storage, c10::DispatchKey key, const at::Tensor& like) {
  auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(key), like.dtype());
  t.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(), like.storage_offset());
  if (like.is_conj()) {
    t._set_conj(true);
  }
  if (like.is_neg()) {
    t._set_neg(true);
  }
  return t;
}

// t as a CPU tensor on `alias`, a host alias of t's storage. Arguments of one op that share a
// neuron storage must share one alias storage too: CPU kernels detect overlapping inputs and
// outputs by storage identity (x[1:].copy_(x[:-1]) must raise, as on CPU, not go wrong).
at::Tensor host_alias_on(const c10::Storage& alias, const at::Tensor& t) {
  return tensor_like_on(alias, c10::DispatchKey::CPU, t);
}

at::Tensor host_alias(const at::Tensor& t) { return host_alias_on(alias_storage(t.storage()), t); }

// A neuron storage that adopts a CPU storage's bytes, zero-copy, charged to device d (a new
// result inside a launch is not: Note [Deferred outputs are charged at issue] in memory.cpp).
c10::Storage adopt(const c10::Storage& cpu, c10::DeviceIndex d, bool new_result) {
  return c10::Storage(c10::Storage::use_byte_size_t(), cpu.nbytes(), adopt_bytes(cpu, d, new_result),
                      c10::GetAllocator(kNeuron), /*resizable=*/true);
}

at::Tensor neuron_tensor_on(c10::Storage storage, const at::Tensor& geometry) {
  return tensor_like_on(std::move(storage), c10::DispatchKey::PrivateUse1, geometry);
}

}  // namespace eager_detail

// For kernels written in Python on host tensors (dispatch/custom_kernels.py): a host alias
// that keeps the device bytes alive for as long as it lives (the eager path's aliases live
// for one call only, so they own nothing), and the adoption of a host result.
at::Tensor owning_host_alias(const at::Tensor& t) {
  TORCH_CHECK(t.device().type() == kNeuron, "host_alias takes a neuron tensor, got one on ", t.device());
  sync_before_host_access();  // a host kernel reads (or writes) the bytes now
  const c10::Storage& storage = t.storage();
  if (is_projected(storage) || projection_enabled()) {
    eager_detail::refuse_projected();
  }
  check_computed(storage);  // a value whose op failed has no bytes to alias
  auto* keep = new c10::Storage(storage);
  c10::Storage alias(c10::Storage::use_byte_size_t(), storage.nbytes(),
                     c10::DataPtr(const_cast<void*>(storage.data()), keep,
                                  [](void* ctx) { delete static_cast<c10::Storage*>(ctx); }, c10::Device(c10::kCPU)),
                     /*allocator=*/nullptr, /*resizable=*/false);
  return eager_detail::host_alias_on(alias, t);
}

at::Tensor adopt_host_tensor(const at::Tensor& host, int64_t device) {
  TORCH_CHECK(host.device().is_cpu() && host.layout() == c10::kStrided,
              "adopt takes a dense CPU tensor, got a ", host.layout(), " tensor on ", host.device());
  c10::Storage adopted = eager_detail::adopt(host.storage(), checked_device(device), /*new_result=*/true);
  return eager_detail::neuron_tensor_on(std::move(adopted), host);
}

at::Tensor adopt_meta_tensor(const at::Tensor& meta, int64_t device) {
  TORCH_CHECK(meta.is_meta() && meta.layout() == c10::kStrided,
              "adopt_meta takes a dense meta tensor, got a ", meta.layout(), " tensor on ", meta.device());
  const size_t nbytes = meta.has_storage() ? meta.storage().nbytes()
                                           : at::detail::computeStorageNbytes(meta.sizes(), meta.strides(),
                                                                              meta.dtype().itemsize(), meta.storage_offset());
  const c10::DeviceIndex d = checked_device(device);
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, adopt_projected(nbytes, d, /*new_result=*/true),
                       c10::GetAllocator(kNeuron), /*resizable=*/true);
  return eager_detail::neuron_tensor_on(std::move(storage), meta);
}

void forget_values(const at::Tensor& t) {
  TORCH_CHECK(t.device().type() == kNeuron, "forget_values takes a neuron tensor, got one on ", t.device());
  if (!is_projected(t.storage())) {
    project_in_place(t.storage(), t.storage().nbytes(), /*grown=*/false);
  }
}

}  // namespace neuron
