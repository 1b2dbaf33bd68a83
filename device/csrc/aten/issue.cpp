// Note [Eager ops run on the device]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every op of a neuron tensor that the adaptive engine does not take is issued here, on the
// thread that calls it (the user's, or autograd's thread for the device), and runs on the
// device's executor (Note [The device executor] in runtime/executor.cpp), with CPU's kernel
// (run_on_host.cpp): the issuing thread runs no kernel. Two ways:
//   - Posted, and the issuer goes on (as CUDA's host runs ahead of its kernels): an op whose
//     outputs' geometry is known before it runs. It is known from an earlier run of the op
//     with the same key (geometry_key: each argument's geometry and dtype, every other
//     argument's value, the default dtype), where its run showed that nothing else decides it:
//     an aten op with no data-dependent shape, no host result, no random draw, no warning, its
//     written arguments keeping their geometry, each result new bytes of its own. Its outputs
//     are handed out now, charged now, and get their bytes when it runs (Note [Deferred
//     launches] in engine/queue.cpp); an error it meets waits for the next sync.
//   - Run while the issuer waits: the first call of each key (its run teaches the plan), and
//     every op that cannot be posted. Its error raises here, at the call.
// NEURON_LAUNCH_BLOCKING=1 runs every op the second way. So does a profiled op (the profiler
// records the calling thread's ranges, and run_on_device carries them to the executor), an op
// of a compiled graph (inductor's generated kernels, on the calling thread, read the data of
// what its ATen calls return), an op of a fused launch (torch.compile's backend='neuron'), and
// every op in projection mode (its kernel is the Meta one: nothing to run ahead of).
#include "aten/eager_internal.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/DefaultDtype.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace neuron {
namespace {

using c10::IValue;

std::atomic<bool> g_launch_blocking{false};
std::atomic<int64_t> g_posted{0};  // eager ops posted, and run while their issuer waited
std::atomic<int64_t> g_waited{0};

// Learned plans by key; nullptr: the op runs while its issuer waits. Cleared when full, so a
// stream of ever new sizes keeps bounded memory.
std::mutex g_lock;
std::unordered_map<std::vector<int64_t>, std::shared_ptr<const DeferPlan>, GeometryKeyHash> g_plans;
constexpr size_t kPlansKept = 1 << 15;

// Ops whose results' geometry (or existence) the arguments' geometry does not decide, or that
// draw random numbers (a draw's order against the host's seeding must stay the host's).
bool may_post(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first) {
  const c10::OperatorName& name = op.operator_name();
  // An op TorchNeuron runs on the host (Note [Ops TorchNeuron runs on the host]) reads its
  // arguments there, as the chip's runtime does: posted, it was charged a launch, not its round trip.
  if (name.name.rfind("aten::", 0) != 0 || op.hasTag(at::Tag::data_dependent_output) || torchneuron_runs_on_host(name) ||
      draws_random_numbers(name.name, op.hasTag(at::Tag::nondeterministic_seeded), false)) {
    return false;
  }
  if (op.hasTag(at::Tag::dynamic_output_shape)) {
    // Indexing with integer tensors has the indices' shape; only a mask's count is data.
    if (name.name != "aten::index" || name.overload_name != "Tensor") {
      return false;
    }
    for (const IValue& index : stack[first + 1].toListRef()) {
      if (index.isTensor() && (index.toTensor().scalar_type() == at::kBool || index.toTensor().scalar_type() == at::kByte)) {
        return false;
      }
    }
  }
  return true;
}

struct Geometry {
  const c10::StorageImpl* storage;
  std::vector<int64_t> sizes, strides;
  int64_t offset;
};

// What learning needs of the arguments, read before the op consumes them. Their bytes are
// looked at after the run: an argument posted before may have none until then.
struct Arguments {
  std::vector<c10::Storage> storages;  // every neuron argument's
  std::vector<Geometry> written;  // neuron arguments the op writes (a written list's tensors too)
  std::vector<at::Tensor> written_tensors;  // the same, to compare after the run
  bool writes_host = false;  // it writes a CPU tensor
  bool postable = true;

  void add(const IValue& v, bool written_arg) {
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (!t.defined()) {
        return;
      }
      if (t.device().type() != kNeuron) {
        writes_host = writes_host || written_arg;
        return;
      }
      storages.push_back(t.storage());
      if (written_arg) {
        written.push_back(Geometry{t.storage().unsafeGetStorageImpl(), t.sizes().vec(), t.strides().vec(),
                                   t.storage_offset()});
        written_tensors.push_back(t);
      }
    } else if (v.isList()) {
      for (const IValue& e : v.toListRef()) {
        add(e, written_arg);
      }
    }
  }
};

