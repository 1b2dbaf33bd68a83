// The neuron device as C++ autograd and the dispatcher see it: device guard and PrivateUse1 hooks.
//
// Note [C++ device guard]: these functions run inside C++ autograd (on its worker threads,
// and in noexcept destructors such as ~InlineStreamGuard while an exception unwinds) and at
// every device switch. The Python guard torch offers a Python backend calls into Python
// there, so a pending exception (a failing backward hook) or a KeyboardInterrupt arriving
// in that call ended in std::terminate. Nothing here touches Python, nothing here throws
// where the interface says noexcept, and the device count is the one the runtime chose, so
// autograd sizes its per-device queues right (backward on neuron:1 asserted before).
//
// The current device is per thread, as on CUDA, and so is the current stream of each device.
#include "neuron.h"

#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/Resize.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <atomic>

namespace neuron {
namespace {

using c10::Device;
using c10::DeviceIndex;
using c10::DeviceType;
using c10::Stream;

std::atomic<DeviceIndex> g_device_count{0};
std::atomic<bool> g_set_device_called{false};
thread_local DeviceIndex t_current_device = 0;

std::string g_refusal;  // why there is no device (install_refusing_guard), until install_guard

// Note [An invalid device is an AcceleratorError]: a device index out of range raises what
// CUDA raises for torch's own APIs (a factory on cuda:9, torch.cuda.set_device(9),
// torch.accelerator.set_device_index(9)): torch.AcceleratorError, a RuntimeError, with the
// driver's error code (cudaErrorInvalidDevice, 101, kept so that code reading error_code as on
// CUDA reads the same). Not IndexError, which `except RuntimeError` misses; not TorchNeuron's
// ValueError, since code written for torch catches what torch.cuda raises. The runtime's
// Python check raises the same type (NeuronDeviceIndexError, device/errors.py).
constexpr int32_t kInvalidDevice = 101;

DeviceIndex checked(DeviceIndex index) {
  const DeviceIndex count = g_device_count.load();
  TORCH_CHECK(count > 0 || g_refusal.empty(), g_refusal);
  if (index < 0 || index >= count) {
    throw c10::AcceleratorError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, kInvalidDevice,
                                c10::str("Invalid device: neuron:", static_cast<int>(index),
                                         ". The device index is out of range; it must be in [0, ",
                                         static_cast<int>(count),
                                         ") (set NEURON_NUM_DEVICES or NEURON_LOGICAL_NC_CONFIG for more devices)."));
  }
  return index;
}

DeviceIndex exchange(DeviceIndex index) {
  const DeviceIndex previous = t_current_device;
  if (index >= 0) {  // -1: "the current device", left as it is
    t_current_device = checked(index);
  }
  return previous;
}

Stream default_stream(DeviceIndex index) {
  return Stream(Stream::DEFAULT, Device(kNeuron, index < 0 ? t_current_device : index));
}

struct NeuronGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return kNeuron; }

  Device exchangeDevice(Device d) const override {
    TORCH_CHECK(d.type() == kNeuron, "expected a neuron device, got ", d);
    return Device(kNeuron, exchange(d.index()));
  }

  Device getDevice() const override { return Device(kNeuron, t_current_device); }

  void setDevice(Device d) const override {
    TORCH_CHECK(d.type() == kNeuron, "expected a neuron device, got ", d);
    exchange(d.index());
    // C++ autograd's device threads call this first thing (Engine::set_device): Note
    // [Autograd's device threads at exit] in dispatch/registration.py.
    g_set_device_called.store(true, std::memory_order_relaxed);
  }

  void uncheckedSetDevice(Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < g_device_count.load()) {
      t_current_device = d.index();
    }
  }

  // Streams and events: streams.cpp (Note [One queue per device]).
  Stream getStream(Device d) const override { return current_stream(d.index()); }
  Stream getDefaultStream(Device d) const override { return default_stream(d.index()); }
  Stream getStreamFromGlobalPool(Device d, bool /*isHighPriority*/) const override { return new_stream(d.index()); }
  Stream getNewStream(Device d, int /*priority*/) const override { return new_stream(d.index()); }
  Stream exchangeStream(Stream s) const override { return exchange_stream(s); }

  void record(void** event, const Stream& stream, const DeviceIndex /*device_index*/,
              const c10::EventFlag flag) const override {
    record_event(event, stream, flag);
  }
  // One in-order queue: a stream waiting for an event waits for nothing.
  void block(void* /*event*/, const Stream& /*stream*/) const override {}
  // Note [One queue per device] (streams.cpp): done once the executor has run all it was given.
  bool queryEvent(void* /*event*/) const override { return device_idle(); }
  void synchronizeEvent(void* event) const override { synchronize_event(event); }
  double elapsedTime(void* start, void* end, const DeviceIndex /*device_index*/) const override {
    return elapsed_ms(start, end);
  }
  bool queryStream(const Stream& /*stream*/) const override { return device_idle(); }
  void synchronizeStream(const Stream& stream) const override { synchronize(stream.device_index()); }
  void synchronizeDevice(const DeviceIndex device_index) const override { synchronize(device_index); }

  DeviceIndex deviceCount() const noexcept override { return g_device_count.load(); }

  void destroyEvent(void* event, const DeviceIndex /*device_index*/) const noexcept override { destroy_event(event); }
};

