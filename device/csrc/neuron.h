// What the files of the neuron device's C++ core share: the device type, the device count and
// current device (guard.cpp), memory accounting (memory.cpp) and the launch clock (clock.cpp).
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/record_function.h>
#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <typeinfo>
#include <unordered_map>
#include <utility>
#include <vector>

namespace torch {
class Library;
}  // namespace torch

namespace neuron {

constexpr c10::DeviceType kNeuron = c10::DeviceType::PrivateUse1;

// guard.cpp
c10::DeviceIndex device_count();
// Whether the guard's setDevice ever ran: C++ autograd's device threads start with it.
bool autograd_device_threads_may_run();
c10::DeviceIndex current_device();
// Raises torch.AcceleratorError naming the valid range for an index that is not a device
// (Note [An invalid device is an AcceleratorError] in runtime/guard.cpp).
c10::DeviceIndex checked_device(int64_t index);
void set_current_device(int64_t index);
// Registers the guard and hooks for device_count devices. Once, at install.
void install_guard(int64_t device_count);
// The guard with no device (count 0, no hooks), whose every device check raises message.
void install_refusing_guard(std::string message);

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
bool fits(c10::DeviceIndex d, int64_t nbytes);  // whether nbytes more fit, without raising
struct MemoryStats {
  int64_t capacity, limit, allocated, peak;
  int64_t live;  // charged allocations not yet released
  // Accumulated since install or the last reset_accumulated_memory_stats:
  int64_t num_allocs, num_frees, bytes_allocated, bytes_freed, num_ooms;
};
// torch.neuron.set_per_process_memory_fraction: allocations beyond fraction * capacity raise
// torch.OutOfMemoryError, as the CUDA caching allocator's do.
void set_memory_fraction(c10::DeviceIndex d, double fraction);
MemoryStats memory_stats(c10::DeviceIndex d);
void reset_peak(c10::DeviceIndex d);
// Note [Deferred outputs are charged at issue] (memory.cpp). While one lives, the results this
// thread's kernels make are not charged: they fill deferred outputs, charged at their issue.
struct ChargeScope {
  ChargeScope();
  ~ChargeScope();
  ChargeScope(const ChargeScope&) = delete;
  ChargeScope& operator=(const ChargeScope&) = delete;
};
bool charges_new_results();  // false inside a ChargeScope
// A deferred output's DataPtr: its bytes, not made yet, nbytes charged to d from now until it
// dies (Note [A deferred output's bytes exist at issue], memory.cpp).
c10::DataPtr deferred_bytes(c10::DeviceIndex d, size_t nbytes);
// Whether a neuron storage holds its value: false while the op that makes it is queued, and
// for good if that op failed.
bool value_made(const c10::Storage& storage);
// Note [The device holds no caller's storage] (memory.cpp): a deferred output's storage, on
// deferred_bytes, which the executor reaches through a weak reference alone.
c10::Storage deferred_storage(c10::DeviceIndex d, size_t nbytes);
// A deferred output's bytes, offered to its op's kernel as a CPU allocation (Note [A kernel's
// results are made in their outputs' bytes]): one holder more; none if let go or made.
struct ReservedBytes {
  c10::DataPtr share;
  size_t nbytes = 0;
  const void* data = nullptr;
  bool offered = false;  // an allocation of its size reached it (output_steering.cpp)
};
ReservedBytes reserved_for_kernel(const c10::weak_intrusive_ptr<c10::StorageImpl>& storage);
// output_steering.cpp: Note [A kernel's results are made in their outputs' bytes]. While one
// lives, this thread's CPU allocations of a reserved size are offered the outputs' bytes.
class OutputSteering {
 public:
  explicit OutputSteering(std::vector<ReservedBytes>* reserved);
  ~OutputSteering();
  OutputSteering(const OutputSteering&) = delete;
  OutputSteering& operator=(const OutputSteering&) = delete;

