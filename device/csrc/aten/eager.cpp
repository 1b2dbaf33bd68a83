// The eager path of neuron tensors: every ATen op runs its CPU kernel on the host memory the
// device tensors own, without entering Python.
//
// Note [Host aliases]: a neuron tensor's bytes are host memory from the neuron allocator
// (memory.cpp). To run an op, each neuron argument is replaced by a CPU tensor that aliases
// those bytes (same sizes, strides, offset and math bits; its storage owns nothing), the
// op's CPU kernel runs, and each result is mapped back:
//   - a result whose storage is an alias's storage is a view: a neuron tensor on the
//     original storage, with the result's geometry;
//   - a written argument (in-place, out=) is returned as the very input; if the kernel
//     resized it, the original takes the new geometry, and new bytes if it reallocated;
//   - any other result is new: its CPU storage is adopted, zero-copy, by a neuron storage,
//     and charged to the device (torch.OutOfMemoryError if it does not fit).
// Same CPU kernels as CPU itself, so CPU's bits. Random ops draw from the device's generator
// (Note [RNG order] in dispatch/rng.py): a `generator=None` argument gets it, and an op
// without one (native_dropout) runs with torch's default CPU generator lent its state.
#include "neuron.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/Resize.h>
#include <ATen/native/TensorFactories.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/RefcountedDeleter.h>
#include <torch/headeronly/version.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <typeinfo>
#include <unordered_set>
#include <unordered_map>
#include <utility>
#include <vector>

namespace neuron {
namespace {

using c10::DeviceIndex;
using c10::IValue;

// -- the cost model's figures, set from Python (device/cost.py) ---------------------------
// Written once, at install.
double g_us_per_byte = 0;
double g_on_chip_bytes = 0;  // the logical device's SBUF (Note [On-chip intermediates])
struct RateTable {  // µs per unit by ScalarType
  std::unordered_map<int, double> by_type;
  double default_us = 0;