struct NeuronHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return g_device_count.load() > 0; }
  bool hasPrimaryContext(DeviceIndex /*device_index*/) const override { return true; }
  void init() const override {}
  DeviceIndex deviceCount() const override { return g_device_count.load(); }
  void setCurrentDevice(DeviceIndex device) const override { exchange(device); }
  DeviceIndex getCurrentDevice() const override { return t_current_device; }
  DeviceIndex exchangeDevice(DeviceIndex device) const override { return exchange(device); }
  DeviceIndex maybeExchangeDevice(DeviceIndex device) const override {
    if (device < 0 || device >= g_device_count.load()) {
      return t_current_device;
    }
    return exchange(device);
  }
  const at::Generator& getDefaultGenerator(DeviceIndex device_index) const override {
    return default_generator(device_index);
  }
  at::Generator getNewGenerator(DeviceIndex device_index) const override { return new_generator(device_index); }
  // Pinned host memory (pinned_memory.cpp); is_pinned asks about a tensor's data pointer.
  bool isPinnedPtr(const void* data) const override { return is_pinned_ptr(data); }
  at::Allocator* getPinnedMemoryAllocator() const override { return pinned_allocator(); }
  // UntypedStorage.resize_ (FSDP1 frees and regrows parameter storage with it). The bytes are
  // host memory; the storage's allocator (memory.cpp) charges the new size on the storage's
  // device and the old block's deleter releases the old one.
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t new_bytes) const override {
    const c10::Device device = storage.device();
    const c10::DeviceGuard guard(device);
    at::native::resize_bytes_cpu(storage.unsafeGetStorageImpl(), new_bytes);
    if (new_bytes == 0) {
      // resize_bytes_cpu leaves a default DataPtr at size 0, and a storage's device is its
      // DataPtr's: the storage would move to the CPU (FSDP1 frees a flat parameter's storage
      // so, then set_()s it to a neuron shard: "devices must match").
      storage.unsafeGetStorageImpl()->set_data_ptr_noswap(c10::DataPtr(nullptr, device));
    }
  }
};

bool g_installed = false;

}  // namespace

DeviceIndex device_count() { return g_device_count.load(); }

bool autograd_device_threads_may_run() { return g_set_device_called.load(std::memory_order_relaxed); }
DeviceIndex current_device() { return t_current_device; }
DeviceIndex checked_device(int64_t index) { return checked(static_cast<DeviceIndex>(index)); }
void set_current_device(int64_t index) { exchange(static_cast<DeviceIndex>(index)); }

void register_guard_impl() {
  static NeuronGuardImpl guard;
  static c10::impl::DeviceGuardImplRegistrar registrar(kNeuron, &guard);  // once: the first call
}

// Once per process, at registration (dispatch/registration.py), with the runtime's count.
void install_guard(int64_t device_count) {
  TORCH_CHECK(!g_installed, "the neuron device guard is installed once per process");
  TORCH_CHECK(device_count > 0 && device_count <= 64, "device_count must be in [1, 64], got ", device_count);
  g_device_count.store(static_cast<DeviceIndex>(device_count));
  register_guard_impl();
  at::RegisterPrivateUse1HooksInterface(new NeuronHooks());  // torch keeps it for the process
  g_installed = true;
}

// A bad setting (Note [A bad setting fails at first use] in device/settings.py): the
// guard alone, with no device, so that `device='neuron'` (which asks the current device)
// reaches the refusing kernels and their message; install_guard may follow once it is fixed.
void install_refusing_guard(std::string message) {
  TORCH_CHECK(!g_installed, "the neuron device is installed already");
  g_refusal = std::move(message);
  register_guard_impl();
}

}  // namespace neuron
