// The emulated device's stream: one worker thread that runs fused launches in issue order,
// without the GIL, while the host (Python) goes on issuing. See device/stream.py.
//
// A launch is a Program (the ops of a cached trace, built once) plus the boxed arguments of
// this launch (built by the host at submit, under the GIL, exactly as torch.ops builds them).
// Values produced inside the launch are patched into the stacks when their op runs; each
// op's outputs are flattened into slots as adaptive_eager/trace.py numbers them.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/python_arg_parser.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include <unistd.h>

namespace {

// Polls `ready` for up to 50 us; true as soon as it holds.
template <typename F>
bool spin_until(F ready) {
  auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
  do {
    if (ready()) return true;
  } while (std::chrono::steady_clock::now() < end);
  return false;
}

struct Patch {  // stack[arg] (or its list element `item`) <- results[op][slot]
  int arg, item, op, slot;
};

struct Step {
  c10::OperatorHandle handle;
  bool allow_numbers;
  bool use_written;              // outputs = the written arguments (in-place ops returning nothing)
  std::vector<int> written;      // schema indices of those arguments
  std::vector<int> new_slots;    // output slots that are new device memory (counted)
  std::vector<std::pair<int, int>> frees;  // (op, slot) read for the last time by this op
  bool consumed;                 // a later op reads some output
  std::vector<int> unread;       // output slots no later op reads
  std::vector<std::pair<int, int>> refs;  // placeholder i stands for results[op][slot]
  std::optional<std::vector<Patch>> patches;  // found on the first launch (fixed by the signature)
  explicit Step(c10::OperatorHandle h) : handle(std::move(h)) {}
};

struct Program {
  std::vector<Step> steps;
  std::vector<at::Tensor> placeholders;  // the Python-side stand-ins for internal values
};

// A memory event of a launch, replayed on the host's accounting when the launch finishes.
struct Event {
  int kind;         // 0: an intermediate allocated, 1: it died, 2: an exported output allocated
  int64_t nbytes;   // kinds 0 and 1
  int index;        // kind 2: export index; kinds 0/1: intermediate id
};

struct Job {
  std::shared_ptr<Program> program;
  std::vector<torch::jit::Stack> stacks;
  // Every tensor of the stacks, held until the host collects the outcome. A tensor with a
  // Python object calls into Python (taking the GIL) when its reference count drops back
  // to 1 (c10/util/intrusive_ptr.h); with these references the worker never drops it there.
  std::vector<at::Tensor> keep;
  std::vector<std::vector<std::pair<int, int>>> exports_of;  // per op: (slot, export index)
  std::vector<at::Tensor> exports;
  std::vector<Event> events;
  std::vector<std::pair<int, c10::Storage>> survivors;  // (id, storage) of intermediates alive at the end
  c10::impl::LocalDispatchKeySet keys{c10::impl::PODLocalDispatchKeySet{}};  // the issuing thread's keys
  c10::AutogradState autograd{false, false, false, false};
  int num_threads;
  // outcome
  std::mutex m;
  std::condition_variable cv;
  bool finished = false;
  std::atomic<bool> done{false};  // `finished`, readable without the lock (for spinning)
  int failed_op = -1;
  std::string error_kind, error_message;
};

class Stream {
 public:
  Stream() : pid_(getpid()), worker_([this] { loop(); }) {}

