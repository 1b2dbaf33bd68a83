// Device memory: what each device holds against its capacity, and the allocator behind
// `torch.empty(..., device='neuron')` and `torch.accelerator.memory_*`.
//
// Note [Device memory accounting]: the bytes of a neuron tensor live in host memory; the
// device is charged for them from allocation until the last reference to the storage dies,
// as on a real accelerator (views keep their base's bytes charged). Storages the C++
// allocator makes are charged by it; storages made elsewhere (the Python executor's host
// tensors) are charged by the Python accounting through charge/release. Either way the
// numbers live here, once, under one lock per device, since deleters run on whichever
// thread drops the last reference (autograd's worker threads included).
#include "neuron.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace neuron {
namespace {

struct DeviceMemory {
  std::mutex lock;
  int64_t capacity = 0;
  int64_t allocated = 0;
  int64_t peak = 0;
  int64_t num_allocs = 0;
  int64_t num_frees = 0;
  int64_t num_ooms = 0;
};

// Sized once, at install, before any allocation: never resized, so no lock guards the vector.
std::vector<std::unique_ptr<DeviceMemory>> g_memory;

DeviceMemory& memory_of(c10::DeviceIndex d) {
  TORCH_CHECK(d >= 0 && static_cast<size_t>(d) < g_memory.size(),
              "internal error: no memory accounting for neuron:", static_cast<int>(d),
              " (the device is not installed)");
  return *g_memory[d];
}

std::string format_bytes(int64_t n) {
  static const struct { const char* unit; int64_t size; } units[] = {
      {"GiB", int64_t{1} << 30}, {"MiB", int64_t{1} << 20}, {"KiB", int64_t{1} << 10}};
  for (const auto& u : units) {
    if (n >= u.size) {
      char buf[64];
      std::snprintf(buf, sizeof(buf), "%.2f %s", static_cast<double>(n) / u.size, u.unit);
      return buf;
    }
  }
  return std::to_string(n) + " bytes";
}

// Raises torch.OutOfMemoryError unless nbytes more fit on m (caller holds m.lock).
void check_fits(DeviceMemory& m, c10::DeviceIndex d, int64_t nbytes) {
  if (m.allocated + nbytes <= m.capacity) {
    return;
  }
  m.num_ooms++;
  const std::string name = "neuron:" + std::to_string(static_cast<int>(d));
  TORCH_CHECK_WITH(OutOfMemoryError, false,
      name, " out of memory. Tried to allocate ", format_bytes(nbytes), ". ", name,
      " has a total capacity of ", format_bytes(m.capacity), ", of which ", format_bytes(m.allocated),
      " is already allocated and ", format_bytes(m.capacity - m.allocated), " is free. Free tensors you "
      "no longer need (drop every reference to them), use a smaller batch, or raise the capacity with "
      "NEURON_DEVICE_MEMORY.");
}

void add(DeviceMemory& m, int64_t nbytes) {
  m.allocated += nbytes;
  if (m.allocated > m.peak) {
    m.peak = m.allocated;
  }
}

// -- the allocator ------------------------------------------------------------------------
// What a neuron DataPtr's deleter needs: the host block and what its device was charged.
struct Block {
  void* data;
  size_t nbytes;
  c10::DeviceIndex device;
};

void free_block(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  c10::free_cpu(block->data);
  release(block->device, block->nbytes);
  delete block;
}

struct NeuronAllocator final : public c10::DeviceAllocator {
  c10::DataPtr allocate(size_t nbytes) override {
    const c10::DeviceIndex d = current_device();
    const c10::Device device(kNeuron, d);
    if (nbytes == 0) {
      return c10::DataPtr(nullptr, device);
    }
    charge(d, nbytes);  // first: an allocation that does not fit takes no host memory
    void* data = nullptr;
    try {
      data = c10::alloc_cpu(nbytes);
    } catch (...) {
      release(d, nbytes);
      throw;
    }
    return c10::DataPtr(data, new Block{data, nbytes, d}, &free_block, device);
  }

  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }  // blocks carry a context

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  bool initialized() override { return !g_memory.empty(); }

  void emptyCache(c10::MempoolId_t /*mempool_id*/) override {}  // nothing is cached: frees are immediate