 private:
  std::vector<ReservedBytes>* previous_;
};
void install_output_steering();  // once, at install: wraps the CPU allocator
int64_t steered_allocations();  // allocations made in an output's bytes, since start
// Writes a deferred_storage's value: `made` (its op's result, in its layout), in place if the
// kernel made it in the storage's bytes, else copied there; and, if asked, a share of them
// (as share_if_computed). Nothing, and no share, if its holders let it go.
c10::Storage fill_deferred(c10::StorageImpl* storage, const c10::Storage& made, bool share);
// Outputs whose bytes a kernel's allocation kept past the kernel, given bytes of their own.
int64_t rehomed_outputs();
// A share of a storage's bytes (as share_bytes) through a weak reference, or none: let go, or
// not made yet. A deferred_storage's use count stays its holders'. Only for a deferred_storage.
c10::Storage share_if_computed(const c10::weak_intrusive_ptr<c10::StorageImpl>& storage);
// A neuron DataPtr adopting a CPU storage's bytes, zero-copy. new_result: an op's new result,
// charged unless in a ChargeScope; else (new bytes of an existing storage) always charged.
c10::DataPtr adopt_bytes(const c10::Storage& cpu, c10::DeviceIndex d, bool new_result);
// New bytes for a deferred output whose result came in another layout (charged as new_result);
// projected: address space only (Note [Projected bytes]).
c10::DataPtr launch_bytes(c10::DeviceIndex d, size_t nbytes, bool projected = false);
// Note [Projected bytes] (memory.cpp): projection mode, in which new neuron storages carry no
// bytes, only their charge and an address no one may read.
void set_projection(bool on);
bool projection_enabled();
bool is_projected(const c10::Storage& storage);
// A projected DataPtr for an op's result of nbytes, charged as adopt_bytes charges.
c10::DataPtr adopt_projected(size_t nbytes, c10::DeviceIndex d, bool new_result);
// storage's bytes become projected ones of nbytes: grown (a resize), charged as new bytes and
// the old released; else the same charge moves over (a tensor written in projection mode).
void project_in_place(const c10::Storage& storage, size_t nbytes, bool grown);
// Host reads of projected values answered with a placeholder (0, zeros) so far (kernels.cpp,
// Note [Host reads in projection mode]).
int64_t placeholder_reads();
// Whether ptr is the device's own, with no charge of its own: a launch's own allocation.
bool uncharged_bytes(const c10::DataPtr& ptr);
// A new storage holding storage's bytes, charged nothing: what a queued op or a launch keeps
// of a value (Note [Queued arguments count no references]). Its holder's charge stays theirs.
c10::Storage share_bytes(const c10::Storage& storage);
// For tests (Note [Shares count their holders in one step]): how many storages hold
// storage's bytes as the device counts them (the caller's and the shares queued ops keep); 0
// for no bytes; -1 for bytes the device does not count (a DataPtr made elsewhere, not shared yet).
int64_t bytes_holders(const c10::Storage& storage);
// Whether anything but `storage` holds its bytes: another tensor's storage object, or a share.
bool bytes_shared(const c10::Storage& storage);
// Whether two storages hold the same bytes (one of them a share of the other's): they have
// one bytes_key (the bytes' address; the storage's, for none).
const void* bytes_key(const c10::Storage& s);
bool same_bytes(const c10::Storage& a, const c10::Storage& b);

// touched.cpp, Note [Gathers and scatters]: what an op moves, as the eager path counts it from
// its tensors; count_touched_bytes makes the indexed tensor of a gather or in-place scatter
// count only the part the op touches.
struct OpTraffic {
  double in_bytes = 0;
  double in_elements = 0;
  double out_bytes = 0;
  double out_elements = 0;
};
// How an op touches the tensor it indexes (touched.cpp, Notes [Gathers and scatters] and [Index
// puts]), read from its arguments before it runs: an index put's host index tensors are not
// among the device inputs. kind < 0: the op is counted whole.
struct Touch {
  int kind = -1;
  double put_elements = -1;  // what an index put writes
  bool accumulates = false;
};
Touch touch_of(const c10::OperatorName& op, const torch::jit::Stack& stack, size_t first);
void count_touched_bytes(const Touch& touch, c10::ArrayRef<at::Tensor> inputs, OpTraffic* traffic);

// threads.cpp, Note [Kernels take the host's thread count]: the intra-op thread count of the
// user's thread that last issued an op; take_host_thread_count() records it (on a user's thread)
// or takes it (on autograd's thread for the device), before a kernel runs.
int host_thread_count();
void take_host_thread_count();
void mark_device_thread();  // the device stream's worker: it takes the count per launch

// runtime/executor.cpp, Note [The device executor]: the device's own thread, which runs every
// kernel on neuron tensors, in the order issued.
bool on_device_thread();  // the calling thread is the executor
// Runs job on the executor after everything posted before it; the caller goes on. An error it
// raises waits for the next wait_for_device.
uint64_t post_to_device(std::function<void()> job);  // returns its ticket (jobs are numbered from 0)
// Runs job on the executor after everything posted before it, with the caller's thread-local
// state, and waits for it (without the GIL); raises what it raised. Inline on the executor.
void run_on_device(const std::function<void()>& job);
// Waits for every job posted so far (without the GIL), then raises the first error of a job
// no one waited for, once. Nothing on the executor itself.
void wait_for_device();
// engine/queue.cpp's answers for a host thread about to wait for the executor (Note [Streamed
// launches]): before_run (its own job, posted behind everything) seals a streamed launch
// still open; wait_limit(last) gives the last job a wait for the device's work waits for
// (the one before a streamed launch still open, which waits for its host).
void set_device_wait_hooks(void (*before_run)(), uint64_t (*wait_limit)(uint64_t last));
// Runs fn without the GIL if the calling thread holds it: for a wait on a lock the executor
// may hold while it runs a Python kernel (which takes the GIL).
void without_python(const std::function<void()>& fn);
void note_device_error(std::exception_ptr error);  // the first one waits for wait_for_device
bool device_idle();  // every posted job has run
// Note [The device's queue is bounded]: with 8,192 jobs queued, a host thread waits (without the
// GIL) until half of them have run, as a CUDA launch waits for room in the launch queue.
void wait_for_room_on_device();
int64_t device_jobs_queued();  // posted and not yet run
// Holds the device's queue for `seconds` (the host goes on), as torch.cuda._sleep holds a
// stream: for tests of what the host does while the device is behind.
void sleep_on_device(double seconds);
// The executor sleeps `seconds` before each hand-over of a value to or from a caller's storage
// (engine/queue.cpp; 0: never): a test's window into Note [The device holds no caller's storage].
void set_handover_pause(double seconds);
// Note [The executor spins before it sleeps]: lets go of `guard` while `changes` still reads
// `seen`, for at most the executor's spin budget, and takes it again; the caller then looks at
// what the guard protects and sleeps if it still has nothing to do. For the executor's thread.
void spin_for_change(std::unique_lock<std::mutex>& guard, const std::atomic<uint64_t>& changes, uint64_t seen);
void set_executor_spin(int64_t microseconds);  // NEURON_EXECUTOR_SPIN_US
void set_device_team_sleeps(bool sleeps);  // NEURON_DEVICE_TEAM_SLEEPS
// Frees the calling thread's OpenMP team, if it has one and no region is open (Note [The
// device executor]: a host thread's idle team slows every region of the executor's).
void release_host_thread_team();

// issue_site.cpp, Note [Where an op was issued]: the user's Python line that issues an op.
struct IssueSite {
  const void* code = nullptr;  // a PyCodeObject, kept for the process's life; null: none
  int lasti = -1;
};
IssueSite issue_site();  // the calling thread's innermost frame outside the internal dirs
std::string describe_issue_site(const IssueSite& site);  // "file:line in function", or ""
void add_internal_source_dir(std::string dir);  // torch's, and each layer of this package

// pinned_memory.cpp: the host allocator for pinned memory, and whether data lies in a block of it.
c10::Allocator* pinned_allocator();
bool is_pinned_ptr(const void* data);

// generator.cpp: the devices' default generators (a seed and an offset, as TorchNeuron's: no op
// draws from them, Note [Random ops draw from CPU's generator]) and explicit neuron generators.
void install_generators(c10::DeviceIndex device_count, uint64_t seed);
// runtime/host_math.cpp, Note [MKL's vector math starts racily]: one VML call on this thread,
// before any kernel runs, so no two threads' first calls race.
void set_up_host_vector_math();
const at::Generator& default_generator(c10::DeviceIndex d);  // -1: the current device's
at::Generator new_generator(c10::DeviceIndex d);
// The CPU generator a kernel must be given for g (g itself when it is a CPU generator; torch's
// default CPU generator for a device's default).
at::Generator host_generator(const at::Generator& g);

// aten/generator_lending.cpp: whether the op `name` (ns::op) with these tags may draw random
// numbers on neuron, whose kernels are CPU's (Note [Seeded ops that never draw]).
bool draws_random_numbers(const std::string& name, bool nondeterministic_seeded, bool has_generator_argument);
// Note [Deferred random ops draw at issue]: whether the op (ns::op, overload) may be deferred,
// its draws made at issue: on scratch tensors of its arguments' geometry (how many numbers it
// draws depends on that geometry alone), or by the draws function its custom kernel gave;
// other random ops run at issue.
bool draws_at_issue(const std::string& name, const std::string& overload);
// For a deferred random op (stack holds its arguments from `first`): a copy of torch's default
// CPU generator as it is now, for the op to draw from when it runs, after moving the default on
// as the op's draws will (its CPU kernel run on scratch tensors of its arguments' geometry).
at::Generator draw_at_issue(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first);
bool has_explicit_generator(const torch::jit::Stack& stack, size_t first);  // a Generator among the arguments
// A custom kernel's account of its draws: given its arguments (neuron tensors whose bytes may not
// exist: geometry only), makes from torch's default CPU generator the draws its body will make.
using DrawHook = std::function<void(const torch::jit::Stack& arguments)>;
void set_draw_hook(const std::string& op, DrawHook hook);  // op: "ns::op.overload"
// The generator a deferred random op running on this thread draws from (DrawsFrom), if any.
std::optional<at::Generator> drawing_from();
// While one lives, a random op without a generator that runs on this thread draws from g (the
// generator draw_at_issue gave it); an undefined g changes nothing.
class DrawsFrom {
 public:
  explicit DrawsFrom(const std::optional<at::Generator>& g);
  ~DrawsFrom();
  DrawsFrom(const DrawsFrom&) = delete;
  DrawsFrom& operator=(const DrawsFrom&) = delete;