bool unchanged(const Geometry& g, const at::Tensor& t) {
  return t.storage().unsafeGetStorageImpl() == g.storage && t.sizes() == g.sizes && t.strides() == g.strides &&
         t.storage_offset() == g.offset;
}

// The plan the op's run shows, or nullptr if it cannot be posted (Note [Eager ops run on the
// device]). stack holds its results.
std::shared_ptr<const DeferPlan> learn(const c10::OperatorHandle& op, const torch::jit::Stack& stack,
                                       const Arguments& args, c10::DeviceIndex device) {
  if (!args.postable || args.writes_host) {
    return nullptr;
  }
  for (size_t i = 0; i < args.written.size(); ++i) {
    if (!unchanged(args.written[i], args.written_tensors[i])) {
      return nullptr;  // an out= resize: the host's tensor changes when the op runs
    }
  }
  auto plan = std::make_shared<DeferPlan>();
  plan->device = -1;
  std::unordered_set<const void*> seen;
  for (const c10::Storage& s : args.storages) {
    seen.insert(s.data());
  }
  auto add = [&](const IValue& v) {
    if (v.isNone()) {
      plan->outputs.push_back(OutputSpec{{}, {}, 0, at::ScalarType::Undefined, 0, /*defined=*/false});
      return true;
    }
    if (!v.isTensor()) {
      return false;  // a host value
    }
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) {
      plan->outputs.push_back(OutputSpec{{}, {}, 0, at::ScalarType::Undefined, 0, /*defined=*/false});
      return true;
    }
    if (t.device().type() != kNeuron || (plan->device >= 0 && t.device().index() != plan->device) ||
        t.storage().data() == nullptr || !seen.insert(t.storage().data()).second) {
      return false;  // on the host, on two devices, or a view of an argument or of another result
    }
    plan->device = t.device().index();
    plan->outputs.push_back(OutputSpec{t.sizes().vec(), t.strides().vec(), t.storage_offset(), t.scalar_type(),
                                       static_cast<int64_t>(t.storage().nbytes())});
    return true;
  };
  const auto& returns = op.schema().returns();
  const size_t first = stack.size() - returns.size();
  for (size_t r = 0; r < returns.size(); ++r) {
    const auto* alias_info = returns[r].alias_info();
    if (alias_info != nullptr && alias_info->isWrite()) {
      continue;  // the written argument itself
    }
    const IValue& v = stack[first + r];
    if (is_tensor_list(returns[r].type())) {
      if (!v.isTensorList()) {
        return nullptr;
      }
      const auto list = v.toTensorVector();
      plan->list_lengths.push_back(static_cast<int64_t>(list.size()));
      for (const at::Tensor& t : list) {
        if (!add(IValue(t))) {
          return nullptr;
        }
      }
    } else if (!add(v)) {
      return nullptr;
    }
  }
  if (plan->device < 0) {
    plan->device = device;  // no new output: the device the op ran with
  }
  return plan;
}

struct CollectWarnings final : public c10::WarningHandler {
  std::vector<c10::Warning> warnings;
  void process(const c10::Warning& warning) override { warnings.push_back(warning); }
};

// Runs the op on the device while the caller waits; learns its plan under key if keyed.
void run_and_learn(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::vector<int64_t>* key_buffer) {
  g_waited.fetch_add(1, std::memory_order_relaxed);
  // Copied before anything runs: the buffer is the issuing thread's (issue_eager), and a
  // warning handler or a Python kernel may issue on this thread before the plan is learnt.
  std::optional<std::vector<int64_t>> key;
  if (key_buffer != nullptr) {
    key = *key_buffer;
  }
  const c10::FunctionSchema& schema = op.schema();
  const size_t n = schema.arguments().size();
  const size_t first = stack->size() - n;
  Arguments args;
  if (key) {
    args.postable = may_post(op, *stack, first);
    for (size_t i = 0; i < n && args.postable; ++i) {
      const auto* alias_info = schema.arguments()[i].alias_info();
      args.add((*stack)[first + i], alias_info != nullptr && alias_info->isWrite());
    }
  }
  CollectWarnings collected;
  const c10::DeviceIndex device = current_device();
  FusedLaunch* fused = current_fused_launch();  // a compiled graph's: its ops are one launch
  run_on_device([&] {
    // The executor's warnings reach the caller's handler (Python's warnings) below.
    const c10::WarningUtils::WarningHandlerGuard collecting(&collected);
    const c10::DeviceGuard guard(c10::Device(kNeuron, device));
    const FusedLaunchOnThread joined(fused);
    const RouteBypass bypass;  // the op's own kernel at PrivateUse1 (the fallback's: run_on_host)
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), stack);
  });
  for (const c10::Warning& w : collected.warnings) {
    c10::warn(w);
  }
  if (!key) {
    return;
  }
  std::shared_ptr<const DeferPlan> plan =
      collected.warnings.empty() ? learn(op, *stack, args, device) : nullptr;  // a warning is raised at each call
  std::unique_lock<std::mutex> guard(g_lock);
  if (g_plans.size() >= kPlansKept) {
    g_plans.clear();
  }
  g_plans.emplace(std::move(*key), std::move(plan));
}

}  // namespace

