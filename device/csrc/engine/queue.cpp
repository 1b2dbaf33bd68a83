// The device's queue of issued ops that have not run yet: what the adaptive engine defers
// on neuron tensors, and the route by which ops reach the engine at all.
//
// Note [Deferred launches]: a deferred op is what it is on a real asynchronous accelerator.
//   - At issue, its arguments are captured: each neuron tensor as a new tensor on its bytes,
//     with its geometry (Note [Queued arguments count no references]), so a later
//     `p.data = ...` of the caller's tensor cannot redirect it, as a launched kernel holds raw
//     pointers; each CPU tensor it does not write as a snapshot (host data is read at issue).
//   - Each new output is a neuron tensor handed out at once, with the geometry the engine's
//     trace promises and a storage of that many bytes whose memory does not exist yet.
//     In-place and out= outputs are the very inputs, as in eager mode.
//   - The launch runs the queue in order, each op through the eager path (the same CPU
//     kernels, so the same bits), and moves each new result's bytes into the storage handed
//     out for it: zero-copy when the geometry agrees, a copy otherwise. Memory is charged
//     when the output is handed out, at issue, and released when the last holder of its
//     storage lets go, as in eager mode (Note [Deferred outputs are charged at issue] in
//     memory.cpp): peak memory and out-of-memory errors are eager's. An output nobody holds
//     any more is dropped as soon as its op has run.
//   - A host read (a copy to the host, `item()`, a Python kernel's host alias, resize_,
//     set_) first runs the host sync, which launches the queue. A value whose launch failed
//     never gets bytes: reading it raises the launch's error (check_computed).
// One queue for the process: the engine defers only the ops of one trace, on one device, and
// launches them before it defers anything else.
#include "engine/launch.h"
#include "neuron.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/RefcountedDeleter.h>

#include <pthread.h>

#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace neuron {
namespace {

using c10::IValue;

Launch g_queue;  // the one being issued; guarded by the engine's lock (Python) and the GIL

int64_t run_launch(Launch& launch, int64_t* failed);

// Note [The device stream]: a complete trace with only C++ kernels (no random ops, no Python
// kernels: adaptive_eager/engine/executor.py decides) runs on this thread, beside the host, which goes on
// issuing the next trace's ops into the next queue. One launch is in flight at a time; the
// host waits for it (finish_launch) before the next launch, an op it runs now, or any host
// access, and before capturing an output of the launch that has no bytes yet (capture).
struct Outcome {
  int64_t ran = 0;
  int64_t failed = -1;
  std::exception_ptr error;
};

struct Worker {
  std::mutex lock;
  std::condition_variable changed;
  std::unique_ptr<Launch> job;  // submitted, not yet taken by the thread
  bool finished = false;
  Outcome outcome;
  std::atomic<bool> busy{false};  // submitted and not yet collected by the host
  int threads = 1;
  bool started = false;
  // The storages the launch in flight makes: the host's own copy, fixed at submit (the
  // thread never reads it), so the host waits only to capture one of them (reads_unmade_bytes).
  std::unordered_set<const c10::StorageImpl*> making;

  void submit(std::unique_ptr<Launch> launch) {
    making.clear();
    for (const Entry& e : launch->entries) {
      for (const auto& out : e.outputs) {
        making.insert(out._unsafe_get_target());
      }
    }
    std::unique_lock<std::mutex> guard(lock);
    if (!started) {
      started = true;
      // Detached: it waits on `changed` for the process's life, and must not be joined at exit.
      std::thread([this] { loop(); }).detach();
    }
    threads = host_thread_count();  // the host's intra-op threads, as its kernels would use
    job = std::move(launch);
    finished = false;
    busy.store(true);
    changed.notify_all();
  }