 private:
  const std::optional<at::Generator>* previous_;
};

// streams.cpp: streams and events on the device's one in-order queue (Note [One queue per device]).
// The synchronizer runs what upper layers hold back for device d (-1: all), then waits for it.
void set_synchronizer(std::function<void(c10::DeviceIndex)> synchronizer,
                      std::function<void(c10::DeviceIndex)> issuer);
void synchronize(c10::DeviceIndex d);
c10::Stream current_stream(c10::DeviceIndex d);  // the calling thread's
c10::Stream new_stream(c10::DeviceIndex d);
c10::Stream exchange_stream(const c10::Stream& s) noexcept;
void record_event(void** event, const c10::Stream& s, c10::EventFlag flag);
void destroy_event(void* event) noexcept;
void synchronize_event(void* event);
double elapsed_ms(void* start, void* end);

// device_timeline.cpp: the device's track in torch.profiler (Note [The device timeline]).
void install_device_timeline();
bool timeline_recording();  // a profiler session asking for the device's track records now
struct TimelineTag {  // what ties a device op to the host: kineto's correlation id, the user's line
  uint64_t correlation = 0;
  IssueSite site;
};
struct TimelineIssue {  // where and when the host issued a launch
  int64_t ns = 0;
  int32_t thread = 0;
  c10::StreamId stream = 0;
  TimelineTag tag;
  std::string label;  // the launch's name, if its issuer gave one (label_next_launch)
};
TimelineIssue timeline_issue();  // the calling thread's, now (it takes the label given)
TimelineTag timeline_tag();  // the calling thread's, now
void label_next_launch(std::string label);  // names the next launch this thread issues
struct TimelineIssueScope {  // while it lives, this thread's launches are `issue`'s
  explicit TimelineIssueScope(const TimelineIssue* issue);
  ~TimelineIssueScope();
  TimelineIssueScope(const TimelineIssueScope&) = delete;
  TimelineIssueScope& operator=(const TimelineIssueScope&) = delete;
  const TimelineIssue* previous;
};
struct TimelineOpScope {  // while it lives, the ops this thread prices are the op `tag` tags
  explicit TimelineOpScope(const TimelineTag* tag);
  ~TimelineOpScope();
  TimelineOpScope(const TimelineOpScope&) = delete;
  TimelineOpScope& operator=(const TimelineOpScope&) = delete;
  const TimelineTag* previous;
};
struct TimelineOp {
  std::string name;
  double us;
  TimelineTag tag;
};
void timeline_op(std::vector<TimelineOp>* ops, std::string_view name, double op_us);  // one op of a launch
void timeline_launch(c10::DeviceIndex d, double overhead_us, double total_us, std::vector<TimelineOp> ops);
void timeline_transfer(c10::DeviceIndex d, int64_t nbytes, double us);

// clock.cpp: one launch of num_ops ops whose roofline time is op_us, on device d's clock;
// returns its emulated time (launch overhead included).
// name: its op's, for the device timeline.
double launch(c10::DeviceIndex d, double op_us, int64_t num_ops, std::string_view name);
// The accounting alone, with the given overhead, spending nothing (Python spends it itself).
double account_launch(c10::DeviceIndex d, double overhead_us, double op_us, int64_t num_ops, std::string_view name);
// on_chip.cpp, Note [On-chip intermediates] (device/cost.py): what stays on chip of the op now
// running in a fused launch, for the first launch it makes (which takes it: nothing after, and
// outside a queued launch's op).
struct OnChipShare {
  double bytes = 0;  // left out of its HBM traffic
  bool folded = false;  // a cast done by a neighbouring instruction: no Vector pass of its own
};
// An op's price in a streamed launch (Note [Streamed launches] in engine/queue.cpp), kept as
// its roofline's terms until the launch's on-chip plan exists; or a price already worked out
// (a Python kernel's), kept to add it in the same order.
struct DeferredPrice {
  int64_t entry;  // the launch's entry whose op made it
  bool roofline;
  std::string name;
  double flops, nbytes, elements;
  at::ScalarType dtype;
  double op_us;  // !roofline: the price
  int64_t num_ops;
};
// While one lives, the launches its thread makes are the ops of one launch, accounted (and
// its overhead spent) when it ends: a fused launch of the adaptive engine (queue.cpp).
struct FusedLaunch {
  explicit FusedLaunch(c10::DeviceIndex d);
  ~FusedLaunch();
  FusedLaunch(const FusedLaunch&) = delete;
  FusedLaunch& operator=(const FusedLaunch&) = delete;
  c10::DeviceIndex device;
  FusedLaunch* previous;
  double op_us = 0;
  int64_t num_ops = 0;
  // >= 0: a launch handed to the device stream, whose launch and this many ops
  // issue_launch already counted; its end charges the device time and settles the ops.
  int64_t issued_ops = -1;
  // Note [Streamed launches]: while set, ops' prices wait here (DeferredPrice) for
  // settle_deferred_prices, and `entry` names the entry whose op runs.
  std::vector<DeferredPrice>* deferred = nullptr;
  int64_t entry = -1;
  std::vector<TimelineOp> timeline_ops;  // while the device timeline records (device_timeline.cpp)
};
// Works out a streamed launch's deferred prices in the order they were made, each entry's
// on-chip share (share(entry)) going to its first roofline, as take_on_chip gives it
// (aten/pricing.cpp); adds them to the launch and the op log.
void settle_deferred_prices(FusedLaunch& launch, const std::function<OnChipShare(int64_t)>& share);
// The fused launch the calling thread is inside, or nullptr; while a FusedLaunchOnThread
// lives, its thread's ops join `launch` (a host waiting on the executor lends it its own).
FusedLaunch* current_fused_launch();
struct FusedLaunchOnThread {
  explicit FusedLaunchOnThread(FusedLaunch* launch);
  ~FusedLaunchOnThread();
  FusedLaunchOnThread(const FusedLaunchOnThread&) = delete;
  FusedLaunchOnThread& operator=(const FusedLaunchOnThread&) = delete;
  FusedLaunch* previous;
};
// A launch handed to the device stream counts as issued at once (stats(wait=False) sees
// it); its device time is charged when it ends (FusedLaunch::issued_ops).
void issue_launch(c10::DeviceIndex d, int64_t num_ops);
// The running entry's OnChipShare, for the first launch its op makes (which takes it).
OnChipShare take_on_chip();
// An empty tensor's new storage (aten/kernels.cpp's factories): while ops are queued, its first
// queued writer makes a value of the launch.
void note_fresh_storage(const c10::Storage& storage);
// ranges.cpp: profiler ranges (Note [Profiler ranges] in device/profiling.py).
bool profiling();  // a torch profiler records now; ask before building a Range
class Range {  // one named range while it lives (nothing if no profiler records)
 public:
  explicit Range(std::string name, const std::unordered_map<std::string, c10::IValue>& args = {});
  Range(const Range&) = delete;
  Range& operator=(const Range&) = delete;