  void recordStream(const c10::DataPtr& /*ptr*/, c10::Stream /*stream*/) override {}  // one stream per device

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    using c10::CachingAllocator::StatType;
    DeviceMemory& m = memory_of(device);
    std::lock_guard<std::mutex> guard(m.lock);
    c10::CachingDeviceAllocator::DeviceStats stats;
    const auto all = static_cast<size_t>(StatType::AGGREGATE);
    // No cache and no block splitting: what is allocated is what is reserved, active, requested.
    for (auto* stat : {&stats.allocated_bytes[all], &stats.reserved_bytes[all], &stats.active_bytes[all],
                       &stats.requested_bytes[all]}) {
      stat->current = m.allocated;
      stat->peak = m.peak;
    }
    for (auto* stat : {&stats.allocation[all], &stats.segment[all], &stats.active[all]}) {
      stat->current = m.num_allocs - m.num_frees;
      stat->allocated = m.num_allocs;
      stat->freed = m.num_frees;
    }
    stats.num_ooms = m.num_ooms;
    stats.num_device_alloc = m.num_allocs;
    stats.num_device_free = m.num_frees;
    return stats;
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    DeviceMemory& m = memory_of(device);
    std::lock_guard<std::mutex> guard(m.lock);
    m.num_ooms = 0;
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    DeviceMemory& m = memory_of(device);
    std::lock_guard<std::mutex> guard(m.lock);
    m.peak = m.allocated;
  }
};

NeuronAllocator g_allocator;

}  // namespace

void charge(c10::DeviceIndex d, size_t nbytes, bool check) {
  DeviceMemory& m = memory_of(d);
  std::lock_guard<std::mutex> guard(m.lock);
  if (check) {
    check_fits(m, d, static_cast<int64_t>(nbytes));
  }
  add(m, static_cast<int64_t>(nbytes));
  m.num_allocs++;
}

void release(c10::DeviceIndex d, size_t nbytes) noexcept {
  if (d < 0 || static_cast<size_t>(d) >= g_memory.size()) {
    return;
  }
  DeviceMemory& m = *g_memory[d];
  std::lock_guard<std::mutex> guard(m.lock);
  m.allocated -= static_cast<int64_t>(nbytes);
  m.num_frees++;
}

void install_memory(const std::vector<int64_t>& capacities) {
  TORCH_CHECK(g_memory.empty(), "the neuron device memory is installed once per process");
  for (int64_t capacity : capacities) {
    TORCH_CHECK(capacity > 0, "a device capacity must be positive, got ", capacity);
    g_memory.push_back(std::make_unique<DeviceMemory>());
    g_memory.back()->capacity = capacity;
  }
  c10::SetAllocator(kNeuron, &g_allocator);
}

// Python's accounting (device/memory.py) of storages it made: the same numbers.
void check_fits(c10::DeviceIndex d, int64_t nbytes) {
  DeviceMemory& m = memory_of(d);
  std::lock_guard<std::mutex> guard(m.lock);
  check_fits(m, d, nbytes);
}

bool fits(c10::DeviceIndex d, int64_t nbytes) {
  DeviceMemory& m = memory_of(d);
  std::lock_guard<std::mutex> guard(m.lock);
  return m.allocated + nbytes <= m.capacity;
}

void resize_charge(c10::DeviceIndex d, int64_t old_nbytes, int64_t new_nbytes) {
  DeviceMemory& m = memory_of(d);
  std::lock_guard<std::mutex> guard(m.lock);
  const int64_t growth = new_nbytes - old_nbytes;
  if (growth > 0) {
    check_fits(m, d, growth);
  }
  add(m, growth);
}

void uncharge(c10::DeviceIndex d, int64_t nbytes) {
  DeviceMemory& m = memory_of(d);
  std::lock_guard<std::mutex> guard(m.lock);
  m.allocated -= nbytes;
  m.num_allocs--;
}

MemoryStats memory_stats(c10::DeviceIndex d) {
  DeviceMemory& m = memory_of(d);
  std::lock_guard<std::mutex> guard(m.lock);
  return {m.capacity, m.allocated, m.peak, m.num_allocs, m.num_frees, m.num_ooms};
}

void reset_peak(c10::DeviceIndex d) { g_allocator.resetPeakStats(d); }

}  // namespace neuron