  void set(const Rates& rates) {
    by_type.insert(rates.by_type.begin(), rates.by_type.end());
    default_us = rates.default_us;
  }
  double of(at::ScalarType t) const {
    auto it = by_type.find(static_cast<int>(t));
    return it == by_type.end() ? default_us : it->second;
  }
};
RateTable g_us_per_flop;  // Note [Matmul rates] (device/profiles.py)
RateTable g_us_per_element;  // Note [The Vector Engine floor] (device/cost.py)

// Note [Matmul rates] in device/profiles.py: a dtype the Tensor Engine does not take is priced as
// converted; its first matmul says so, once (the values are still the CPU kernel's).
std::unordered_map<int, std::string> g_converted;  // written once, at install
std::mutex g_warned_mutex;
std::unordered_set<int> g_warned;

void warn_if_converted(at::ScalarType t) {
  auto it = g_converted.find(static_cast<int>(t));
  if (it == g_converted.end()) {
    return;
  }
  std::lock_guard<std::mutex> lock(g_warned_mutex);
  if (g_warned.insert(static_cast<int>(t)).second) {
    TORCH_WARN(it->second);
  }
}

// FLOPs as torch.utils.flop_counter counts them, for the ops that do most of a model's math
// (the matmul family and convolutions); 0 for other ops, priced by the bytes they move.
// `in` are the neuron inputs in argument order, `out` the results; a convolution's flags are
// read from its arguments before it runs (ConvFlags).
struct ConvFlags {
  bool transposed = false;
  bool grad_input = false, grad_weight = false;  // convolution_backward's output_mask
};

ConvFlags conv_flags(const c10::OperatorName& name, const torch::jit::Stack& stack, size_t first) {
  ConvFlags f;
  if (name.name == "aten::convolution") {
    f.transposed = stack[first + 6].toBool();
  } else if (name.name == "aten::convolution_backward") {
    f.transposed = stack[first + 7].toBool();
    const auto mask = stack[first + 10].toBoolList();
    f.grad_input = mask.get(0);
    f.grad_weight = mask.get(1);
  }
  return f;
}

// torch's conv_flop_count: 2 * batch * c_out * c_in * prod(filter) * prod(spatial), the
// spatial size being the output's (the input's, transposed).
double conv_flop_count(c10::IntArrayRef x, c10::IntArrayRef w, c10::IntArrayRef out, bool transposed) {
  if (x.size() < 3 || w.size() != x.size() || out.size() != x.size()) {
    return 0;
  }
  double flops = 2.0 * static_cast<double>(x[0]) * static_cast<double>(w[0]) * static_cast<double>(w[1]);
  const c10::IntArrayRef spatial = transposed ? x : out;
  for (size_t i = 2; i < x.size(); ++i) {
    flops *= static_cast<double>(w[i]) * static_cast<double>(spatial[i]);
  }
  return flops;
}

std::vector<int64_t> swap01(c10::IntArrayRef s) {  // torch's t(shape): channels before batch
  std::vector<int64_t> v(s.begin(), s.end());
  if (v.size() >= 2) {
    std::swap(v[0], v[1]);
  }
  return v;
}

// The ops the Tensor Engine runs (op_flops counts their FLOPs): Note [On-chip intermediates]
// streams no value into them, as they read each operand once per output tile.
const std::unordered_set<std::string> kTensorEngineOps = {
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm", "aten::_scaled_mm_v2",
    "aten::_grouped_mm", "aten::_scaled_grouped_mm", "aten::convolution", "aten::convolution_backward"};

double op_flops(const c10::OperatorName& name, const std::vector<at::Tensor>& in, const ConvFlags& conv,
                const IValue* out, size_t num_out) {
  const std::string& n = name.name;
  auto dims = [&](size_t i) { return in.size() > i ? in[i].sizes() : c10::IntArrayRef(); };
  auto out_dims = [&](size_t i) {
    return i < num_out && out[i].isTensor() && out[i].toTensor().defined() ? out[i].toTensor().sizes()
                                                                            : c10::IntArrayRef();
  };
  if (n == "aten::mm" || n == "aten::addmm") {
    const size_t a = n == "aten::mm" ? 0 : 1;
    if (dims(a).size() == 2 && dims(a + 1).size() == 2) {
      return 2.0 * dims(a)[0] * dims(a)[1] * dims(a + 1)[1];
    }
  } else if (n == "aten::bmm" || n == "aten::baddbmm") {
    const size_t a = n == "aten::bmm" ? 0 : 1;
    if (dims(a).size() == 3 && dims(a + 1).size() == 3) {
      return 2.0 * dims(a)[0] * dims(a)[1] * dims(a)[2] * dims(a + 1)[2];
    }
  } else if (n == "aten::_scaled_mm" || n == "aten::_scaled_mm_v2") {  // (self [M, K], mat2 [K, N], scales...)
    if (dims(0).size() == 2 && dims(1).size() == 2) {
      return 2.0 * dims(0)[0] * dims(0)[1] * dims(1)[1];
    }
  } else if (n == "aten::_grouped_mm" || n == "aten::_scaled_grouped_mm") {
    // (self, mat2, ...): 2D x 3D groups rows by offs, 3D x 3D is batched, 2D x 2D groups the
    // contraction (weight gradients), 3D x 2D groups mat2's columns; each row of the output
    // is one contraction of self's last dim
    const auto a = dims(0), b = dims(1);
    if (a.size() == 2 && b.size() == 3) {
      return 2.0 * a[0] * a[1] * b[2];
    }
    if (a.size() == 3 && b.size() == 3) {
      return 2.0 * a[0] * a[1] * a[2] * b[2];
    }
    if (a.size() == 2 && b.size() == 2) {
      return 2.0 * a[0] * a[1] * b[1];
    }
    if (a.size() == 3 && b.size() == 2) {
      return 2.0 * a[1] * a[2] * b[1];
    }
  } else if (n == "aten::convolution") {  // (input, weight, bias?): all neuron tensors
    return conv_flop_count(dims(0), dims(1), out_dims(0), conv.transposed);
  } else if (n == "aten::convolution_backward") {  // (grad_output, input, weight)
    double flops = 0;
    if (conv.grad_input) {
      flops += conv_flop_count(dims(0), dims(2), out_dims(0), !conv.transposed);
    }
    if (conv.grad_weight && !out_dims(1).empty()) {
      const auto gw = swap01(out_dims(1));
      flops += conv.transposed ? conv_flop_count(swap01(dims(0)), swap01(dims(1)), gw, false)
                               : conv_flop_count(swap01(dims(1)), swap01(dims(0)), gw, false);
    }
    return flops;
  }
  return 0;
}

// Functional ops whose CPU kernel is a composite computing through their out= variant (found by
// running OpInfo's samples in adaptive mode): run whole, as the CPU runs them. Decomposed on
// neuron, the out= op would be a sync point of the adaptive engine (an out= op may resize its
// output), cutting every trace they sit in; torchao's float8 casts take the abs of each
// tensor they scale, for one.
const std::unordered_set<std::string> kRunWhole = {
    "aten::abs", "aten::complex", "aten::deg2rad", "aten::rad2deg", "aten::frexp.Tensor", "aten::logical_not",
    "aten::logical_and", "aten::logical_or", "aten::logical_xor", "aten::logsumexp", "aten::nan_to_num",
    "aten::polar"};

// An op torch has no CPU kernel for cannot run on neuron, whose every op is the CPU's kernel on
// the device's bytes: say so, with the backends it does have kernels for, instead of torch's
// "Could not run ... with arguments from the 'CPU' backend".
void refuse_without_cpu_kernel(const c10::OperatorHandle& op) {
  if (op.hasKernelForDispatchKey(c10::DispatchKey::CPU) ||
      op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
      op.hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) {
    return;  // the CPU kernel itself refused these arguments: its message stands
  }
  std::string where;
  for (const auto key : {c10::DispatchKey::CUDA, c10::DispatchKey::HIP, c10::DispatchKey::XPU, c10::DispatchKey::MPS}) {
    if (op.hasKernelForDispatchKey(key)) {
      where += std::string(where.empty() ? "" : ", ") + c10::toString(key);
    }
  }
  const std::string& name = op.operator_name().name;
  std::string hint = "compute it with ops the CPU has";
  if (name == "aten::_scaled_grouped_mm") {
    hint = "dequantize the operands (to bfloat16, times their scales) and call torch._grouped_mm, which runs on neuron";
  }
  TORCH_CHECK_NOT_IMPLEMENTED(false, name, " has no CPU kernel in torch ", TORCH_VERSION,
                              where.empty() ? std::string() : " (it has kernels for " + where + " only)",
                              ", and neuron runs every op with the CPU's kernel on the device's bytes: it cannot "
                              "run on neuron; ", hint, ".");
}

// nbytes: what the op moves to or from HBM; elements: what it streams through the Vector
// Engine if the Tensor Engine does not run it (flops == 0).
double roofline_us(double flops, double nbytes, double elements, at::ScalarType dtype) {
  const double memory_us = nbytes * g_us_per_byte;
  if (flops == 0) {
    const double vector_us = elements * g_us_per_element.of(dtype);
    return vector_us > memory_us ? vector_us : memory_us;
  }
  warn_if_converted(dtype);
  const double compute_us = flops * g_us_per_flop.of(dtype);
  return compute_us > memory_us ? compute_us : memory_us;
}

// One op on d's clock at its roofline, less its share of a fused launch's on-chip work (Note
// [On-chip intermediates] in device/cost.py), and in the op log; its time, as launch() gives it.
double launch_op(DeviceIndex d, const std::string& name, double flops, double nbytes, double elements,
                 at::ScalarType dtype) {
  const OnChipShare on_chip = take_on_chip();
  const double op_us = roofline_us(flops, std::max(0.0, nbytes - on_chip.bytes), on_chip.folded ? 0 : elements, dtype);
  log_op(name, op_us);
  return launch(d, op_us, 1);
}

// -- Note [Host aliases] ------------------------------------------------------------------
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

c10::Storage alias_storage(const c10::Storage& storage) {
  check_computed(storage);  // a deferred value whose launch failed has no bytes to alias
  // Resizable with the CPU allocator: an out= kernel may resize its output (then it gets new
  // CPU bytes, which sync_written adopts). The alias never frees the device's bytes.
  return c10::Storage(c10::Storage::use_byte_size_t(), storage.nbytes(),
                      c10::DataPtr(const_cast<void*>(storage.data()), c10::Device(c10::kCPU)),
                      c10::GetCPUAllocator(), /*resizable=*/true);
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
c10::Storage adopt(const c10::Storage& cpu, DeviceIndex d, bool new_result) {
  return c10::Storage(c10::Storage::use_byte_size_t(), cpu.nbytes(), adopt_bytes(cpu, d, new_result),
                      c10::GetAllocator(kNeuron), /*resizable=*/true);
}

at::Tensor neuron_tensor_on(c10::Storage storage, const at::Tensor& geometry) {
  return tensor_like_on(std::move(storage), c10::DispatchKey::PrivateUse1, geometry);
}

// As Python prints it (torch.sparse_coo), for error messages.
const char* layout_name(c10::Layout layout) {
  switch (layout) {
    case c10::kSparse: return "torch.sparse_coo";
    case c10::kSparseCsr: return "torch.sparse_csr";
    case c10::kSparseCsc: return "torch.sparse_csc";
    case c10::kSparseBsr: return "torch.sparse_bsr";
    case c10::kSparseBsc: return "torch.sparse_bsc";
    case c10::kJagged: return "torch.jagged";
    case c10::kMkldnn: return "torch._mkldnn";
    default: return "non-strided";
  }
}

// Whether a list IValue holds tensors (Tensor[], Tensor?[], Tensor[][]): int[] and the like,
// on every op's path, are passed on untouched.
bool holds_tensors(const IValue& v) {
  c10::TypePtr element = v.toList().elementType();
  while (element->kind() == c10::TypeKind::ListType || element->kind() == c10::TypeKind::OptionalType) {
    element = element->containedType(0);
  }
  return element->kind() == c10::TypeKind::TensorType;
}

// Where an item of a HostCall vector is, by a key derived from it: the vector itself searched
// linearly while short (an op has a handful of arguments, and this runs per op: no allocation),
// a hash map of it, caught up lazily, once long (a foreach op over every parameter of a deep
// model has thousands: linear searches made it quadratic, 0.27 s an op at 5,000 tensors).
template <typename Key>
struct Index {
  static constexpr size_t npos = static_cast<size_t>(-1);
  static constexpr size_t kLinear = 16;
  std::unordered_map<Key, size_t> hashed;
  size_t hashed_up_to = 0;  // items [0, hashed_up_to) are in `hashed`

  // The first item whose key_of(item) is key, as a linear search finds it; npos if none.
  template <typename Item, typename KeyOf>
  size_t find(const std::vector<Item>& items, Key key, KeyOf key_of) {
    if (items.size() <= kLinear) {
      for (size_t i = 0; i < items.size(); ++i) {
        if (key_of(items[i]) == key) {
          return i;
        }
      }
      return npos;
    }
    for (; hashed_up_to < items.size(); ++hashed_up_to) {
      hashed.emplace(key_of(items[hashed_up_to]), hashed_up_to);  // emplace keeps the first
    }
    auto it = hashed.find(key);
    return it == hashed.end() ? npos : it->second;
  }
};

// One op's arguments on the host, and what maps results back.
struct HostCall {
  DeviceIndex device = -1;
  DeviceIndex target = -1;  // the device a `device=` argument names
  bool cpu_indices_ok = false;
  double in_bytes = 0;
  double in_elements = 0;  // summed: the Vector Engine streams each input (Note [The Vector Engine floor])
  c10::optional<at::ScalarType> dtype;
  // (host storage, neuron storage): each alias storage and the neuron storage it aliases, and
  // each new result's CPU storage and the neuron storage that adopted it; found by the neuron
  // storage's bytes (same_bytes) or by the host storage
  using StoragePair = std::pair<c10::Storage, c10::Storage>;
  std::vector<StoragePair> storages;
  Index<const void*> by_bytes;
  Index<const c10::StorageImpl*> by_host;
  // alias TensorImpl -> the neuron argument it stands for (kept alive for the call)
  using Original = std::pair<const c10::TensorImpl*, at::Tensor>;
  std::vector<Original> originals;
  Index<const c10::TensorImpl*> by_alias;
  std::vector<at::Tensor> aliases;  // the host aliases, in argument order

  // The entry of storages whose neuron storage holds these bytes (same_bytes), or npos.
  size_t storage_with_bytes(const c10::Storage& s) {
    return by_bytes.find(storages, bytes_key(s), [](const StoragePair& p) { return bytes_key(p.second); });
  }

  size_t storage_with_host(const c10::Storage& host) {
    return by_host.find(storages, static_cast<const c10::StorageImpl*>(host.unsafeGetStorageImpl()),
                        [](const StoragePair& p) { return static_cast<const c10::StorageImpl*>(p.first.unsafeGetStorageImpl()); });
  }

  at::Tensor* original_of(const at::Tensor& alias) {
    const size_t i = by_alias.find(originals, static_cast<const c10::TensorImpl*>(alias.unsafeGetTensorImpl()),
                                   [](const Original& o) { return o.first; });
    return i == Index<const c10::TensorImpl*>::npos ? nullptr : &originals[i].second;
  }

  [[noreturn]] void mismatch(const std::string& a, const std::string& b, const c10::OperatorName& op) {
    TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two devices, ", a,
                " and ", b, "! (when running ", op, "). Move them to one device first, e.g. with .to('", a, "').");
  }

  at::Tensor to_host(const at::Tensor& t, const c10::OperatorName& op) {
    if (!t.defined()) {
      return t;
    }
    if (t.device().type() != kNeuron) {
      // CPU 0-dim tensors are scalars, as on CUDA; CPU index tensors are allowed for indexing.
      if (t.dim() != 0 && !cpu_indices_ok && !t.is_meta()) {
        mismatch("neuron:" + std::to_string(device < 0 ? 0 : device), t.device().str(), op);
      }
      return t;
    }
    const DeviceIndex d = t.device().index();
    if (device >= 0 && d != device) {
      mismatch("neuron:" + std::to_string(device), "neuron:" + std::to_string(d), op);
    }
    device = d;
    if (!dtype) {
      dtype = t.scalar_type();
    }
    in_bytes += static_cast<double>(t.numel()) * t.element_size();
    in_elements += static_cast<double>(t.numel());
    at::Tensor alias;
    const size_t same = storage_with_bytes(t.storage());
    if (same != Index<const void*>::npos) {  // an earlier argument's bytes: the same alias
      alias = host_alias_on(storages[same].first, t);
    } else {
      alias = host_alias(t);
      storages.emplace_back(alias.storage(), t.storage());
    }
    originals.emplace_back(alias.unsafeGetTensorImpl(), t);
    aliases.push_back(alias);
    return alias;
  }

  IValue arg_to_host(IValue v, const c10::OperatorName& op) {
    if (v.isTensor()) {
      return to_host(v.toTensor(), op);
    }
    if (v.isList() && holds_tensors(v)) {
      // A new list, never the caller's: a boxed List argument shares its elements with the
      // caller's c10::List (index's indices), which must keep its neuron tensors.
      return map_list(v, [&](IValue e, size_t) { return arg_to_host(std::move(e), op); });
    }
    if (v.isDevice() && v.toDevice().type() == kNeuron) {
      target = checked_device(v.toDevice().has_index() ? v.toDevice().index() : current_device());
      return IValue(c10::Device(c10::kCPU));
    }
    return v;
  }

  at::Tensor from_host(const at::Tensor& r, DeviceIndex d) {
    if (!r.defined() || r.device().type() != c10::kCPU) {
      return r;
    }
    TORCH_CHECK_NOT_IMPLEMENTED(!r.is_nested(), "neuron tensors are dense (strided) only, but this op produced a nested "
        "tensor of the strided layout. Use the jagged layout, which is built of dense tensors and runs on neuron: "
        "torch.nested.nested_tensor(tensors, layout=torch.jagged, device='neuron').");
    if (r.layout() != c10::kStrided) {
      TORCH_CHECK_NOT_IMPLEMENTED(false, "neuron tensors are dense (strided) only, but this op produced a ",
          layout_name(r.layout()), " tensor. Keep sparse tensors on the CPU (x.cpu().to_sparse()), or use a dense equivalent "
          "(to_dense(), torch.mm on dense tensors) on neuron.");
    }
    if (at::Tensor* same = original_of(r)) {
      return *same;  // written in place (its geometry is synced by sync_written)
    }
    const size_t view = storage_with_host(r.storage());
    if (view != Index<const c10::StorageImpl*>::npos) {
      return neuron_tensor_on(storages[view].second, r);  // a view of an argument, or of an earlier new result
    }
    c10::Storage adopted = adopt(r.storage(), d, /*new_result=*/true);
    // Other results on the same new bytes (several views of one buffer) share the storage.
    storages.emplace_back(r.storage(), adopted);
    return neuron_tensor_on(adopted, r);
  }

  // Adds the result's bytes to *out_bytes and raises *out_elements to its largest output.
  IValue result_from_host(IValue v, DeviceIndex d, double* out_bytes, double* out_elements) {
    if (v.isTensor()) {
      const at::Tensor& r = v.toTensor();
      if (r.defined()) {
        *out_bytes += static_cast<double>(r.numel()) * r.element_size();
        *out_elements = std::max(*out_elements, static_cast<double>(r.numel()));
      }
      return from_host(r, d);
    }
    if (v.isList() && holds_tensors(v)) {  // Tensor[], Tensor[][] (c10d)
      return map_list(v, [&](IValue e, size_t) { return result_from_host(std::move(e), d, out_bytes, out_elements); });
    }
    return v;
  }

  // A written argument whose alias the kernel resized (or reallocated): the neuron tensor
  // takes the alias's geometry, and its new bytes.
  void sync_written(const at::Tensor& alias) {
    at::Tensor* found = original_of(alias);
    if (found == nullptr) {
      return;
    }
    at::Tensor& original = *found;
    c10::TensorImpl* impl = original.unsafeGetTensorImpl();
    if (alias.storage().data() != original.storage().data() || alias.storage().nbytes() != original.storage().nbytes()) {
      impl->set_storage_keep_dtype(adopt(alias.storage(), original.device().index(), /*new_result=*/false));
    }
    if (original.sizes() != alias.sizes() || original.strides() != alias.strides() ||
        original.storage_offset() != alias.storage_offset()) {
      impl->set_sizes_and_strides(alias.sizes(), alias.strides(), alias.storage_offset());
    }
  }
};

bool is_optional_generator(const c10::Argument& a) {
  const auto& type = a.type();
  if (type->kind() == c10::TypeKind::GeneratorType) {
    return true;
  }
  if (type->kind() == c10::TypeKind::OptionalType) {
    return type->containedType(0)->kind() == c10::TypeKind::GeneratorType;
  }
  return false;
}

// Inside the block, torch's default CPU generator draws from `lender`'s state; on exit the
// state reached goes back to `lender` and the default gets its own back, exception or not.
struct DefaultGeneratorLent {
  at::Generator lender;
  at::Generator def;
  c10::intrusive_ptr<c10::TensorImpl> saved;

