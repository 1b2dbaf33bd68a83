// The device's queue of issued ops that have not run yet: what the adaptive engine defers
// on neuron tensors, and the route by which ops reach the engine at all.
//
// Note [Deferred launches]: a deferred op is what it is on a real asynchronous accelerator.
//   - At issue, its arguments are captured: each neuron tensor as a new tensor on its bytes,
//     with its geometry (Note [Queued arguments count no references]), so a later
//     `p.data = ...` of the caller's tensor cannot redirect it, as a launched kernel holds raw
//     pointers; each CPU tensor it does not write as a snapshot (host data is read at issue).
//   - Each new output is a neuron tensor handed out at once, with the geometry the engine's
//     trace promises and a storage of that many bytes, its value not made yet (Note [A
//     deferred output's bytes exist at issue] in memory.cpp).
//     In-place and out= outputs are the very inputs, as in eager mode.
//   - The launch runs the queue in order, each op through the eager path (the same CPU
//     kernels, so the same bits), and writes each new result into the storage handed out
//     for it: in place when the kernel made it there, a copy otherwise. Memory is charged
//     when the output is handed out, at issue, and released when the last holder of its
//     storage lets go, as in eager mode (Note [Deferred outputs are charged at issue] in
//     memory.cpp): peak memory and out-of-memory errors are eager's. An output nobody holds
//     any more is dropped as soon as its op has run.
//   - A host read (a copy to the host, `item()`, a Python kernel's host alias, resize_,
//     set_) first runs the host sync, which launches the queue. A value whose launch failed
//     is never made: reading it raises the launch's error (check_computed).
// One queue for the process: the engine defers only the ops of one trace, on one device, and
// launches them before it defers anything else.
#include "engine/launch.h"
#include "neuron.h"

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>

#include <pthread.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <optional>
#include <exception>
#include <mutex>
#include <thread>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace neuron {
namespace {

using c10::IValue;

// The one being issued; guarded by the engine's lock (Python) and the GIL. Shared with the
// executor while it is streamed (Note [Streamed launches]).
std::shared_ptr<Launch> g_queue = std::make_shared<Launch>();

int64_t run_launch(Launch& launch, int64_t* failed);
int64_t run_streamed_launch(Launch& launch, int64_t* failed);

// Note [The device stream]: a complete trace with only C++ kernels (no random ops, no Python
// kernels: adaptive_eager/engine/executor.py decides) is posted to the device's executor (Note
// [The device executor] in runtime/executor.cpp), and the host goes on issuing the next
// trace's ops into the next queue. Up to kStreamDepth such launches are in flight; the host
// collects their outcomes (finish_launch) oldest first, and eager ops it issues meanwhile
// queue behind them on the executor. Two, not one: with one, the host that completed step
// k's trace waited for step k-1's launch to end before submitting k, and the executor sat
// idle between the two wake-ups (a chain of small adds ran at 3.1 us per op where the host
// issued them at 2.3); with two, the executor goes from one launch to the next.
//
// Note [A read of the launch in flight]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The next trace's ops read the launch in flight's outputs (a decoded token, the step's
// loss): captured as any output without bytes is, a pending read through the handoff (Note
// [Values handed between jobs]), which the producer fills under the handoff's lock whether it
// runs before or after the capture, and the executor runs launches in order. The host used to
// wait for the launch before such a capture: every step then began only once the last had run
// on the device, and a token of bench's decode cost host time plus device time (457 us per
// token, eager 294); it overlaps now. A failed producer leaves the reader without bytes, and
// the reader's launch fails at the next sync with the producer's error (raise_failure).
struct Outcome {
  int64_t ran = 0;
  int64_t failed = -1;
  std::exception_ptr error;
};

struct Worker {
  std::mutex lock;
  std::condition_variable changed;
  std::deque<Outcome> ended;  // outcomes of launches that ran and were not collected, oldest first
  std::atomic<int64_t> in_flight{0};  // submitted and not yet collected by the host

  // A whole launch, or a streamed one (Note [Streamed launches]) that runs as it is issued;
  // returns its job's ticket on the executor.
  uint64_t submit(std::shared_ptr<Launch> job) {
    in_flight.fetch_add(1);
    return post_to_device([this, job]() mutable {
      Outcome result;
      try {
        result.ran = job->feed ? run_streamed_launch(*job, &result.failed) : run_launch(*job, &result.failed);
      } catch (...) {
        result.error = std::current_exception();
      }
      job.reset();  // its inputs and kept values go now, on the executor
      std::unique_lock<std::mutex> guard(lock);
      ended.push_back(std::move(result));  // the executor runs jobs in order: so do these
      changed.notify_all();
    });
  }

  bool oldest_ended() {
    std::unique_lock<std::mutex> guard(lock);
    return !ended.empty();
  }

  bool all_ended(int64_t open) {  // but the `open` newest (Note [Streamed launches])
    std::unique_lock<std::mutex> guard(lock);
    return static_cast<int64_t>(ended.size()) >= in_flight.load() - open;
  }

