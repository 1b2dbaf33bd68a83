// Profiler ranges of the C++ eager path and of fused launches: the same names and nesting as
// the Python layers open (Note [Profiler ranges] in device/profiling.py), so one trace reads
// the same whichever layer launched: `neuron::aten::addmm` per eager launch,
// `neuron::transfer[host->device]` per transfer, each with a nested `neuron::device_time`
// whose arguments are what the clock charged. Nothing is built while no profiler records:
// callers ask profiling() first (one read of a global flag).
#include "neuron.h"

#include <torch/csrc/profiler/orchestration/observer.h>

namespace neuron {

bool profiling() { return torch::profiler::impl::profilerEnabled(); }

Range::Range(std::string name, const std::unordered_map<std::string, c10::IValue>& args)
    : name_(std::move(name)), record_(at::RecordScope::USER_SCOPE) {
  if (record_.isActive()) {
    record_.before(std::string_view(name_), &args);  // name_ outlives record_: declared first
  }
}

const char* transfer_range_name(bool src_on_device, bool dst_on_device) {
  if (src_on_device && dst_on_device) {
    return "neuron::transfer[device->device]";
  }
  return dst_on_device ? "neuron::transfer[host->device]" : "neuron::transfer[device->host]";
}

void mark_device_time(double device_us, const char* what, int64_t count, c10::DeviceIndex device) {
  const Range mark("neuron::device_time", {{"device_us", device_us}, {what, count}, {"device", static_cast<int64_t>(device)}});
}

}  // namespace neuron