  explicit DefaultGeneratorLent(at::Generator g) : lender(std::move(g)), def(at::detail::getDefaultCPUGenerator()) {
    saved = def.get_state().getIntrusivePtr();
    def.set_state(lender.get_state());
  }
  ~DefaultGeneratorLent() {
    try {
      lender.set_state(def.get_state());
      def.set_state(at::Tensor(saved));
    } catch (...) {  // a destructor never throws; the states are plain byte tensors
    }
  }
};

bool is_cpu_index_op(const c10::OperatorName& name) {
  const std::string& n = name.name;
  return n == "aten::index" || n == "aten::index_put_" || n == "aten::index_put" || n == "aten::_index_put_impl_";
}

// Elements at most in the result of a factory run whole (Note [CPU kernels whole]), read
// from its arguments; -1 when they do not say (another op, or arguments of other types).
double factory_numel_bound(const c10::OperatorName& name, const torch::jit::Stack& stack, size_t first) {
  auto number = [&](size_t i) {
    const IValue& v = stack[first + i];
    return v.isInt() ? static_cast<double>(v.toInt()) : v.isDouble() ? v.toDouble() : std::nan("");
  };
  const std::string& n = name.name;
  const std::string& overload = name.overload_name;
  double bound = -1;
  if (n == "aten::arange" || n == "aten::range") {
    const double start = overload.empty() ? 0 : number(0);
    const double end = number(overload.empty() ? 0 : 1);
    const double step = overload == "start_step" || overload == "step" ? number(2) : 1;
    bound = std::abs(end - start) / std::abs(step) + 1;
  } else if ((n == "aten::linspace" || n == "aten::logspace") && overload.empty()) {
    bound = number(2);
  } else if (n == "aten::eye") {
    bound = number(0) * (overload == "m" ? number(1) : number(0));
  } else if (n == "aten::randperm") {
    bound = number(0);
  }
  return std::isfinite(bound) ? bound : -1;
}

// A factory run whole on the host (arange, eye, linspace, randperm) would fill host memory
// with its result before the device's allocator, adopting it, found it too large (4 GiB of
// RSS for a 1 GiB device). Where its arguments bound the result within the free memory
// (the usual case: arange(seq_len) every step), nothing more is asked; else its meta run
// sizes the result (~30 us), and the device's capacity is checked before any host byte.
void check_factory_fits(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first, DeviceIndex d) {
  constexpr double kMaxElementBytes = 16;  // complex128
  const double numel = factory_numel_bound(op.schema().operator_name(), stack, first);
  if (numel >= 0 && numel * kMaxElementBytes < 1e18 &&
      fits(d, static_cast<int64_t>(numel * kMaxElementBytes))) {
    return;
  }
  torch::jit::Stack meta(stack.begin() + static_cast<std::ptrdiff_t>(first), stack.end());
  for (IValue& v : meta) {
    if (v.isDevice()) {
      v = IValue(c10::Device(c10::kMeta));
    } else if (v.isGenerator()) {
      v = IValue();  // meta kernels draw nothing
    }
  }
  try {
    op.callBoxed(&meta);
  } catch (const std::exception&) {
    return;  // no meta kernel: the allocator checks when the result is adopted
  }
  int64_t nbytes = 0;
  for (const IValue& v : meta) {
    if (v.isTensor()) {
      nbytes += static_cast<int64_t>(v.toTensor().storage().nbytes());
    }
  }
  check_fits(d, nbytes);
}

void run_on_host(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const c10::OperatorName& name = schema.operator_name();
  const size_t num_args = schema.arguments().size();
  const size_t first = stack->size() - num_args;
  HostCall call;
  call.cpu_indices_ok = is_cpu_index_op(name);
  int generator_arg = -1;
  for (size_t i = 0; i < num_args; ++i) {
    IValue& v = (*stack)[first + i];
    if (generator_arg < 0 && is_optional_generator(schema.arguments()[i])) {
      generator_arg = static_cast<int>(i);
      continue;
    }
    v = call.arg_to_host(std::move(v), name);
  }
  const DeviceIndex d = call.device >= 0 ? call.device : (call.target >= 0 ? call.target : current_device());
  const DeviceIndex result_device = call.target >= 0 ? call.target : d;
  // A factory on the device; in a launch its output was charged (and checked) at issue.
  if (call.aliases.empty() && call.target >= 0 && charges_new_results()) {
    check_factory_fits(op, *stack, first, call.target);
  }
  std::unique_ptr<DefaultGeneratorLent> lent;
  if (generator_arg >= 0) {
    IValue& g = (*stack)[first + generator_arg];
    g = IValue(host_generator(g.isNone() ? default_generator(d) : g.toGenerator()));
  } else if (op.hasTag(at::Tag::nondeterministic_seeded)) {
    lent = std::make_unique<DefaultGeneratorLent>(host_generator(default_generator(d)));
  }

  const ConvFlags conv = conv_flags(name, *stack, first);
  const Touch touch = touch_of(name, *stack, first);  // Note [Gathers and scatters] (touched.cpp)
  std::optional<Range> range;  // an eager launch's own range; a fused launch's ops have none
  if (profiling() && !in_fused_launch()) {
    range.emplace("neuron::" + name.name);
  }
  try {
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  } catch (const c10::NotImplementedError&) {
    refuse_without_cpu_kernel(op);  // says why in neuron's terms, or rethrows what the kernel said
    throw;
  }
  lent.reset();

  // Written arguments first: a result that is a written argument must see its new geometry.
  for (size_t i = 0; i < num_args; ++i) {
    const auto* alias_info = schema.arguments()[i].alias_info();
    if (alias_info != nullptr && alias_info->isWrite()) {
      for (size_t k = 0; k < call.aliases.size(); ++k) {
        call.sync_written(call.aliases[k]);
      }
      break;
    }
  }
  double out_bytes = 0;
  double out_elements = 0;
  const size_t num_returns = schema.returns().size();
  const size_t results = stack->size() - num_returns;
  for (size_t i = 0; i < num_returns; ++i) {
    IValue& v = (*stack)[results + i];
    v = call.result_from_host(std::move(v), result_device, &out_bytes, &out_elements);
  }
  const double flops = op_flops(name, call.aliases, conv, stack->data() + results, num_returns);
  OpTraffic traffic{call.in_bytes, call.in_elements, out_bytes, out_elements};
  count_touched_bytes(touch, call.aliases, &traffic);
  const double us = launch_op(d, name.name, flops, traffic.in_bytes + traffic.out_bytes,
                             std::max(traffic.in_elements, traffic.out_elements), call.dtype.value_or(at::kFloat));
  if (range) {
    mark_device_time(us, "ops", 1, d);
  }
}

// -- the kernels every backend must have: allocation, views, copies ---------------------------
void check_dense_unpinned(c10::optional<at::Layout> layout, c10::optional<bool> pin_memory) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided,
              "neuron tensors are dense (strided) only; keep sparse tensors on the CPU");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "Only dense CPU tensors can be pinned");
}

