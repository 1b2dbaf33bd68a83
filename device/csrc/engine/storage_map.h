// A map keyed by a storage's address, flat: open addressing with linear probing in one array.
// A launch's on-chip plan (cost/on_chip.cpp) fills several of them per launch, and its shares
// (Note [One share per storage per launch], engine/queue.cpp) one, on the host thread while it
// issues; std::unordered_map allocated a node per key (a seventh of the host's allocations on
// a small MLP's step), this allocates once per doubling.
#pragma once

#include <c10/core/StorageImpl.h>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace neuron {

template <typename Value>
class StorageMap {
 public:
  // The value at key, or nullptr.
  const Value* find(const c10::StorageImpl* key) const {
    if (used_ == 0) {
      return nullptr;
    }
    const Slot& slot = slots_[probe(key)];
    return slot.first == key ? &slot.second : nullptr;
  }
  Value* find(const c10::StorageImpl* key) { return const_cast<Value*>(std::as_const(*this).find(key)); }
  bool contains(const c10::StorageImpl* key) const { return find(key) != nullptr; }

  // Inserts value at key unless key is there; the value at key, and whether it was inserted.
  std::pair<Value*, bool> try_emplace(const c10::StorageImpl* key, Value value) {
    if (2 * (used_ + 1) > slots_.size()) {  // at most half full: probes stay short
      grow();
    }
    Slot& slot = slots_[probe(key)];
    if (slot.first == key) {
      return {&slot.second, false};
    }
    slot = Slot(key, std::move(value));
    ++used_;
    return {&slot.second, true};
  }

  void clear() {
    slots_.clear();
    used_ = 0;
  }

 private:
  using Slot = std::pair<const c10::StorageImpl*, Value>;  // a null key: an empty slot

  // The slot holding key, or the empty slot where it would go (there is one: never full).
  size_t probe(const c10::StorageImpl* key) const {
    const size_t mask = slots_.size() - 1;
    // Fibonacci hashing of the address: its low bits are alignment, the high bits of the
    // product mix all of them.
    size_t i = static_cast<size_t>((reinterpret_cast<uintptr_t>(key) * 0x9E3779B97F4A7C15ull) >> 32) & mask;
    while (slots_[i].first != nullptr && slots_[i].first != key) {
      i = (i + 1) & mask;
    }
    return i;
  }

  void grow() {
    std::vector<Slot> old(slots_.empty() ? 16 : 2 * slots_.size(), Slot(nullptr, Value()));
    old.swap(slots_);
    for (Slot& slot : old) {
      if (slot.first != nullptr) {
        slots_[probe(slot.first)] = std::move(slot);
      }
    }
  }

  std::vector<Slot> slots_;  // a power of two in size
  size_t used_ = 0;
};

// A set of storages' addresses: a StorageMap with nothing at each.
class StorageSet {
 public:
  void insert(const c10::StorageImpl* key) { map_.try_emplace(key, Nothing()); }
  bool contains(const c10::StorageImpl* key) const { return map_.contains(key); }

 private:
  struct Nothing {};
  StorageMap<Nothing> map_;
};

}  // namespace neuron
