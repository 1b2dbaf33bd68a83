// Note [The device timeline]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// `torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1])`
// (PrivateUse1 is `ProfilerActivity.NEURON` once the backend is named) shows each neuron device
// as a track of its own, as CUDA's profiler shows a GPU's streams: every launch at its time on
// the modelled clock, each op of a fused launch a slice inside it, an arrow from where the host
// issued it. This file is that track: a kineto activity profiler, handed to torch through
// PrivateUse1ProfilerRegistry, recording while a profiler that asked for the device runs.
//
// - What a slice's time means. The chip is not here: a launch's duration is what the clock
//   charged (clock.cpp: its launch overhead, then each op's roofline), and its start is when
//   the device's one queue (Note [One queue per device]) could start it: not before the host
//   issued it, not before the launch ahead of it ended. So the track is what the chip would
//   spend on the work this host issued when it issued it; a host that would wait for the chip
//   (a value read) is not slowed down by it here, so where the device runs behind, the real
//   chip's host would run later too.
// - Links. Each launch is a `neuron::launch` slice on the issuing thread (as cudaLaunchKernel
//   is), with a flow to the device slice; each op on the device is linked to the torch op
//   that issued it (its correlation id, which kineto hands to child profilers on the thread
//   running the op), so `key_averages()` gives ops their modelled device time, in fused
//   launches too. The host launch of a fused launch is the engine's `neuron::fused[...]`
//   range (adaptive_eager/engine/executor.py); the device slice containing its ops is a
//   GPU_USER_ANNOTATION, as CUDA shows a range around kernels, and inside it the launch
//   overhead is a kernel slice of its own (linked to that range) before the ops: the kernel
//   slices add up to the device's time, each counted once.
// - Source lines. Each op carries the user's source line that issued it (Note [Where an op
//   was issued]): an eager op's where the issuing thread was, a fused launch's ops' where
//   each was queued (engine/queue.cpp). Autograd's thread has no Python frame: none.
// - Cost. Nothing is recorded or captured while no session records: one relaxed atomic read
//   where a launch is accounted or an op queued. While one records, every launch runs while its
//   issuer waits (issue.cpp, the engine streams none: Note [Profiler ranges]).
#ifndef USE_KINETO
#define USE_KINETO  // torch's CPU wheel is built with kineto; its headers guard on this
#endif
#define FMT_HEADER_ONLY  // GenericTraceActivity::addMetadata formats with fmt, which torch does not export
#include "neuron.h"

#include <torch/csrc/profiler/standalone/privateuse1_profiler.h>

