// The eager path of neuron tensors: every ATen op runs its CPU kernel on the host memory the
// device tensors own, without entering Python. The fallback every op of a neuron tensor reaches
// (registration.cpp) offers the op to the adaptive engine's route, else runs it here, now: its
// arguments as host aliases, its results mapped back (Note [Host aliases] in host_alias.cpp),
// its time on the device's clock (pricing.cpp).
//
// Note [Projected ops]
// ~~~~~~~~~~~~~~~~~~~~
// In projection mode (Note [Projected bytes] in runtime/memory.cpp) the op runs its shape
// function instead of its kernel: the same HostCall, with meta aliases of its arguments (one per
// neuron storage, of that storage's size, so views map back as host aliases' do), `device=`
// arguments meta, its generator dropped (a shape function draws nothing, and the device's
// generator does not advance), redispatched to Meta; new results get projected bytes, charged as
// adopted CPU results are, and what it writes loses its values (a tensor made before projection
// mode becomes projected). Everything after the kernel is the path with bytes: written
// arguments' geometry, views, the price (which reads geometry only: cost/, pricing.cpp), so a
// projected op costs on the clock and in memory exactly what it costs with bytes, wherever the
// Meta kernel gives CPU's geometry. An op without a shape function is refused by name; a
// collective moves nothing (Note [Projected collectives] in collectives.cpp).
#include "aten/eager_internal.h"

#include <ATen/ExpandUtils.h>
#include <c10/core/CPUAllocator.h>
#include <ATen/core/jit_type.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>
#include <c10/util/accumulate.h>
#include <torch/headeronly/version.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstddef>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace neuron {
namespace eager_detail {
namespace {

using c10::DeviceIndex;
using c10::IValue;

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

// A neuron storage of nbytes without bytes, charged as adopt charges (Note [Projected bytes]).
c10::Storage projected_storage(size_t nbytes, DeviceIndex d, bool new_result) {
  return c10::Storage(c10::Storage::use_byte_size_t(), nbytes, adopt_projected(nbytes, d, new_result),
                      c10::GetAllocator(kNeuron), /*resizable=*/true);
}

// A meta tensor with like's dtype and geometry on a storage of nbytes (Note [Projected ops]).
at::Tensor on_storage_of(const at::Tensor& like, size_t nbytes) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, c10::DataPtr(nullptr, c10::Device(c10::kMeta)),
                       c10::GetAllocator(c10::kMeta), /*resizable=*/true);
  return tensor_like_on(std::move(storage), c10::DispatchKey::Meta, like);
}

