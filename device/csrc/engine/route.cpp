// The route's Python side: while adaptive mode is on, each op of a neuron tensor is
// handed to the engine (a Python callable) as `engine(op_overload, args, kwargs)`, the way
// torch hands ops to __torch_dispatch__; the engine answers with one of the five kinds of
// `Answer` below (Note [The route's answers]; the Python side names them RouteAnswer, in
// dispatch/executor.py).
// Pure-CPU code never gets here: the route sits in the PrivateUse1 kernels only.
#include "neuron.h"
#include "engine/guards.h"
#include "engine/period_detector.h"

#include <ATen/ScalarOps.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/tensor_memoryformats.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/extension.h>

#include <algorithm>
#include <deque>
#include <limits>
#include <mutex>
#include <optional>
#include <tuple>
#include <string>
#include <unordered_map>

namespace {

using c10::IValue;

py::object* g_run_eager = nullptr;  // leaked: must outlive interpreter shutdown
py::object* g_issue_failed = nullptr;  // the engine's: an op it deferred could not be queued

// Note [One issuer at a time]: the engine decides under its own lock, but queues the op here,
// after that lock is let go, and waiting for the device stream lets go of the GIL as well.
// Between the two another thread could complete the trace and launch the queue without this
// op, whose results are already handed out. So each thread's whole call (the engine's
// answer, then the action and `after`) holds this lock; recursive, for the engine's own ops.
std::recursive_mutex& g_issue = *new std::recursive_mutex;  // leaked, as g_run_eager

// Runs wait() without the GIL if this thread holds it: what it waits for may need it.
template <class Wait>
auto without_gil(Wait wait) {
  if (PyGILState_Check()) {
    py::gil_scoped_release released;
    return wait();
  }
  return wait();
}

struct IssueLock {
  std::unique_lock<std::recursive_mutex> held{g_issue, std::try_to_lock};
  IssueLock() {
    if (!held.owns_lock()) {  // another thread issues: wait for it
      without_gil([this] { held.lock(); });
    }
  }
};

py::object to_python(const c10::Argument& arg, const IValue& v) {
  if (v.isNone()) {
    return py::none();
  }
  // Enum-like arguments travel as ints in an IValue; Python wants the torch objects.
  c10::TypePtr type = arg.real_type();
  if (type->kind() == c10::TypeKind::OptionalType) {
    type = type->containedType(0);
  }
  switch (type->kind()) {
    case c10::TypeKind::ScalarTypeType:
      return py::reinterpret_borrow<py::object>(
          reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<at::ScalarType>(v.toInt()))));
    case c10::TypeKind::LayoutType:
      return py::reinterpret_borrow<py::object>(
          reinterpret_cast<PyObject*>(torch::getTHPLayout(static_cast<at::Layout>(v.toInt()))));
    case c10::TypeKind::MemoryFormatType:
      return py::reinterpret_borrow<py::object>(torch::utils::getTHPMemoryFormat(static_cast<at::MemoryFormat>(v.toInt())));
    default:
      return torch::jit::toPyObject(v);
  }
}

// args and kwargs as __torch_dispatch__ gets them: positional arguments up to the first
// keyword-only one, trailing defaults left out; keyword-only ones that differ from their default.
std::pair<py::tuple, py::dict> to_python_call(const c10::FunctionSchema& schema, const IValue* values) {
  const auto& arguments = schema.arguments();
  const size_t n = arguments.size();
  auto is_default = [&](size_t i) {
    const auto& d = arguments[i].default_value();
    return d.has_value() && *d == values[i];
  };
  size_t kwarg_only_start = n;
  while (kwarg_only_start > 0 && arguments[kwarg_only_start - 1].kwarg_only()) {
    --kwarg_only_start;
  }
  size_t positional_end = kwarg_only_start;
  while (positional_end > 0 && is_default(positional_end - 1)) {
    --positional_end;
  }
  py::tuple args(positional_end);
  for (size_t i = 0; i < positional_end; ++i) {
    args[i] = to_python(arguments[i], values[i]);
  }
  py::dict kwargs;
  for (size_t i = kwarg_only_start; i < n; ++i) {
    if (!is_default(i)) {
      kwargs[py::str(arguments[i].name())] = to_python(arguments[i], values[i]);
    }
  }
  return {std::move(args), std::move(kwargs)};
}

void push_result(const c10::FunctionSchema& schema, torch::jit::Stack* stack, const py::object& out) {
  const auto& returns = schema.returns();
  if (returns.size() == 1) {
    stack->push_back(torch::jit::toIValue(out, returns[0].real_type()));
  } else if (returns.size() > 1) {
    auto items = out.cast<py::sequence>();
    TORCH_CHECK(items.size() == returns.size(), "the engine returned ", items.size(), " results for ",
                schema.operator_name(), ", which has ", returns.size());
    for (size_t i = 0; i < returns.size(); ++i) {
      stack->push_back(torch::jit::toIValue(items[i], returns[i].real_type()));
    }
  }
}

py::object results_to_python(const c10::FunctionSchema& schema, const torch::jit::Stack& stack) {
  const size_t n = schema.returns().size();
  if (n == 0) {
    return py::none();
  }
  if (n == 1) {
    return torch::jit::toPyObject(stack.back());
  }
  py::tuple out(n);
  for (size_t i = 0; i < n; ++i) {
    out[i] = torch::jit::toPyObject(stack[stack.size() - n + i]);
  }
  return std::move(out);
}

