// What the files of the neuron device's C++ core share: the device type, the device count and
// current device (guard.cpp), memory accounting (memory.cpp) and the launch clock (clock.cpp).
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

namespace neuron {

constexpr c10::DeviceType kNeuron = c10::DeviceType::PrivateUse1;

// guard.cpp
c10::DeviceIndex device_count();
c10::DeviceIndex current_device();
// Raises an IndexError naming the valid range for an index that is not a device.
c10::DeviceIndex checked_device(int64_t index);
void set_current_device(int64_t index);
// Registers the guard and hooks for device_count devices. Once, at install.
void install_guard(int64_t device_count);

// memory.cpp: the bytes each device holds, against its capacity.
// Counts nbytes against device d, or raises torch.OutOfMemoryError (counting nothing);
// check=false counts bytes already in use, whatever the capacity (a finished launch's).
void charge(c10::DeviceIndex d, size_t nbytes, bool check = true);
// Gives back what charge counted (never raises: it runs in deleters).
void release(c10::DeviceIndex d, size_t nbytes) noexcept;
// One capacity per device; registers the allocator. Once, at install.
void install_memory(const std::vector<int64_t>& capacities);
// Raises torch.OutOfMemoryError unless nbytes more fit (counting nothing).
void check_fits(c10::DeviceIndex d, int64_t nbytes);
// A charged storage changed size in place (resize_): charge the difference.
void resize_charge(c10::DeviceIndex d, int64_t old_nbytes, int64_t new_nbytes);
// Undoes a charge without counting a free (the storage is charged another way from now on).
void uncharge(c10::DeviceIndex d, int64_t nbytes);
struct MemoryStats {
  int64_t capacity, allocated, peak, num_allocs, num_frees, num_ooms;
};
MemoryStats memory_stats(c10::DeviceIndex d);
void reset_peak(c10::DeviceIndex d);

// pinned_memory.cpp: the host allocator for pinned memory, and whether data lies in a block of it.
c10::Allocator* pinned_allocator();
bool is_pinned_ptr(const void* data);

// generator.cpp: neuron generators, each holding the CPU generator the kernels draw from.
void install_generators(std::vector<at::Generator> host_generators);  // the runtime's, one per device
const at::Generator& default_generator(c10::DeviceIndex d);  // -1: the current device's
at::Generator new_generator(c10::DeviceIndex d);
// The CPU generator a kernel must be given for g (g itself when it is a CPU generator).
at::Generator host_generator(const at::Generator& g);

// streams.cpp: streams and events on the device's one in-order queue (Note [One queue per device]).
// The synchronizer runs what upper layers hold back for device d (-1: all), then waits for it.
void set_synchronizer(std::function<void(c10::DeviceIndex)> synchronizer);
void synchronize(c10::DeviceIndex d);
c10::Stream current_stream(c10::DeviceIndex d);  // the calling thread's
c10::Stream new_stream(c10::DeviceIndex d);
c10::Stream exchange_stream(const c10::Stream& s) noexcept;
void record_event(void** event, const c10::Stream& s, c10::EventFlag flag);
void destroy_event(void* event) noexcept;
void synchronize_event(void* event);
double elapsed_ms(void* start, void* end);

// clock.cpp: one launch of num_ops ops whose roofline time is op_us, on device d's clock;
// returns its emulated time (launch overhead included).
double launch(c10::DeviceIndex d, double op_us, int64_t num_ops);
// The accounting alone, with the given overhead, spending nothing (Python spends it itself).
double account_launch(c10::DeviceIndex d, double overhead_us, double op_us, int64_t num_ops);
struct Counters {
  int64_t launches = 0;
  int64_t kernel_ops = 0;  // ops run inside launches (a fused launch holds many)
  int64_t transfers = 0;
  int64_t transfer_bytes = 0;
  double device_time_us = 0;
  double launch_overhead_us = 0;  // the part of device_time_us spent on launch overhead
};
void install_clock(c10::DeviceIndex count, double launch_overhead_us, bool spend_overhead);
void set_spend_overhead(bool spend);
// One copy of nbytes between the host and device d (or between devices), taking us.
void transfer(c10::DeviceIndex d, int64_t nbytes, double us);
// A launch accounted at issue failed before num_ops of its ops ran.
void refund(c10::DeviceIndex d, double op_us, int64_t num_ops);
Counters counters(c10::DeviceIndex d);
void reset_counters();

// eager.cpp: the eager path of native neuron tensors (CPU kernels on device memory), with the
// cost model's figures (us_per_flop by ScalarType code).
void install_eager(double us_per_byte, const std::vector<std::pair<int, double>>& us_per_flop,
                   double default_us_per_flop);
// A CPU tensor on t's bytes that keeps them alive; a neuron tensor adopting host's bytes
// (zero-copy, charged to device).
at::Tensor owning_host_alias(const at::Tensor& t);
at::Tensor adopt_host_tensor(const at::Tensor& host, int64_t device);

}  // namespace neuron