// Whether torch can tell an op's outputs' geometry without running it: a Meta kernel, or a
// composite whose parts have theirs.
bool has_shape_function(const c10::OperatorHandle& op) {
  return op.hasKernelForDispatchKey(c10::DispatchKey::Meta) ||
         op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
         op.hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd);
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
  template <typename Items, typename KeyOf>
  size_t find(const Items& items, Key key, KeyOf key_of) {
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

// One op's arguments on the host, and what maps results back (Note [Host aliases] in
// host_alias.cpp).
struct HostCall {
  // Note [Projected ops]: the op runs its shape function (its Meta kernel) on meta aliases of
  // its arguments, and its results get projected bytes, instead of its CPU kernel on host aliases.
  bool projecting = false;
  DeviceIndex device = -1;
  DeviceIndex target = -1;  // the device a `device=` argument names
  bool cpu_indices_ok = false;
  double in_bytes = 0;
  double in_elements = 0;  // summed: the Vector Engine streams each input (Note [The Vector Engine floor])
  c10::optional<at::ScalarType> dtype;
  // Its lists hold kInline items inline: an op has a handful of tensor arguments, and the
  // heap blocks of std::vector's growth were a sixth of the executor's allocations on a small
  // MLP's step.
  static constexpr unsigned kInline = 8;
  // (host storage, neuron storage): each alias storage and the neuron storage it aliases, and
  // each new result's CPU storage and the neuron storage that adopted it; found by the neuron
  // storage's bytes (same_bytes) or by the host storage
  using StoragePair = std::pair<c10::Storage, c10::Storage>;
  c10::SmallVector<StoragePair, kInline> storages;
  Index<const void*> by_bytes;
  Index<const c10::StorageImpl*> by_host;
  // alias TensorImpl -> the neuron argument it stands for (kept alive for the call)
  using Original = std::pair<const c10::TensorImpl*, at::Tensor>;
  c10::SmallVector<Original, kInline> originals;
  Index<const c10::TensorImpl*> by_alias;
  Index<const c10::TensorImpl*> by_original;
  c10::SmallVector<at::Tensor, kInline> aliases;  // the host aliases, in argument order (originals' order too)

  // The entry of storages whose neuron storage holds these bytes (same_bytes), or npos.
  size_t storage_with_bytes(const c10::Storage& s) {
    return by_bytes.find(storages, bytes_key(s), [](const StoragePair& p) { return bytes_key(p.second); });
  }

  size_t storage_with_host(const c10::Storage& host) {
    return by_host.find(storages, static_cast<const c10::StorageImpl*>(host.unsafeGetStorageImpl()),
                        [](const StoragePair& p) { return static_cast<const c10::StorageImpl*>(p.first.unsafeGetStorageImpl()); });
  }

  // The host alias an earlier argument that is this very tensor got, or undefined.
  at::Tensor alias_given_to(const at::Tensor& t) {
    const size_t i = by_original.find(originals, static_cast<const c10::TensorImpl*>(t.unsafeGetTensorImpl()),
                                      [](const Original& o) { return static_cast<const c10::TensorImpl*>(o.second.unsafeGetTensorImpl()); });
    return i == Index<const c10::TensorImpl*>::npos ? at::Tensor() : aliases[i];
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
    // Note [One tensor, one alias]: a tensor passed twice is one host tensor twice, as CPU's
    // kernel sees one TensorImpl twice. It matters where a kernel changes an argument's
    // geometry: torch.sum(a, 0, out=a) resizes its output, and with it, on CPU, its input
    // (before reducing: the result is zeros, where a second alias kept the input whole and
    // gave the real sum). Storage identity alone (below) cannot say so.
    at::Tensor alias = alias_given_to(t);
    if (!alias.defined()) {
      const size_t same = storage_with_bytes(t.storage());
      if (same != Index<const void*>::npos) {  // an earlier argument's bytes: the same alias storage
        alias = projecting ? tensor_like_on(storages[same].first, c10::DispatchKey::Meta, t)
                           : host_alias_on(storages[same].first, t);
      } else {
        alias = projecting ? meta_alias(t) : host_alias(t);
        storages.emplace_back(alias.storage(), t.storage());
      }
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
      return IValue(c10::Device(projecting ? c10::kMeta : c10::kCPU));
    }
    return v;
  }

  // t as a meta tensor on a storage of its storage's size (Note [Projected ops]).
  static at::Tensor meta_alias(const at::Tensor& t) {
    check_computed(t.storage());  // a deferred value whose launch failed has nothing to project
    return on_storage_of(t, t.storage().nbytes());
  }

  at::Tensor from_host(const at::Tensor& r, DeviceIndex d) {
    if (!r.defined() || r.device().type() != (projecting ? c10::kMeta : c10::kCPU)) {
      return r;
    }
    TORCH_CHECK_NOT_IMPLEMENTED(!r.is_nested(), "neuron tensors are dense (strided) only, but this op produced a nested "
        "tensor of the strided layout. Use the jagged layout, which is built of dense tensors and runs on neuron: "
        "torch.nested.nested_tensor(tensors, layout=torch.jagged, device='neuron').");
    // Note [No quantized tensors] (layouts.cpp): a quantized result adopted as a neuron tensor
    // would lose its quantizer and fail at every later use.
    TORCH_CHECK_NOT_IMPLEMENTED(!r.is_quantized(), "neuron has no quantized tensors, but this op produced a ",
        r.scalar_type(), " tensor. ", kQuantizedInstead);
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
    c10::Storage adopted = projecting ? projected_storage(r.storage().nbytes(), d, /*new_result=*/true)
                                      : adopt(r.storage(), d, /*new_result=*/true);
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
    if (projecting) {
      if (alias.storage().nbytes() != original.storage().nbytes()) {
        impl->set_storage_keep_dtype(projected_storage(alias.storage().nbytes(), original.device().index(),
                                                       /*new_result=*/false));
      }
    } else if (alias.storage().data() != original.storage().data() ||
               alias.storage().nbytes() != original.storage().nbytes()) {
      impl->set_storage_keep_dtype(adopt(alias.storage(), original.device().index(), /*new_result=*/false));
    }
    if (original.sizes() != alias.sizes() || original.strides() != alias.strides() ||
        original.storage_offset() != alias.storage_offset()) {
      impl->set_sizes_and_strides(alias.sizes(), alias.strides(), alias.storage_offset());
    }
  }
};

bool is_cpu_index_op(const c10::OperatorName& name) {
  const std::string& n = name.name;
  return n == "aten::index" || n == "aten::index_put_" || n == "aten::index_put" || n == "aten::_index_put_impl_";
}

// Note [An op's traits, once]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// run_on_host runs for every op, on the device's thread, and asked each op's name the same
// questions at every call (an index op? a collective? one whose FLOPs are counted, or that
// TorchNeuron runs on the host? which argument is its generator?): string compares and hash
// lookups, 5% of the executor's instructions on a chain of small adds (callgrind, per op:
// 17,000-17,100 before, 16,300 after; that chain's wall clock is the host's, which this does
// not touch). The answers depend on the op alone: worked out at its
// first call on a thread and kept in a small table of that thread's, slotted by the address of
// the op's schema and checked against its name, since a custom op's registration may go (a
// torch.library.Library deleted) and another take its address.
struct OpTraits {
  const c10::FunctionSchema* schema = nullptr;
  c10::OperatorName name{"", ""};
  bool cpu_indices_ok = false;
  bool collective = false;
  bool priced_collective = false;
  bool runs_on_host = false;  // Note [Ops TorchNeuron runs on the host] (pricing.cpp)
  bool tensor_engine = false;  // op_flops counts its FLOPs; conv_flags reads its flags
  int generator_arg = -1;  // its first optional Generator argument
};

const OpTraits& traits_of(const c10::FunctionSchema& schema) {
  constexpr size_t kSlots = 256;
  thread_local std::vector<OpTraits> table(kSlots);
  OpTraits& t = table[(reinterpret_cast<uintptr_t>(&schema) >> 4) % kSlots];
  const c10::OperatorName& name = schema.operator_name();
  if (t.schema == &schema && t.name == name) {
    return t;
  }
  t.schema = &schema;
  t.name = name;
  t.cpu_indices_ok = is_cpu_index_op(name);
  // c10d's prefix first: the table's lookup hashes the name.
  t.collective = name.name.compare(0, 6, "c10d::") == 0;
  t.priced_collective = t.collective && is_priced_collective(name);
  t.runs_on_host = torchneuron_runs_on_host(name);
  t.tensor_engine = runs_on_tensor_engine(name);
  t.generator_arg = -1;
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    if (is_optional_generator(schema.arguments()[i])) {
      t.generator_arg = static_cast<int>(i);
      break;
    }
  }
  return t;
}