  // Waits for the oldest launch to end and collects its outcome; with `unless_failed`, a
  // failed one is left (nullopt) for the host that names its error.
  std::optional<Outcome> collect_oldest(bool unless_failed = false) {
    std::unique_lock<std::mutex> guard(lock);
    changed.wait(guard, [this] { return !ended.empty(); });
    if (unless_failed && ended.front().error) {
      return std::nullopt;
    }
    Outcome outcome = std::move(ended.front());
    ended.pop_front();
    in_flight.fetch_sub(1);
    return outcome;
  }
};

// Never destroyed, as the executor (runtime/executor.cpp); a forked child starts a fresh one.
Worker* g_worker = new Worker;
// A streamed launch open at the fork (the engine seals it before: dispatch/registration.py)
// would have no executor job in the child, and entries the parent's executor ran.
const int g_fork_handler = pthread_atfork(nullptr, nullptr, [] {
  g_worker = new Worker;
  if (g_queue->feed) {
    g_queue = std::make_shared<Launch>();
  }
});
std::atomic<bool> g_held{false};  // ops are queued, or a failed launch's error waits
bool g_error_waiting = false;
// The error of the launch that left values uncomputed, and its Python type's name: set by the
// engine's host (set_failure) and by the executor (an eager op's), read by the host.
std::mutex g_failure_lock;
std::string g_failure;
std::string g_failure_type;
int64_t g_failed_index = -1;
OpRoute g_route;
std::function<void(const char*)> g_host_sync;
thread_local bool t_bypass = false;
thread_local bool t_bypass_posts = false;  // Note [Recorded ops are posted]

// Note [Values handed between jobs]: an op queued before its argument's producer has run
// captures that argument weakly (Note [Queued arguments count no references]) and counts
// itself a reader of its storage; the producer, when it runs, keeps its result's bytes here for
// as long as readers remain, in case the caller dropped the tensor meanwhile. Shared by every
// launch, fused or eager, since a reader may sit in another launch than its producer. The
// lock orders a capture's look at a storage's bytes against the producer handing them over.
struct Handoff {
  std::mutex lock;
  std::unordered_map<const c10::StorageImpl*, int64_t> readers;  // queued reads per unmade storage
  std::unordered_map<const c10::StorageImpl*, c10::Storage> produced;  // made, with readers left
};
Handoff g_handoff;

void update_held() { g_held.store(!g_queue->entries.empty() || g_error_waiting); }

at::Tensor on_storage(c10::Storage storage, c10::DispatchKeySet keys, caffe2::TypeMeta dtype, c10::IntArrayRef sizes,
                      c10::IntArrayRef strides, int64_t offset) {
  auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), keys, dtype);
  t.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, offset);
  return t;
}

// A test's window into the executor's hand-over of a value (set_handover_pause): it sleeps
// this long before it gives a deferred output its bytes or reads a pending argument's.
std::atomic<int64_t> g_handover_pause_us{0};

void pause_in_handover() {
  if (const int64_t us = g_handover_pause_us.load(std::memory_order_relaxed)) {
    std::this_thread::sleep_for(std::chrono::microseconds(us));
  }
}

// Note [Wrapped numbers are shared]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A Python number passed where an op takes a tensor (`x.add_(2)`, `pos.remainder_(32)`)
// reaches us as a 0-dim CPU tensor the dispatcher wrapped. It is read at issue, as any CPU
// argument, but neither the caller's tensor (it holds a Python object: dropping it on the
// executor took the GIL there, once per op) nor a clone of it per op (an allocation and a free
// on two threads per op: a third of the host's time on a chain of small adds, in malloc's
// locks) will do. No kernel writes an input it did not declare written, so one tensor per
// (dtype, value) serves every op that passes that number: a small table of them, refilled
// from scratch when full (a queued op keeps the one it took).
at::Tensor shared_wrapped_number(const at::Tensor& t) {
  struct Key {
    c10::ScalarType dtype;
    std::array<uint8_t, 16> bytes;  // the widest scalar: complex<double>
    bool operator==(const Key& o) const { return dtype == o.dtype && bytes == o.bytes; }
  };
  struct Hash {
    size_t operator()(const Key& k) const {
      size_t h = static_cast<size_t>(k.dtype);
      for (uint8_t b : k.bytes) {
        h = h * 131 + b;
      }
      return h;
    }
  };
  static std::mutex lock;
  static auto& table = *new std::unordered_map<Key, at::Tensor, Hash>;  // leaked: used at exit
  Key key{t.scalar_type(), {}};
  std::memcpy(key.bytes.data(), t.const_data_ptr(), t.element_size());  // a 0-dim CPU tensor
  std::lock_guard<std::mutex> guard(lock);
  auto found = table.find(key);
  if (found != table.end()) {
    return found->second;
  }
  if (table.size() >= 1024) {
    table.clear();
  }
  at::Tensor snapshot = t.clone();
  snapshot.unsafeGetTensorImpl()->set_wrapped_number(true);  // type promotion reads it as a number
  table.emplace(key, snapshot);
  return snapshot;
}

// Note [One share per storage per launch]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A captured argument whose bytes exist stands on a share of them (share_bytes: a storage and
// its block, two heap allocations), so that the queue holds no reference the caller can see
// (Note [Queued arguments count no references]). The ops of one launch read the same storages
// again and again (an optimizer step's foreach ops read each parameter, gradient and moment
// several times; a chain of in-place ops, one tensor), so a fused launch keeps the first share
// of each storage and its later captures stand on it: two allocations fewer per repeat on the
// host that issues, two frees fewer on the executor. The launch keeps them until it leaves the
// host (submitted, sealed or run: forget_shares), so the bytes of a storage the caller drops
// mid-launch live until then rather than until the last op that read them ran: host memory
// only, as a share is charged nothing. Keyed by the caller's storage, whose address stays
// unique while the launch lives (its ExistingArg holds it weakly), and checked to still be
// its bytes: a storage given new bytes in place (a resize that reallocates) gets a new share.
c10::Storage launch_share(Launch& launch, const c10::Storage& storage) {
  auto [kept, added] = launch.shares.try_emplace(storage.unsafeGetStorageImpl(), c10::Storage());
  if (added || !*kept || kept->data() != storage.data() || kept->nbytes() != storage.nbytes()) {
    *kept = share_bytes(storage);  // (none yet if an earlier share_bytes raised)
  }
  return *kept;
}