 private:
  std::string name_;
  at::RecordFunction record_;
};
const char* transfer_range_name(bool src_on_device, bool dst_on_device);
// The nested `neuron::device_time` range closing a launch (what="ops") or transfer ("bytes").
void mark_device_time(double device_us, const char* what, int64_t count, c10::DeviceIndex device);
// Whether this thread runs a fused launch now (its ops get no ranges of their own).
bool in_fused_launch();
// What the last fused launch that ended on this thread charged: (device µs, overhead
// included; the ops that ran and were charged, a failed launch's included).
std::pair<double, int64_t> last_fused_launch();

// The launch log (tests): while on, each launch's (device, ops) in order; take empties it.
void set_launch_log(bool on);
std::vector<std::pair<int64_t, int64_t>> take_launch_log();
// The op log: while on, each op the eager path prices, as (name, roofline µs), fused or not.
void set_op_log(bool on);
void log_op(const std::string& name, double op_us);
std::vector<std::pair<std::string, double>> take_op_log();

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

// aten/: the eager path of neuron tensors (CPU kernels on device memory). registration.cpp
// installs it with the cost model's figures, by which pricing.cpp prices each op.
// `converted`: the dtypes whose matmuls are priced as converted, and why (warned once each).
struct Rates {  // µs per unit by ScalarType code, else the default
  std::vector<std::pair<int, double>> by_type;
  double default_us;
};
struct EagerCosts {
  double us_per_byte;  // HBM
  double on_chip_bytes;  // the logical device's SBUF (Note [On-chip intermediates] in device/cost.py)
  Rates us_per_flop;  // the Tensor Engine's (Note [Matmul rates] in device/profiles.py)
  Rates us_per_element;  // the Vector Engine's (Note [The Vector Engine floor] in device/cost.py)
};
void install_eager(const EagerCosts& costs, const std::vector<std::pair<int, std::string>>& converted);
// Note [Collectives on the link] (aten/collective_pricing.cpp): what one rank's collectives
// spend, from device/cost.py's CostModel.collective_costs (once, at install).
struct CollectiveCosts {
  double link_us_per_byte;  // the rank's share of its chip's NeuronLink
  double efa_us_per_byte;  // the rank's share of its instance's EFA (groups beyond one domain)
  double hop_us;  // one link hop's latency
  double reduce_us_per_byte;  // the DMA engines' collective compute
  int64_t ranks_per_domain;  // ranks that one scale-up domain holds
};
void set_collective_costs(const CollectiveCosts& costs);
// pricing.cpp
double on_chip_bytes();
bool runs_on_tensor_engine(const c10::OperatorName& name);  // the ops op_flops counts FLOPs of
// Note [Ops TorchNeuron runs on the host] (pricing.cpp): it runs them on CPU, the chip moves their bytes
bool torchneuron_runs_on_host(const c10::OperatorName& name);
// layouts.cpp: the kernels that refuse sparse and nested (strided) tensors on neuron, kept
// alive in libraries (Note [Dense layouts only]).
void refuse_sparse_and_nested(std::vector<std::unique_ptr<torch::Library>>& libraries);
// layouts.cpp, Note [No quantized tensors]: the kernels that refuse quantized tensors on neuron,
// and what to do instead (for every message that refuses one).
void refuse_quantized_tensors(std::vector<std::unique_ptr<torch::Library>>& libraries);
extern const char* const kQuantizedInstead;
// autograd_layouts.cpp, Note [Backward formulas that pick a layout by device]: the autograd
// kernels that take CPU's layout where torch's formula checks the device; the C++ type of
// the node that native_group_norm's hangs its outputs on (module.cpp shows it to Python as
// torch's NativeGroupNormBackward0).
void register_autograd_layouts(std::vector<std::unique_ptr<torch::Library>>& libraries);
const std::type_info& group_norm_backward_type();
// issue.cpp: the op on the eager path now, whatever the route (after the queue has run): run
// while the caller waits, or posted if posts and eager mode would post it (Note [Recorded ops are posted]).
void run_eager(const c10::OperatorHandle& op, torch::jit::Stack* stack, bool posts = false);
// The kernel of every op neuron runs on the CPU's kernels: offered to the engine's route, else
// run on host aliases now.
void eager_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack);
// composites.cpp, Note [Third-party composite ops]: start watching for them (at install); cover
// the ones defined since the last look (cheap when none: an atomic read); the names covered.
void watch_third_party_composites();
void cover_third_party_composites();
std::vector<std::string> covered_third_party_composites();
// host_alias.cpp: a CPU tensor on t's bytes that keeps them alive; a neuron tensor adopting
// host's bytes (zero-copy, charged to device).
at::Tensor owning_host_alias(const at::Tensor& t);
at::Tensor adopt_host_tensor(const at::Tensor& host, int64_t device);
// Projection mode's counterparts (Note [Projected bytes]): a neuron tensor with a meta tensor's
// geometry on projected bytes of its storage's size, charged as an adopted result; and a neuron
// tensor whose values a kernel run without them wrote (they are no longer known).
at::Tensor adopt_meta_tensor(const at::Tensor& meta, int64_t device);
void forget_values(const at::Tensor& t);
// kernels.cpp: scaled_dot_product_attention's input checks, CPU's (its composite makes them
// before any kernel runs); the kernel CPU's choice picks for host tensors with metadata of neuron
// ones (Note [The overrideable SDPA backend]).
void validate_sdpa_input(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const c10::optional<at::Tensor>& attn_mask);
int64_t host_sdp_choice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const c10::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                        c10::optional<double> scale, bool enable_gqa);
// The same choice for neuron tensors: their host shadows made here (host_shadow).
int64_t device_sdp_choice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const c10::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                          c10::optional<double> scale, bool enable_gqa);