  void push(std::shared_ptr<Job> job) {
    {
      std::lock_guard<std::mutex> g(m_);
      queue_.push_back(std::move(job));
      queued_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_one();
  }

  pid_t pid() const { return pid_; }

 private:
  void loop() {
    for (;;) {
      std::shared_ptr<Job> job;
      // A training loop submits the next launch soon after this one finished: waiting a
      // little before sleeping saves the wake-up (tens of microseconds on a VM).
      spin_until([this] { return queued_.load(std::memory_order_acquire) > 0; });
      {
        std::unique_lock<std::mutex> g(m_);
        cv_.wait(g, [this] { return !queue_.empty(); });
        job = std::move(queue_.front());
        queue_.pop_front();
        queued_.fetch_sub(1, std::memory_order_relaxed);
      }
      run(*job);
      {
        std::lock_guard<std::mutex> g(job->m);
        job->finished = true;
        job->done.store(true, std::memory_order_release);
      }
      job->cv.notify_all();
    }
  }

  static void run(Job& job) {
    // The issuing thread's dispatch state (grad/inference mode, excluded keys) and intra-op
    // thread count: the same kernels, split the same way, give the same bits. (Not the whole
    // at::ThreadLocalState: it holds Python objects, and the host only submits launches
    // when no Python mode or hook could be reached from a host kernel.)
    c10::impl::_force_tls_local_dispatch_key_set(job.keys);
    c10::AutogradState::set_tls_state(job.autograd);
    if (at::get_num_threads() != job.num_threads) {
      at::set_num_threads(job.num_threads);
    }
    Program& program = *job.program;
    const size_t n = program.steps.size();
    std::vector<std::vector<at::Tensor>> results(n);
    std::unordered_map<c10::StorageImpl*, std::pair<c10::Storage, int>> live;  // intermediates
    std::unordered_map<c10::StorageImpl*, int64_t> sizes;
    int next_id = 0;
    size_t k = 0;
    try {
      for (k = 0; k < n; ++k) {
        Step& step = program.steps[k];
        torch::jit::Stack& stack = job.stacks[k];
        patch(step, stack, results, program);
        std::vector<at::Tensor> flat;
        std::unordered_set<c10::StorageImpl*> input_storages;
        for (const auto& v : stack) collect_storages(v, input_storages);
        if (step.use_written) {
          for (int i : step.written) flatten(stack[i], flat);
        }
        step.handle.callBoxed(stack);
        if (!step.use_written) {
          for (const auto& v : stack) flatten(v, flat);
        }
        stack.clear();  // the returned values live on in `flat` only as long as they are needed
        // Exports first: the values whose wrappers are alive leave the launch.
        std::vector<bool> exported(flat.size(), false);
        for (const auto& [slot, index] : job.exports_of[k]) {
          job.exports[index] = flat.at(slot);
          exported[slot] = true;
        }
        for (int slot : step.new_slots) {
          const at::Tensor& t = flat.at(slot);
          c10::StorageImpl* key = t.storage().unsafeGetStorageImpl();
          if (input_storages.count(key) || live.count(key)) continue;
          if (exported[slot]) {
            int index = -1;
            for (const auto& [s, i] : job.exports_of[k]) if (s == slot) index = i;
            job.events.push_back({2, 0, index});
          } else {
            int id = next_id++;
            int64_t nbytes = static_cast<int64_t>(t.storage().nbytes());
            live.emplace(key, std::make_pair(t.storage(), id));
            sizes[key] = nbytes;
            job.events.push_back({0, nbytes, id});
          }
        }
        for (const auto& [j, slot] : step.frees) {
          if (!results[j].empty()) results[j][slot] = at::Tensor();
        }
        if (step.consumed) {
          for (int slot : step.unread) flat[slot] = at::Tensor();
          results[k] = std::move(flat);
        } else {
          flat.clear();
        }
        // Intermediates nothing holds any more died here (only our handle is left).
        for (auto it = live.begin(); it != live.end();) {
          if (it->second.first.use_count() == 1) {
            job.events.push_back({1, sizes[it->first], it->second.second});
            it = live.erase(it);
          } else {
            ++it;
          }
        }
      }
    } catch (const c10::Error& e) {
      job.failed_op = static_cast<int>(k);
      job.error_kind = kind_of(e);
      job.error_message = e.what_without_backtrace();
    } catch (const std::exception& e) {
      job.failed_op = static_cast<int>(k);
      job.error_kind = "RuntimeError";
      job.error_message = e.what();
    }
    results.clear();
    for (auto& [key, entry] : live) {
      if (entry.first.use_count() > 1) job.survivors.emplace_back(entry.second, entry.first);
    }
    job.stacks.clear();
  }

  static std::string kind_of(const c10::Error& e) {
    if (dynamic_cast<const c10::IndexError*>(&e)) return "IndexError";
    if (dynamic_cast<const c10::ValueError*>(&e)) return "ValueError";
    if (dynamic_cast<const c10::TypeError*>(&e)) return "TypeError";
    if (dynamic_cast<const c10::NotImplementedError*>(&e)) return "NotImplementedError";
    if (dynamic_cast<const c10::LinAlgError*>(&e)) return "LinAlgError";
    if (dynamic_cast<const c10::OutOfMemoryError*>(&e)) return "OutOfMemoryError";
    return "RuntimeError";
  }

  static void patch(Step& step, torch::jit::Stack& stack, std::vector<std::vector<at::Tensor>>& results,
                    const Program& program) {
    if (step.refs.empty()) return;
    if (!step.patches) {
      // Where the placeholders landed in the stack: fixed by the op's signature.
      std::vector<Patch> found;
      for (size_t a = 0; a < stack.size(); ++a) {
        const auto& v = stack[a];
        if (v.isTensor()) {
          int r = placeholder_index(v.toTensor(), step, program);
          if (r >= 0) found.push_back({static_cast<int>(a), -1, step.refs[r].first, step.refs[r].second});
        } else if (v.isTensorList()) {
          auto list = v.toTensorList();
          for (size_t i = 0; i < list.size(); ++i) {
            int r = placeholder_index(list.get(i), step, program);
            if (r >= 0) found.push_back({static_cast<int>(a), static_cast<int>(i), step.refs[r].first, step.refs[r].second});
          }
        } else if (v.isList()) {  // Tensor?[] (index ops)
          auto list = v.toList();
          for (size_t i = 0; i < list.size(); ++i) {
            c10::IValue e = list.get(i);
            if (!e.isTensor()) continue;
            int r = placeholder_index(e.toTensor(), step, program);
            if (r >= 0) found.push_back({static_cast<int>(a), static_cast<int>(i), step.refs[r].first, step.refs[r].second});
          }
        }
      }
      TORCH_CHECK(found.size() == step.refs.size(), "adaptive engine bug: ", found.size(), " of ",
                  step.refs.size(), " internal values of ", step.handle.schema().name(), " found in its stack");
      step.patches = std::move(found);
    }
    for (const Patch& p : *step.patches) {
      const at::Tensor& value = results.at(p.op).at(p.slot);
      TORCH_CHECK(value.defined(), "adaptive engine bug: ", step.handle.schema().name(),
                  " reads a value freed before its last use");
      if (p.item < 0) {
        stack[p.arg] = value;
      } else if (stack[p.arg].isTensorList()) {
        auto list = stack[p.arg].toTensorList();
        list.set(p.item, value);
      } else {
        auto list = stack[p.arg].toList();
        list.set(p.item, c10::IValue(value));
      }
    }
  }

  static int placeholder_index(const at::Tensor& t, const Step& step, const Program& program) {
    if (!t.defined()) return -1;
    for (size_t r = 0; r < step.refs.size(); ++r) {
      if (program.placeholders.at(r).unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) return static_cast<int>(r);
    }
    return -1;
  }

  static void collect_storages(const c10::IValue& v, std::unordered_set<c10::StorageImpl*>& out) {
    if (v.isTensor()) {
      const auto& t = v.toTensor();
      if (t.defined() && t.has_storage()) out.insert(t.storage().unsafeGetStorageImpl());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec())
        if (t.defined() && t.has_storage()) out.insert(t.storage().unsafeGetStorageImpl());
    } else if (v.isList()) {
      for (const c10::IValue& e : v.toList().vec()) collect_storages(e, out);
    }
  }

