// Note [On-chip intermediates] (device/cost.py): what of a launch of the adaptive engine's
// queue stays on chip, planned at issue from the queue alone, and each entry's share of it,
// handed to the eager path that prices the entry's op (take_on_chip).
#include "engine/launch.h"

#include <c10/util/accumulate.h>

#include <atomic>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace neuron {
namespace {

thread_local OnChipShare t_on_chip;  // the running entry's (take_on_chip)

// The storages of empty tensors made while ops are queued, not yet used by a queued op: the
// first queued op that writes one (the copy_ of a cast: `x.float()` is empty_strided, then
// copy_) makes a value in the launch, as a new output would be (Note [On-chip intermediates]).
// Weak: their addresses stay unique until the queue launches, which forgets them. Locked: an
// empty tensor may be made on any thread (the factories are not routed to the engine).
std::mutex g_fresh_lock;
std::unordered_map<const c10::StorageImpl*, c10::weak_intrusive_ptr<c10::StorageImpl>> g_fresh;
// Whether g_fresh may hold any: every queued argument asks (take_fresh), almost always of none.
std::atomic<bool> g_any_fresh{false};

double element_bytes(c10::IntArrayRef sizes, double item_size) {
  return static_cast<double>(c10::multiply_integers(sizes)) * item_size;
}

// The bytes the eager path will count for this entry (its tensors' numel x element size) that
// stay on chip: reads of resident values, writes of unstored ones (new outputs, and the
// written arguments an in-place or out= op returns, which the eager path counts as outputs).
double on_chip_bytes_of(const Launch& launch, const Entry& entry) {
  const c10::FunctionSchema& schema = entry.op.schema();
  bool returns_written = false;
  for (const auto& r : schema.returns()) {
    returns_written = returns_written || (r.alias_info() != nullptr && r.alias_info()->isWrite());
  }
  double bytes = 0;
  auto argument = [&](const c10::StorageImpl* key, double nbytes, bool written, bool defines) {
    if (!defines && launch.resident.contains(key)) {
      bytes += nbytes;
    }
    if (written && returns_written && launch.unstored.contains(key)) {
      bytes += nbytes;
    }
  };
  for (const PendingArg& p : entry.pending) {
    const auto* alias_info = schema.arguments()[p.arg].alias_info();
    argument(p.key, element_bytes(p.sizes, static_cast<double>(p.dtype.itemsize())),
             alias_info != nullptr && alias_info->isWrite(), false);
  }
  for (const ExistingArg& e : entry.existing) {
    argument(e.key, e.nbytes, e.written, e.defines);
  }
  size_t k = 0;
  for (const OutputSpec& spec : entry.plan->outputs) {
    if (spec.defined && launch.unstored.contains(entry.outputs[k++]._unsafe_get_target())) {
      bytes += element_bytes(spec.sizes, static_cast<double>(c10::elementSize(spec.dtype)));
    }
  }
  return bytes;
}

}  // namespace