#include <libkineto.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace neuron {
namespace {

using libkineto::ActivityType;
using libkineto::GenericTraceActivity;

struct Record {
  bool transfer;
  c10::DeviceIndex device;
  std::string name;  // a transfer's; "" for a launch, named by its label or its one op
  double overhead_us;
  double total_us;
  int64_t bytes;
  int64_t done_ns;  // host wall clock when the host side accounted it
  TimelineIssue issue;
  std::vector<TimelineOp> ops;
};

constexpr const char* kOverhead = "launch overhead";  // a fused launch's first slice

std::atomic<bool> g_recording{false};
std::mutex g_lock;
std::vector<Record> g_records;
std::atomic<uint32_t> g_next_flow{1};  // ac2g flow ids: unique within the process's traces

thread_local std::vector<uint64_t> t_correlations;  // kineto's, pushed on the thread running an op
thread_local const TimelineIssue* t_issue = nullptr;  // the issuer's, while a job of it runs here
thread_local const TimelineTag* t_op_tag = nullptr;  // the queued op running here
thread_local std::string t_next_label;

int64_t wall_ns() {
  // kineto's and torch's trace times are Unix-epoch nanoseconds
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

int32_t thread_id() { return static_cast<int32_t>(syscall(SYS_gettid)); }

uint64_t top_correlation() { return t_correlations.empty() ? 0 : t_correlations.back(); }

TimelineTag tag_here() {
  TimelineTag tag;
  tag.correlation = top_correlation();
  // The executor never walks Python frames: its issuer may hold the GIL while it waits.
  if (!on_device_thread()) {
    tag.site = issue_site();
  }
  return tag;
}

int64_t to_ns(double us) { return std::llround(us * 1000.0); }

class Session final : public libkineto::IActivityProfilerSession {
 public:
  explicit Session(bool track) : track_(track) {}

  void start() override {
    if (!track_) {
      return;
    }
    {
      std::lock_guard<std::mutex> guard(g_lock);
      g_records.clear();
    }
    g_recording.store(true);
    status_ = libkineto::TraceStatus::RECORDING;
  }

  void stop() override {
    if (!track_) {
      return;
    }
    // No wait for the device here (its executor may be running a Python kernel that needs the
    // GIL this thread holds): while a session records, launches run while their issuer waits,
    // so what was issued before the stop has been recorded.
    g_recording.store(false);
    std::lock_guard<std::mutex> guard(g_lock);
    records_.swap(g_records);
    status_ = libkineto::TraceStatus::PROCESSING;
  }

  std::vector<std::string> errors() override { return {}; }

  void processTrace(libkineto::ActivityLogger& logger) override { processTrace(logger, nullptr, 0, 0); }

  void processTrace(libkineto::ActivityLogger& logger, libkineto::getLinkedActivityCallback linked, int64_t start,
                    int64_t end) override {
    buffer_ = std::make_unique<libkineto::CpuTraceBuffer>();
    buffer_->span = libkineto::TraceSpan(start, end, "neuron");
    buffer_->gpuOpCount = 0;
    const int32_t pid = static_cast<int32_t>(getpid());
    std::vector<int64_t> free_at;  // per device: when its queue ends its last launch
    for (const Record& r : records_) {
      if (static_cast<size_t>(r.device) >= free_at.size()) {
        free_at.resize(r.device + 1, 0);
      }
      const int64_t begin = std::max(r.issue.ns, free_at[r.device]);
      const int64_t finish = begin + to_ns(r.total_us);
      free_at[r.device] = finish;
      const uint32_t flow = g_next_flow.fetch_add(1);

      // The host's side: the call that issued it, on the issuing thread.
      GenericTraceActivity& host = add(ActivityType::PRIVATEUSE1_RUNTIME,
                                       r.transfer ? "neuron::transfer" : "neuron::launch", pid, r.issue.thread,
                                       r.issue.ns, std::max(r.issue.ns, r.done_ns));
      link(host, flow, true);
      host.id = static_cast<int32_t>(r.issue.tag.correlation);
      host.linked = linked && r.issue.tag.correlation != 0 ? linked(static_cast<int32_t>(r.issue.tag.correlation)) : nullptr;

      const bool fused = !r.transfer && (r.ops.size() != 1 || !r.issue.label.empty());
      const ActivityType type = r.transfer ? ActivityType::GPU_MEMCPY
                                : fused   ? ActivityType::GPU_USER_ANNOTATION
                                          : ActivityType::CONCURRENT_KERNEL;
      std::string name = r.name;
      if (name.empty()) {
        name = !r.issue.label.empty() ? r.issue.label : fused ? "fused launch" : r.ops.front().name;
      }
      GenericTraceActivity& slice = add(type, name, r.device, 0, begin, finish);
      link(slice, flow, false);
      slice.addMetadata("device_us", r.total_us);
      slice.addMetadata("stream", r.issue.stream);
      if (r.transfer) {
        slice.addMetadata("bytes", r.bytes);
      } else {
        slice.addMetadata("overhead_us", r.overhead_us);
        slice.addMetadata("ops", r.ops.size());
      }
      const std::string where = describe_issue_site(r.issue.tag.site);
      if (!where.empty()) {
        slice.addMetadataQuoted("source", escaped(where));
      }
      if (!fused && !r.transfer) {
        attach(slice, r.ops.front().tag, linked);
        continue;
      }
      int64_t at = begin + to_ns(r.overhead_us);
      if (at > begin) {  // a slice of its own, so the ops' slices and it add up to the launch
        GenericTraceActivity& overhead = add(ActivityType::CONCURRENT_KERNEL, kOverhead, r.device, 0, begin, at);
        overhead.addMetadata("device_us", r.overhead_us);
        attach(overhead, r.issue.tag, linked);
      }
      for (const TimelineOp& op : r.ops) {
        const int64_t op_end = std::min(finish, at + to_ns(op.us));
        GenericTraceActivity& child = add(ActivityType::CONCURRENT_KERNEL, op.name, r.device, 0, at, op_end);
        child.addMetadata("device_us", op.us);
        const std::string op_where = describe_issue_site(op.tag.site);
        if (!op_where.empty()) {
          child.addMetadataQuoted("source", escaped(op_where));
        }
        attach(child, op.tag, linked);
        at = op_end;
      }
    }
    for (const auto& activity : buffer_->activities) {
      activity->log(logger);
    }
  }

  // The track's process: kineto asks one per session, so it names the first device recorded
  // (other devices' tracks keep kineto's own "GPU n" label, their queues named below).
  std::unique_ptr<libkineto::DeviceInfo> getDeviceInfo() override {
    const c10::DeviceIndex d = records_.empty() ? current_device() : records_.front().device;
    return std::make_unique<libkineto::DeviceInfo>(
        libkineto::DeviceInfo{d, kSortAfterHost + d, "neuron:" + std::to_string(d), "neuron"});
  }

  std::vector<libkineto::ResourceInfo> getResourceInfos() override {
    std::set<c10::DeviceIndex> devices;
    for (const Record& r : records_) {
      devices.insert(r.device);
    }
    std::vector<libkineto::ResourceInfo> out;
    for (c10::DeviceIndex d : devices) {
      out.push_back(libkineto::ResourceInfo{0, 0, d, "neuron:" + std::to_string(d) + " queue (all its streams)"});
    }
    return out;
  }

  // The activities logged above: kineto keeps them with the trace (processTrace's logger holds
  // pointers to them until the trace is saved).
  std::unique_ptr<libkineto::CpuTraceBuffer> getTraceBuffer() override { return std::move(buffer_); }

  void pushCorrelationId(uint64_t id) override { t_correlations.push_back(id); }
  void popCorrelationId() override { pop(); }
  void pushUserCorrelationId(uint64_t id) override { t_correlations.push_back(id); }
  void popUserCorrelationId() override { pop(); }

 private:
  static void pop() {
    if (!t_correlations.empty()) {  // a range begun before the session started ends in it
      t_correlations.pop_back();
    }
  }

  GenericTraceActivity& add(ActivityType type, const std::string& name, int32_t device, int32_t resource,
                            int64_t start, int64_t finish) {
    buffer_->emplace_activity(buffer_->span, type, name);
    GenericTraceActivity& a = libkineto::CpuTraceBuffer::toRef(buffer_->activities.back());
    a.device = device;
    a.resource = resource;
    a.startTime = start;
    a.endTime = finish;
    return a;
  }

  static void link(GenericTraceActivity& a, uint32_t flow, bool start) {
    a.flow.id = flow;
    a.flow.type = libkineto::kLinkAsyncCpuGpu;
    a.flow.start = start ? 1 : 0;
  }

  static void attach(GenericTraceActivity& a, const TimelineTag& tag, const libkineto::getLinkedActivityCallback& linked) {
    if (tag.correlation == 0) {
      return;
    }
    a.id = static_cast<int32_t>(tag.correlation);
    a.linked = linked ? linked(static_cast<int32_t>(tag.correlation)) : nullptr;
  }

  // A quoted metadata value goes into the JSON as written
  static std::string escaped(const std::string& s) {
    std::string out;
    for (char c : s) {
      if (c == '"' || c == '\\') {
        out.push_back('\\');
      }
      out.push_back(c);
    }
    return out;
  }

  static constexpr int64_t kSortAfterHost = 1 << 24;  // process ids sort the host's tracks
  bool track_;
  std::vector<Record> records_;
  std::unique_ptr<libkineto::CpuTraceBuffer> buffer_;
};

class Profiler final : public libkineto::IActivityProfiler {
 public:
  const std::string& name() const override { return name_; }
  // The device's activities (a CPU-only profile asks PRIVATEUSE1_RUNTIME, not these)
  const std::set<ActivityType>& availableActivities() const override { return types_; }

  // Kineto configures every child profiler for every trace: one without the device's
  // activities (a CPU-only profile) gets a session recording nothing.
  std::unique_ptr<libkineto::IActivityProfilerSession> configure(const std::set<ActivityType>& types,
                                                                 const libkineto::Config& /*config*/) override {
    const bool track = std::any_of(types.begin(), types.end(), [this](ActivityType t) { return types_.count(t) > 0; });
    return std::make_unique<Session>(track);
  }

  std::unique_ptr<libkineto::IActivityProfilerSession> configure(int64_t /*ts_ms*/, int64_t /*duration_ms*/,
                                                                 const std::set<ActivityType>& types,
                                                                 const libkineto::Config& config) override {
    return configure(types, config);
  }

 private:
  std::string name_{"neuron"};
  std::set<ActivityType> types_{ActivityType::CONCURRENT_KERNEL, ActivityType::GPU_MEMCPY};
};

void add_record(Record record) {
  record.done_ns = wall_ns();
  std::lock_guard<std::mutex> guard(g_lock);
  if (g_recording.load(std::memory_order_relaxed)) {  // not one that ended while it was made
    g_records.push_back(std::move(record));
  }
}

TimelineIssue current_issue() { return t_issue != nullptr ? *t_issue : timeline_issue(); }

}  // namespace

void install_device_timeline() {
  auto& registry = torch::profiler::impl::PrivateUse1ProfilerRegistry::instance();
  registry.registerFactory([] { return std::unique_ptr<libkineto::IActivityProfiler>(new Profiler()); });
  // torch 2.13 never calls onKinetoInit, so the factory would wait for it for ever. Kineto
  // takes a factory whether or not it has started: it keeps it for its initialisation, or
  // makes the profiler at once.
  registry.onKinetoInit();
}

bool timeline_recording() { return g_recording.load(std::memory_order_relaxed); }

TimelineIssue timeline_issue() {
  TimelineIssue issue;
  issue.ns = wall_ns();
  issue.thread = thread_id();
  issue.tag = tag_here();
  issue.stream = current_stream(current_device()).id();
  issue.label = std::move(t_next_label);
  t_next_label.clear();
  return issue;
}

TimelineTag timeline_tag() { return tag_here(); }

void label_next_launch(std::string label) { t_next_label = std::move(label); }

TimelineIssueScope::TimelineIssueScope(const TimelineIssue* issue) : previous(t_issue) { t_issue = issue; }
TimelineIssueScope::~TimelineIssueScope() { t_issue = previous; }

TimelineOpScope::TimelineOpScope(const TimelineTag* tag) : previous(t_op_tag) { t_op_tag = tag; }
TimelineOpScope::~TimelineOpScope() { t_op_tag = previous; }

void timeline_op(std::vector<TimelineOp>* ops, std::string_view name, double op_us) {
  // The op's own tag: a queued op's (run_entry), else its issuer's (an eager op on the
  // executor, whose own ranges there are ours), else this thread's (a compiled graph's op).
  const TimelineTag tag = t_op_tag != nullptr ? *t_op_tag : t_issue != nullptr ? t_issue->tag : tag_here();
  ops->push_back(TimelineOp{std::string(name), op_us, tag});
}

void timeline_launch(c10::DeviceIndex d, double overhead_us, double total_us, std::vector<TimelineOp> ops) {
  add_record(Record{false, d, "", overhead_us, total_us, 0, 0, current_issue(), std::move(ops)});
}

void timeline_transfer(c10::DeviceIndex d, int64_t nbytes, double us) {
  add_record(Record{true, d, "neuron::transfer", 0, us, nbytes, 0, current_issue(), {}});
}

}  // namespace neuron