// The engine counted an op as queued that was not: it ends its match (engine.issue_failed).
void tell_issue_failed(const char* reason) {
  try {
    if (g_issue_failed != nullptr && !g_issue_failed->is_none()) {
      (*g_issue_failed)(reason);
    }
  } catch (py::error_already_set& e) {
    e.discard_as_unraisable(__func__);  // the op's own error, if any, is the one to raise
  }
}

// Note [The route's answers]: what the engine answers for an op, read once.
enum class AnswerKind {
  kRunEager,      // RUN_EAGER: run it on the eager path now (its held-back ops have run: queue.cpp)
  kRunEagerThen,  // (RUN_EAGER, after): run it now, then call after(results): the engine records it
  kDefer,         // a DeferPlan: queue it (Note [Deferred launches]), hand out its results at once
  kDeferThen,     // (DeferPlan, after): queue it, then call after(): the engine launches the queue
  kResult,        // anything else: the op's result, which the engine computed itself
};

struct Answer {
  AnswerKind kind;
  py::object value;  // the plan, or the result
  py::object after;  // kRunEagerThen, kDeferThen
};

Answer read_answer(py::object out) {
  if (out.is(*g_run_eager)) {
    return {AnswerKind::kRunEager, {}, {}};
  }
  if (py::isinstance<neuron::DeferPlan>(out)) {
    return {AnswerKind::kDefer, std::move(out), {}};
  }
  if (py::isinstance<py::tuple>(out) && py::len(out) == 2) {
    py::tuple pair = out.cast<py::tuple>();
    py::object action = pair[0];
    if (action.is(*g_run_eager)) {
      return {AnswerKind::kRunEagerThen, {}, pair[1]};
    }
    if (py::isinstance<neuron::DeferPlan>(action)) {
      return {AnswerKind::kDeferThen, std::move(action), pair[1]};
    }
  }
  return {AnswerKind::kResult, std::move(out), {}};
}

// Note [Armed matching]: while a cached trace is being matched (once detection has paused,
// or gone quiet for a while before that), the engine arms the route with the trace's next
// positions (their guards, Note [A position's guards in C++], and plans): each op that fits
// the next one is queued here, with no Python call, and the count moves on. The first op that does not fit, or the end of the armed
// positions (the trace's last op, whose completion is Python's but in Note [Armed rounds]),
// disarms it and goes to the engine, which first takes the count (disarm: absolute values,
// so taking it twice is harmless), gives its detection the positions matched here if it has
// not paused (in order, before the op that disarmed: the history is as if matched one by one),
// and then matches, diverges or completes as it always does.
//
// Note [Armed rounds]
// ~~~~~~~~~~~~~~~~~~~
// Armed with `wrap` (the trace's launches may use the device stream, and the engine has
// launched nothing of this match yet), the route also matches the trace's last op and does
// what the engine's completion does for such a launch: it makes room on the stream (collects
// the oldest launch's outcome, waiting without the GIL), submits the queue as one launch,
// and goes on at the trace's first position: a loop whose step is one cached trace runs
// with no Python call at all. The engine takes the rounds at its next entry (disarm: how many
// were submitted, how many outcomes collected) and counts them as completions. The route goes
// back to the engine instead where the engine must decide: an outcome that failed (its error
// names the trace's op: the engine collects it), the stream turned off, or a profiler on
// (its launches are ranges the engine draws).
// A shape-generic trace's rounds too: each binds its symbols anew, and its completion notes
// the sizes it met as the engine's would (Trace.note_sizes: note_round_sizes).
//
// Note [Armed syncs]
// ~~~~~~~~~~~~~~~~~~
// A loop that reads the host every step (generate() reads its stopping criteria each token)
// reaches a sync point between two rounds: nothing is queued, only launches on the stream.
// What the engine does there (Note [Sync points]: wait for them, count the sync, move the
// stream position past it) the route does here (sync_armed), so the step's trace is not
// disarmed, and the next round starts in C++: before, every such step cost two calls of the
// engine (its first op, to start the trace again, and its last, to complete it). Anything
// else at a sync goes to the engine: an op queued, an error waiting, a launch that failed
// (its error names the trace's op), a profiler on (a sync is a range it draws).
struct GuardTable {
  std::vector<std::shared_ptr<const neuron::PositionGuards>> guards;  // per trace position
  std::vector<std::shared_ptr<const neuron::DeferPlan>> plans;
  int32_t nsyms = 0;  // the most symbols a position names (Note [Generic guards]): checked once per arming
};

// Note [Detection fed by the route]: a trace's positions' (exact, size-erased) detector keys,
// made once per trace (and per start afresh of the engine's key tables), not per arming.
struct FeedKeys {
  std::vector<std::pair<int64_t, int64_t>> keys;
};