  // As trace.flat_tensors: the tensors of a value, in order; nothing else.
  static void flatten(const c10::IValue& v, std::vector<at::Tensor>& out) {
    if (v.isTensor()) {
      if (v.toTensor().defined()) out.push_back(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) out.push_back(t);
    } else if (v.isList()) {
      for (const c10::IValue& e : v.toList().vec()) flatten(e, out);
    } else if (v.isTuple()) {
      for (const c10::IValue& e : v.toTupleRef().elements()) flatten(e, out);
    }
  }

  pid_t pid_;
  std::atomic<int> queued_{0};
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::thread worker_;
};

Stream* stream() {
  // Never destroyed: a joinable std::thread destroyed at exit would terminate the process.
  // After a fork the child has no worker thread: it starts its own.
  static Stream* s = nullptr;
  if (s == nullptr || s->pid() != getpid()) {
    s = new Stream();
  }
  return s;
}

void collect_tensors(const c10::IValue& v, std::vector<at::Tensor>& out) {
  if (v.isTensor()) {
    out.push_back(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList().vec()) out.push_back(t);
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toList().vec()) collect_tensors(e, out);
  }
}

std::shared_ptr<Program> make_program(const py::list& steps, int max_refs) {
  auto program = std::make_shared<Program>();
  for (int i = 0; i < max_refs; ++i) program->placeholders.push_back(at::empty({0}));
  for (const auto& item : steps) {
    auto spec = item.cast<py::tuple>();
    auto name = spec[0].cast<std::string>();
    auto overload = spec[1].cast<std::string>();
    Step step(c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str()));
    // As torch.ops decides it (opAllowsNumbersAsTensors in torch/csrc/jit/python/init.cpp).
    auto symbol = c10::Symbol::fromQualString(name);
    step.allow_numbers = symbol.is_prims() || symbol.is_nvprims() ||
                         (symbol.is_aten() && torch::should_allow_numbers_as_tensors(symbol.toUnqualString()));
    step.use_written = spec[2].cast<bool>();
    step.written = spec[3].cast<std::vector<int>>();
    step.new_slots = spec[4].cast<std::vector<int>>();
    step.frees = spec[5].cast<std::vector<std::pair<int, int>>>();
    step.consumed = spec[6].cast<bool>();
    step.unread = spec[7].cast<std::vector<int>>();
    step.refs = spec[8].cast<std::vector<std::pair<int, int>>>();
    program->steps.push_back(std::move(step));
  }
  return program;
}