  void loop() {
    mark_device_thread();
    for (;;) {
      std::unique_ptr<Launch> launch;
      int n = 1;
      {
        std::unique_lock<std::mutex> guard(lock);
        changed.wait(guard, [this] { return job != nullptr; });
        launch = std::move(job);
        n = threads;
      }
      // Note [The stream's intra-op threads]: the host's count (Note [Kernels take the host's
      // thread count] in runtime/threads.cpp), set only when it differs: at::set_num_threads
      // also calls mkl_set_dynamic(false) for the whole process, after which MKL's VML ran a
      // 2,048-element tanh on a thread team: 3-10x slower host kernels, in eager mode too,
      // for the rest of the process.
      if (at::get_num_threads() != n) {
        at::set_num_threads(n);
      }
      Outcome result;
      try {
        result.ran = run_launch(*launch, &result.failed);
      } catch (...) {
        result.error = std::current_exception();
      }
      launch.reset();  // its inputs and kept values go now, on this thread
      std::unique_lock<std::mutex> guard(lock);
      outcome = std::move(result);
      finished = true;
      changed.notify_all();
    }
  }

  void wait_finished() {
    std::unique_lock<std::mutex> guard(lock);
    changed.wait(guard, [this] { return finished; });
  }

  Outcome collect() {
    wait_finished();
    std::unique_lock<std::mutex> guard(lock);
    busy.store(false);
    finished = false;
    return std::move(outcome);
  }
};

// Never destroyed: at exit its thread still waits on `changed`, and destroying a condition
// variable that a thread waits on blocks exit for ever (glibc's pthread_cond_destroy).
Worker* g_worker = new Worker;

// A forked child has no stream thread (the parent waited for its launch before forking:
// dispatch/registration.py), and its copy of the worker's lock and condition may be mid-use:
// it starts a fresh worker, its thread made at its first launch. The old one is leaked.
const int g_fork_handler = pthread_atfork(nullptr, nullptr, [] { g_worker = new Worker; });
std::atomic<bool> g_held{false};  // ops are queued, or a failed launch's error waits
bool g_error_waiting = false;
std::string g_failure;  // the error of the launch that left values uncomputed
std::string g_failure_type;  // its Python type's name
int64_t g_failed_index = -1;
OpRoute g_route;
std::function<void(const char*)> g_host_sync;
thread_local bool t_bypass = false;

void update_held() { g_held.store(!g_queue.entries.empty() || g_error_waiting); }

at::Tensor on_storage(c10::Storage storage, c10::DispatchKeySet keys, caffe2::TypeMeta dtype, c10::IntArrayRef sizes,
                      c10::IntArrayRef strides, int64_t offset) {
  auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), keys, dtype);
  t.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, offset);
  return t;
}

IValue capture(const IValue& v, bool written, Entry& entry, size_t arg, int64_t element) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) {
      return v;
    }
    if (t.device().type() == kNeuron) {
      const c10::Storage& storage = t.storage();
      if (storage.data() == nullptr && storage.nbytes() > 0) {  // made by an op still queued
        c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
        ++g_queue.readers[impl];
        entry.pending.push_back(PendingArg{arg, element, c10::weak_intrusive_ptr<c10::StorageImpl>(storage.getWeakStorageImpl()),
                                           impl, t.sizes().vec(), t.strides().vec(), t.storage_offset(), t.dtype(),
                                           t.key_set()});
        return at::Tensor();
      }
      const c10::StorageImpl* key = storage.unsafeGetStorageImpl();
      // A fresh storage's first use: a value of the launch if this op writes it, else outside it.
      const bool defines = take_fresh(key) && written;
      entry.existing.push_back(ExistingArg{arg, c10::weak_intrusive_ptr<c10::StorageImpl>(storage.getWeakStorageImpl()),
                                           key, static_cast<double>(t.numel()) * static_cast<double>(t.element_size()),
                                           written, defines});
      return on_storage(share_bytes(storage), t.key_set(), t.dtype(), t.sizes(),
                        t.strides(), t.storage_offset());
    }
    if (written) {
      return v;
    }
    at::Tensor snapshot = t.clone();  // Note [CPU scalar tensors]: read at issue
    // A Python number the dispatcher wrapped: type promotion treats it as a number, not a tensor.
    snapshot.unsafeGetTensorImpl()->set_wrapped_number(t.unsafeGetTensorImpl()->is_wrapped_number());
    return snapshot;
  }
  if (v.isList()) {
    return map_list(v, [&](const IValue& e, size_t i) {
      return capture(e, written, entry, arg, static_cast<int64_t>(i));
    });
  }
  return v;
}