struct Armed {
  std::mutex lock;  // a leaf: taken under g_issue, or under the engine's lock with the GIL
  std::shared_ptr<const GuardTable> table;
  size_t pos = 0;  // the trace position the next op must fit
  size_t stop = 0;  // armed for positions [pos, stop)
  int64_t position = 0;  // the engine's stream position, moved with pos
  int64_t matched = 0;  // ops queued here, all told
  int64_t generation = -1;  // the engine's name for this arming: disarm tells it which it ends
  bool wrap = false;  // Note [Armed rounds]: complete the trace here and go on from its start
  int64_t rounds = 0;  // trace launches submitted here since armed
  int64_t collected = 0;  // launch outcomes collected here since armed (all without errors)
  std::vector<int64_t> syms;  // a generic trace's sizes as this match binds them (Note [Generic guards])
  // A generic trace's last completions' sizes (Trace.recent_sizes, rounds included), how
  // many of them to keep, and whether a round's sizes were among them (Trace.sizes_repeat).
  std::deque<std::vector<int64_t>> recent_sizes;
  size_t sizes_kept = 0;
  bool sizes_repeat = false;
  // Note [Armed syncs]: the engine's last sync's stream position and the longest stretch
  // between two syncs, moved by the syncs taken here.
  int64_t last_sync_at = 0;
  int64_t longest_unsynced = 0;
  // Note [Detection fed by the route]: per trace position, its exact and size-erased keys
  // (empty: not fed here); the engine's two detectors; the position whose keys fired a
  // period (-1: none) and what each detector answered there; what decides a quiet pause.
  std::shared_ptr<const FeedKeys> feed_keys;
  neuron::PeriodDetector* detector = nullptr;
  neuron::PeriodDetector* shape_detector = nullptr;
  int64_t fired_at = -1;
  std::optional<int64_t> fired_period, fired_shape_period;
  struct QuietWatch {  // the engine's _maybe_quiet, its numbers as at arming
    int64_t fruitless = 0, fruitless_limit = 0, max_pause_after = 0, twice_repeats = 0, longest_unsynced = 0;
  } quiet;
  bool armed = false;
};
Armed& g_armed = *new Armed;  // leaked, as g_run_eager
// A symbol not bound yet, as Python's None: no size, stride, offset or int argument is this.
constexpr int64_t kUnbound = std::numeric_limits<int64_t>::min();
std::atomic<bool> g_stream_allowed{true};  // stream.set_enabled's setting: rounds only while true

// Room for one more launch on the stream, for a round's completion: false where the engine
// must look (the oldest outcome failed). Waits without the GIL (a launch may take it).
bool make_room_on_stream() {
  while (neuron::launches_in_flight() >= neuron::kStreamDepth) {
    if (!without_gil(neuron::collect_launch_if_ok)) {
      return false;
    }
    ++g_armed.collected;
  }
  return true;
}

// A generic trace's round completed here: its sizes, noted as Trace.note_sizes notes them,
// and its symbols unbound for the next round.
void note_round_sizes() {
  auto& recent = g_armed.recent_sizes;
  if (std::find(recent.begin(), recent.end(), g_armed.syms) != recent.end()) {
    g_armed.sizes_repeat = true;
  }
  recent.push_back(g_armed.syms);
  while (recent.size() > g_armed.sizes_kept) {
    recent.pop_front();
  }
  std::fill(g_armed.syms.begin(), g_armed.syms.end(), kUnbound);
}

// Note [Armed syncs]: a host access between two rounds, taken here; false if the engine must.
bool sync_armed() {
  // Never waits for another issuer: a thread inside the engine may be the one holding it,
  // and the engine takes every sync correctly.
  const std::unique_lock<std::recursive_mutex> issuing{g_issue, std::try_to_lock};
  if (!issuing.owns_lock()) {
    return false;
  }
  const std::lock_guard<std::mutex> guard(g_armed.lock);
  if (!g_armed.armed || !g_armed.wrap || g_armed.pos != 0 || neuron::ops_held() || neuron::queue_streamed() ||
      !g_stream_allowed.load() || torch::autograd::profiler::profilerEnabled()) {
    return false;
  }
  while (neuron::launches_in_flight() > 0) {
    if (!without_gil(neuron::collect_launch_if_ok)) {
      return false;  // the engine collects the failed one and raises its error
    }
    ++g_armed.collected;
  }
  // As the engine's _note_sync, then its stream position past the sync (detection is paused).
  g_armed.longest_unsynced = std::max(g_armed.longest_unsynced, g_armed.position - g_armed.last_sync_at);
  g_armed.last_sync_at = g_armed.position;
  ++g_armed.position;
  return true;
}

// Note [Detection fed by the route]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Before detection pauses, each op the route matches must reach the engine's period detectors
// as the engine would have pushed it, at its place in the stream: an adoption made late
// places the new trace where the stream has already passed (Note [Armed matching while
// detecting] in adaptive_eager/engine/executor.py). Armed with each position's two keys (an
// exact trace whose ops the detectors have seen, so no key is new), the route pushes them
// itself, as the engine's _advance would, and a period that fires disarms it after that op:
// the engine takes the matched ops into its history at its next entry, this one's answers
// with it, and adopts right where it would have, op by op. So the route is armed from a
// trace's second match (its first, in Python, takes each position's source line), where it
// waited before for detection to go quiet, and the ops of a small MLP's steps 4 to 12 are
// matched here instead of in Python. The route stops likewise
// after the op at which the engine's _maybe_quiet would pause detection (its count of ops
// with nothing found reaches its limit: the same arithmetic, on the numbers it had at
// arming), so that no op after it reaches the detectors, as none would from the engine.
// Returns whether it must stop. The detectors are the engine's, which disarms before it
// touches them (its lock's entry) and before it replaces them (reset): used only while armed.
bool feed_detectors(size_t k) {
  if (!g_armed.feed_keys) {
    return false;
  }
  const auto& [key, shape_key] = g_armed.feed_keys->keys[k];
  const std::optional<int64_t> period = g_armed.detector->push(key);
  const std::optional<int64_t> shape_period = g_armed.shape_detector->push(shape_key);
  if (period || shape_period) {
    g_armed.fired_at = static_cast<int64_t>(k);
    g_armed.fired_period = period;
    g_armed.fired_shape_period = shape_period;
    return true;
  }
  auto& quiet = g_armed.quiet;
  if (++quiet.fruitless < quiet.fruitless_limit) {
    return false;
  }
  // As _maybe_quiet: g_armed.position is the engine's self.position once it advanced past this op.
  const int64_t unit = std::max(quiet.longest_unsynced, g_armed.position - g_armed.last_sync_at);
  const int64_t limit = std::max(quiet.fruitless_limit, std::min(quiet.max_pause_after, quiet.twice_repeats * unit));
  return quiet.fruitless >= limit;
}

