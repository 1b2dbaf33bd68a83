// What the files of the neuron device's C++ core share: the device type, the device count and
// current device (guard.cpp), memory accounting (memory.cpp) and the launch clock (clock.cpp).
#pragma once

#include <ATen/core/Generator.h>
#include <c10/core/Device.h>

#include <cstddef>
#include <cstdint>
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
// Counts nbytes against device d, or raises torch.OutOfMemoryError (counting nothing).
void charge(c10::DeviceIndex d, size_t nbytes);
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
// cost model's figures (us_per_flop by ScalarType code) and one generator per device.
void install_eager(double us_per_byte, const std::vector<std::pair<int, double>>& us_per_flop,
                   double default_us_per_flop, std::vector<at::Generator> generators);

}  // namespace neuron