// Its shares let go on the host, as the launch leaves it (Note [One share per storage per launch]).
void forget_shares(Launch& launch) { launch.shares.clear(); }

// fused: the entry is an op of the engine's queue, whose launch's on-chip plan counts fresh
// storages (Note [On-chip intermediates]) and whose captures share (Note [One share per storage
// per launch]); an eager launch has neither.
IValue capture(const IValue& v, bool written, Launch& launch, Entry& entry, size_t arg, int64_t element, bool fused) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) {
      return v;
    }
    if (t.device().type() == kNeuron) {
      const c10::Storage& storage = t.storage();
      std::unique_lock<std::mutex> handoff(g_handoff.lock);
      if (!value_made(storage)) {  // made by an op still queued (or failed)
        c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
        ++g_handoff.readers[impl];
        entry.pending.push_back(PendingArg{arg, element, c10::weak_intrusive_ptr<c10::StorageImpl>(storage.getWeakStorageImpl()),
                                           impl, c10::DimVector(t.sizes()), c10::DimVector(t.strides()), t.storage_offset(), t.dtype(),
                                           t.key_set()});
        return at::Tensor();
      }
      handoff.unlock();
      const c10::StorageImpl* key = storage.unsafeGetStorageImpl();
      // A fresh storage's first use: a value of the launch if this op writes it, else outside it.
      const bool defines = fused && take_fresh(key) && written;
      entry.existing.push_back(ExistingArg{arg, c10::weak_intrusive_ptr<c10::StorageImpl>(storage.getWeakStorageImpl()),
                                           key, static_cast<double>(t.numel()) * static_cast<double>(t.element_size()),
                                           written, defines});
      return on_storage(fused ? launch_share(launch, storage) : share_bytes(storage), t.key_set(), t.dtype(),
                        t.sizes(), t.strides(), t.storage_offset());
    }
    if (written) {
      return v;
    }
    if (t.unsafeGetTensorImpl()->is_wrapped_number()) {  // 0-dim only (a CPU index tensor is not)
      return shared_wrapped_number(t);
    }
    return t.clone();  // Note [CPU scalar tensors]: read at issue
  }
  if (v.isList()) {
    return map_list(v, [&](const IValue& e, size_t i) {
      return capture(e, written, launch, entry, arg, static_cast<int64_t>(i), fused);
    });
  }
  return v;
}

// The bytes a pending argument's producer made in this launch, as a tensor of its geometry.
at::Tensor resolve(const PendingArg& p) {
  pause_in_handover();
  // Its bytes on a storage of our own, not the caller's storage: holding that for the op's
  // run would keep it on the device's books after the caller drops it, which a streamed launch
  // (Note [Streamed launches]) does while the host issues on: peak memory would depend on the
  // executor's timing, not be eager's. Not even for a moment: Note [The device holds no
  // caller's storage].
  c10::Storage storage = share_if_computed(p.storage);
  if (!storage || storage.data() == nullptr) {
    std::unique_lock<std::mutex> handoff(g_handoff.lock);
    auto found = g_handoff.produced.find(p.key);
    if (found != g_handoff.produced.end()) {
      storage = found->second;
    }
  }
  if (!storage || storage.data() == nullptr) {
    raise_failure();  // its producer failed in an earlier launch
  }
  return on_storage(storage, p.keys, p.dtype, p.sizes, p.strides, p.offset);
}

void bind_pending(Entry& entry, torch::jit::Stack& stack) {
  for (const PendingArg& p : entry.pending) {
    at::Tensor t = resolve(p);
    if (p.element < 0) {
      stack[p.arg] = std::move(t);
    } else {
      c10::List<IValue> list = stack[p.arg].toList();  // the entry's own list
      list.set(static_cast<size_t>(p.element), std::move(t));
    }
  }
}

// Its reads done, an entry lets go of what it read: the last reader frees a produced value.
// Once (a failed entry is released again with those dropped after it); the pending arguments
// stay listed, for the on-chip plan of a streamed launch (Note [Streamed launches]).
void release_pending(Entry& entry) {
  if (entry.released) {
    return;
  }
  entry.released = true;
  c10::Storage freed;  // the last reader's value goes outside the lock
  std::unique_lock<std::mutex> handoff(g_handoff.lock);
  for (const PendingArg& p : entry.pending) {
    auto it = g_handoff.readers.find(p.key);
    if (it != g_handoff.readers.end() && --it->second <= 0) {
      g_handoff.readers.erase(it);
      auto made = g_handoff.produced.find(p.key);
      if (made != g_handoff.produced.end()) {
        freed = std::move(made->second);
        g_handoff.produced.erase(made);
        handoff.unlock();
        freed = c10::Storage();
        handoff.lock();
      }
    }
  }
}

