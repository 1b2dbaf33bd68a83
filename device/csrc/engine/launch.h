// The adaptive engine's queue of deferred ops, as a launch: its entries as queue.cpp issues
// them, shared with on_chip.cpp, which plans what of the launch stays on chip. Internal to
// device/csrc (neuron.h is the core's interface).
#pragma once

#include "engine/storage_map.h"
#include "neuron.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/DimVector.h>
#include <c10/util/SmallVector.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

namespace neuron {

// An argument that is a deferred output of an earlier op of the queue: its bytes do not
// exist yet. Held weakly (see Note [Queued arguments count no references]).
struct PendingArg {
  size_t arg;  // argument index
  int64_t element;  // index in a Tensor[] argument, or -1
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  const c10::StorageImpl* key;  // its address: kept unique while `storage` (a weak ref) lives
  c10::DimVector sizes, strides;  // its geometry, as the caller's tensor has it (inline to 5 dims)
  int64_t offset;
  caffe2::TypeMeta dtype;
  c10::DispatchKeySet keys;  // math bits (conj, neg) included
};

// A neuron argument whose bytes exist, as Note [On-chip intermediates] (device/cost.py) sees
// it: the caller's storage (weak: its address stays unique while the launch lives).
struct ExistingArg {
  size_t arg;
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  const c10::StorageImpl* key;
  double nbytes;  // of the argument's view
  bool written;
  bool defines;  // the first write to a fresh storage (an empty tensor made while ops are queued)
};

// Its lists hold a few items inline: an op has a handful of tensor arguments and outputs, and
// their heap blocks (and a pending argument's geometry, two more) were about a seventh of the
// host's allocations while issuing a small MLP's step, each freed on the device's executor, so
// that the host's next allocation missed glibc's per-thread cache.
struct Entry {
  c10::OperatorHandle op;
  std::vector<c10::IValue> args;  // captured at issue (undefined where a PendingArg goes); the op's stack when it runs
  c10::SmallVector<PendingArg, 2> pending;
  c10::SmallVector<ExistingArg, 4> existing;
  std::shared_ptr<const DeferPlan> plan;
  // The storages handed out for the new outputs, in plan order: weak, so an output nobody
  // holds is not kept (a later queued op that reads it holds it through its own alias).
  c10::SmallVector<c10::weak_intrusive_ptr<c10::StorageImpl>, 2> outputs;
  bool folded_cast = false;  // Note [On-chip intermediates] (plan_on_chip)
  bool released = false;  // its pending reads were let go (release_pending): once
  // A random op's copy of torch's default CPU generator at issue (Note [Deferred random ops
  // draw at issue], aten/generator_lending.cpp): what it draws from when it runs.
  std::optional<at::Generator> draws_from;
  TimelineTag timeline;  // while the device timeline records: its host op and line (Note [The device timeline])
};

// Note [Streamed launches] (queue.cpp): the host's side of a launch that runs while it is
// being issued. The executor takes entries [0, published) as the host appends them, and ends
// once the host has sealed the launch (its last entry published, its on-chip plan made).
struct StreamFeed {
  std::mutex lock;  // published, sealed, waiting, and the entries' deque itself
  std::condition_variable grew;
  size_t published = 0;
  bool sealed = false;
  bool sealing = false;  // the host plans it (seal_queue): the executor waits for `sealed`
  bool waiting = false;  // the executor sleeps on `grew` until `published` passes `wake_at`
  size_t wake_at = 0;
  // Counts changes of published, sealed and beside (made under `lock`), for the executor's
  // spin without the lock (Note [The executor spins before it sleeps]).
  std::atomic<uint64_t> changes{0};
  // Jobs that touch nothing of the launch (a transfer into bytes only its tensor holds), run
  // between its entries rather than behind it: run_beside_streamed_launch.
  std::deque<std::function<void()>> beside;
  // Held by the executor while an entry runs, and by the host while it plans the launch: the
  // plan reads which values the program holds (weak references' liveness), and a running
  // entry holds its arguments' storages for a moment (Note [Streamed launches]).
  std::mutex running;
};

// Note [Queued arguments count no references]: autograd decides from reference counts
// whether it may accumulate a gradient in place (InputBuffer: the storage's use_count() is
// 1), so a queue holding references would change the very op stream it defers (add_ in
// eager mode, add once deferred) and traces would never match. So the queue holds none a
// caller can see: an argument whose bytes exist is captured on a new storage sharing those
// bytes (share_bytes, memory.cpp: charged nothing, so a value the caller drops is released
// from the device's books then, as in eager mode; same_bytes still sees the two as one, which
// CPU kernels' overlap checks need, through the eager path's host aliases); a deferred
// output of an earlier queued op is held weakly, and its bytes, once its op has run, are
// kept for as long as queued readers remain (Note [Values handed between jobs] in queue.cpp),
// on a storage sharing them the same way.
struct Launch {
  // A deque: the host appends while the executor runs earlier entries of a streamed launch,
  // and an element's address must not move (Note [Streamed launches]).
  std::deque<Entry> entries;
  std::shared_ptr<StreamFeed> feed;  // set while the launch is streamed (Note [Streamed launches])
  int64_t issued_ops = -1;  // >= 0: counted as issued when handed to the device stream
  IssueSite site;  // a posted eager op's: where its error says it was issued
  // Note [On-chip intermediates] (device/cost.py), decided at issue by plan_on_chip: the values
  // made in the launch that later ops read from SBUF, and those never written to HBM.
  StorageSet resident;
  StorageSet unstored;
  StorageSet streamed;  // made for the next op alone
  // Note [One share per storage per launch] (queue.cpp): the host's, while it issues the launch.
  StorageMap<c10::Storage> shares;
};

// on_chip.cpp, Note [On-chip intermediates] (device/cost.py).
// Decides, at issue on the host thread, which values of the launch stay on chip.
void plan_on_chip(Launch& launch);
// The entry's share of the launch's on-chip work, for the first launch its op makes.
OnChipShare on_chip_share(const Launch& launch, const Entry& entry);
// While one lives, the entry's on-chip share goes to the first launch its op makes (take_on_chip).
class OnChipScope {
 public:
  OnChipScope(const Launch& launch, const Entry& entry);
  ~OnChipScope();
  OnChipScope(const OnChipScope&) = delete;
  OnChipScope& operator=(const OnChipScope&) = delete;
};
// Whether key is a fresh storage (note_fresh_storage) not used before; it is not any more.
bool take_fresh(const c10::StorageImpl* key);
void forget_fresh();  // the queue launched: the storages noted so far are no values of the next

}  // namespace neuron