// A new list of v's element type holding fn(element, index) of each element of list v.
template <typename Fn>
c10::IValue map_list(const c10::IValue& v, Fn fn) {
  c10::List<c10::IValue> list = v.toList();
  c10::impl::GenericList out(list.elementType());
  out.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    out.push_back(fn(list.get(i), i));
  }
  return out;
}
// Whether a schema type is Tensor[] (a return the plans hand out as a list).
inline bool is_tensor_list(const c10::TypePtr& type) {
  return type->kind() == c10::TypeKind::ListType && type->containedType(0)->kind() == c10::TypeKind::TensorType;
}

// queue.cpp: the route of ops to the adaptive engine, and the queue of the ops it defers
// (Note [Deferred launches]).
struct OutputSpec {  // a new output as the trace promises it
  std::vector<int64_t> sizes, strides;
  int64_t offset;
  at::ScalarType dtype;
  int64_t nbytes;  // of its storage
  // An undefined tensor (None in Python): a gradient not asked for, as convolution_backward
  // returns for the input of a network's first layer. No storage, nothing to fill.
  bool defined = true;
};
struct DeferPlan {  // how to hand out a deferred op's results
  c10::DeviceIndex device;
  std::vector<OutputSpec> outputs;  // the new (or undefined) outputs, in return order (lists flattened)
  std::vector<int64_t> list_lengths;  // per Tensor[] return
  // A shape-generic trace's op: its outputs come from its shape function at issue
  // (plan_from_meta); `outputs` and `list_lengths` are empty.
  bool from_meta = false;
  // ... and for an elementwise op, the dtype its output has: its geometry is TensorIterator's
  // (Note [Pointwise shape functions]). Undefined: its own shape function.
  at::ScalarType pointwise_dtype = at::ScalarType::Undefined;
};
// meta_plan.cpp: the plan of one call from the op's shape function (Note [Plans from shape
// functions]); nullptr when it has none or it raises.
std::shared_ptr<const DeferPlan> plan_from_meta(const c10::OperatorHandle& op, const torch::jit::Stack& stack,
                                                const DeferPlan& generic);