at::Tensor lazy_output(const OutputSpec& s, c10::DeviceIndex d, Entry& entry) {
  // Its bytes from now on, charged, its value made when its op runs (Note [A deferred output's
  // bytes exist at issue] in memory.cpp). Never fewer bytes than its view reaches: the value
  // is written in them.
  const size_t reached = at::detail::computeStorageNbytes(s.sizes, s.strides, c10::elementSize(s.dtype),
                                                          static_cast<size_t>(s.offset));
  c10::Storage storage = deferred_storage(d, std::max(static_cast<size_t>(s.nbytes), reached));
  entry.outputs.push_back(c10::weak_intrusive_ptr<c10::StorageImpl>(storage.getWeakStorageImpl()));
  auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                    c10::scalarTypeToTypeMeta(s.dtype));
  t.unsafeGetTensorImpl()->set_sizes_and_strides(s.sizes, s.strides, s.offset);
  return t;
}

// The launch made `result` for an output handed out as `spec`: its bytes in spec's layout, on
// a storage of the executor's own, uncharged (its output's storage was charged at issue).
c10::Storage output_bytes(const at::Tensor& result, const OutputSpec& spec, const c10::OperatorHandle& op) {
  TORCH_CHECK(result.defined() && result.device().type() == kNeuron && result.scalar_type() == spec.dtype &&
                  result.sizes() == c10::IntArrayRef(spec.sizes),
              "adaptive engine bug: ", op.schema().operator_name(), " produced ", result.sizes(), " ",
              result.scalar_type(), " but its trace promised ", c10::IntArrayRef(spec.sizes), " ", spec.dtype,
              ". Set NEURON_ADAPTIVE_EAGER=0 to avoid it, and please report it.");
  const bool same_geometry = result.strides() == c10::IntArrayRef(spec.strides) && result.storage_offset() == spec.offset;
  // The result's bytes are its own, and uncharged (the launch made them): they move, with their
  // size (a kernel may allocate more than the view needs; the recorded run's storage may differ).
  if (same_geometry && result.storage().use_count() == 1 && uncharged_bytes(result.storage().data_ptr())) {
    return result.storage();
  }
  // Another layout, or bytes shared with something else: new bytes, and a copy into them.
  c10::Storage bytes(c10::Storage::use_byte_size_t(), spec.nbytes,
                     launch_bytes(result.device().index(), static_cast<size_t>(spec.nbytes), is_projected(result.storage())),
                     /*allocator=*/nullptr, /*resizable=*/false);
  at::Tensor into = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(bytes), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), result.dtype());
  into.unsafeGetTensorImpl()->set_sizes_and_strides(spec.sizes, spec.strides, spec.offset);
  into.copy_(result);
  return bytes;
}

// A result kept for an output whose bytes another result of the same op sits in: its own
// copy, before those bytes are written (Note [A kernel's results are made in their outputs' bytes]).
c10::Storage copied_out(const c10::Storage& made) {
  c10::Storage bytes(c10::Storage::use_byte_size_t(), made.nbytes(), launch_bytes(made.device().index(), made.nbytes()),
                     /*allocator=*/nullptr, /*resizable=*/false);
  std::memcpy(bytes.mutable_data(), made.data(), made.nbytes());
  return bytes;
}

void run_entry(Launch& launch, Entry& entry) {
  const RouteBypass bypass;  // the eager path, not the engine again
  const c10::FunctionSchema& schema = entry.op.schema();
  torch::jit::Stack stack = std::move(entry.args);  // released when the op has run
  bind_pending(entry, stack);
  // A streamed launch's share is worked out once it is sealed (Note [Streamed launches]).
  std::optional<OnChipScope> on_chip;
  if (!launch.feed) {
    on_chip.emplace(launch, entry);
  }
  // Its outputs' bytes, offered to the kernel's allocations (Note [A kernel's results are made
  // in their outputs' bytes]), reached through our weak references alone (Note [The device
  // holds no caller's storage]).
  std::vector<ReservedBytes> reserved;
  reserved.reserve(entry.outputs.size());
  for (const auto& output : entry.outputs) {
    reserved.push_back(reserved_for_kernel(output));
  }
  {
    const DrawsFrom drawn(entry.draws_from);  // Note [Deferred random ops draw at issue]
    const TimelineOpScope tagged(&entry.timeline);
    const OutputSteering steering(&reserved);
    entry.op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), &stack);
  }
  for (ReservedBytes& r : reserved) {
    r.share = c10::DataPtr();  // not taken: from here on, only its storage and the results hold it
  }
  release_pending(entry);
  // The op's results, one per defined output, in entry.outputs' order.
  std::vector<c10::Storage> made;
  made.reserve(entry.outputs.size());
  size_t spec_index = 0;
  auto take = [&](const IValue& v) {
    const OutputSpec& spec = entry.plan->outputs[spec_index++];
    if (!spec.defined) {
      TORCH_CHECK(!v.toTensor().defined(), "adaptive engine bug: ", entry.op.schema().operator_name(),
                  " produced a result where its trace promised none. Set NEURON_ADAPTIVE_EAGER=0 to avoid it, "
                  "and please report it.");
      return;
    }
    made.push_back(output_bytes(v.toTensor(), spec, entry.op));
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
  stack.clear();  // the results live in `made` alone now
  TORCH_INTERNAL_ASSERT(made.size() == entry.outputs.size(), "neuron bug: ", schema.operator_name(), " made ",
                        made.size(), " results for ", entry.outputs.size(), " outputs");
  // A result made in another output's bytes is copied out before that output is written.
  for (size_t k = 0; k < made.size(); ++k) {
    if (made[k].data() == nullptr || made[k].data() == reserved[k].data) {
      continue;
    }
    for (size_t j = 0; j < reserved.size(); ++j) {
      if (j != k && reserved[j].data == made[k].data()) {
        made[k] = copied_out(made[k]);
        break;
      }
    }
  }
  for (size_t k = 0; k < made.size(); ++k) {
    c10::StorageImpl* target = entry.outputs[k]._unsafe_get_target();
    pause_in_handover();
    {
      // Under the lock: a capture on the host sees either the value not made and counts itself
      // a reader before this looks, or the value (Note [Values handed between jobs]).
      const std::lock_guard<std::mutex> handoff(g_handoff.lock);
      const bool read_later = g_handoff.readers.count(target) > 0;
      c10::Storage kept = fill_deferred(target, made[k], read_later);
      if (read_later) {  // queued readers keep a share of the value: its storage's bytes, or the result's if let go
        g_handoff.produced[target] = kept ? std::move(kept) : share_bytes(made[k]);
      }
    }
    made[k] = c10::Storage();  // a result nobody holds is freed here, outside the lock
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
      for (size_t j = k; j < launch.entries.size(); ++j) {
        release_pending(launch.entries[j]);  // they will not read what they waited for
      }
      throw;  // the entries after k are dropped: their outputs never get bytes
    }
  }
  return static_cast<int64_t>(launch.entries.size());
}