// Note [On-chip intermediates]: which values of the launch stay on chip, from the queue alone
// and the program's references at issue (so the modelled time is the same whenever the device
// stream runs it). On the host thread, before the launch runs.
void plan_on_chip(Launch& launch) {
  const size_t n = launch.entries.size();
  struct Reads {
    size_t first, last, entries;  // the first and last entry that read a value, and how many do
  };
  StorageMap<Reads> reads;
  auto read_at = [&](const c10::StorageImpl* key, size_t i) {
    auto [r, added] = reads.try_emplace(key, Reads{i, i, 1});
    if (!added && r->last != i) {
      r->last = i;
      ++r->entries;
    }
  };
  // Note [Ops TorchNeuron runs on the host]: what such an op reads goes to the host from HBM.
  StorageSet to_host;
  std::vector<bool> host_run(n);  // asked once per entry: a name lookup
  for (size_t i = 0; i < n; ++i) {
    host_run[i] = torchneuron_runs_on_host(launch.entries[i].op.operator_name());
    for (const PendingArg& p : launch.entries[i].pending) {
      read_at(p.key, i);
      if (host_run[i]) {
        to_host.insert(p.key);
      }
    }
    for (const ExistingArg& e : launch.entries[i].existing) {
      if (!e.defines) {
        read_at(e.key, i);
        if (host_run[i]) {
          to_host.insert(e.key);
        }
      }
    }
  }
  const double capacity = on_chip_bytes();
  double used = 0;
  // The bytes of the resident values last read at i, freed after entry i: sums of whole
  // bytes, exact in a double, so the same as subtracting each value in turn.
  std::vector<double> leaving(n, 0.0);
  // A value entry i makes: held by the program at issue (`leaves`), the launch writes it to HBM.
  auto made = [&](size_t i, const c10::StorageImpl* key, double nbytes, bool leaves) {
    leaves = leaves || to_host.contains(key);
    const Reads* read = reads.find(key);
    if (read == nullptr) {
      if (!leaves) {
        launch.unstored.insert(key);  // nobody reads it: never stored
      }
      return;
    }
    const Reads& r = *read;
    // Streamed: the next op alone reads it, tile by tile as it is made, off the Tensor Engine
    // (whose operands are read once per output tile), so it needs no room of its own.
    if (!leaves && r.entries == 1 && r.first == i + 1 && !runs_on_tensor_engine(launch.entries[i + 1].op.operator_name())) {
      launch.resident.insert(key);
      launch.unstored.insert(key);
      launch.streamed.insert(key);
      return;
    }
    if (used + nbytes > capacity) {
      return;  // spilled: written to HBM, and read from there
    }
    used += nbytes;
    leaving[r.last] += nbytes;
    launch.resident.insert(key);
    if (!leaves) {
      launch.unstored.insert(key);
    }
  };
  for (size_t i = 0; i < n; ++i) {
    const Entry& entry = launch.entries[i];
    // Note [Ops TorchNeuron runs on the host]: its results come from the host into HBM, and
    // are read from there.
    if (!host_run[i]) {
      size_t k = 0;
      for (const OutputSpec& spec : entry.plan->outputs) {
        if (spec.defined) {
          const c10::weak_intrusive_ptr<c10::StorageImpl>& output = entry.outputs[k++];
          made(i, output._unsafe_get_target(), static_cast<double>(spec.nbytes), !output.expired());
        }
      }
      for (const ExistingArg& e : entry.existing) {
        if (e.defines) {
          made(i, e.key, e.nbytes, !e.storage.expired());
        }
      }
    }
    used -= leaving[i];
  }
  // A copy_ (a cast) streamed from the op before it or into the op after it is that op's
  // conversion on reading or writing, as every engine instruction converts its operands:
  // no Vector pass of its own.
  for (Entry& entry : launch.entries) {
    if (entry.op.operator_name().name != "aten::copy_") {
      continue;
    }
    for (const PendingArg& p : entry.pending) {
      entry.folded_cast = entry.folded_cast || launch.streamed.contains(p.key);
    }
    for (const ExistingArg& e : entry.existing) {
      entry.folded_cast = entry.folded_cast || launch.streamed.contains(e.key);
    }
  }
}

OnChipShare on_chip_share(const Launch& launch, const Entry& entry) {
  return OnChipShare{on_chip_bytes_of(launch, entry), entry.folded_cast};
}

OnChipScope::OnChipScope(const Launch& launch, const Entry& entry) { t_on_chip = on_chip_share(launch, entry); }

OnChipScope::~OnChipScope() { t_on_chip = OnChipShare(); }

OnChipShare take_on_chip() {
  const OnChipShare share = t_on_chip;
  t_on_chip = OnChipShare();
  return share;
}

void note_fresh_storage(const c10::Storage& storage) {
  if (!route_active() || !ops_held()) {
    return;  // nothing queued (or the eager path of a queued op): not a value of a launch
  }
  const std::lock_guard<std::mutex> guard(g_fresh_lock);
  g_fresh.emplace(storage.unsafeGetStorageImpl(), c10::weak_intrusive_ptr<c10::StorageImpl>(storage.getWeakStorageImpl()));
  g_any_fresh.store(true);
}

bool take_fresh(const c10::StorageImpl* key) {
  if (!g_any_fresh.load()) {
    return false;
  }
  const std::lock_guard<std::mutex> guard(g_fresh_lock);
  const bool fresh = g_fresh.erase(key) > 0;
  g_any_fresh.store(!g_fresh.empty());
  return fresh;
}

void forget_fresh() {
  const std::lock_guard<std::mutex> guard(g_fresh_lock);
  g_fresh.clear();
  g_any_fresh.store(false);
}

}  // namespace neuron
