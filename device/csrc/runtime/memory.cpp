// Device memory: what each device holds against its capacity, and the allocator behind
// `torch.empty(..., device='neuron')` and `torch.accelerator.memory_*`.
//
// Note [Device memory accounting]: the bytes of a neuron tensor live in host memory; the
// device is charged for them from allocation until the last reference to the storage dies,
// as on a real accelerator (views keep their base's bytes charged). Every neuron storage
// comes from the C++ allocator or is adopted by it, and is charged by it. The numbers live
// here, once, under one lock per device, since deleters run on whichever thread drops the
// last reference (autograd's worker threads included).
//
// Note [Deferred outputs are charged at issue]: an op the adaptive engine defers hands out
// its outputs at issue, with storages whose bytes its launch makes later. Eager mode would
// have allocated them at that very point of the program, after the earlier ops had freed
// their temporaries and before the later ones made theirs; so that is when the device is
// charged for them (deferred_bytes: torch.OutOfMemoryError at the op eager mode raises it
// at), and what is charged is released when the last holder of the storage drops it, as in
// eager mode, whether or not its launch has run. The launch's own allocations (the results
// its kernels make, values it keeps for its later ops after their holders dropped them) are
// not charged again (ChargeScope): the memory a launch works in is the memory eager mode
// held at the same program points. The bytes themselves exist from issue too (Note [A
// deferred output's bytes exist at issue]).
#include "neuron.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace neuron {
namespace {

struct DeviceMemory {
  std::mutex lock;
  int64_t capacity = 0;
  int64_t limit = 0;  // what this process may use: capacity * set_per_process_memory_fraction
  int64_t allocated = 0;
  int64_t peak = 0;
  int64_t live = 0;  // charged allocations not yet released
  // Accumulated since install or the last reset_accumulated_memory_stats, as CUDA's allocator
  // counts them: allocations and frees, and the bytes they charged and released.
  int64_t num_allocs = 0;
  int64_t num_frees = 0;
  int64_t bytes_allocated = 0;
  int64_t bytes_freed = 0;
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
  if (m.allocated + nbytes <= m.limit) {
    return;
  }
  m.num_ooms++;
  const std::string name = "neuron:" + std::to_string(static_cast<int>(d));
  const std::string limited = m.limit == m.capacity ? "" : "; this process may use " + format_bytes(m.limit) +
      " of it (torch.neuron.set_per_process_memory_fraction)";
  TORCH_CHECK_WITH(OutOfMemoryError, false,
      name, " out of memory. Tried to allocate ", format_bytes(nbytes), ". ", name,
      " has a total capacity of ", format_bytes(m.capacity), ", of which ", format_bytes(m.allocated),
      " is already allocated and ", format_bytes(m.capacity - m.allocated), " is free", limited, ". Free tensors "
      "you no longer need (drop every reference to them), use a smaller batch, or raise the capacity with "
      "NEURON_DEVICE_MEMORY.");
}

void add(DeviceMemory& m, int64_t nbytes) {
  m.allocated += nbytes;
  if (m.allocated > m.peak) {
    m.peak = m.allocated;
  }
}

// -- the allocator ------------------------------------------------------------------------
// A neuron DataPtr's context. The bytes may be held by several storages: the user's, and a
// queued op's or a launch's share of them (share_bytes). Each holder's Block says what its
// device was charged for it, so the charge follows the user's holders, not the bytes: a value
// the user dropped is released when eager mode would release it, though a queued op still
// reads it (Note [Deferred outputs are charged at issue]). charged 0: a share, a launch's own
// allocation, or bytes whose charge moved on.
struct Bytes {
  void* data;
  // The storage whose bytes were adopted (a CPU tensor's, or one holding a DataPtr made
  // elsewhere: adopt_foreign); none when `data` is ours.
  c10::Storage host;
  std::atomic<int64_t> holders{1};
  size_t projected = 0;  // > 0: `data` is address space of this many bytes, never mapped (Note [Projected bytes])
  // false: a deferred output's bytes, which its op has not written yet (Note [A deferred output's
  // bytes exist at issue]). Set once, by the executor, after it wrote them (release, acquire).
  std::atomic<bool> made{true};
  size_t cached_size = 0;  // > 0: `data` came from cached_or_new and goes back to free_or_cache
};

// Note [Freed small bytes serve the next issue]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every posted or deferred op allocates its outputs' bytes on the issuing thread (Note [A
// deferred output's bytes exist at issue]), 64-byte aligned as c10 allocates (CPU's bits need
// it: MKL's sums depend on where operands sit), and glibc's aligned allocation takes its slow
// path (~700 instructions a call, callgrind). Small bytes freed are kept by size for the next
// allocation of that size, as CUDA's caching allocator keeps blocks: the device's one queue is
// in order, so bytes freed on the host can serve the next issue at once. Host memory only,
// charged to no device; bounded (kCacheCap), and kept only for sizes up to kCachedMax.
struct FreedBytes {
  std::mutex lock;
  std::unordered_map<size_t, std::vector<void*>> by_size;
  size_t total = 0;
};
constexpr size_t kCachedMax = 64 * 1024;
constexpr size_t kCacheCap = size_t{32} << 20;

// Never destroyed: deleters run on any thread, at exit too.
FreedBytes& freed_bytes() {
  static auto* freed = new FreedBytes();
  return *freed;
}

void* cached_or_new(size_t nbytes) {
  if (nbytes > 0 && nbytes <= kCachedMax) {
    FreedBytes& freed = freed_bytes();
    const std::lock_guard<std::mutex> guard(freed.lock);
    auto found = freed.by_size.find(nbytes);
    if (found != freed.by_size.end() && !found->second.empty()) {
      void* data = found->second.back();
      found->second.pop_back();
      freed.total -= nbytes;
      return data;
    }
  }
  return c10::alloc_cpu(nbytes);
}

void free_or_cache(void* data, size_t nbytes) {
  if (nbytes > 0 && nbytes <= kCachedMax) {
    FreedBytes& freed = freed_bytes();
    const std::lock_guard<std::mutex> guard(freed.lock);
    if (freed.total + nbytes <= kCacheCap) {
      freed.by_size[nbytes].push_back(data);
      freed.total += nbytes;
      return;
    }
  }
  c10::free_cpu(data);
}

struct Block {
  Bytes* bytes;  // none: an empty storage's (no bytes to hold)
  c10::DeviceIndex device;
  size_t charged;
};

void free_block(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  Bytes* bytes = block->bytes;
  if (bytes != nullptr && bytes->holders.fetch_sub(1) == 1) {
    if (bytes->projected > 0) {
      munmap(bytes->data, bytes->projected);
    } else if (!bytes->host && bytes->data != nullptr) {
      free_or_cache(bytes->data, bytes->cached_size);
    }
    delete bytes;  // an adopted CPU storage goes with it
  }
  if (block->charged > 0) {
    release(block->device, block->charged);
  }
  delete block;
}

c10::DataPtr data_ptr_of(Bytes* bytes, c10::DeviceIndex d, size_t charged) {
  void* data = bytes == nullptr ? nullptr : bytes->data;
  return c10::DataPtr(data, new Block{bytes, d, charged}, &free_block, c10::Device(kNeuron, d));
}

Block* block_of(const c10::DataPtr& ptr) {
  return ptr.get_deleter() == &free_block ? static_cast<Block*>(ptr.get_context()) : nullptr;
}

thread_local int t_uncharged = 0;  // > 0 inside a launch: Note [Deferred outputs are charged at issue]

// Charges nbytes for a new allocation unless this thread runs a launch; returns what it charged.
size_t charge_new(c10::DeviceIndex d, size_t nbytes) {
  if (t_uncharged > 0 || nbytes == 0) {
    return 0;
  }
  charge(d, nbytes);
  return nbytes;
}

c10::DataPtr host_bytes(c10::DeviceIndex d, size_t nbytes, size_t charged) {
  void* data = nullptr;
  try {
    data = cached_or_new(nbytes);  // Note [Freed small bytes serve the next issue]
  } catch (...) {
    if (charged > 0) {
      release(d, charged);
    }
    throw;
  }
  auto* bytes = new Bytes{data, {}};
  bytes->cached_size = nbytes;
  return data_ptr_of(bytes, d, charged);
}

// Note [Projected bytes]
// ~~~~~~~~~~~~~~~~~~~~~
// In projection mode (adaptive_eager.projection()) a neuron tensor carries no bytes: its
// storage is charged as eager mode charges it, and its address is a reservation of address
// space, PROT_NONE and MAP_NORESERVE, which takes no memory (a 16 GiB weight costs nothing)
// and is never mapped. Why an address and not null: every storage identity the eager path
// and the engine take (bytes_key, same_bytes, share_bytes, the posting plans' "new bytes of
// its own" test) is the bytes' address, which a projected storage keeps unique this way for
// as long as it lives. A read of one that a branch forgot faults
// at the reading instruction, never returns another tensor's values.
//
// Small storages keep their bytes: one of kValuedBytes or less that the allocator makes in
// projection mode (a copy's destination: `.to('neuron')`, `torch.tensor(..., device=...)`) is
// host memory as outside it, so a small tensor copied from the host keeps its values until an op
// writes it (what an op writes becomes projected: Note [Projected ops]). That is what a program's
// bookkeeping sends through the device and reads back: a step count, DDP's check that every rank
// holds the same parameters, an object collective's pickled bytes (Note [Projected collectives]).
// Ops' results are always projected (their shape function makes them), whatever their size.
std::atomic<bool> g_projection{false};
constexpr size_t kValuedBytes = 64 * 1024;

void* reserve_address_space(size_t nbytes) {
  void* p = mmap(nullptr, nbytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  TORCH_CHECK(p != MAP_FAILED, "projection mode could not reserve ", format_bytes(static_cast<int64_t>(nbytes)),
              " of address space for a tensor without bytes (mmap: ", std::strerror(errno), ")");
  return p;
}

c10::DataPtr projected_bytes(c10::DeviceIndex d, size_t nbytes, size_t charged) {
  void* data = nullptr;
  try {
    data = reserve_address_space(nbytes);
  } catch (...) {
    if (charged > 0) {
      release(d, charged);
    }
    throw;
  }
  auto* bytes = new Bytes{data, {}};
  bytes->projected = nbytes;
  return data_ptr_of(bytes, d, charged);
}

struct NeuronAllocator final : public c10::DeviceAllocator {
  c10::DataPtr allocate(size_t nbytes) override {
    const c10::DeviceIndex d = current_device();
    const c10::Device device(kNeuron, d);
    if (nbytes == 0) {
      return c10::DataPtr(nullptr, device);
    }
    // Charged first: an allocation that does not fit takes no host memory. Always charged,
    // in a launch too (a storage resized there gives its old, charged bytes back).
    charge(d, nbytes);
    return g_projection.load(std::memory_order_relaxed) && nbytes > kValuedBytes ? projected_bytes(d, nbytes, nbytes)
                                                                                 : host_bytes(d, nbytes, nbytes);
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
      stat->allocated = m.bytes_allocated;
      stat->freed = m.bytes_freed;
    }
    for (auto* stat : {&stats.allocation[all], &stats.segment[all], &stats.active[all]}) {
      stat->current = m.live;
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
    m.num_allocs = m.num_frees = m.bytes_allocated = m.bytes_freed = m.num_ooms = 0;
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
  m.live++;
  m.num_allocs++;
  m.bytes_allocated += static_cast<int64_t>(nbytes);
}

void release(c10::DeviceIndex d, size_t nbytes) noexcept {
  if (d < 0 || static_cast<size_t>(d) >= g_memory.size()) {
    return;
  }
  DeviceMemory& m = *g_memory[d];
  std::lock_guard<std::mutex> guard(m.lock);
  m.allocated -= static_cast<int64_t>(nbytes);
  m.live--;
  m.num_frees++;
  m.bytes_freed += static_cast<int64_t>(nbytes);
}

void install_memory(const std::vector<int64_t>& capacities) {
  TORCH_CHECK(g_memory.empty(), "the neuron device memory is installed once per process");
  for (int64_t capacity : capacities) {
    TORCH_CHECK(capacity > 0, "a device capacity must be positive, got ", capacity);
    g_memory.push_back(std::make_unique<DeviceMemory>());
    g_memory.back()->capacity = capacity;
    g_memory.back()->limit = capacity;
  }
  c10::SetAllocator(kNeuron, &g_allocator);
  install_output_steering();  // Note [A kernel's results are made in their outputs' bytes]
}

// Raises unless nbytes more fit, counting nothing (the eager path, before it adopts host bytes).
void check_fits(c10::DeviceIndex d, int64_t nbytes) {
  DeviceMemory& m = memory_of(d);
  std::lock_guard<std::mutex> guard(m.lock);
  check_fits(m, d, nbytes);
}

bool fits(c10::DeviceIndex d, int64_t nbytes) {
  DeviceMemory& m = memory_of(d);
  std::lock_guard<std::mutex> guard(m.lock);
  return m.allocated + nbytes <= m.limit;
}

MemoryStats memory_stats(c10::DeviceIndex d) {
  DeviceMemory& m = memory_of(d);
  std::lock_guard<std::mutex> guard(m.lock);
  return {m.capacity, m.limit, m.allocated, m.peak, m.live, m.num_allocs, m.num_frees, m.bytes_allocated,
          m.bytes_freed, m.num_ooms};
}

void set_memory_fraction(c10::DeviceIndex d, double fraction) {
  TORCH_CHECK_VALUE(fraction >= 0 && fraction <= 1, "Invalid fraction value: ", fraction,
                    ". Allowed range: 0~1 (a share of neuron:", static_cast<int>(d), "'s capacity)");
  DeviceMemory& m = memory_of(d);
  std::lock_guard<std::mutex> guard(m.lock);
  m.limit = static_cast<int64_t>(fraction * static_cast<double>(m.capacity));
}

void reset_peak(c10::DeviceIndex d) { g_allocator.resetPeakStats(d); }

// -- Note [Deferred outputs are charged at issue] ------------------------------------------
ChargeScope::ChargeScope() { ++t_uncharged; }
ChargeScope::~ChargeScope() { --t_uncharged; }
bool charges_new_results() { return t_uncharged == 0; }

// Note [A deferred output's bytes exist at issue]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// An op posted to the device (eager mode) or deferred by the engine hands out its outputs at
// issue, and their bytes are allocated then, as CUDA's caching allocator gives a kernel's
// output its address before the kernel runs: the storage's address is its own from the start
// and never changes (`data_ptr()`, `untyped_storage().data_ptr()`, torch.save's and
// safetensors' storage keys, tied weights found by address), and what the device is charged
// for is memory that exists. Until the op has written them the bytes are not its value:
// `made` says so, and every reader of a value (a host read, a queued op's argument, a copy)
// tests it where it tested for null bytes before (value_made); a value whose op failed stays
// unmade, and reading it raises the op's error. The executor writes the value in place: the
// kernel's result is allocated in these very bytes when it can be (Note [A kernel's results
// are made in their outputs' bytes], output_steering.cpp), else copied into them
// (fill_deferred). Nothing but the value's storage and the executor's writing holds them
// before it is made, so a host far ahead of the device holds what eager mode would hold at
// the same point of the program, plus the bytes of queued ops' outputs it already dropped
// (freed when their op has run), as a CUDA host's queued kernels hold their outputs' blocks.
c10::DataPtr deferred_bytes(c10::DeviceIndex d, size_t nbytes) {
  if (nbytes == 0) {
    return c10::DataPtr(nullptr, c10::Device(kNeuron, d));  // nothing to make, nothing charged
  }
  charge(d, nbytes);  // raises torch.OutOfMemoryError where eager mode's allocation would
  // Projected (Note [Projected bytes]): an op's result in projection mode has no values.
  c10::DataPtr bytes = g_projection.load(std::memory_order_relaxed) ? projected_bytes(d, nbytes, nbytes)
                                                                    : host_bytes(d, nbytes, nbytes);
  block_of(bytes)->bytes->made.store(false, std::memory_order_relaxed);  // published with the storage
  return bytes;
}

bool value_made(const c10::Storage& storage) {
  const c10::DataPtr& data = storage.data_ptr();
  if (const Block* block = block_of(data); block != nullptr && block->bytes != nullptr) {
    return block->bytes->made.load(std::memory_order_acquire);
  }
  // Bytes from elsewhere, an empty storage, or a deferred output its holders let go.
  return data.get() != nullptr || storage.nbytes() == 0;
}

// Note [The device holds no caller's storage]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Autograd sums a gradient's contributions in place (`add_`) only while it holds the last
// reference to the first one and to its storage (InputBuffer's accumulate: use_count() == 1
// and storage().use_count() == 1), else out of place (`add`). So any reference the device
// takes to a caller's storage, however briefly, changes the ops autograd issues: the adaptive
// engine's trace, recorded with one, diverged at the other ("expected aten.add_.Tensor, got
// aten.add.Tensor at (autograd engine)"), and a steady step ran dozens of launches where it
// ran one ([213, 83, 74, 1, 1, 20, 1, 1] on a 24-layer stack, the machine loaded: a preempted
// executor widens the moment). The executor took one as it gave a deferred output its bytes,
// and as it read a pending argument's bytes: its weak reference made strong (lock()).
// A deferred output's storage is a DeferredStorage instead, whose release takes a lock of its
// own: the executor reaches it through its weak reference alone (which keeps the object,
// not its bytes) and, under that lock, finds it held (its bytes go in, or are shared out) or
// released (the bytes are dropped), never half of either. The caller's use counts are theirs.
namespace {
struct DeferredStorage final : c10::StorageImpl {
  using c10::StorageImpl::StorageImpl;

  void release_resources() override {
    c10::DataPtr bytes;  // freed outside the lock: it may release the device's charge
    {
      const std::lock_guard<std::mutex> guard(lock);
      released = true;
      bytes = set_data_ptr_no_materialize(c10::DataPtr(nullptr, device()));
    }
  }

  std::mutex lock;
  bool released = false;  // its last holder let go: its bytes, if any, are freed
};

// lazy_output (the eager path) makes every storage the executor fills or reads pending, and
// makes it with deferred_storage: a static cast, checked in debug builds (a dynamic_cast per
// output on the executor costs what its checks are worth once).
DeferredStorage* as_deferred(c10::StorageImpl* storage) {
  TORCH_INTERNAL_ASSERT_DEBUG_ONLY(dynamic_cast<DeferredStorage*>(storage) != nullptr,
                                   "neuron bug: a deferred output's storage is not a DeferredStorage");
  return static_cast<DeferredStorage*>(storage);
}

// A new storage on a Block's bytes, one holder more, charged nothing (Note [Deferred outputs
// are charged at issue]): the caller's charge stays with the caller's holders.
c10::Storage share_block(const Block& block, size_t nbytes) {
  block.bytes->holders.fetch_add(1);
  return c10::Storage(c10::Storage::use_byte_size_t(), nbytes, data_ptr_of(block.bytes, block.device, 0),
                      /*allocator=*/nullptr, /*resizable=*/false);
}

}  // namespace

namespace {
std::atomic<int64_t> g_rehomed{0};
}  // namespace

int64_t rehomed_outputs() { return g_rehomed.load(); }

c10::Storage deferred_storage(c10::DeviceIndex d, size_t nbytes) {
  // Resizable through the neuron allocator, as any neuron storage is.
  auto storage = c10::make_intrusive<DeferredStorage>(c10::StorageImpl::use_byte_size_t(), static_cast<int64_t>(nbytes),
                                                      deferred_bytes(d, nbytes), c10::GetAllocator(kNeuron),
                                                      /*resizable=*/true);
  return c10::Storage(std::move(storage));
}

ReservedBytes reserved_for_kernel(const c10::weak_intrusive_ptr<c10::StorageImpl>& storage) {
  DeferredStorage* deferred = as_deferred(storage._unsafe_get_target());
  const std::lock_guard<std::mutex> guard(deferred->lock);
  const Block* block = block_of(deferred->data_ptr());
  if (deferred->released || block == nullptr || block->bytes == nullptr || block->bytes->projected > 0 ||
      block->bytes->made.load(std::memory_order_relaxed)) {
    return {};  // let go, empty, projected (a shape function's result has no bytes to land in), or made
  }
  Bytes* bytes = block->bytes;
  bytes->holders.fetch_add(1);
  // A CPU allocation's DataPtr, as the kernel's allocator would have made it; charged nothing.
  return {c10::DataPtr(bytes->data, new Block{bytes, block->device, 0}, &free_block, c10::Device(c10::kCPU)),
          deferred->nbytes(), bytes->data};
}

c10::Storage fill_deferred(c10::StorageImpl* storage, const c10::Storage& made, bool share) {
  DeferredStorage* deferred = as_deferred(storage);
  const std::lock_guard<std::mutex> guard(deferred->lock);
  if (deferred->released) {
    return c10::Storage();
  }
  Block* block = block_of(deferred->data_ptr());
  if (block == nullptr || block->bytes == nullptr) {  // an empty output: nothing to write
    return share ? share_bytes(made) : c10::Storage();
  }
  Bytes* bytes = block->bytes;
  // Its bytes are held by its storage, and by the result if the kernel made it there. Anyone
  // else kept what the kernel's allocator handed out (Note [A kernel's results are made in
  // their outputs' bytes]) and may write it later: the value moves to bytes of its own.
  const bool in_place = made.data() == bytes->data;
  if (bytes->holders.load() > (in_place ? 2 : 1)) {
    const size_t charged = block->charged;
    block->charged = 0;  // the charge moves with the value (host_bytes releases it if it cannot allocate)
    c10::DataPtr fresh = host_bytes(block->device, deferred->nbytes(), charged);
    block_of(fresh)->bytes->made.store(false, std::memory_order_relaxed);  // before a reader can see it
    deferred->set_data_ptr_noswap(std::move(fresh));  // the old Block: one holder fewer, nothing released
    block = block_of(deferred->data_ptr());
    bytes = block->bytes;
    g_rehomed.fetch_add(1, std::memory_order_relaxed);
  }
  if (made.data() != bytes->data && bytes->projected == 0 && !is_projected(made)) {
    std::memcpy(bytes->data, made.data(), std::min(made.nbytes(), deferred->nbytes()));
  }
  bytes->made.store(true, std::memory_order_release);
  return share ? share_block(*block, deferred->nbytes()) : c10::Storage();
}

c10::Storage share_if_computed(const c10::weak_intrusive_ptr<c10::StorageImpl>& storage) {
  DeferredStorage* deferred = as_deferred(storage._unsafe_get_target());
  const std::lock_guard<std::mutex> guard(deferred->lock);
  const Block* block = block_of(deferred->data_ptr());
  if (deferred->released || block == nullptr || block->bytes == nullptr ||
      !block->bytes->made.load(std::memory_order_acquire)) {
    return c10::Storage();  // let go, empty, or not made yet (or its op failed)
  }
  return share_block(*block, deferred->nbytes());
}

c10::DataPtr adopt_bytes(const c10::Storage& cpu, c10::DeviceIndex d, bool new_result) {
  const size_t nbytes = cpu.nbytes();
  // Raises torch.OutOfMemoryError: the CPU bytes die with the exception.
  size_t charged = nbytes;
  if (new_result) {
    charged = charge_new(d, nbytes);
  } else {
    charge(d, nbytes);
  }
  return data_ptr_of(new Bytes{const_cast<void*>(cpu.data()), cpu}, d, charged);
}

c10::DataPtr launch_bytes(c10::DeviceIndex d, size_t nbytes, bool projected) {
  const size_t charged = charge_new(d, nbytes);
  return projected ? projected_bytes(d, nbytes, charged) : host_bytes(d, nbytes, charged);
}

bool uncharged_bytes(const c10::DataPtr& ptr) {
  const Block* block = block_of(ptr);
  return block != nullptr && block->bytes != nullptr && block->charged == 0 && block->bytes->holders.load() == 1;
}

// Note [Shares count their holders in one step]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A share's last two holders are often let go at once on two threads: the host drops its
// tensor as the executor drops the share the op it queued read. So the count that frees the
// bytes must be decremented and tested in one atomic step (free_block: fetch_sub(1) == 1).
// c10's shared DataPtr (newStorageImplFromRefcountedDataPtr) is not: refcounted_deleter
// decrements, then reads the count again, and two threads letting go together can both read
// 0 and both delete its context (a 24-byte object). Its storages were shared that way when
// their bytes were not a Block of ours: every empty tensor (the allocator's DataPtr for 0 bytes
// has no context), which HF models make by the dozen. Now and then a heap corrupted on
// autograd's worker thread ("malloc(): unaligned tcache chunk detected" in InputBuffer, a
// segfault in a T5 backward; under ASan, "attempting double-free" of that context, freed on
// the executor). So an empty storage's share is an empty storage (there is nothing to hold),
// and bytes from elsewhere (a DataPtr torch or a library made: from_blob, a storage built on
// a data pointer) are adopted first: the storage's DataPtr is swapped, once, for a Block of
// ours that owns the original, as c10's sharing swaps in its own.
namespace {
std::mutex g_adopt;

const Block& adopt_foreign(const c10::Storage& storage) {
  const std::lock_guard<std::mutex> guard(g_adopt);
  c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  if (const Block* block = block_of(impl->data_ptr()); block != nullptr && block->bytes != nullptr) {
    return *block;  // adopted by another thread meanwhile
  }
  void* data = const_cast<void*>(impl->data());
  const c10::Device device = impl->device();
  const size_t nbytes = impl->nbytes();
  c10::DataPtr original = impl->set_data_ptr(c10::DataPtr(data, device));
  // The original lives in a storage of its own, freed with the last holder (its deleter runs
  // then, on whichever thread that is, once). Charged nothing: what made it charged it, if anything.
  c10::Storage owner(c10::Storage::use_byte_size_t(), nbytes, std::move(original), /*allocator=*/nullptr,
                     /*resizable=*/false);
  impl->set_data_ptr_noswap(data_ptr_of(new Bytes{data, std::move(owner)}, device.index(), 0));
  return *block_of(impl->data_ptr());
}
}  // namespace

c10::Storage share_bytes(const c10::Storage& storage) {
  if (storage.data() == nullptr) {  // no bytes (an empty storage, or a value not made yet)
    return c10::Storage(c10::Storage::use_byte_size_t(), storage.nbytes(), c10::DataPtr(nullptr, storage.device()),
                        /*allocator=*/nullptr, /*resizable=*/false);
  }
  const Block* block = block_of(storage.data_ptr());
  if (block == nullptr || block->bytes == nullptr) {  // bytes from elsewhere: Note [Shares count their holders in one step]
    block = &adopt_foreign(storage);
  }
  return share_block(*block, storage.nbytes());
}

int64_t bytes_holders(const c10::Storage& storage) {
  const c10::DataPtr& data = storage.data_ptr();
  if (const Block* block = block_of(data); block != nullptr && block->bytes != nullptr) {
    return block->bytes->holders.load();
  }
  return data.get() == nullptr && data.get_context() == nullptr ? 0 : -1;
}

bool bytes_shared(const c10::Storage& storage) {
  if (storage.use_count() > 1) {
    return true;
  }
  const Block* block = block_of(storage.data_ptr());
  return block != nullptr && block->bytes != nullptr && block->bytes->holders.load() > 1;
}

const void* bytes_key(const c10::Storage& s) {
  return s.data() != nullptr ? s.data() : static_cast<const void*>(s.unsafeGetStorageImpl());
}

bool same_bytes(const c10::Storage& a, const c10::Storage& b) { return bytes_key(a) == bytes_key(b); }

// -- Note [Projected bytes] -----------------------------------------------------------------
void set_projection(bool on) { g_projection.store(on); }
bool projection_enabled() { return g_projection.load(std::memory_order_relaxed); }

bool is_projected(const c10::Storage& storage) {
  const Block* block = block_of(storage.data_ptr());
  return block != nullptr && block->bytes != nullptr && block->bytes->projected > 0;
}

c10::DataPtr adopt_projected(size_t nbytes, c10::DeviceIndex d, bool new_result) {
  if (nbytes == 0) {
    return c10::DataPtr(nullptr, c10::Device(kNeuron, d));
  }
  size_t charged = nbytes;
  if (new_result) {
    charged = charge_new(d, nbytes);
  } else {
    charge(d, nbytes);
  }
  return projected_bytes(d, nbytes, charged);
}

void project_in_place(const c10::Storage& storage, size_t nbytes, bool grown) {
  c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  Block* old = block_of(impl->data_ptr());
  const c10::DeviceIndex d = old != nullptr ? old->device : impl->device().index();
  size_t charged = 0;
  if (grown) {
    // New bytes, as the allocator charges a resize's: the old ones go after the new arrived
    // (the peak counts both, as eager's copy into the new bytes holds both).
    charge(d, nbytes);
    charged = nbytes;
  } else if (old != nullptr) {
    // Values no longer known, the same bytes: the charge stays the storage's, moved over.
    charged = old->charged;
    old->charged = 0;
  }
  c10::DataPtr bytes = nbytes == 0 ? c10::DataPtr(nullptr, c10::Device(kNeuron, d)) : projected_bytes(d, nbytes, charged);
  impl->set_data_ptr_noswap(std::move(bytes));  // the old bytes are freed (and released, if charged)
  impl->set_nbytes(nbytes);
}

}  // namespace neuron