namespace eager_detail {

void issue_eager(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (on_device_thread()) {  // an op of a job: a fused launch's, or a composite's part
    eager_detail::run_on_host(op, stack);
    return;
  }
  release_host_thread_team();  // Note [The device executor]
  // Waited for, too: an op of a compiled graph (inductor's generated code reads the data
  // pointers of what its ATen calls returned, on this thread), or one the engine runs now.
  // And every op in projection mode (Note [Projected ops]): posted, the op ran on bytes shared
  // with its arguments', and what it wrote became projected there, not in the caller's
  // storage (a second projected run's AdamW left its parameters with stale host values).
  if (g_launch_blocking.load(std::memory_order_relaxed) || profiling() || in_fused_launch() || bypassed_ops_wait() ||
      projection_enabled()) {
    run_and_learn(op, stack, nullptr);
    return;
  }
  // One buffer per issuing thread, kept with its capacity: a key built afresh per op cost a
  // heap allocation or two (a foreach op's key outgrows any small reserve). perf sampled them
  // at 5% of the host thread in a small eager training step, where the host's allocations
  // miss its cache of free chunks (the executor frees what the host allocates); callgrind
  // counts only ~0.2% fewer instructions: the cost was malloc's slow path, not its work.
  thread_local std::vector<int64_t> key;
  key.clear();
  key.push_back(static_cast<int64_t>(c10::get_default_dtype_as_scalartype()));  // a factory's dtype=None
  // An elementwise op's (a foreach op's) results take their geometry from its tensors: its
  // float arguments (Adam's bias corrections, new each step) do not enter the key. Any other
  // op's may decide a shape (upsample's scale factors, arange's end).
  const std::string& name = op.operator_name().name;
  const bool float_values = !(op.hasTag(at::Tag::pointwise) || name.rfind("aten::_foreach_", 0) == 0);
  if (!geometry_key(op, *stack, current_device(), &key, float_values)) {
    run_and_learn(op, stack, nullptr);
    return;
  }
  std::shared_ptr<const DeferPlan> plan;
  bool known = false;
  {
    std::unique_lock<std::mutex> guard(g_lock);
    auto found = g_plans.find(key);
    if (found != g_plans.end()) {
      known = true;
      plan = found->second;
    }
  }
  if (plan) {
    g_posted.fetch_add(1, std::memory_order_relaxed);
    wait_for_room_on_device();  // Note [The device's queue is bounded]
    post_eager(op, stack, std::move(plan));
  } else {
    run_and_learn(op, stack, known ? nullptr : &key);
  }
}

}  // namespace eager_detail

void set_launch_blocking(bool blocking) { g_launch_blocking.store(blocking); }

std::pair<int64_t, int64_t> eager_issue_counts() { return {g_posted.load(), g_waited.load()}; }

void eager_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  cover_third_party_composites();  // a library loaded since: before its ops meet neuron tensors
  if (route_op(op, stack)) {  // the adaptive engine took it (Note [Deferred launches])
    return;
  }
  eager_detail::issue_eager(op, stack);
}

// Note [Recorded ops are posted]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// While the adaptive engine records (a loop's first steps, and any stretch it has not matched
// yet), it answers "run it now, then tell me" (the route's kRunEagerThen): the op takes the
// eager path and the engine records what it returned. It is posted, as eager mode posts it
// (Note [Eager ops run on the device]), rather than run while the host waits: a recording
// host runs ahead of the device as an eager one does, where it made a round trip per op (the
// better part of adaptive mode's warm-up over eager's). The engine reads its results' geometry,
// never their values, and their bytes exist from issue (Note [A deferred output's bytes exist
// at issue], memory.cpp): an address, a storage's data_ptr() or torch.save in a recorded
// stretch gives what eager mode gives. Its errors wait for the next sync, as eager mode's do.
void run_eager(const c10::OperatorHandle& op, torch::jit::Stack* stack, bool posts) {
  run_before_eager();
  const RouteBypass bypass(posts);
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), stack);
}

}  // namespace neuron