// Note [Streamed launches]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A launch submitted whole starts on the device only once its trace's last op is issued: with
// a host read every decoded token, a token's wall time was the host's issue of its ops and
// then the device's run of them, one after the other, where eager mode's executor runs each
// op while the host issues the next (a generate() call: adaptive 15.6 ms, eager 16.5, the
// user's thread busy 11.7 of them). So a launch the engine will put on the device stream
// (only C++ kernels, no random numbers: engine/executor.py's _may_use_stream) is posted to
// the executor at its first op (`stream_next` asks for it): the executor runs its entries as
// the host publishes them and sleeps when it has caught up, and the host seals it (submit
// queue) where it would have submitted it. Still one launch on the clock, with the same bits:
//   - Its price needs its on-chip plan, which needs the whole launch and what the program
//     holds at its end (Note [On-chip intermediates]): the eager path's prices wait as their
//     roofline's terms (FusedLaunch::deferred) and are worked out in order once it is sealed,
//     so its modelled time is the whole launch's, as before.
//   - The plan is made on the host at the seal, as for a whole launch, while no entry runs
//     (the host holds StreamFeed::running: a running entry holds its arguments' storages,
//     which would read as held by the program). From the seal's start (`sealing`) the
//     executor takes no further entry until the plan is made: the host waits for the entry
//     running then, not for the device to run every entry published.
//   - An argument made earlier in the same launch whose entry has run is captured as its
//     bytes, not as a pending read: the same storage, the same plan.
//   - It takes its room on the stream at its open: the host collects the older launches that
//     have ended, without waiting, and a launch that finds no room is submitted whole at its
//     end, as before (waiting there would keep the host a launch closer to the device).
//   - The host must seal it before it waits for the device (a launch waiting for entries
//     would wait for ever): the engine does at every sync point; a wait that comes anyway
//     seals it first (seal_for_wait, counted in forced_seals()).
//   - An executor that has caught up sleeps until kWakeBatch more entries are published, or
//     the seal: small kernels run faster than the host issues them, and waking it is a system
//     call on the host (pthread_cond_signal took 5% of a generate() call's host time woken
//     every 8 entries).
constexpr size_t kWakeBatch = 32;

int64_t run_streamed_launch(Launch& launch, int64_t* failed) {
  StreamFeed& feed = *launch.feed;
  c10::DeviceIndex device = 0;
  {
    const std::lock_guard<std::mutex> guard(feed.lock);
    device = launch.entries.front().plan->device;  // opened with its first entry
  }
  std::vector<DeferredPrice> prices;
  FusedLaunch fused(device);  // one launch for them all, on the device's clock
  const ChargeScope charged_at_issue;  // Note [Deferred outputs are charged at issue] (memory.cpp)
  fused.deferred = &prices;
  std::exception_ptr error;
  size_t k = 0;
  for (;; ++k) {
    Entry* entry = nullptr;
    std::function<void()> beside;
    {
      std::unique_lock<std::mutex> guard(feed.lock);
      // Nothing to run: every published entry taken, or the host is planning the launch (it
      // waits for `running`, which this thread would take again at once, entry after entry,
      // and the host would wait for the device to catch up: an AdamW step's host time grew
      // by half).
      const auto idle = [&] { return feed.beside.empty() && !feed.sealed && (k >= feed.published || feed.sealing); };
      if (idle()) {
        spin_for_change(guard, feed.changes, feed.changes.load(std::memory_order_relaxed));
      }
      if (idle()) {
        feed.waiting = true;
        feed.wake_at = k + kWakeBatch;
        feed.grew.wait(guard, [&] { return !idle(); });
        feed.waiting = false;
      }
      if (!feed.beside.empty()) {
        beside = std::move(feed.beside.front());
        feed.beside.pop_front();
      } else if (k >= feed.published) {
        break;  // sealed, and every entry taken
      } else {
        entry = &launch.entries[k];  // a deque's element stays where it is as it grows
      }
    }
    if (beside) {
      beside();  // never throws: run_beside_streamed_launch wraps it
      --k;  // no entry taken
      continue;
    }
    if (error) {
      release_pending(*entry);  // dropped: it will not read what it waited for
      continue;
    }
    fused.entry = static_cast<int64_t>(k);
    try {
      const std::lock_guard<std::mutex> running(feed.running);
      run_entry(launch, *entry);
    } catch (...) {
      error = std::current_exception();
      *failed = static_cast<int64_t>(k);
      release_pending(*entry);
    }
  }
  // Sealed: the plan is made, issued_ops set (both before `sealed`, under feed.lock).
  fused.issued_ops = launch.issued_ops;
  settle_deferred_prices(fused, [&](int64_t i) { return on_chip_share(launch, launch.entries[static_cast<size_t>(i)]); });
  if (error) {
    std::rethrow_exception(error);  // the entries after the failed one never ran
  }
  return static_cast<int64_t>(k);
}