bool match_armed(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  std::unique_lock<std::mutex> guard(g_armed.lock);
  if (!g_armed.armed) {
    return false;
  }
  const size_t k = g_armed.pos;
  const auto& guards = *g_armed.table->guards[k];
  const bool last = g_armed.wrap && k + 1 == g_armed.table->guards.size();
  if (last && (!g_stream_allowed.load() || torch::autograd::profiler::profilerEnabled())) {
    g_armed.armed = false;  // the engine completes it (Note [Armed rounds])
    return false;
  }
  if (!guards.matches(op, *stack, g_armed.syms.data())) {
    g_armed.armed = false;  // the engine looks at this op: a divergence, or a switch
    return false;
  }
  std::shared_ptr<const neuron::DeferPlan> plan = g_armed.table->plans[k];
  if (plan->from_meta) {  // a generic position's: Note [Plans from shape functions] (meta_plan.cpp)
    plan = neuron::plan_from_meta(op, *stack, *plan);
    if (!plan) {  // the engine matches it again, and finds it has no shape function
      g_armed.armed = false;
      return false;
    }
  }
  // A streamed launch is on the stream already (Note [Streamed launches] in queue.cpp).
  if (last && !neuron::queue_streamed() && !make_room_on_stream()) {
    g_armed.armed = false;
    return false;
  }
  // Counted before it is queued, as the engine counts a position before the route queues
  // it: an op that raises (out of memory) was counted, and the engine's issue_failed ends
  // the match (Note [Interrupted issue]).
  ++g_armed.pos;
  ++g_armed.position;
  ++g_armed.matched;
  const bool fired = feed_detectors(k);  // always: every matched op is pushed
  g_armed.armed = g_armed.pos < g_armed.stop && !fired;
  try {
    neuron::enqueue(op, stack, std::move(plan));
    if (last) {  // Note [Armed rounds]: the engine's completion of a stream launch
      neuron::submit_queue();
      ++g_armed.rounds;
      if (!g_armed.syms.empty()) {
        note_round_sizes();
      }
      g_armed.pos = 0;
      g_armed.armed = true;
      // The next round streams (Note [Streamed launches]) if there is room on the stream,
      // made by collecting what has ended (waiting here would keep the host one launch
      // closer to the device); else it is submitted whole, as before.
      while (neuron::launches_in_flight() >= neuron::kStreamDepth && neuron::oldest_launch_ended() &&
             without_gil(neuron::collect_launch_if_ok)) {
        ++g_armed.collected;
      }
      neuron::stream_next(neuron::launches_in_flight() < neuron::kStreamDepth);
    }
  } catch (...) {
    g_armed.armed = false;
    guard.unlock();
    if (Py_IsInitialized()) {  // not at interpreter exit: no engine to tell
      py::gil_scoped_acquire gil;
      tell_issue_failed("out of memory");
    }
    throw;
  }
  return true;
}

bool call_engine(const py::object& engine, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (!Py_IsInitialized()) {
    return false;
  }
  const IssueLock issuing;  // before the GIL: Note [One issuer at a time]
  py::gil_scoped_acquire gil;
  const c10::FunctionSchema& schema = op.schema();
  const size_t n = schema.arguments().size();
  auto [args, kwargs] = to_python_call(schema, stack->data() + (stack->size() - n));
  Answer answer = read_answer(engine(torch::detail::getTorchApiFunction(op), args, kwargs));
  switch (answer.kind) {
    case AnswerKind::kRunEager:
      return false;  // the eager path runs it
    case AnswerKind::kRunEagerThen:
      neuron::run_eager(op, stack, /*posts=*/true);  // Note [Recorded ops are posted]
      answer.after(results_to_python(schema, *stack));
      return true;
    case AnswerKind::kResult:
      torch::jit::drop(*stack, n);
      push_result(schema, stack, answer.value);
      return true;
    case AnswerKind::kDefer:
    case AnswerKind::kDeferThen:
      break;
  }
  // kDefer, kDeferThen: queue it.
  std::shared_ptr<const neuron::DeferPlan> plan = answer.value.cast<std::shared_ptr<neuron::DeferPlan>>();
  if (plan->from_meta) {  // Note [Plans from shape functions] (meta_plan.cpp)
    plan = neuron::plan_from_meta(op, *stack, *plan);
    if (!plan) {  // not deferred after all: the engine ends its match, and the op runs now
      tell_issue_failed("no shape function");
      neuron::run_eager(op, stack);
      return true;
    }
  }
  // An output of the launch on the stream with no bytes yet is captured as a pending read,
  // as any queued value is (Note [A read of the launch in flight]): no wait here.
  try {
    neuron::enqueue(op, stack, std::move(plan));
  } catch (...) {
    // The engine counted the op as queued: tell it the op raised instead (out of memory).
    tell_issue_failed("out of memory");
    throw;
  }
  if (answer.kind == AnswerKind::kDeferThen) {
    answer.after();
  }
  return true;
}

