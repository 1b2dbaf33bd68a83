// Note [A kernel's results are made in their outputs' bytes]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A posted or deferred op's outputs have their bytes from issue (Note [A deferred output's
// bytes exist at issue], memory.cpp), and its kernel, CPU's, allocates its results where
// c10's CPU allocator puts them. So while the executor runs the op, the CPU allocator (this
// wrapper of the one it found) offers each output's bytes to an allocation of their size:
// the k-th allocation of n bytes during the kernel gets the k-th output of n bytes, which is
// where the kernel's results are, in output order, for ~95-100% of the results of real
// training loops (measured over bench's workloads, a CNN with batch norm, attention, a
// TransformerEncoderLayer, an autocast MLP: the misses are kernels that allocate a buffer of
// the output's size before it, oneDNN's convolutions and batch norm's backward). A result
// made there is the value in place; any other is copied in (fill_deferred), and one that a
// temporary took the bytes of is correct either way: the temporary is gone when the kernel
// returns, and the output's bytes are written after it. What the offered bytes' DataPtr
// holds is a share of them (a holder more), so whatever keeps an allocation keeps its bytes
// alive; an output whose bytes something kept past its kernel moves to bytes of its own.
// Allocations through raw_allocate (oneDNN's) are offered too, and given back through
// raw_deleter, which frees the rest as the wrapped allocator does.
// Only the executor's thread steers, inside one op at a time: the OpenMP workers a kernel
// starts, the host's threads and every other allocation go to the wrapped allocator as before.
#include "neuron.h"

#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace neuron {
namespace {

thread_local std::vector<ReservedBytes>* t_reserved = nullptr;
std::atomic<int64_t> g_steered{0};

// Offered bytes handed out, by address: each holds its share until the allocation is freed.
// An offered allocation's context is its address, as the wrapped allocator's are, because
// c10's raw_allocate (oneDNN's scratchpads and buffers: convolution_backward) asserts it and
// frees the address with raw_deleter(), which must then tell an offered one from the rest.
std::mutex g_lent_lock;
std::unordered_map<void*, c10::DataPtr> g_lent;
std::atomic<int64_t> g_lent_count{0};
c10::DeleterFnPtr g_wrapped_raw_deleter = nullptr;

bool give_back(void* data) {
  if (g_lent_count.load(std::memory_order_acquire) == 0) {
    return false;
  }
  c10::DataPtr share;  // freed outside the lock: its last holder frees the bytes
  {
    const std::lock_guard<std::mutex> guard(g_lent_lock);
    auto found = g_lent.find(data);
    if (found == g_lent.end()) {
      return false;
    }
    share = std::move(found->second);
    g_lent.erase(found);
    g_lent_count.fetch_sub(1, std::memory_order_release);
  }
  return true;
}

void free_lent(void* data) { give_back(data); }

void raw_delete(void* data) {
  if (!give_back(data) && g_wrapped_raw_deleter != nullptr) {
    g_wrapped_raw_deleter(data);
  }
}

struct SteeringAllocator final : c10::Allocator {
  c10::Allocator* wrapped = nullptr;

  c10::DataPtr allocate(size_t nbytes) override {
    if (std::vector<ReservedBytes>* reserved = t_reserved; reserved != nullptr && nbytes > 0) {
      for (ReservedBytes& r : *reserved) {
        if (!r.offered && r.nbytes == nbytes) {
          r.offered = true;  // the k-th allocation of its size, whether or not its bytes are still wanted
          if (r.share) {
            void* data = r.share.get();
            {
              const std::lock_guard<std::mutex> guard(g_lent_lock);
              g_lent.emplace(data, std::move(r.share));
              g_lent_count.fetch_add(1, std::memory_order_release);
            }
            g_steered.fetch_add(1, std::memory_order_relaxed);
            return c10::DataPtr(data, data, &free_lent, c10::Device(c10::kCPU));
          }
          break;
        }
      }
    }
    return wrapped->allocate(nbytes);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &raw_delete; }

  void copy_data(void* dest, const void* src, std::size_t count) const override { wrapped->copy_data(dest, src, count); }
};

SteeringAllocator g_steering;

}  // namespace

OutputSteering::OutputSteering(std::vector<ReservedBytes>* reserved) : previous_(t_reserved) { t_reserved = reserved; }

OutputSteering::~OutputSteering() { t_reserved = previous_; }

void install_output_steering() {
  if (g_steering.wrapped != nullptr) {
    return;
  }
  g_steering.wrapped = c10::GetCPUAllocator();
  g_wrapped_raw_deleter = g_steering.wrapped->raw_deleter();
  // Priority 0, the default allocator's: one a library sets later replaces this one, and its
  // kernels' results are then copied into their outputs, as any result allocated elsewhere.
  c10::SetCPUAllocator(&g_steering, /*priority=*/0);
}

int64_t steered_allocations() { return g_steered.load(); }

}  // namespace neuron
