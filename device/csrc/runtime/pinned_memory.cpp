// Pinned host memory: what `torch.empty(..., pin_memory=True)`, `Tensor.pin_memory()` and
// DataLoader(pin_memory=True) ask the accelerator's hooks for.
//
// The emulated device copies from any host memory, so "pinned" is plain host memory that
// remembers it was allocated here: `is_pinned()` must say True for it (and for views into
// it), False for everything else, as on CUDA. Blocks are looked up by address range.
//
// It is also the device's host allocator (at::HostAllocator, registered for PrivateUse1):
// `torch.accelerator.empty_host_cache()` and the host-memory statistics ask
// `at::getHostAllocator(accelerator)`, which dereferenced a null allocator (a segfault)
// before one was registered. Nothing is cached (each block is freed when its tensor is), so
// emptying the cache has nothing to do, and the statistics count live blocks.
#include "neuron.h"

#include <ATen/core/CachingHostAllocator.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <cstdint>
#include <iterator>
#include <map>
#include <mutex>

namespace neuron {
namespace {

std::mutex g_lock;
std::map<uintptr_t, size_t> g_blocks;  // start address -> size, of live pinned blocks
at::HostStats g_stats;                  // under g_lock

void free_pinned(void* data) {
  {
    std::lock_guard<std::mutex> guard(g_lock);
    auto block = g_blocks.find(reinterpret_cast<uintptr_t>(data));
    if (block != g_blocks.end()) {
      for (auto* stat : {&g_stats.active_bytes, &g_stats.allocated_bytes}) {
        stat->decrease(block->second);
      }
      g_stats.active_requests.decrease(1);
      g_stats.allocations.decrease(1);
      g_stats.num_host_free += 1;
      g_blocks.erase(block);
    }
  }
  c10::free_cpu(data);
}

struct PinnedAllocator final : public at::HostAllocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* data = nbytes == 0 ? nullptr : c10::alloc_cpu(nbytes);
    if (data != nullptr) {
      std::lock_guard<std::mutex> guard(g_lock);
      g_blocks[reinterpret_cast<uintptr_t>(data)] = nbytes;
      for (auto* stat : {&g_stats.active_bytes, &g_stats.allocated_bytes}) {
        stat->increase(nbytes);
      }
      g_stats.active_requests.increase(1);
      g_stats.allocations.increase(1);
      g_stats.num_host_alloc += 1;
    }
    return c10::DataPtr(data, data, &free_pinned, c10::Device(c10::kCPU));
  }

  // A transfer between host and device runs when it is called (copy_from, aten/kernels.cpp), so
  // no stream has to finish before a pinned block is freed.
  bool record_event(void* /*ptr*/, void* /*ctx*/, c10::Stream /*stream*/) override { return true; }

  void empty_cache() override {}

  at::HostStats get_stats() override {
    std::lock_guard<std::mutex> guard(g_lock);
    return g_stats;
  }

  void reset_accumulated_stats() override {
    std::lock_guard<std::mutex> guard(g_lock);
    for (auto* stat : {&g_stats.active_requests, &g_stats.active_bytes, &g_stats.allocations,
                       &g_stats.allocated_bytes}) {
      stat->reset_accumulated();
    }
    g_stats.num_host_alloc = 0;
    g_stats.num_host_free = 0;
  }

  void reset_peak_stats() override {
    std::lock_guard<std::mutex> guard(g_lock);
    for (auto* stat : {&g_stats.active_requests, &g_stats.active_bytes, &g_stats.allocations,
                       &g_stats.allocated_bytes}) {
      stat->reset_peak();
    }
  }

  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

PinnedAllocator g_pinned;

}  // namespace

REGISTER_HOST_ALLOCATOR(at::kPrivateUse1, &g_pinned)

c10::Allocator* pinned_allocator() { return &g_pinned; }

bool is_pinned_ptr(const void* data) {
  const auto address = reinterpret_cast<uintptr_t>(data);
  std::lock_guard<std::mutex> guard(g_lock);
  auto after = g_blocks.upper_bound(address);  // the first block starting past address
  if (after == g_blocks.begin()) {
    return false;
  }
  const auto& [start, size] = *std::prev(after);
  return address < start + size;
}

}  // namespace neuron