// Elements at most in the result of a factory run whole (Note [CPU kernels whole] in
// registration.cpp), read from its arguments; -1 when they do not say (another op, or
// arguments of other types).
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
  } else if (name.find("attention") != std::string::npos) {
    // CUDA's fused attention kernels (flash, memory-efficient, cuDNN): the public entry runs here.
    hint = "call torch.nn.functional.scaled_dot_product_attention, which runs on neuron the kernel the CPU picks "
           "(for packed sequences, torch.nn.attention.varlen.varlen_attn)";
  }
  TORCH_CHECK_NOT_IMPLEMENTED(false, name, " has no CPU kernel in torch ", TORCH_VERSION,
                              where.empty() ? std::string() : " (it has kernels for " + where + " only)",
                              ", and neuron runs every op with the CPU's kernel on the device's bytes: it cannot "
                              "run on neuron; ", hint, ".");
}

// Projecting: an op with no shape function cannot be projected. Said in neuron's terms, unless
// its Meta kernel (or composite) itself refused these arguments.
void refuse_without_meta_kernel(const c10::OperatorHandle& op) {
  if (has_shape_function(op)) {
    return;
  }
  TORCH_CHECK_NOT_IMPLEMENTED(false, op.operator_name().name, " has no shape function (Meta kernel) in torch ",
                              TORCH_VERSION, ", so projection mode cannot tell its outputs' sizes without computing "
                              "them. Run this part of the program outside adaptive_eager.projection(), or with an "
                              "equivalent op that has one.");
}