std::vector<at::Tensor> placeholders(const std::shared_ptr<Program>& program) { return program->placeholders; }

// calls: per op (args tuple, kwargs dict), internal values given as placeholders;
// exports: per op, the (slot, export index) pairs whose values leave the launch.
std::shared_ptr<Job> submit(const std::shared_ptr<Program>& program, const py::list& calls, const py::list& exports,
                            int num_exports, int num_threads) {
  auto job = std::make_shared<Job>();
  job->program = program;
  job->num_threads = num_threads;
  job->exports.resize(num_exports);
  const size_t n = program->steps.size();
  TORCH_CHECK(py::len(calls) == n && py::len(exports) == n, "adaptive engine bug: a launch of the wrong length");
  job->stacks.reserve(n);
  for (size_t k = 0; k < n; ++k) {
    const Step& step = program->steps[k];
    auto call = calls[k].cast<py::tuple>();
    // Exactly how torch.ops turns Python arguments into a stack (numbers as tensors where
    // the op allows it, defaults filled in).
    torch::jit::ToIValueAllowNumbersAsTensors numbers(step.allow_numbers);
    job->stacks.push_back(torch::jit::createStackForSchema(step.handle.schema(), torch::jit::tuple_slice(call[0].cast<py::tuple>()),
                                                           call[1].cast<py::kwargs>(), std::nullopt));
    job->exports_of.push_back(exports[k].cast<std::vector<std::pair<int, int>>>());
    for (const auto& v : job->stacks.back()) collect_tensors(v, job->keep);
  }
  job->keys = c10::impl::tls_local_dispatch_key_set();
  job->autograd = c10::AutogradState::get_tls_state();
  stream()->push(job);
  return job;
}

void wait(const std::shared_ptr<Job>& job) {
  if (job->done.load(std::memory_order_acquire)) return;
  py::gil_scoped_release no_gil;
  if (spin_until([&] { return job->done.load(std::memory_order_acquire); })) return;
  std::unique_lock<std::mutex> g(job->m);
  job->cv.wait(g, [&] { return job->finished; });
}

bool finished(const std::shared_ptr<Job>& job) {
  std::lock_guard<std::mutex> g(job->m);
  return job->finished;
}

// After wait(): (failed op or -1, error kind, message, exports, events, survivors)
py::tuple outcome(const std::shared_ptr<Job>& job) {
  py::list events;
  for (const Event& e : job->events) events.append(py::make_tuple(e.kind, e.nbytes, e.index));
  py::list survivors;  // as byte tensors on the storage: the host tracks storages by identity
  for (const auto& [id, storage] : job->survivors) {
    survivors.append(py::make_tuple(id, at::empty({0}, at::TensorOptions().dtype(at::kByte)).set_(storage)));
  }
  py::tuple out = py::make_tuple(job->failed_op, job->error_kind, job->error_message, job->exports, events, survivors);
  job->exports.clear();
  job->survivors.clear();
  job->keep.clear();  // here, under the GIL (see Job::keep)
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Program, std::shared_ptr<Program>>(m, "Program");
  py::class_<Job, std::shared_ptr<Job>>(m, "Job");
  m.def("make_program", &make_program);
  m.def("placeholders", &placeholders);
  m.def("submit", &submit);
  m.def("wait", &wait);
  m.def("finished", &finished);
  m.def("outcome", &outcome);
}