std::atomic<bool> g_open_next{false};  // stream the next launch opened (Note [Streamed launches])
std::atomic<bool> g_streaming{true};  // set_streamed_launches: off, every launch is submitted whole
std::atomic<int64_t> g_forced_seals{0};
std::atomic<int64_t> g_streamed{0};  // streamed launches opened, all told

// The host's end of a streamed launch (Note [Streamed launches]): where a whole launch is
// submitted, this one is planned, counted as issued, and let finish.
void seal_queue() {
  std::shared_ptr<Launch> launch = std::move(g_queue);
  g_queue = std::make_shared<Launch>();
  update_held();
  launch->issued_ops = static_cast<int64_t>(launch->entries.size());
  forget_fresh();
  forget_shares(*launch);
  StreamFeed& feed = *launch->feed;
  {
    const std::lock_guard<std::mutex> guard(feed.lock);
    feed.sealing = true;  // the executor takes no further entry until it is sealed
  }
  if (!feed.running.try_lock()) {  // an entry runs: wait for it (it may take the GIL)
    without_python([&] { feed.running.lock(); });
  }
  {
    const std::lock_guard<std::mutex> running(feed.running, std::adopt_lock);
    plan_on_chip(*launch);
  }
  issue_launch(launch->entries.front().plan->device, launch->issued_ops);
  bool wake = false;
  {
    const std::lock_guard<std::mutex> guard(feed.lock);
    feed.sealed = true;
    feed.changes.fetch_add(1, std::memory_order_release);
    wake = feed.waiting;
  }
  if (wake) {
    feed.grew.notify_one();
  }
}

// A host about to wait for the device while a streamed launch is open would wait for ever:
// seal it first. The engine seals at every sync point; this is for a wait it did not see.
void seal_for_wait() {
  if (on_device_thread() || !g_queue->feed) {
    return;
  }
  g_forced_seals.fetch_add(1);
  seal_queue();
}

uint64_t g_open_ticket = 0;  // the executor's job that runs the streamed launch open, if one is

// A wait for the device's work waits for what is ahead of a streamed launch still open, not
// for the launch, which waits for its host: a reader of the device's state (stats(), the
// drain at exit) launches nothing held back, and the open launch's ops are still held back
// as far as it is concerned (queued_ops counts them). A job posted behind it would be waited
// for too: then it is sealed first.
uint64_t wait_limit(uint64_t last) {
  if (on_device_thread() || !g_queue->feed) {
    return last;
  }
  if (last == g_open_ticket) {
    return g_open_ticket == 0 ? UINT64_MAX : g_open_ticket - 1;
  }
  seal_for_wait();
  return last;
}

const bool g_wait_hooks = (set_device_wait_hooks(seal_for_wait, wait_limit), true);

// The queue open streamed launches count, in the worker's in-flight count.
int64_t open_launches() { return g_queue->feed ? 1 : 0; }

}  // namespace

RouteBypass::RouteBypass(bool posts) : previous(t_bypass), previous_posts(t_bypass_posts) {
  t_bypass = true;
  t_bypass_posts = posts;
}
RouteBypass::~RouteBypass() {
  t_bypass = previous;
  t_bypass_posts = previous_posts;
}

bool set_bypass(bool bypass) {
  const bool previous = t_bypass;
  t_bypass = bypass;
  t_bypass_posts = false;
  return previous;
}

void set_handover_pause(double seconds) { g_handover_pause_us.store(static_cast<int64_t>(seconds * 1e6)); }

void set_route(OpRoute route) { g_route = std::move(route); }

bool route_active() { return g_route && !t_bypass; }

bool route_bypassed() { return t_bypass; }

bool bypassed_ops_wait() { return t_bypass && !t_bypass_posts; }

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
  // sync point that cuts its traces, whether or not anything waits at this moment. Not while
  // bypassed: an op of a launch (what it reads was made before it), or one the engine runs now.
  if (!t_bypass && g_host_sync && (g_route || g_held.load(std::memory_order_relaxed))) {
    g_host_sync(reason);
  }
  // The eager ops posted to the device (Note [The device executor]); nothing on the executor.
  wait_for_device();
}

void run_before_eager() {
  // An engine launch in flight needs no wait: an eager op is posted behind it, in order.
  if (!t_bypass && !g_queue->entries.empty() && g_host_sync) {
    g_host_sync("host read");
  }
}

void check_computed(const c10::Storage& storage) {
  if (value_made(storage)) {
    return;
  }
  sync_before_host_access();  // its launch may still be queued
  if (!value_made(storage)) {
    raise_failure();
  }
}