// Note [Losses on their buffer]: CPU's kernels of these losses, reduced (mean or sum), return the
// 0-dim result on the storage of their elementwise buffer (input's size), which the device is
// charged for as long as the loss lives; their Meta kernels give it a storage of its own. A
// projected run must hold what the run with bytes holds: the storage's size CPU would give, or
// 0 for any other op. (Found by comparing every OpInfo sample's results on CPU and on meta.)
size_t cpu_result_storage_nbytes(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first) {
  static const std::unordered_set<std::string> kLosses = {"aten::mse_loss", "aten::smooth_l1_loss",
                                                         "aten::soft_margin_loss", "aten::binary_cross_entropy"};
  const c10::OperatorName& name = op.operator_name();
  if (!name.overload_name.empty() || kLosses.count(name.name) == 0) {
    return 0;
  }
  const auto reduction = op.schema().argumentIndexWithName("reduction");
  if (!reduction || stack[first + *reduction].toInt() == 0) {  // reduction='none': a result of input's size
    return 0;
  }
  const at::Tensor& self = stack[first].toTensor();
  const at::Tensor& target = stack[first + 1].toTensor();
  return static_cast<size_t>(c10::multiply_integers(at::infer_size(self.sizes(), target.sizes()))) * self.dtype().itemsize();
}


// Note [Value-dependent ops on placeholder values]: an op whose outputs' sizes depend on its
// inputs' values (nonzero, masked_select, unique, a boolean mask's index) has no shape function,
// or one that refuses; `print(t)` calls masked_select. Projected tensors read as zeros
// everywhere else (Note [Host reads in projection mode]), so such an op runs its CPU kernel on
// zeros of its arguments' geometry: its result is the one zeros give (an empty mask, one unique
// value), counted as a placeholder read. Bounded: arguments larger than this are refused by name.
constexpr size_t kPlaceholderRunBytes = size_t{256} << 20;

// v with each meta tensor made a CPU tensor of its geometry on zeroed bytes (a list's too), and a
// meta device argument the CPU; *bytes counts the bytes made.
IValue zeros_on_host(const IValue& v, size_t* bytes) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.defined() || !t.is_meta()) {
      return v;
    }
    const size_t nbytes = t.storage().nbytes();
    *bytes += nbytes;
    c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, c10::GetCPUAllocator(), /*resizable=*/true);
    if (nbytes > 0) {
      std::memset(storage.mutable_data(), 0, nbytes);
    }
    return tensor_like_on(std::move(storage), c10::DispatchKey::CPU, t);
  }
  if (v.isList() && holds_tensors(v)) {
    return map_list(v, [&](IValue e, size_t) { return zeros_on_host(e, bytes); });
  }
  if (v.isDevice() && v.toDevice().is_meta()) {
    return IValue(c10::Device(c10::kCPU));
  }
  return v;
}