// The bytes a pending argument's producer made in this launch, as a tensor of its geometry.
at::Tensor resolve(Launch& launch, const PendingArg& p) {
  c10::Storage storage;
  if (auto alive = p.storage.lock()) {
    storage = c10::Storage(std::move(alive));
  }
  if (!storage || storage.data() == nullptr) {
    auto found = launch.produced.find(p.key);
    if (found != launch.produced.end()) {
      storage = found->second;
    }
  }
  if (!storage || storage.data() == nullptr) {
    raise_failure();  // its producer failed in an earlier launch
  }
  return on_storage(storage, p.keys, p.dtype, p.sizes, p.strides, p.offset);
}

void bind_pending(Launch& launch, Entry& entry, torch::jit::Stack& stack) {
  for (const PendingArg& p : entry.pending) {
    at::Tensor t = resolve(launch, p);
    if (p.element < 0) {
      stack[p.arg] = std::move(t);
    } else {
      c10::List<IValue> list = stack[p.arg].toList();  // the entry's own list
      list.set(static_cast<size_t>(p.element), std::move(t));
    }
  }
}

// Its reads done, an entry lets go of what it read: the last reader frees a produced value.
void release_pending(Launch& launch, const Entry& entry) {
  for (const PendingArg& p : entry.pending) {
    auto it = launch.readers.find(p.key);
    if (it != launch.readers.end() && --it->second <= 0) {
      launch.readers.erase(it);
      launch.produced.erase(p.key);
    }
  }
}

at::Tensor lazy_output(const OutputSpec& s, c10::DeviceIndex d, Entry& entry) {
  // No bytes yet (Note [Deferred launches]), but charged from now on (Note [Deferred outputs
  // are charged at issue] in memory.cpp); resizable through the neuron allocator, as any
  // neuron storage is.
  c10::Storage storage(c10::Storage::use_byte_size_t(), s.nbytes, deferred_bytes(d, static_cast<size_t>(s.nbytes)),
                       c10::GetAllocator(kNeuron), /*resizable=*/true);
  entry.outputs.push_back(c10::weak_intrusive_ptr<c10::StorageImpl>(storage.getWeakStorageImpl()));
  auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                    c10::scalarTypeToTypeMeta(s.dtype));
  t.unsafeGetTensorImpl()->set_sizes_and_strides(s.sizes, s.strides, s.offset);
  return t;
}

// The launch made `result` for an output handed out as `spec` on `target`: give target the bytes.
void fill(const c10::intrusive_ptr<c10::StorageImpl>& target, const at::Tensor& result, const OutputSpec& spec,
          const c10::OperatorHandle& op) {
  TORCH_CHECK(result.defined() && result.device().type() == kNeuron && result.scalar_type() == spec.dtype &&
                  result.sizes() == c10::IntArrayRef(spec.sizes),
              "adaptive engine bug: ", op.schema().operator_name(), " produced ", result.sizes(), " ",
              result.scalar_type(), " but its trace promised ", c10::IntArrayRef(spec.sizes), " ", spec.dtype,
              ". Set NEURON_ADAPTIVE_EAGER=0 to avoid it, and please report it.");
  c10::StorageImpl* source = result.storage().unsafeGetStorageImpl();
  const bool same_geometry = result.strides() == c10::IntArrayRef(spec.strides) && result.storage_offset() == spec.offset;
  // The result's bytes are its own, and uncharged (the launch made them): move them, with the
  // charge the output took at issue (Note [Deferred outputs are charged at issue]).
  if (same_geometry && result.storage().use_count() == 1 && uncharged_bytes(source->data_ptr())) {
    // With their size: a kernel may allocate more than the view needs (the recorded run's
    // storage may differ).
    hand_over_charge(target->data_ptr(), source->data_ptr());
    target->set_nbytes(source->nbytes());
    target->set_data_ptr_noswap(source->set_data_ptr(c10::DataPtr(nullptr, source->device())));
    return;
  }
  // Another layout, or bytes shared with something else: new bytes, and a copy into them.
  c10::DataPtr bytes = launch_bytes(result.device().index(), static_cast<size_t>(spec.nbytes));
  hand_over_charge(target->data_ptr(), bytes);
  target->set_data_ptr_noswap(std::move(bytes));
  at::Tensor into = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(target), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), result.dtype());
  into.unsafeGetTensorImpl()->set_sizes_and_strides(spec.sizes, spec.strides, spec.offset);
  into.copy_(result);
}

