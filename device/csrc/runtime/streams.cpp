// Streams and events of the emulated device, on its clock.
//
// Note [One queue per device]: the emulated device runs its launches in issue order, one at
// a time (the clock is their sum: clock.cpp), so every stream of a device is a name for the
// same queue: the device's executor (Note [The device executor] in executor.cpp). Work on two
// streams can never overlap or reorder, `wait_stream`/`wait_event` (block) have nothing to
// wait for, and a stream or event is complete (query) once the executor has run everything
// issued (a conservative answer for an event recorded before later work). Streams still exist, with ids, per-thread current streams and priorities, so
// code written for CUDA streams (FSDP2, DCP, overlap schedules) runs as written.
//
// What upper layers hold back (the adaptive engine's pending ops) has not been issued yet:
// synchronizing a stream, an event or the device first asks the synchronizer set from Python
// (device/runtime.py) to run it. A timing event asks it to issue them when recorded, and
// posts a job behind them that reads the device clock: its time is the modelled clock after
// everything issued before it, and the host runs on, as a CUDA event's record does not wait
// for the stream. elapsed_time waits for both (as CUDA's requires completed events).
// Nothing here calls the synchronizer where autograd calls the guard (record of a plain
// event, block, exchangeStream), so autograd's worker threads never reach Python through it.
#include "neuron.h"

#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>

namespace neuron {
namespace {

constexpr size_t kMaxDevices = 64;

std::array<std::atomic<c10::StreamId>, kMaxDevices> g_next_stream{};  // 0 is the default stream
thread_local std::array<c10::StreamId, kMaxDevices> t_current_stream{};

std::mutex g_sync_lock;
std::function<void(c10::DeviceIndex)> g_synchronizer;
std::function<void(c10::DeviceIndex)> g_issuer;

struct NeuronEvent {
  c10::DeviceIndex device = -1;
  bool timing = false;
  bool recorded = false;
  // The device clock when the executor reached the record (timing events). Shared with the
  // job that writes it: the event may be destroyed before the job runs.
  std::shared_ptr<std::atomic<double>> time_us = std::make_shared<std::atomic<double>>(0.0);
};

c10::DeviceIndex stream_device(const c10::Stream& s) {
  return s.device_index() < 0 ? current_device() : s.device_index();
}

}  // namespace

void set_synchronizer(std::function<void(c10::DeviceIndex)> synchronizer,
                      std::function<void(c10::DeviceIndex)> issuer) {
  std::lock_guard<std::mutex> guard(g_sync_lock);
  g_synchronizer = std::move(synchronizer);
  g_issuer = std::move(issuer);
}

namespace {

// Calls one of the two (read under the lock: Python may replace them), if set.
void call_held(const std::function<void(c10::DeviceIndex)>& which, c10::DeviceIndex d) {
  std::function<void(c10::DeviceIndex)> fn;
  {
    std::lock_guard<std::mutex> guard(g_sync_lock);
    fn = which;
  }
  if (fn) {
    fn(d);
  }
}

// Issues what upper layers hold back, without waiting for it to run.
void issue_held(c10::DeviceIndex d) { call_held(g_issuer, d); }

}  // namespace

void synchronize(c10::DeviceIndex d) {
  call_held(g_synchronizer, d);
  wait_for_device();  // the eager ops posted to the executor (Note [The device executor])
}

c10::Stream current_stream(c10::DeviceIndex d) {
  const c10::DeviceIndex index = d < 0 ? current_device() : d;
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(kNeuron, index), t_current_stream.at(index));
}

c10::Stream new_stream(c10::DeviceIndex d) {
  const c10::DeviceIndex index = d < 0 ? current_device() : d;
  const c10::StreamId id = ++g_next_stream.at(index);
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(kNeuron, index), id);
}

c10::Stream exchange_stream(const c10::Stream& s) noexcept {
  const c10::DeviceIndex index = stream_device(s);
  const c10::Stream previous = current_stream(index);
  t_current_stream[index] = s.id();
  return previous;
}

void record_event(void** event, const c10::Stream& s, c10::EventFlag flag) {
  const c10::DeviceIndex index = stream_device(s);
  auto* e = static_cast<NeuronEvent*>(*event);
  if (e == nullptr) {
    e = new NeuronEvent();
    e->device = index;
    e->timing = flag == c10::EventFlag::BACKEND_DEFAULT;
    *event = e;
  }
  TORCH_CHECK(e->device == index, "Event device neuron:", static_cast<int>(e->device),
              " does not match the recording stream's device neuron:", static_cast<int>(index), ".");
  if (e->timing) {
    issue_held(index);
    post_to_device([time_us = e->time_us, index] { time_us->store(counters(index).device_time_us); });
  }
  e->recorded = true;
}

void destroy_event(void* event) noexcept { delete static_cast<NeuronEvent*>(event); }

void synchronize_event(void* event) {
  const auto* e = static_cast<NeuronEvent*>(event);
  if (e != nullptr && e->recorded) {
    synchronize(e->device);
  }
}

double elapsed_ms(void* start, void* end) {
  const auto* a = static_cast<NeuronEvent*>(start);
  const auto* b = static_cast<NeuronEvent*>(end);
  TORCH_CHECK(a != nullptr && b != nullptr && a->recorded && b->recorded,
              "Both events must be recorded before calculating elapsed time: call event.record() on each.");
  TORCH_CHECK(a->timing && b->timing,
              "Both events must be created with enable_timing=True to calculate elapsed time.");
  TORCH_CHECK(a->device == b->device, "Both events must be on the same device to calculate elapsed time.");
  wait_for_device();  // both records' jobs have run
  return (b->time_us->load() - a->time_us->load()) / 1000.0;
}

}  // namespace neuron