// A CPU result of that run as the meta result a shape function would have given (a list's too).
IValue as_meta_result(const IValue& v) {
  if (v.isTensor()) {
    const at::Tensor& r = v.toTensor();
    return r.defined() && r.device().is_cpu() ? IValue(on_storage_of(r, r.storage().nbytes())) : v;
  }
  if (v.isList() && holds_tensors(v)) {
    return map_list(v, [](IValue e, size_t) { return as_meta_result(e); });
  }
  return v;
}

// The neuron storages of an argument (a tensor, or a list of them).
void collect_neuron_storages(const IValue& v, std::vector<c10::Storage>* out) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (t.defined() && t.device().type() == kNeuron) {
      out->push_back(t.storage());
    }
  } else if (v.isList()) {
    for (const IValue& e : v.toListRef()) {
      collect_neuron_storages(e, out);
    }
  }
}

// Whether an op's outputs' sizes need its inputs' values, or it has no shape function at all.
bool needs_values_for_shapes(const c10::OperatorHandle& op) {
  return op.hasTag(at::Tag::dynamic_output_shape) || op.hasTag(at::Tag::data_dependent_output) ||
         !has_shape_function(op);
}

// Note [Value-dependent ops on placeholder values]: reruns an op whose shape function refused
// on zeros, its results made meta; false (nothing done) if it writes an argument, its arguments
// are too large, or it has no CPU kernel either.
bool run_on_placeholder_values(const c10::OperatorHandle& op, torch::jit::Stack* stack, size_t first,
                               const torch::jit::Stack& meta_arguments) {
  if (meta_arguments.empty() || !op.hasKernelForDispatchKey(c10::DispatchKey::CPU)) {
    return false;
  }
  size_t bytes = 0;
  torch::jit::Stack zeros;
  zeros.reserve(meta_arguments.size());
  for (const IValue& v : meta_arguments) {
    zeros.push_back(zeros_on_host(v, &bytes));
    if (bytes > kPlaceholderRunBytes) {
      return false;
    }
  }
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &zeros);
  note_placeholder_values(op.operator_name().name);
  stack->resize(first);
  for (const IValue& v : zeros) {
    stack->push_back(as_meta_result(v));
  }
  return true;
}

}  // namespace