at::Tensor empty_memory_format(c10::IntArrayRef size, c10::optional<at::ScalarType> dtype,
                               c10::optional<at::Layout> layout, c10::optional<at::Device> device,
                               c10::optional<bool> pin_memory, c10::optional<at::MemoryFormat> memory_format) {
  check_dense_unpinned(layout, pin_memory);
  const c10::DeviceGuard guard(c10::device_or_default(device));  // the allocator takes the current device
  at::Tensor t = at::detail::empty_generic(size, c10::GetAllocator(kNeuron), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype), memory_format);
  note_fresh_storage(t.storage());
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

// Both may grow the storage through its allocator, the neuron one, which allocates on the
// current device: hence the guard. New bytes are charged, old ones released.
const at::Tensor& resize(const at::Tensor& self, c10::IntArrayRef size, c10::optional<at::MemoryFormat> format) {
  sync_before_host_access();  // queued ops hold the old bytes' geometry; they run first
  const c10::DeviceGuard guard(self.device());
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
    // A kernel on one device: the adaptive engine may defer it, as any other op. Offered as
    // the copy_ it comes from, whose schema says which tensor it writes (_copy_from's does not);
    // a queued copy_ reaches this kernel again when its launch runs.
    static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("aten::copy_", "");
    torch::jit::Stack stack{dst, self, non_blocking};
    if (route_op(op, &stack)) {
      return dst;
    }
  } else if (src_neuron || bytes_shared(dst.storage()) || (dst.storage().data() == nullptr && dst.storage().nbytes() > 0)) {
    // A transfer reads or writes device memory now: what is queued runs first. A copy into
    // bytes only dst holds (`.to('neuron')` right after its allocation), or into no bytes at
    // all (`torch.tensor([], device='neuron')`, as HF's DynamicCache makes per layer and
    // step), waits for nothing, and is no sync point.
    sync_before_host_access();
  }
  cover_third_party_composites();  // Note [Third-party composite ops]: weights moving to the device
  const bool within_device = src_neuron && dst_neuron && self.device() == dst.device();
  std::optional<Range> range;
  if (profiling() && !(within_device && in_fused_launch())) {
    range.emplace(within_device ? "neuron::aten::copy_" : transfer_range_name(src_neuron, dst_neuron));
  }
  at::Tensor src_host = src_neuron ? host_alias(self) : self;
  // One alias storage for both when they share one (Note: overlap is found by storage identity).
  at::Tensor dst_host = !dst_neuron ? dst
                        : src_neuron && same_bytes(dst.storage(), self.storage()) ? host_alias_on(src_host.storage(), dst)
                                                                                 : host_alias(dst);
  dst_host.copy_(src_host, non_blocking);
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
    transfer(d, static_cast<int64_t>(nbytes), nbytes * g_us_per_byte);
    if (range) {
      mark_device_time(nbytes * g_us_per_byte, "bytes", static_cast<int64_t>(nbytes), d);
    }
  }
  return dst;
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
  const at::Tensor host = self.device().type() == kNeuron ? host_alias(self) : self;
  const double us = self.element_size() * g_us_per_byte;
  transfer(self.device().index(), static_cast<int64_t>(self.element_size()), us);
  if (range) {
    mark_device_time(us, "bytes", static_cast<int64_t>(self.element_size()), self.device().index());
  }
  return at::_local_scalar_dense(host);
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  cover_third_party_composites();  // a library loaded since: before its ops meet neuron tensors
  if (route_op(op, stack)) {  // the adaptive engine took it (Note [Deferred launches])
    return;
  }
  run_on_host(op, stack);
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