// A kernel written in Python at PrivateUse1 (custom kernels: dispatch/custom_kernels.py) is not
// behind the C++ fallback; it offers its call to the route itself. Returns (handled, result):
// not handled, the kernel runs its body now (anything queued has run by then).
py::tuple offer(const py::object& func, const py::tuple& args, const py::dict& kwargs) {
  if (!neuron::route_active()) {  // eager mode, or the launch running this kernel: no stack to build
    return py::make_tuple(false, py::none());
  }
  const c10::OperatorHandle& op = neuron::op_of(func);
  torch::jit::Stack stack = neuron::stack_of(op, args, kwargs);
  if (!neuron::route_op(op, &stack)) {
    return py::make_tuple(false, py::none());
  }
  return py::make_tuple(true, results_to_python(op.schema(), stack));
}

// Which recorded op last wrote a tensor's bytes, for the engine's choice of where a trace
// starts (its values live across a cut). Keyed by storage, not TensorImpl: what reads a
// value is often another TensorImpl over the same bytes (a view such as the `t()` that makes
// a weight's gradient, or the shallow copy autograd saves of an output), and must still be
// seen as reading it. Held weakly: a weak reference keeps the address from being reused (no
// stale answer for new bytes), frees no later than the storage would, and counts no use
// (autograd's in-place decisions read use counts: Note [Queued arguments count no references]).
struct Producer {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  int64_t position, slot;
};
std::unordered_map<const c10::StorageImpl*, Producer> g_producers;
constexpr size_t kProducersKept = 1 << 16;  // a stream that never repeats: bounded memory

void note_producer(const at::Tensor& t, int64_t position, int64_t slot) {
  if (!t.has_storage()) {
    return;
  }
  if (g_producers.size() > kProducersKept) {
    g_producers.clear();
  }
  const c10::Storage& storage = t.storage();
  g_producers.insert_or_assign(storage.unsafeGetStorageImpl(),
                               Producer{storage.getWeakStorageImpl(), position, slot});
}

py::object producer_of(const at::Tensor& t) {
  if (!t.has_storage()) {
    return py::none();
  }
  auto it = g_producers.find(t.storage().unsafeGetStorageImpl());
  if (it == g_producers.end()) {
    return py::none();
  }
  if (it->second.storage.expired()) {  // cannot be t's: t holds it. Stale; drop it
    g_producers.erase(it);
    return py::none();
  }
  return py::make_tuple(it->second.position, it->second.slot);
}

// Python callables held by C++ for the process's life, in leaked objects (see module.cpp).
void set_engine(py::object engine, py::object issue_failed) {
  if (engine.is_none()) {
    neuron::set_route(nullptr);
    return;
  }
  g_issue_failed = new py::object(std::move(issue_failed));  // leaked, as the engine is
  auto* held = new py::object(std::move(engine));
  neuron::set_route([held](const c10::OperatorHandle& op, torch::jit::Stack* stack) {
    {
      const IssueLock issuing;  // Note [One issuer at a time]
      if (match_armed(op, stack)) {  // Note [Armed matching]
        return true;
      }
    }
    return call_engine(*held, op, stack);
  });
}

void set_host_sync(py::object sync) {
  auto* held = new py::object(std::move(sync));
  neuron::set_host_sync([held](const char* reason) {
    if (!Py_IsInitialized()) {
      return;
    }
    if (sync_armed()) {  // Note [Armed syncs]
      return;
    }
    py::gil_scoped_acquire gil;
    (*held)(reason);
  });
}

using OutputTuple = std::tuple<std::vector<int64_t>, std::vector<int64_t>, int64_t, at::ScalarType, int64_t>;

std::shared_ptr<neuron::DeferPlan> make_plan(int64_t device, const std::vector<std::optional<OutputTuple>>& outputs,
                                             std::vector<int64_t> list_lengths) {
  auto plan = std::make_shared<neuron::DeferPlan>();
  plan->device = neuron::checked_device(device);
  for (const auto& output : outputs) {
    if (!output) {  // an undefined result
      plan->outputs.push_back(neuron::OutputSpec{{}, {}, 0, at::ScalarType::Undefined, 0, /*defined=*/false});
      continue;
    }
    const auto& [sizes, strides, offset, dtype, nbytes] = *output;
    TORCH_CHECK(sizes.size() == strides.size(), "an output spec needs one stride per size");
    plan->outputs.push_back(neuron::OutputSpec{sizes, strides, offset, dtype, nbytes});
  }
  plan->list_lengths = std::move(list_lengths);
  return plan;
}

}  // namespace