void run_on_host(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const c10::OperatorName& name = schema.operator_name();
  const size_t num_args = schema.arguments().size();
  const size_t first = stack->size() - num_args;
  const OpTraits& traits = traits_of(schema);  // Note [An op's traits, once]
  HostCall call;
  call.projecting = projection_enabled();
  call.cpu_indices_ok = traits.cpu_indices_ok;
  const bool collective = traits.collective;
  const bool priced_collective = traits.priced_collective;
  if (call.projecting && priced_collective) {  // Note [Projected collectives] (collectives.cpp)
    project_collective(op, stack, first);
    return;
  }
  // Note [A collective's future holds device tensors]: what it writes, before the arguments
  // become host aliases.
  const std::vector<at::Tensor> collective_writes = priced_collective ? tensors_of((*stack)[first]) : std::vector<at::Tensor>();
  const int generator_arg = traits.generator_arg;
  std::vector<c10::Storage> written;  // projecting: the neuron storages the op writes
  for (size_t i = 0; i < num_args; ++i) {
    IValue& v = (*stack)[first + i];
    if (static_cast<int>(i) == generator_arg) {
      if (call.projecting) {
        v = IValue();  // a shape function draws nothing (Note [Projected ops])
      }
      continue;
    }
    if (call.projecting) {
      const auto* alias_info = schema.arguments()[i].alias_info();
      if (alias_info != nullptr && alias_info->isWrite()) {
        collect_neuron_storages(v, &written);
      }
    }
    v = call.arg_to_host(std::move(v), name);
  }
  const DeviceIndex d = call.device >= 0 ? call.device : (call.target >= 0 ? call.target : current_device());
  const DeviceIndex result_device = call.target >= 0 ? call.target : d;
  // A factory on the device; in a launch its output was charged (and checked) at issue.
  if (call.aliases.empty() && call.target >= 0 && charges_new_results() && !call.projecting) {
    check_factory_fits(op, *stack, first, call.target);
  }
  std::unique_ptr<DefaultGeneratorLent> lent =
      call.projecting ? nullptr : lend_generator(op, stack, first, generator_arg);

  const ConvFlags conv = traits.tensor_engine ? conv_flags(name, *stack, first) : ConvFlags{};
  const Touch touch = touch_of(name, *stack, first);  // Note [Gathers and scatters] (touched.cpp)
  std::optional<Range> range;  // an eager launch's own range; a fused launch's ops have none
  if (profiling() && !in_fused_launch()) {
    range.emplace("neuron::" + name.name);
  }
  // Note [Collectives on the link]: priced from the arguments, before the op changes them.
  const std::optional<double> link_us = collective ? collective_us(op, *stack, first) : std::nullopt;
  // Note [Reduce ops as NCCL computes them] (collectives.cpp): PREMUL_SUM and integer AVG.
  const ReduceRewrite reduce = collective ? rewrite_reduce_op(op, stack, first) : ReduceRewrite{};
  const size_t buffer_nbytes = call.projecting ? cpu_result_storage_nbytes(op, *stack, first) : 0;
  // Projecting: the arguments as given to the shape function, for a run on placeholder values.
  const torch::jit::Stack meta_arguments = call.projecting && written.empty()
      ? torch::jit::Stack(stack->begin() + static_cast<std::ptrdiff_t>(first), stack->end()) : torch::jit::Stack();
  try {
    op.redispatchBoxed(c10::DispatchKeySet(call.projecting ? c10::DispatchKey::Meta : c10::DispatchKey::CPU), stack);
  } catch (const std::exception& error) {
    // A shape function that cannot say (a Python one raises Python's NotImplementedError).
    if (!(call.projecting && needs_values_for_shapes(op) && run_on_placeholder_values(op, stack, first, meta_arguments))) {
      if (dynamic_cast<const c10::NotImplementedError*>(&error) != nullptr) {
        if (call.projecting) {
          refuse_without_meta_kernel(op);
        }
        refuse_without_cpu_kernel(op);  // says why in neuron's terms, or rethrows what the kernel said
      }
      throw;
    }
  }
  if (buffer_nbytes > 0) {
    IValue& result = stack->back();
    result = on_storage_of(result.toTensor(), buffer_nbytes);
  }
  // What the op wrote has no known values any more (a tensor made before projection mode).
  for (const c10::Storage& s : written) {
    if (!is_projected(s)) {
      project_in_place(s, s.nbytes(), /*grown=*/false);
    }
  }
  if (reduce.active) {
    finish_reduce_op(reduce, stack, schema.returns().size());
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
  if (traits.runs_on_host) {  // Note [Ops TorchNeuron runs on the host] (pricing.cpp)
    const double us = charge_host_round_trip(d, call.in_bytes, out_bytes);
    if (range) {
      mark_device_time(us, "bytes", static_cast<int64_t>(call.in_bytes + out_bytes), d);
    }
    return;
  }
  if (link_us) {
    if (num_returns > 0) {  // every collective returns its Work last
      stack->back() = work_with_device_tensors(stack->back(), collective_writes);
    }
    const double us = launch_collective(d, name.name, *link_us);
    if (range) {
      mark_device_time(us, "ops", 1, d);
    }
    return;
  }
  const double flops = traits.tensor_engine ? op_flops(name, call.aliases, conv, stack->data() + results, num_returns) : 0;
  OpTraffic traffic{call.in_bytes, call.in_elements, out_bytes, out_elements};
  count_touched_bytes(touch, call.aliases, &traffic);
  const double us = launch_op(d, name.name, flops, traffic.in_bytes + traffic.out_bytes,
                             std::max(traffic.in_elements, traffic.out_elements), call.dtype.value_or(at::kFloat));
  if (range) {
    mark_device_time(us, "ops", 1, d);
  }
}

}  // namespace eager_detail
}  // namespace neuron