int64_t fused_sdp_choice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const c10::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                         c10::optional<double> scale, bool enable_gqa) {
  auto on_host = [](const at::Tensor& t) { return t.device().type() == kNeuron ? host_shadow(t) : t; };
  const c10::optional<at::Tensor> host_mask = mask.has_value() && mask->defined()
                                                 ? c10::optional<at::Tensor>(on_host(*mask)) : mask;
  return at::_ops::_fused_sdp_choice::redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), on_host(q), on_host(k),
                                                  on_host(v), host_mask, dropout_p, is_causal, scale, enable_gqa);
}

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
    aten.impl(name, torch::CppFunction::makeFromBoxedFunction<&fallback>());
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
      aten.impl(c10::toString(name).c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
      continue;
    }
    if (!op->hasKernelForDispatchKey(c10::DispatchKey::CPU)) {
      continue;
    }
    for (const auto key : composites) {
      if (op->hasKernelForDispatchKey(key)) {
        aten.impl(c10::toString(name).c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
        break;
      }
    }
  }
}

}  // namespace

void eager_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) { fallback(op, stack); }

void run_eager(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  run_before_eager();
  const RouteBypass bypass;
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), stack);
}

// For kernels written in Python on host tensors (dispatch/custom_kernels.py): a host alias
// that keeps the device bytes alive for as long as it lives (the eager path's aliases live
// for one call only, so they own nothing), and the adoption of a host result.
at::Tensor owning_host_alias(const at::Tensor& t) {
  TORCH_CHECK(t.device().type() == kNeuron, "host_alias takes a neuron tensor, got one on ", t.device());
  sync_before_host_access();  // a host kernel reads (or writes) the bytes now
  const c10::Storage& storage = t.storage();
  auto* keep = new c10::Storage(storage);
  c10::Storage alias(c10::Storage::use_byte_size_t(), storage.nbytes(),
                     c10::DataPtr(const_cast<void*>(storage.data()), keep,
                                  [](void* ctx) { delete static_cast<c10::Storage*>(ctx); }, c10::Device(c10::kCPU)),
                     /*allocator=*/nullptr, /*resizable=*/false);
  return host_alias_on(alias, t);
}