void bind_route(py::module_& m) {
  g_run_eager = new py::object(py::module_::import("builtins").attr("object")());
  m.attr("RUN_EAGER") = *g_run_eager;
  py::class_<neuron::DeferPlan, std::shared_ptr<neuron::DeferPlan>>(m, "DeferPlan")
      .def(py::init(&make_plan), py::arg("device"), py::arg("outputs"), py::arg("list_lengths"),
           "outputs: (sizes, strides, storage offset, dtype, storage nbytes) per new output, in return order; "
           "None for an undefined one")
      .def_readonly("is_from_meta", &neuron::DeferPlan::from_meta, "its outputs come from the op's shape function at issue")
      .def_static("from_meta", [](int64_t device, std::optional<at::ScalarType> pointwise_dtype) {
        auto plan = std::make_shared<neuron::DeferPlan>();
        plan->device = neuron::checked_device(device);
        plan->from_meta = true;
        plan->pointwise_dtype = pointwise_dtype.value_or(at::ScalarType::Undefined);
        return plan;
      }, py::arg("device"), py::arg("pointwise_dtype") = py::none(),
      "a plan whose outputs the op's shape function gives at issue (Note [Plans from shape functions]); "
      "pointwise_dtype: an elementwise op's, TensorIterator's geometry (Note [Pointwise shape functions])");
  m.def("pointwise_geometry", [](const std::vector<at::Tensor>& inputs, at::ScalarType dtype) {
    const at::Tensor out = neuron::pointwise_output(inputs, dtype);
    return py::make_tuple(out.sizes().vec(), out.strides().vec(), out.storage_offset());
  }, py::arg("inputs"), py::arg("dtype"), "(sizes, strides, offset) of an elementwise op's output on these meta inputs");
  m.def("set_engine", &set_engine, py::arg("engine"), py::arg("issue_failed") = py::none(),
        "engine(op, args, kwargs) gets every op of neuron tensors; None: none does. issue_failed(reason) is "
        "called when an op the engine deferred was not queued: it raised (out of memory), or had no plan");
  // A storage's identity and size without making its Python object (which would hold a
  // reference to it: Note [Queued arguments count no references]).
  m.def("storage_of", [](const at::Tensor& t) {
    return py::make_tuple(reinterpret_cast<intptr_t>(t.storage().unsafeGetStorageImpl()),
                          static_cast<int64_t>(t.storage().nbytes()));
  }, "(identity, nbytes) of t's storage");
  m.def("note_producer", &note_producer, "t was last written by the recorded op at (position, slot)");
  m.def("producer_of", &producer_of, "(position, slot) of the recorded op that last wrote t, or None");
  m.def("forget_producers", []() { g_producers.clear(); });
  m.def("offer", &offer, "a Python kernel's call, offered to the route: (handled, result)");
  // Note [A position's guards in C++] (guards.cpp)
  py::class_<neuron::PositionGuards, std::shared_ptr<neuron::PositionGuards>>(m, "PositionGuards")
      .def(py::init([](const py::object& func, const py::sequence& per_argument) {
             auto guards = std::make_shared<neuron::PositionGuards>(neuron::PositionGuards{neuron::op_of(func), {}, true, 0});
             TORCH_CHECK(per_argument.size() == guards->op.schema().arguments().size(),
                         "adaptive engine bug: ", per_argument.size(), " guards for ", guards->op.schema().operator_name(),
                         "'s ", guards->op.schema().arguments().size(), " arguments");
             for (const auto& item : per_argument) {
               const auto pair = item.cast<py::tuple>();
               neuron::ArgGuard arg{neuron::parse_guard(pair[0]), pair[1].cast<bool>()};
               guards->supported = guards->supported && !neuron::has_unsupported(arg.guard);
               guards->nsyms = std::max(guards->nsyms, neuron::symbols_named(arg.guard));
               guards->args.push_back(std::move(arg));
             }
             return guards;
           }),
           py::arg("func"), py::arg("per_argument"), "per schema argument: (guard, given where its default is left out)")
      .def_readonly("supported", &neuron::PositionGuards::supported)
      .def("matches", [](const neuron::PositionGuards& guards, const py::object& func, const py::tuple& args,
                         const py::dict& kwargs) {
             const c10::OperatorHandle& op = neuron::op_of(func);
             return guards.matches(op, neuron::stack_of(op, args, kwargs));
           }, "whether the call (func, args, kwargs) fits, checked on its IValue stack")
      .def_readonly("nsyms", &neuron::PositionGuards::nsyms)
      .def("binds", [](const neuron::PositionGuards& guards, const py::object& func, const py::tuple& args,
                       const py::dict& kwargs, std::vector<int64_t> syms) -> std::optional<std::vector<int64_t>> {
             TORCH_CHECK(static_cast<int64_t>(syms.size()) >= guards.nsyms, "binds: ", syms.size(), " symbols for a position naming ",
                         guards.nsyms);
             const c10::OperatorHandle& op = neuron::op_of(func);
             if (!guards.matches(op, neuron::stack_of(op, args, kwargs), syms.data())) {
               return std::nullopt;
             }
             return syms;
           }, "a generic position's check (Note [Generic guards]): the symbols after the call, or None if it does not fit");
  py::class_<FeedKeys, std::shared_ptr<FeedKeys>>(m, "FeedKeys")
      .def(py::init([](std::vector<std::pair<int64_t, int64_t>> keys) {
             return std::make_shared<FeedKeys>(FeedKeys{std::move(keys)});
           }),
           py::arg("keys"), "a trace's positions' (exact, size-erased) detector keys (Note [Detection fed by the route])");
  py::class_<GuardTable, std::shared_ptr<GuardTable>>(m, "GuardTable")
      .def(py::init([](std::vector<std::shared_ptr<neuron::PositionGuards>> guards,
                       std::vector<std::shared_ptr<neuron::DeferPlan>> plans) {
             TORCH_CHECK(guards.size() == plans.size(), "adaptive engine bug: ", guards.size(), " guards, ", plans.size(), " plans");
             auto table = std::make_shared<GuardTable>();
             table->guards.assign(guards.begin(), guards.end());
             table->plans.assign(plans.begin(), plans.end());
             for (const auto& g : guards) {
               table->nsyms = std::max(table->nsyms, g->nsyms);
             }
             return table;
           }),
           "a trace's positions for armed matching (Note [Armed matching])");
  // Both without the GIL while they wait for the lock: its holder may be queueing an op on
  // autograd's thread, and dropping a tensor there can take the GIL.
  m.def("arm", [](std::shared_ptr<GuardTable> table, size_t pos, size_t stop, int64_t position, int64_t generation,
                  bool wrap, std::vector<std::optional<int64_t>> syms, int64_t last_sync_at,
                  std::vector<std::vector<std::optional<int64_t>>> recent_sizes, size_t sizes_kept,
                  std::shared_ptr<FeedKeys> feed_keys, neuron::PeriodDetector* detector,
                  neuron::PeriodDetector* shape_detector, std::vector<int64_t> quiet) {
    TORCH_CHECK(pos < stop && stop <= table->guards.size() && (!wrap || stop == table->guards.size()),
                "adaptive engine bug: arming [", pos, ", ", stop, ")");
    TORCH_CHECK(!feed_keys || (feed_keys->keys.size() == table->guards.size() && !wrap && detector != nullptr &&
                               shape_detector != nullptr && quiet.size() == 5),
                "adaptive engine bug: ", feed_keys ? feed_keys->keys.size() : 0, " positions' keys to feed for a trace of ",
                table->guards.size(), wrap ? ", armed for rounds" : "",
                detector == nullptr || shape_detector == nullptr ? ", no detectors" : "", ", ", quiet.size(),
                " numbers of the quiet pause");
    TORCH_CHECK(table->nsyms <= static_cast<int32_t>(syms.size()), "adaptive engine bug: the trace names ", table->nsyms,
                " symbols, the match has ", syms.size());
    const std::lock_guard<std::mutex> guard(g_armed.lock);
    g_armed.generation = generation;
    g_armed.table = std::move(table);
    g_armed.pos = pos;
    g_armed.stop = stop;
    g_armed.position = position;
    g_armed.wrap = wrap;
    g_armed.rounds = 0;
    g_armed.collected = 0;
    g_armed.syms.resize(syms.size());  // an unbound one is bound before it is read
    for (size_t i = 0; i < syms.size(); ++i) {
      g_armed.syms[i] = syms[i].value_or(kUnbound);
    }
    g_armed.recent_sizes.clear();
    for (const auto& sizes : recent_sizes) {
      g_armed.recent_sizes.emplace_back();
      for (const auto& size : sizes) {
        g_armed.recent_sizes.back().push_back(size.value_or(kUnbound));
      }
    }
    g_armed.sizes_kept = sizes_kept;
    g_armed.sizes_repeat = false;
    g_armed.last_sync_at = last_sync_at;
    g_armed.longest_unsynced = 0;
    g_armed.feed_keys = std::move(feed_keys);
    g_armed.detector = detector;
    g_armed.shape_detector = shape_detector;
    if (quiet.size() == 5) {
      g_armed.quiet = {quiet[0], quiet[1], quiet[2], quiet[3], quiet[4]};
    }
    g_armed.fired_at = -1;
    g_armed.fired_period.reset();
    g_armed.fired_shape_period.reset();
    g_armed.armed = true;
  }, py::arg("table"), py::arg("pos"), py::arg("stop"), py::arg("position"), py::arg("generation"), py::arg("wrap"),
  py::arg("syms") = std::vector<std::optional<int64_t>>{}, py::arg("last_sync_at") = 0,
  py::arg("recent_sizes") = std::vector<std::vector<std::optional<int64_t>>>{}, py::arg("sizes_kept") = 0,
  py::arg("feed_keys") = nullptr, py::arg("detector") = nullptr,
  py::arg("shape_detector") = nullptr, py::arg("quiet") = std::vector<int64_t>{},
  py::call_guard<py::gil_scoped_release>(),
  "match positions [pos, stop) of the table in C++; position: the engine's stream position; "
  "generation: the engine's name for this arming; wrap: complete the trace and go on (Note [Armed rounds]); "
  "syms: a generic trace's sizes bound so far (None: not yet), Note [Generic guards]; last_sync_at: the "
  "engine's last sync's position (Note [Armed syncs]); recent_sizes, sizes_kept: a generic trace's last "
  "completions' sizes and how many it keeps, which its rounds add to; feed_keys, detector, shape_detector: each "
  "position's (exact, size-erased) keys, pushed to the two detectors as it is matched, and quiet: the engine's "
  "(fruitless, fruitless limit, longest pause, 2 x repeats, longest unsynced stretch), to stop where it would pause "
  "(Note [Detection fed by the route])");
  m.def("disarm", []() {
    const std::lock_guard<std::mutex> guard(g_armed.lock);
    g_armed.armed = false;
    auto to_python_sizes = [](const std::vector<int64_t>& sizes) {
      std::vector<std::optional<int64_t>> out;
      for (int64_t size : sizes) {
        out.push_back(size == kUnbound ? std::nullopt : std::optional<int64_t>(size));
      }
      return out;
    };
    std::vector<std::vector<std::optional<int64_t>>> recent;
    for (const auto& sizes : g_armed.recent_sizes) {
      recent.push_back(to_python_sizes(sizes));
    }
    std::optional<std::tuple<int64_t, std::optional<int64_t>, std::optional<int64_t>>> fired;
    if (g_armed.fired_at >= 0) {
      fired = std::make_tuple(g_armed.fired_at, g_armed.fired_period, g_armed.fired_shape_period);
    }
    return std::make_tuple(g_armed.generation, g_armed.pos, g_armed.position, g_armed.rounds, g_armed.collected,
                           to_python_sizes(g_armed.syms), std::move(recent), g_armed.sizes_repeat,
                           g_armed.last_sync_at, g_armed.longest_unsynced, std::move(fired));
  }, py::call_guard<py::gil_scoped_release>(),
  "stop matching in C++: (arming's generation, trace position, stream position, rounds submitted, outcomes "
  "collected, a generic trace's symbols, its last completions' sizes, whether a round's repeated one of "
  "them, the last sync's position, the longest stretch between syncs, and (trace position, period, size-erased "
  "period) where a pushed key fired, else None), the same if called again");
  m.def("set_stream_allowed", [](bool allowed) { g_stream_allowed.store(allowed); },
        "whether armed rounds may submit to the device stream (stream.set_enabled)");
  m.def("armed_matches", []() { return g_armed.matched; }, "ops queued by armed matching, all told");
  m.def("route_call", [](const py::object& func, const py::tuple& args, const py::dict& kwargs) {
    const c10::OperatorHandle& op = neuron::op_of(func);
    const torch::jit::Stack stack = neuron::stack_of(op, args, kwargs);
    return to_python_call(op.schema(), stack.data());
  }, "(args, kwargs) as the route hands this call to the engine (tests: the matchers' input)");
  m.def("set_host_sync", &set_host_sync, "fn(reason) runs before a host access while ops are queued");
  m.def("set_bypass", &neuron::set_bypass, "True: this thread's ops take the eager path; returns the previous value");
  m.def("run_queue", &neuron::run_queue, "run the queued ops as one launch; returns how many ran");
  m.def("queue_size", &neuron::queue_size);
  m.def("host_sync", [](const std::string& reason) { neuron::sync_before_host_access(reason.c_str()); },
        py::arg("reason"), "a sync point: what the engine holds back runs first (named `reason`)");
  m.def("last_fused_launch", &neuron::last_fused_launch,
        "(device µs, ops) the last fused launch that ended on this thread charged (its profiler mark)");
  m.def("queued_ops", &neuron::queued_ops, py::arg("device"), "a device's queued ops: issued, not yet run");
  m.def("submit_queue", &neuron::submit_queue, "run the queue on the device stream, beside the host");
  m.def("stream_next", &neuron::stream_next, py::arg("stream"),
        "whether the next launch opened runs on the device stream as it is issued (Note [Streamed launches])");
  m.def("queue_streamed", &neuron::queue_streamed, "the queue is a streamed launch, already on the device stream");
  m.def("forced_seals", &neuron::forced_seals, "streamed launches sealed by a wait the engine did not see coming");
  m.def("set_streamed_launches", &neuron::set_streamed_launches, py::arg("on"),
        "off: every launch is submitted whole at its end, as before Note [Streamed launches]");
  m.def("streamed_launches", &neuron::streamed_launches, "streamed launches opened, all told");
  m.def("launch_in_flight", &neuron::launch_in_flight);
  m.def("launches_in_flight", &neuron::launches_in_flight);
  m.attr("STREAM_DEPTH") = neuron::kStreamDepth;
  m.def("launch_finished", &neuron::launch_finished);
  m.def("oldest_launch_ended", &neuron::oldest_launch_ended,
        "the oldest launch on the stream has ended: collecting it waits for nothing");
  m.def("finish_launch", &neuron::finish_launch, py::call_guard<py::gil_scoped_release>(),
        "wait for the launch on the stream; raises its op's error");
  m.def("failed_index", &neuron::failed_index, "the queue entry whose op failed in the last run_queue");
  m.def("set_failure", &neuron::set_failure, py::arg("message"), py::arg("type"), py::arg("waiting"));
}

