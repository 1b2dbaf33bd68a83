// Pinned host memory: what `torch.empty(..., pin_memory=True)`, `Tensor.pin_memory()` and
// DataLoader(pin_memory=True) ask the accelerator's hooks for.
//
// The emulated device copies from any host memory, so "pinned" is plain host memory that
// remembers it was allocated here: `is_pinned()` must say True for it (and for views into
// it), False for everything else, as on CUDA. Blocks are looked up by address range.
#include "neuron.h"

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

void free_pinned(void* data) {
  {
    std::lock_guard<std::mutex> guard(g_lock);
    g_blocks.erase(reinterpret_cast<uintptr_t>(data));
  }
  c10::free_cpu(data);
}

struct PinnedAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* data = nbytes == 0 ? nullptr : c10::alloc_cpu(nbytes);
    if (data != nullptr) {
      std::lock_guard<std::mutex> guard(g_lock);
      g_blocks[reinterpret_cast<uintptr_t>(data)] = nbytes;
    }
    return c10::DataPtr(data, data, &free_pinned, c10::Device(c10::kCPU));
  }

  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

PinnedAllocator g_pinned;

}  // namespace

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