[[noreturn]] void raise_failure() {
  // The same error as the failed launch raised (its Python type, its message).
  std::string message;
  std::string type;
  {
    std::lock_guard<std::mutex> guard(g_failure_lock);
    message = g_failure;
    type = g_failure_type;
  }
  if (message.empty()) {
    message = "this neuron tensor's value was never computed: the deferred launch that makes it failed";
  }
  if (type == "IndexError") {
    TORCH_CHECK_INDEX(false, message);
  } else if (type == "ValueError") {
    TORCH_CHECK_VALUE(false, message);
  } else if (type == "TypeError") {
    TORCH_CHECK_TYPE(false, message);
  } else if (type == "NotImplementedError") {
    TORCH_CHECK_NOT_IMPLEMENTED(false, message);
  } else if (type == "OutOfMemoryError") {
    TORCH_CHECK_WITH(OutOfMemoryError, false, message);
  }
  TORCH_CHECK(false, message);
}

namespace {

// Hands out the op's outputs as the plan says and appends the op, its arguments captured, to
// the launch (Note [Deferred launches]).
void enqueue_into(Launch& launch, const c10::OperatorHandle& op, torch::jit::Stack* stack,
                  std::shared_ptr<const DeferPlan> plan, bool fused) {
  const c10::FunctionSchema& schema = op.schema();
  const auto& arguments = schema.arguments();
  const size_t first = stack->size() - arguments.size();
  Entry entry{op, {}, {}, {}, plan, {}};
  if (timeline_recording()) {
    entry.timeline = timeline_tag();
  }
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
  // are charged at issue), and then nothing of the op may be left in the queue's books. Its
  // draws too (they move torch's default generator, which the host reads).
  if (draws_random_numbers(schema.name(), op.hasTag(at::Tag::nondeterministic_seeded), false) &&
      !has_explicit_generator(*stack, first)) {  // an explicit one is drawn from when the op runs
    entry.draws_from = draw_at_issue(op, *stack, first);
  }
  entry.args.reserve(arguments.size());
  for (size_t i = 0; i < arguments.size(); ++i) {
    const auto* alias_info = arguments[i].alias_info();
    entry.args.push_back(
        capture((*stack)[first + i], alias_info != nullptr && alias_info->isWrite(), launch, entry, i, -1, fused));
  }
  stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(first), stack->end());
  for (auto& v : returned) {
    stack->push_back(std::move(v));
  }
  if (!launch.feed) {
    launch.entries.push_back(std::move(entry));
    return;
  }
  StreamFeed& feed = *launch.feed;  // Note [Streamed launches]: the executor may be reading
  bool wake = false;
  {
    const std::lock_guard<std::mutex> guard(feed.lock);
    launch.entries.push_back(std::move(entry));
    feed.published = launch.entries.size();
    feed.changes.fetch_add(1, std::memory_order_release);
    wake = feed.waiting && feed.published >= feed.wake_at;
  }
  if (wake) {
    feed.grew.notify_one();
  }
}

// An eager op's launch: one op, one launch on the clock (its kernel prices itself, outside any
// fused launch), its outputs charged at issue.
void run_eager_launch(Launch& launch) {
  const ChargeScope charged_at_issue;  // Note [Deferred outputs are charged at issue] (memory.cpp)
  Entry& entry = launch.entries.front();
  const c10::DeviceGuard device(c10::Device(kNeuron, entry.plan->device));
  // Counted as issued when posted (post_eager): its end charges its time, as a stream launch's.
  FusedLaunch counted(entry.plan->device);
  counted.issued_ops = 1;
  try {
    run_entry(launch, entry);
  } catch (c10::Error& e) {
    release_pending(entry);
    const std::string where = describe_issue_site(launch.site);
    e.add_context("(raised by " + c10::toString(entry.op.operator_name()) + " on the device, after it was issued" +
                  (where.empty() ? std::string() : " at " + where) +
                  ": set NEURON_LAUNCH_BLOCKING=1 to raise it where it is issued)");
    // What reading a value it never made raises (raise_failure): its type and message.
    const char* type = dynamic_cast<c10::IndexError*>(&e) != nullptr ? "IndexError"
                       : dynamic_cast<c10::ValueError*>(&e) != nullptr ? "ValueError"
                       : dynamic_cast<c10::TypeError*>(&e) != nullptr ? "TypeError"
                       : dynamic_cast<c10::NotImplementedError*>(&e) != nullptr ? "NotImplementedError"
                       : dynamic_cast<c10::OutOfMemoryError*>(&e) != nullptr ? "OutOfMemoryError" : "RuntimeError";
    std::lock_guard<std::mutex> guard(g_failure_lock);
    g_failure = e.what_without_backtrace();
    g_failure_type = type;
    throw;
  } catch (...) {
    release_pending(entry);
    throw;
  }
}

}  // namespace

void enqueue(const c10::OperatorHandle& op, torch::jit::Stack* stack, std::shared_ptr<const DeferPlan> plan) {
  // Note [Streamed launches]: asked for at a match's first op, where the queue is empty; with
  // no room on the stream, the launch is submitted whole at its end instead.
  // A plain load first: this runs once per queued op, the exchange once per launch.
  const bool open = g_open_next.load(std::memory_order_relaxed) && g_open_next.exchange(false) &&
                    g_queue->entries.empty() && g_streaming.load() &&
                    g_worker->in_flight.load() < kStreamDepth;
  enqueue_into(*g_queue, op, stack, std::move(plan), /*fused=*/true);
  update_held();
  if (open) {
    g_queue->feed = std::make_shared<StreamFeed>();
    g_queue->feed->published = g_queue->entries.size();
    g_open_ticket = g_worker->submit(g_queue);
    g_streamed.fetch_add(1);
  }
}