namespace neuron {

const c10::OperatorHandle& op_of(const py::object& func) {
  static std::unordered_map<PyObject*, c10::OperatorHandle> handles;  // OpOverloads live forever
  auto it = handles.find(func.ptr());
  if (it == handles.end()) {
    py::object schema = func.attr("_schema");
    auto name = schema.attr("name").cast<std::string>();
    auto overload = schema.attr("overload_name").cast<std::string>();
    it = handles.emplace(func.ptr(), c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str())).first;
  }
  return it->second;
}

namespace {

// As torch's argument parser makes it: a Python number where the schema wants a tensor is a
// CPU 0-dim tensor marked as a wrapped number (type promotion treats it as a number).
c10::IValue to_ivalue(const py::handle& value, const c10::Argument& arg) {
  c10::TypePtr type = arg.real_type();
  if (type->kind() == c10::TypeKind::OptionalType) {
    type = type->containedType(0);
  }
  if (type->kind() == c10::TypeKind::TensorType &&
      (PyBool_Check(value.ptr()) || PyLong_Check(value.ptr()) || PyFloat_Check(value.ptr()) || PyComplex_Check(value.ptr()))) {
    at::Tensor t = at::scalar_to_tensor(torch::jit::toIValue(value, c10::NumberType::get()).toScalar());
    t.unsafeGetTensorImpl()->set_wrapped_number(true);
    return t;
  }
  return torch::jit::toIValue(value, arg.real_type());
}

}  // namespace

torch::jit::Stack stack_of(const c10::OperatorHandle& op, const py::tuple& args, const py::dict& kwargs) {
  const auto& arguments = op.schema().arguments();
  torch::jit::Stack stack;
  stack.reserve(arguments.size());
  for (size_t i = 0; i < arguments.size(); ++i) {
    const c10::Argument& arg = arguments[i];
    py::str name(arg.name());
    if (i < args.size() || kwargs.contains(name)) {
      const py::object value = i < args.size() ? py::object(args[i]) : py::object(kwargs[name]);
      stack.push_back(to_ivalue(value, arg));
    } else {
      TORCH_CHECK(arg.default_value().has_value(), op.schema().operator_name(), " is missing argument ", arg.name());
      stack.push_back(*arg.default_value());
    }
  }
  return stack;
}

}  // namespace neuron
