// The emulated clock: what each device has done (launches, ops, transfers) and the device
// time the cost model charged for it, in issue order.
//
// Launches are accounted on the thread that issues them and on the device stream's worker
// (device/stream.py), so every update takes the lock. The launch overhead is modelled, and
// also spent on the calling thread when NEURON_SPEND_LAUNCH_OVERHEAD asks for it (a host
// blocked on a launch spins anyway; sleeping cannot wait 15 us).
#include "neuron.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <iterator>
#include <mutex>
#include <vector>

namespace neuron {
namespace {

std::mutex g_lock;
std::vector<Counters> g_counters;  // sized once, at install
double g_launch_overhead_us = 0;
std::atomic<bool> g_spend_overhead{false};
thread_local FusedLaunch* t_fused = nullptr;
// While on, every launch as (device, ops): for tests that ask how ops were grouped into
// launches (a compiled graph's, say), which the counters' sums cannot say.
std::atomic<bool> g_logging{false};
std::vector<std::pair<int64_t, int64_t>> g_log;
// While on, each op the eager path prices as (op, roofline µs), inside fused launches too:
// where a launch's time goes (tests, bench/fp8_step.py).
std::atomic<bool> g_op_logging{false};
std::vector<std::pair<std::string, double>> g_op_log;

Counters& counters_of(c10::DeviceIndex d) {
  TORCH_CHECK(d >= 0 && static_cast<size_t>(d) < g_counters.size(),
              "internal error: no clock for neuron:", static_cast<int>(d), " (the device is not installed)");
  return g_counters[d];
}

void spin_us(double us) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double, std::micro>(us);
  while (std::chrono::steady_clock::now() < end) {
  }
}

// One more launch of num_ops ops on d's counters (and in the launch log); g_lock held.
void count_launch_locked(c10::DeviceIndex d, Counters& c, int64_t num_ops) {
  c.launches += 1;
  c.kernel_ops += num_ops;
  if (g_logging.load(std::memory_order_relaxed)) {
    g_log.emplace_back(d, num_ops);
  }
}

// The modelled overhead, spent in wall-clock time too when NEURON_SPEND_LAUNCH_OVERHEAD asks.
void spin_overhead(double overhead) {
  if (overhead > 0 && g_spend_overhead.load(std::memory_order_relaxed)) {
    spin_us(overhead);
  }
}

}  // namespace

void install_clock(c10::DeviceIndex count, double launch_overhead_us, bool spend_overhead) {
  std::lock_guard<std::mutex> guard(g_lock);
  TORCH_CHECK(g_counters.empty(), "the neuron clock is installed once per process");
  g_counters.resize(count);
  g_launch_overhead_us = launch_overhead_us;
  g_spend_overhead.store(spend_overhead);
}

void set_spend_overhead(bool spend) { g_spend_overhead.store(spend); }

namespace {

// One launch on d's counters and clock; g_lock taken here.
double charge_launch(c10::DeviceIndex d, double overhead, double op_us, int64_t num_ops) {
  const double total = overhead + op_us;
  std::lock_guard<std::mutex> guard(g_lock);
  Counters& c = counters_of(d);
  count_launch_locked(d, c, num_ops);
  c.device_time_us += total;
  c.launch_overhead_us += overhead;
  return total;
}

}  // namespace

double account_launch(c10::DeviceIndex d, double overhead, double op_us, int64_t num_ops, std::string_view name) {
  if (t_fused != nullptr && t_fused->deferred != nullptr) {  // Note [Streamed launches] (engine/queue.cpp)
    t_fused->deferred->push_back(DeferredPrice{t_fused->entry, false, {}, 0, 0, 0, at::kFloat, op_us, num_ops});
    return op_us;
  }
  if (t_fused != nullptr) {  // a Python kernel inside a fused launch: one of its ops
    t_fused->op_us += op_us;
    t_fused->num_ops += num_ops;
    if (timeline_recording()) {
      timeline_op(&t_fused->timeline_ops, name, op_us);
    }
    return op_us;
  }
  const double total = charge_launch(d, overhead, op_us, num_ops);
  if (timeline_recording()) {
    std::vector<TimelineOp> ops;
    timeline_op(&ops, name, op_us);
    timeline_launch(d, overhead, total, std::move(ops));
  }
  return total;
}

double launch(c10::DeviceIndex d, double op_us, int64_t num_ops, std::string_view name) {
  if (t_fused != nullptr) {  // one op of a fused launch: accounted when the launch ends
    return account_launch(d, 0, op_us, num_ops, name);
  }
  const double overhead = g_launch_overhead_us;
  const double total = account_launch(d, overhead, op_us, num_ops, name);
  spin_overhead(overhead);
  return total;
}