void set_streamed_launches(bool on) { g_streaming.store(on); }

int64_t streamed_launches() { return g_streamed.load(); }

void stream_next(bool stream) { g_open_next.store(stream); }

bool run_beside_streamed_launch(const std::function<void()>& job) {
  if (on_device_thread() || !g_queue->feed) {
    return false;
  }
  StreamFeed& feed = *g_queue->feed;
  std::mutex done_lock;
  std::condition_variable done_changed;
  bool done = false;
  std::exception_ptr error;
  const at::ThreadLocalState state;  // the issuing thread's, as run_on_device carries it
  {
    const std::lock_guard<std::mutex> guard(feed.lock);
    feed.beside.emplace_back([&] {
      try {
        const at::ThreadLocalStateGuard with_state(state);
        job();
      } catch (...) {
        error = std::current_exception();
      }
      const std::lock_guard<std::mutex> finished(done_lock);
      done = true;
      done_changed.notify_all();
    });
    feed.changes.fetch_add(1, std::memory_order_release);
  }
  feed.grew.notify_one();
  without_python([&] {  // the launch's entries may free Python-owned storages
    std::unique_lock<std::mutex> waiting(done_lock);
    done_changed.wait(waiting, [&] { return done; });
  });
  if (error) {
    std::rethrow_exception(error);
  }
  return true;
}

bool queue_streamed() { return g_queue->feed != nullptr; }

int64_t forced_seals() { return g_forced_seals.load(); }

void post_eager(const c10::OperatorHandle& op, torch::jit::Stack* stack, std::shared_ptr<const DeferPlan> plan) {
  auto launch = std::make_shared<Launch>();
  launch->site = issue_site();  // Note [Where an op was issued]
  const c10::DeviceIndex device = plan->device;
  enqueue_into(*launch, op, stack, std::move(plan), /*fused=*/false);
  issue_launch(device, 1);  // stats(wait=False) counts it from now, as a stream launch
  post_to_device([launch] { run_eager_launch(*launch); });
}

int64_t queue_size() { return static_cast<int64_t>(g_queue->entries.size()); }

bool ops_held() { return g_held.load(); }

int64_t queued_ops(c10::DeviceIndex device) {
  int64_t n = 0;
  for (const Entry& e : g_queue->entries) {
    n += e.plan->device == device ? 1 : 0;
  }
  return n;
}

int64_t run_queue() {
  TORCH_CHECK(g_worker->in_flight.load() == 0, "internal error: run_queue with a launch on the device stream");
  TORCH_CHECK(!g_queue->feed, "internal error: run_queue with a streamed launch open");
  g_failed_index = -1;
  Launch launch;
  std::swap(launch, *g_queue);
  update_held();
  forget_fresh();
  forget_shares(launch);
  plan_on_chip(launch);
  int64_t failed = -1;
  int64_t ran = 0;
  try {
    // On the device, behind the eager ops posted before it (it may hold random ops or Python
    // kernels, which the executor runs as well: it takes the GIL for them, the host waits
    // without it).
    run_on_device([&] { ran = run_launch(launch, &failed); });
  } catch (...) {
    g_failed_index = failed;
    throw;
  }
  return ran;
}

bool submit_queue() {
  g_failed_index = -1;
  if (g_queue->feed) {  // on the stream since its first op: Note [Streamed launches]
    seal_queue();
    return true;
  }
  TORCH_CHECK(g_worker->in_flight.load() < kStreamDepth, "internal error: ", kStreamDepth,
              " launches are already on the device stream");
  if (g_queue->entries.empty()) {
    return false;
  }
  std::shared_ptr<Launch> launch = std::move(g_queue);
  g_queue = std::make_shared<Launch>();
  update_held();
  launch->issued_ops = static_cast<int64_t>(launch->entries.size());
  forget_fresh();
  forget_shares(*launch);
  plan_on_chip(*launch);
  issue_launch(launch->entries.front().plan->device, launch->issued_ops);
  g_worker->submit(std::move(launch));
  return true;
}

// A streamed launch still open is not in flight yet, as far as the engine is concerned: it
// waits for its host, and is counted as queued (Note [Streamed launches]).
int64_t launches_in_flight() { return g_worker->in_flight.load() - open_launches(); }

bool launch_in_flight() { return launches_in_flight() > 0; }

bool launch_finished() { return g_worker->all_ended(open_launches()); }

bool oldest_launch_ended() { return g_worker->oldest_ended(); }

bool collect_launch_if_ok() {
  return launches_in_flight() == 0 || g_worker->collect_oldest(/*unless_failed=*/true).has_value();
}

int64_t finish_launch() {
  if (launches_in_flight() == 0) {
    return 0;
  }
  Outcome outcome = *g_worker->collect_oldest();
  if (outcome.error) {
    g_failed_index = outcome.failed;
    std::rethrow_exception(outcome.error);
  }
  return outcome.ran;
}

int64_t failed_index() { return g_failed_index; }

void set_failure(std::string message, std::string type, bool waiting) {
  if (!message.empty()) {
    std::lock_guard<std::mutex> guard(g_failure_lock);
    g_failure = std::move(message);
    g_failure_type = std::move(type);
  }
  g_error_waiting = waiting;
  update_held();
}

}  // namespace neuron