void run_entry(Launch& launch, Entry& entry) {
  const RouteBypass bypass;  // the eager path, not the engine again
  const c10::FunctionSchema& schema = entry.op.schema();
  torch::jit::Stack stack = std::move(entry.args);  // released when the op has run
  bind_pending(launch, entry, stack);
  const OnChipScope on_chip(launch, entry);
  entry.op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), &stack);
  release_pending(launch, entry);
  size_t spec_index = 0;
  size_t out = 0;  // entry.outputs holds the defined outputs only
  auto take = [&](const IValue& v) {
    const OutputSpec& spec = entry.plan->outputs[spec_index++];
    if (!spec.defined) {
      TORCH_CHECK(!v.toTensor().defined(), "adaptive engine bug: ", entry.op.schema().operator_name(),
                  " produced a result where its trace promised none. Set NEURON_ADAPTIVE_EAGER=0 to avoid it, "
                  "and please report it.");
      return;
    }
    const size_t k = out++;
    const c10::StorageImpl* key = entry.outputs[k]._unsafe_get_target();
    const bool read_later = launch.readers.count(key) > 0;
    if (auto target = entry.outputs[k].lock()) {
      fill(target, v.toTensor(), spec, entry.op);
      if (read_later) {  // the bytes, not the storage: its holders' use counts stay theirs
        launch.produced[key] = share_bytes(c10::Storage(std::move(target)));
      }
    } else if (read_later) {  // nobody holds it but queued readers: the launch keeps its bytes
      launch.produced[key] = v.toTensor().storage();
    }
  };
  const auto& returns = schema.returns();
  for (size_t i = 0; i < returns.size(); ++i) {
    const auto* alias_info = returns[i].alias_info();
    if (alias_info != nullptr && alias_info->isWrite()) {
      continue;
    }
    const IValue& v = stack[stack.size() - returns.size() + i];
    if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList()) {
        take(IValue(t));
      }
    } else {
      take(v);
    }
  }
}

// Runs a launch's ops in order as one launch on the clock; *failed says which one raised.
int64_t run_launch(Launch& launch, int64_t* failed) {
  if (launch.entries.empty()) {
    return 0;
  }
  const c10::DeviceIndex device = launch.entries.front().plan->device;
  FusedLaunch fused(device);  // one launch for them all, on the device's clock
  const ChargeScope charged_at_issue;  // Note [Deferred outputs are charged at issue] (memory.cpp)
  fused.issued_ops = launch.issued_ops;
  for (size_t k = 0; k < launch.entries.size(); ++k) {
    try {
      run_entry(launch, launch.entries[k]);
    } catch (...) {
      *failed = static_cast<int64_t>(k);
      throw;  // the entries after k are dropped: their outputs never get bytes
    }
  }
  return static_cast<int64_t>(launch.entries.size());
}

}  // namespace

RouteBypass::RouteBypass() : previous(t_bypass) { t_bypass = true; }
RouteBypass::~RouteBypass() { t_bypass = previous; }

bool set_bypass(bool bypass) {
  const bool previous = t_bypass;
  t_bypass = bypass;
  return previous;
}