// What an op's outputs' geometry may depend on, as a flat key: the op, the device, each
// tensor argument's geometry, dtype and device, every other argument's value (a float's only
// with float_values). False for an argument it cannot key (an object, a generator).
bool geometry_key(const c10::OperatorHandle& op, const torch::jit::Stack& stack, c10::DeviceIndex device,
                  std::vector<int64_t>* key, bool float_values = true);
struct GeometryKeyHash {
  size_t operator()(const std::vector<int64_t>& key) const;
};
// The output of an elementwise op on these inputs (meta tensors), as TensorIterator makes it.
at::Tensor pointwise_output(const std::vector<at::Tensor>& inputs, at::ScalarType dtype);
// The route decides for each op of a neuron tensor: true if it handled the op (ran it, or
// queued it with enqueue), false to have the eager path run it. Empty: every op is eager.
using OpRoute = std::function<bool(const c10::OperatorHandle&, torch::jit::Stack*)>;
void set_route(OpRoute route);
// Whether this thread's ops go to the route now (one is set, and the thread is not bypassed).
bool route_active();
// Offers the op to the route (never from inside a launch, nor while bypassed); true if handled.
bool route_op(const c10::OperatorHandle& op, torch::jit::Stack* stack);
// While one lives, its thread's ops take the eager path, whatever the route: run while the
// thread waits, or, posts: posted as eager mode posts them (Note [Recorded ops are posted]).
struct RouteBypass {
  explicit RouteBypass(bool posts = false);
  ~RouteBypass();
  RouteBypass(const RouteBypass&) = delete;
  RouteBypass& operator=(const RouteBypass&) = delete;
  bool previous;
  bool previous_posts;
};
bool set_bypass(bool bypass);  // returns the previous setting; a bypass set so waits for its ops
bool route_bypassed();  // this thread's ops take the eager path now (a compiled graph's, a launch's)
bool bypassed_ops_wait();  // ... and run while the thread waits, never posted
// What a host access runs first while the engine is attached or ops are queued: its flush.
void set_host_sync(std::function<void(const char* reason)> sync);
// reason names the sync point in profiler ranges (`neuron::sync[<reason>]`).
void sync_before_host_access(const char* reason = "host read");
// Launches what is queued before an op runs on the eager path (nothing, when the engine kept
// its rule of flushing first).
void run_before_eager();
// Raises the failed launch's error for a storage whose bytes were never made.
void check_computed(const c10::Storage& storage);
[[noreturn]] void raise_failure();
void enqueue(const c10::OperatorHandle& op, torch::jit::Stack* stack, std::shared_ptr<const DeferPlan> plan);
// An eager op posted to the device as its own launch, its outputs handed out now as the plan
// says (aten/issue.cpp, Note [Eager ops run on the device]).
void post_eager(const c10::OperatorHandle& op, torch::jit::Stack* stack, std::shared_ptr<const DeferPlan> plan);
// NEURON_LAUNCH_BLOCKING=1: every eager op runs while its issuer waits (aten/issue.cpp).
void set_launch_blocking(bool blocking);
// Eager ops issued so far: (posted, run while their issuer waited).
std::pair<int64_t, int64_t> eager_issue_counts();
int64_t queue_size();
// Whether ops are queued (or a failed launch's error waits): an atomic read, from any thread.
bool ops_held();
// The queued ops of one device: issued, not yet run (stats() counts them as ops issued).
int64_t queued_ops(c10::DeviceIndex device);
// Runs the queue as one launch; returns how many ops ran. On an op's error, raises it after
// dropping the ops after it; failed_index() then says which entry failed.
int64_t run_queue();
// Runs the queue on the device stream instead (Note [The device stream]); false if empty. A
// streamed queue (Note [Streamed launches]) is sealed: it is on the stream already.
bool submit_queue();
// Whether the next launch opened (by the next op queued into an empty queue) is streamed.
void stream_next(bool stream);
// Runs job on the executor between the entries of the streamed launch now open, and waits for
// it: for work that touches nothing of that launch (a transfer into bytes only its tensor
// holds). False, running nothing, if no streamed launch is open.
bool run_beside_streamed_launch(const std::function<void()>& job);
bool queue_streamed();  // the queue is a streamed launch, running as it is issued
int64_t forced_seals();  // streamed launches sealed by a wait the engine did not see coming
void set_streamed_launches(bool on);  // off: every launch is submitted whole (tests, diagnosis)
int64_t streamed_launches();  // streamed launches opened, all told
// Launches the engine keeps on the device stream at once (Note [The device stream]).
constexpr int64_t kStreamDepth = 2;
int64_t launches_in_flight();  // submitted, their outcomes not yet collected
bool launch_in_flight();
bool launch_finished();  // every launch on the stream has ended (its host has not collected them yet)
bool oldest_launch_ended();  // the oldest launch not collected has ended: collecting it waits for nothing
// Waits for the oldest launch on the stream; returns how many ops ran, or raises the failing
// op's error as run_queue does (failed_index() then says which). 0 if none is in flight.
int64_t finish_launch();
// Collects the oldest launch's outcome once it has ended, unless it failed (false: left for
// finish_launch, whose caller names the error).
bool collect_launch_if_ok();
int64_t failed_index();
// The failed launch's error, message and Python type name (what reading a value it never
// computed raises), and whether it still waits to be raised (host accesses then sync).
void set_failure(std::string message, std::string type, bool waiting);

}  // namespace neuron