at::Tensor adopt_host_tensor(const at::Tensor& host, int64_t device) {
  TORCH_CHECK(host.device().is_cpu() && host.layout() == c10::kStrided,
              "adopt takes a dense CPU tensor, got a ", host.layout(), " tensor on ", host.device());
  return neuron_tensor_on(adopt(host.storage(), checked_device(device), /*new_result=*/true), host);
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

double on_chip_bytes() { return g_on_chip_bytes; }

bool runs_on_tensor_engine(const c10::OperatorName& name) { return kTensorEngineOps.count(name.name) > 0; }

void install_eager(const EagerCosts& costs, const std::vector<std::pair<int, std::string>>& converted) {
  TORCH_CHECK(g_libraries.empty(), "the neuron eager kernels are installed once per process");
  g_us_per_byte = costs.us_per_byte;
  g_on_chip_bytes = costs.on_chip_bytes;
  g_us_per_flop.set(costs.us_per_flop);
  g_us_per_element.set(costs.us_per_element);
  for (const auto& [type, why] : converted) {
    g_converted[type] = why;
  }
  auto aten = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1,
                                               __FILE__, __LINE__);
  aten->impl("empty.memory_format", TORCH_FN(empty_memory_format));
  aten->impl("empty_strided", TORCH_FN(empty_strided));
  aten->impl("as_strided", TORCH_FN(as_strided));
  aten->impl("view", TORCH_FN(view));
  aten->impl("_reshape_alias", TORCH_FN(reshape_alias));
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
      c10d->impl(c10::toString(name).c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
    }
  }
  g_libraries.push_back(std::move(c10d));
  auto all = std::make_unique<torch::Library>(torch::Library::IMPL, "_", c10::DispatchKey::PrivateUse1,
                                              __FILE__, __LINE__);
  all->fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
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