void set_route(OpRoute route) { g_route = std::move(route); }

bool route_active() { return g_route && !t_bypass; }

bool route_op(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (!route_active()) {
    return false;
  }
  if (g_route(op, stack)) {
    return true;
  }
  // The engine runs this op now: whatever it held back must have run first (it has: this
  // only guards against the engine forgetting to).
  run_before_eager();
  return false;
}

void set_host_sync(std::function<void(const char*)> sync) { g_host_sync = std::move(sync); }

void sync_before_host_access(const char* reason) {
  // While the engine is attached it sees every host access, queued ops or not: each one is a
  // sync point that cuts its traces, whether or not anything waits at this moment.
  if (t_bypass || !g_host_sync || !(g_route || g_held.load(std::memory_order_relaxed))) {
    return;
  }
  g_host_sync(reason);
}

void run_before_eager() {
  if (!t_bypass && (!g_queue.entries.empty() || g_worker->busy.load()) && g_host_sync) {
    g_host_sync("host read");
  }
}

void check_computed(const c10::Storage& storage) {
  if (storage.data() != nullptr || storage.nbytes() == 0) {
    return;
  }
  sync_before_host_access();  // its launch may still be queued
  if (storage.data() == nullptr) {
    raise_failure();
  }
}

[[noreturn]] void raise_failure() {
  // The same error as the failed launch raised (its Python type, its message).
  const std::string message = g_failure.empty()
      ? std::string("this neuron tensor's value was never computed: the deferred launch that makes it failed")
      : g_failure;
  if (g_failure_type == "IndexError") {
    TORCH_CHECK_INDEX(false, message);
  } else if (g_failure_type == "ValueError") {
    TORCH_CHECK_VALUE(false, message);
  } else if (g_failure_type == "TypeError") {
    TORCH_CHECK_TYPE(false, message);
  } else if (g_failure_type == "NotImplementedError") {
    TORCH_CHECK_NOT_IMPLEMENTED(false, message);
  } else if (g_failure_type == "OutOfMemoryError") {
    TORCH_CHECK_WITH(OutOfMemoryError, false, message);
  }
  TORCH_CHECK(false, message);
}

void enqueue(const c10::OperatorHandle& op, torch::jit::Stack* stack, std::shared_ptr<const DeferPlan> plan) {
  const c10::FunctionSchema& schema = op.schema();
  const auto& arguments = schema.arguments();
  const size_t first = stack->size() - arguments.size();
  Entry entry{op, {}, {}, {}, plan, {}};
  std::vector<IValue> returned;
  size_t next = 0;
  size_t next_list = 0;
  auto new_output = [&]() {
    TORCH_CHECK(next < plan->outputs.size(), "adaptive engine bug: too few output specs for ", schema.operator_name());
    const OutputSpec& spec = plan->outputs[next++];
    return spec.defined ? lazy_output(spec, plan->device, entry) : at::Tensor();
  };
  for (const auto& r : schema.returns()) {
    const auto* alias_info = r.alias_info();
    if (alias_info != nullptr && alias_info->isWrite()) {  // an in-place or out= result: the input itself
      size_t i = 0;
      while (i < arguments.size() &&
             (arguments[i].alias_info() == nullptr || arguments[i].alias_info()->beforeSets() != alias_info->beforeSets())) {
        ++i;
      }
      TORCH_CHECK(i < arguments.size(), "adaptive engine bug: no argument for ", schema.operator_name(), "'s result");
      returned.push_back((*stack)[first + i]);
    } else if (is_tensor_list(r.type())) {
      TORCH_CHECK(next_list < plan->list_lengths.size(), "adaptive engine bug: no list length for ", schema.operator_name());
      std::vector<at::Tensor> list;
      for (int64_t k = 0; k < plan->list_lengths[next_list]; ++k) {
        list.push_back(new_output());
      }
      ++next_list;
      returned.emplace_back(std::move(list));
    } else {
      returned.emplace_back(new_output());
    }
  }
  TORCH_CHECK(next == plan->outputs.size(), "adaptive engine bug: unused output specs for ", schema.operator_name());
  // Captured once the outputs are made: making them may raise torch.OutOfMemoryError (they
  // are charged at issue), and then nothing of the op may be left in the queue's books.
  entry.args.reserve(arguments.size());
  for (size_t i = 0; i < arguments.size(); ++i) {
    const auto* alias_info = arguments[i].alias_info();
    entry.args.push_back(capture((*stack)[first + i], alias_info != nullptr && alias_info->isWrite(), entry, i, -1));
  }
  stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(first), stack->end());
  for (auto& v : returned) {
    stack->push_back(std::move(v));
  }
  g_queue.entries.push_back(std::move(entry));
  update_held();
}