void issue_launch(c10::DeviceIndex d, int64_t num_ops) {
  std::lock_guard<std::mutex> guard(g_lock);
  count_launch_locked(d, counters_of(d), num_ops);
}

namespace {

// The end of a launch issue_launch counted: its time, and the ops that did not run (a
// failed launch's) taken back, in one update so a reader never sees half of it.
double settle_issued_launch(c10::DeviceIndex d, double op_us, int64_t ran, int64_t issued) {
  const double overhead = g_launch_overhead_us;
  {
    std::lock_guard<std::mutex> guard(g_lock);
    Counters& c = counters_of(d);
    c.kernel_ops -= issued - ran;
    c.device_time_us += overhead + op_us;
    c.launch_overhead_us += overhead;
  }
  spin_overhead(overhead);
  return overhead + op_us;
}

}  // namespace

FusedLaunch::FusedLaunch(c10::DeviceIndex d) : device(d), previous(t_fused) { t_fused = this; }

// The last fused launch to end, on any thread: the engine's host reads it once its launch,
// run on the device's executor, has ended (Note [The device executor]).
std::pair<double, int64_t> t_last_fused{0, 0};

FusedLaunch::~FusedLaunch() {
  t_fused = previous;
  t_last_fused = {0, num_ops};
  const double overhead = g_launch_overhead_us;
  if (issued_ops >= 0) {
    t_last_fused.first = settle_issued_launch(device, op_us, num_ops, issued_ops);
  } else if (num_ops > 0 && previous != nullptr) {  // inside another fused launch: its ops join it
    if (previous->deferred != nullptr) {  // Note [Streamed launches] (engine/queue.cpp)
      previous->deferred->push_back(DeferredPrice{previous->entry, false, {}, 0, 0, 0, at::kFloat, op_us, num_ops});
    } else {
      previous->op_us += op_us;
      previous->num_ops += num_ops;
      std::move(timeline_ops.begin(), timeline_ops.end(), std::back_inserter(previous->timeline_ops));
    }
    t_last_fused.first = op_us;
    return;
  } else if (num_ops > 0) {  // the ops that ran, a failed launch's included
    t_last_fused.first = charge_launch(device, overhead, op_us, num_ops);
    spin_overhead(overhead);
  }
  if (num_ops > 0 && timeline_recording()) {
    timeline_launch(device, overhead, t_last_fused.first, std::move(timeline_ops));
  }
}

bool in_fused_launch() { return t_fused != nullptr; }

FusedLaunch* current_fused_launch() { return t_fused; }

FusedLaunchOnThread::FusedLaunchOnThread(FusedLaunch* launch) : previous(t_fused) { t_fused = launch; }
FusedLaunchOnThread::~FusedLaunchOnThread() { t_fused = previous; }

std::pair<double, int64_t> last_fused_launch() { return t_last_fused; }

void transfer(c10::DeviceIndex d, int64_t nbytes, double us) {
  {
    std::lock_guard<std::mutex> guard(g_lock);
    Counters& c = counters_of(d);
    c.transfers += 1;
    c.transfer_bytes += nbytes;
    c.device_time_us += us;
  }
  if (timeline_recording()) {
    timeline_transfer(d, nbytes, us);
  }
}

void refund(c10::DeviceIndex d, double op_us, int64_t num_ops) {
  std::lock_guard<std::mutex> guard(g_lock);
  Counters& c = counters_of(d);
  c.kernel_ops -= num_ops;
  c.device_time_us -= op_us;
}

Counters counters(c10::DeviceIndex d) {
  std::lock_guard<std::mutex> guard(g_lock);
  return counters_of(d);
}

void set_launch_log(bool on) {
  std::lock_guard<std::mutex> guard(g_lock);
  g_logging.store(on);
  g_log.clear();
}

std::vector<std::pair<int64_t, int64_t>> take_launch_log() {
  std::lock_guard<std::mutex> guard(g_lock);
  std::vector<std::pair<int64_t, int64_t>> out;
  out.swap(g_log);
  return out;
}

void set_op_log(bool on) {
  std::lock_guard<std::mutex> guard(g_lock);
  g_op_logging.store(on);
  g_op_log.clear();
}

void log_op(const std::string& name, double op_us) {
  if (!g_op_logging.load(std::memory_order_relaxed)) {
    return;
  }
  std::lock_guard<std::mutex> guard(g_lock);
  g_op_log.emplace_back(name, op_us);
}

std::vector<std::pair<std::string, double>> take_op_log() {
  std::lock_guard<std::mutex> guard(g_lock);
  std::vector<std::pair<std::string, double>> out;
  out.swap(g_op_log);
  return out;
}

void reset_counters() {
  std::lock_guard<std::mutex> guard(g_lock);
  for (Counters& c : g_counters) {
    c = Counters();
  }
}

}  // namespace neuron