int64_t queue_size() { return static_cast<int64_t>(g_queue.entries.size()); }

bool ops_held() { return g_held.load(); }

int64_t queued_ops(c10::DeviceIndex device) {
  int64_t n = 0;
  for (const Entry& e : g_queue.entries) {
    n += e.plan->device == device ? 1 : 0;
  }
  return n;
}

int64_t run_queue() {
  TORCH_CHECK(!g_worker->busy.load(), "internal error: run_queue with a launch on the device stream");
  g_failed_index = -1;
  Launch launch;
  std::swap(launch, g_queue);
  update_held();
  forget_fresh();
  plan_on_chip(launch);
  int64_t failed = -1;
  try {
    return run_launch(launch, &failed);
  } catch (...) {
    g_failed_index = failed;
    throw;
  }
}

bool submit_queue() {
  TORCH_CHECK(!g_worker->busy.load(), "internal error: a launch is already on the device stream");
  g_failed_index = -1;
  if (g_queue.entries.empty()) {
    return false;
  }
  auto launch = std::make_unique<Launch>();
  std::swap(*launch, g_queue);
  update_held();
  launch->issued_ops = static_cast<int64_t>(launch->entries.size());
  forget_fresh();
  plan_on_chip(*launch);
  issue_launch(launch->entries.front().plan->device, launch->issued_ops);
  g_worker->submit(std::move(launch));
  return true;
}

bool launch_in_flight() { return g_worker->busy.load(); }

bool launch_finished() {
  std::unique_lock<std::mutex> guard(g_worker->lock);
  return g_worker->finished;
}

void wait_for_stream() {
  if (g_worker->busy.load()) {
    g_worker->wait_finished();
  }
}

namespace {
// An output of the launch in flight, without bytes yet. Outputs of ops queued behind it
// have none either, but the queue resolves those itself: waiting for them would end the
// overlap at the second op of every trace. (A freed output's address reused by a new one
// only makes the host wait for nothing.)
bool made_in_flight(const IValue& v) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    return t.defined() && t.device().type() == kNeuron && t.storage().data() == nullptr &&
           t.storage().nbytes() > 0 && g_worker->making.count(t.storage().unsafeGetStorageImpl()) > 0;
  }
  if (v.isList()) {
    for (const IValue& e : v.toListRef()) {
      if (made_in_flight(e)) {
        return true;
      }
    }
  }
  return false;
}
}  // namespace

bool reads_unmade_bytes(const torch::jit::Stack& stack, size_t first) {
  for (size_t i = first; i < stack.size(); ++i) {
    if (made_in_flight(stack[i])) {
      return true;
    }
  }
  return false;
}

int64_t finish_launch() {
  if (!g_worker->busy.load()) {
    return 0;
  }
  Outcome outcome = g_worker->collect();
  if (outcome.error) {
    g_failed_index = outcome.failed;
    std::rethrow_exception(outcome.error);
  }
  return outcome.ran;
}

int64_t failed_index() { return g_failed_index; }

void set_failure(std::string message, std::string type, bool waiting) {
  if (!message.empty()) {
    g_failure = std::move(message);
    g_failure_type = std::move(type);
  }
  g_error_waiting = waiting;
  update_held();
}

}  // namespace neuron
