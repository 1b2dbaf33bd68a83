// device._C: the Python face of the neuron device's C++ core (the other files of csrc/).
#include "neuron.h"

#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/extension.h>

#include <memory>

void bind_route(py::module_& m);  // route.cpp
void bind_period_detector(py::module_& m);  // engine/period_detector.cpp

namespace {

using c10::DeviceIndex;

DeviceIndex index_of(int64_t index) { return neuron::checked_device(index); }

// Once per process, at registration (dispatch/registration.py).
void install(int64_t device_count, const std::vector<int64_t>& capacities, double launch_overhead_us,
             bool spend_overhead, uint64_t seed) {
  TORCH_CHECK(static_cast<int64_t>(capacities.size()) == device_count, "one capacity per device: got ",
              capacities.size(), " for ", device_count, " devices");
  neuron::set_up_host_vector_math();  // before any kernel: Note [MKL's vector math starts racily]
  neuron::install_guard(device_count);
  neuron::install_memory(capacities);
  neuron::install_clock(static_cast<DeviceIndex>(device_count), launch_overhead_us, spend_overhead);
  neuron::install_generators(static_cast<DeviceIndex>(device_count), seed);
  neuron::install_device_timeline();
}

py::dict memory_stats(int64_t index) {
  const neuron::MemoryStats s = neuron::memory_stats(index_of(index));
  py::dict d;
  d["capacity"] = s.capacity;
  d["limit"] = s.limit;
  d["allocated"] = s.allocated;
  d["peak"] = s.peak;
  d["live"] = s.live;
  d["num_allocs"] = s.num_allocs;
  d["num_frees"] = s.num_frees;
  d["bytes_allocated"] = s.bytes_allocated;
  d["bytes_freed"] = s.bytes_freed;
  d["num_ooms"] = s.num_ooms;
  return d;
}

py::tuple counters(int64_t index) {
  const neuron::Counters c = neuron::counters(index_of(index));
  return py::make_tuple(c.launches, c.kernel_ops, c.transfers, c.transfer_bytes, c.device_time_us,
                        c.launch_overhead_us);
}

// us_per_flop: {torch.dtype: us}, converted: {torch.dtype: why}, read here into ScalarType codes.
// us_per_flop, us_per_element: {torch.dtype: us}, else the default; converted: {torch.dtype: why}.
void install_eager(double us_per_byte, double on_chip_bytes, const py::dict& us_per_flop, double default_us_per_flop,
                   const py::dict& us_per_element, double default_us_per_element, const py::dict& converted) {
  auto code = [](const py::handle& dtype) {
    TORCH_CHECK(THPDtype_Check(dtype.ptr()), "install_eager's keys must be torch.dtype");
    return static_cast<int>(reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type);
  };
  auto rates = [&](const py::dict& by_dtype, double default_us) {
    neuron::Rates out{{}, default_us};
    for (const auto& [dtype, us] : by_dtype) {
      out.by_type.emplace_back(code(dtype), us.cast<double>());
    }
    return out;
  };
  std::vector<std::pair<int, std::string>> why;
  for (const auto& [dtype, text] : converted) {
    why.emplace_back(code(dtype), text.cast<std::string>());
  }
  neuron::install_eager({us_per_byte, on_chip_bytes, rates(us_per_flop, default_us_per_flop),
                         rates(us_per_element, default_us_per_element)},
                        why);
  // Note [Backward formulas that pick a layout by device]: native_group_norm's node on neuron
  // is torch's subclassed; Python shows it as torch's type, `_saved_*` attributes included.
  auto torch_type = py::module_::import("torch._C").attr("_functions").attr("NativeGroupNormBackward0");
  torch::autograd::registerCppFunction(neuron::group_norm_backward_type(),
                                       reinterpret_cast<PyTypeObject*>(torch_type.ptr()));
}

// The synchronizer is Python (the runtime's synchronize): called with the GIL, from the
// threads that synchronize a stream, an event or the device. A Python exception propagates
// as itself (torch's bindings restore it). Kept in a leaked object: it must outlive
// interpreter shutdown's destruction of module globals.
std::function<void(c10::DeviceIndex)> call_python(py::object fn) {
  auto* held = new py::object(std::move(fn));
  return [held](c10::DeviceIndex d) {
    if (!Py_IsInitialized()) {
      return;
    }
    py::gil_scoped_acquire gil;
    (*held)(static_cast<int64_t>(d));
  };
}

// The issuer runs the held-back work without waiting for it (a timing event's record).
void set_synchronizer(py::object fn, py::object issuer) {
  neuron::set_synchronizer(call_python(std::move(fn)), call_python(std::move(issuer)));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "The neuron device's C++ runtime core: guard and hooks, memory accounting and allocator, clock.";
  m.def("install", &install, "register guard, hooks, allocator and clock for the runtime's devices");
  m.def("install_refusing_guard", &neuron::install_refusing_guard,
        "a device guard with no device, raising message at every device check (a bad setting)");
  m.def("current_device", []() { return static_cast<int64_t>(neuron::current_device()); });
  m.def("set_current_device", &neuron::set_current_device);
  m.def("device_count", []() { return static_cast<int64_t>(neuron::device_count()); });
  // memory (Note [Device memory accounting])
  m.def("memory_stats", &memory_stats);
  m.def("autograd_device_threads_may_run", &neuron::autograd_device_threads_may_run,
        "whether C++ autograd may have started its neuron device threads (the guard's setDevice ran)");
  m.def("set_memory_fraction", [](int64_t d, double fraction) { neuron::set_memory_fraction(index_of(d), fraction); });
  m.def("reset_peak", [](int64_t d) { neuron::reset_peak(index_of(d)); });
  // clock
  m.def(
      "account_launch",
      [](int64_t d, double overhead_us, double op_us, int64_t num_ops, const std::string& name) {
        return neuron::account_launch(index_of(d), overhead_us, op_us, num_ops, name);
      },
      py::arg("d"), py::arg("overhead_us"), py::arg("op_us"), py::arg("num_ops"), py::arg("name") = "kernel",
      "name: the kernel's, on the device timeline");
  // the device's track in torch.profiler (Note [The device timeline])
  m.def("timeline_recording", &neuron::timeline_recording);
  m.def("label_next_launch", &neuron::label_next_launch, "the device timeline's name of the next launch this thread issues");
  m.def("transfer", [](int64_t d, int64_t nbytes, double us) { neuron::transfer(index_of(d), nbytes, us); });
  m.def("refund", [](int64_t d, double op_us, int64_t num_ops) { neuron::refund(index_of(d), op_us, num_ops); });
  m.def("counters", &counters, "(launches, kernel_ops, transfers, transfer_bytes, device_time_us, launch_overhead_us)");
  m.def("reset_counters", &neuron::reset_counters);
  m.def("set_spend_overhead", &neuron::set_spend_overhead);
  m.def("set_launch_log", &neuron::set_launch_log, "on: record each launch's (device, ops); clears the log");
  m.def("take_launch_log", [] { neuron::wait_for_device(); return neuron::take_launch_log(); }, "the launches recorded since the last take, in order");
  m.def("covered_third_party_composites", &neuron::covered_third_party_composites,
        "the third-party C++ composite ops neuron runs on the CPU's kernels (Note [Third-party composite ops])");
  m.def("set_op_log", &neuron::set_op_log, "on: record each priced op's (name, roofline us); clears the log");
  m.def("take_op_log", [] { neuron::wait_for_device(); return neuron::take_op_log(); }, "the ops recorded since the last take, in order");
  // `with FusedLaunch(d):` the launches this thread makes are one launch (a compiled graph's)
  struct ScopedFusedLaunch {
    c10::DeviceIndex device;
    std::unique_ptr<neuron::FusedLaunch> live;
  };
  py::class_<ScopedFusedLaunch>(m, "FusedLaunch")
      .def(py::init([](int64_t d) { return ScopedFusedLaunch{index_of(d), nullptr}; }))
      .def("__enter__", [](ScopedFusedLaunch& f) {
        TORCH_CHECK(!f.live, "internal error: a FusedLaunch entered twice");
        f.live = std::make_unique<neuron::FusedLaunch>(f.device);
      })
      .def("__exit__", [](ScopedFusedLaunch& f, const py::args&) {
        f.live.reset();  // accounts the launch: its ops, a failed one's included
        return false;
      });
  // streams and events
  m.def("set_synchronizer", &set_synchronizer,
        "fn(device index, -1 for all) runs held-back work and waits; issuer(index) only issues it");
  // generators
  m.def("host_generator", &neuron::host_generator, "the CPU generator a kernel draws from for a neuron generator");
  m.def("default_generator", [](int64_t index) { return neuron::default_generator(index_of(index)); },
        "neuron:index's default generator (a seed and an offset: Note [Random ops draw from CPU's generator])");
  m.def("draws_at_issue", &neuron::draws_at_issue, py::arg("name"), py::arg("overload"),
        "whether a random op may be deferred, its draws made at issue (Note [Deferred random ops draw at issue])");
  m.def(
      "set_draw_hook",
      [](const std::string& op, py::function draws) {
        // Kept for the process's life, never released: the hook table outlives the interpreter,
        // and releasing a Python object after it has finalized would crash at exit.
        auto* held = new py::function(std::move(draws));
        neuron::set_draw_hook(op, [held](const torch::jit::Stack& arguments) {
          py::gil_scoped_acquire gil;  // at issue, on the issuing thread
          py::tuple args(arguments.size());
          for (size_t i = 0; i < arguments.size(); ++i) {
            args[i] = torch::jit::toPyObject(arguments[i]);
          }
          (*held)(*args);
        });
      },
      py::arg("op"), py::arg("draws"),
      "draws(*arguments) makes the custom kernel op's draws (\"ns::op.overload\"): Note [Deferred random ops "
      "draw at issue]");
  m.def("drawing_from", &neuron::drawing_from,
        "the generator the deferred random op running on this thread draws from, or None");
  // the eager path (aten/registration.cpp) and host aliases of device bytes (aten/host_alias.cpp)
  m.def("install_eager", &install_eager, "register the eager kernels and fallback at PrivateUse1");
  m.def("set_collective_costs",
        [](double link_us_per_byte, double efa_us_per_byte, double hop_us, double reduce_us_per_byte, int64_t ranks_per_domain) {
          neuron::set_collective_costs({link_us_per_byte, efa_us_per_byte, hop_us, reduce_us_per_byte, ranks_per_domain});
        },
        py::arg("link_us_per_byte"), py::arg("efa_us_per_byte"), py::arg("hop_us"), py::arg("reduce_us_per_byte"),
        py::arg("ranks_per_domain"), "what one rank's collectives spend (Note [Collectives on the link])");
  // the device's executor (runtime/executor.cpp) and the eager ops it runs (aten/issue.cpp)
  m.def("wait_for_device", &neuron::wait_for_device, py::call_guard<py::gil_scoped_release>(),
        "wait for every op posted to the device; raises the first error one met, once");
  m.def("device_idle", &neuron::device_idle, "every op posted to the device has run");
  m.def("device_jobs_queued", &neuron::device_jobs_queued, "jobs posted to the device's queue and not yet run");
  m.def("sleep_on_device", &neuron::sleep_on_device, py::arg("seconds"),
        "holds the device's queue for `seconds` while the host goes on (as torch.cuda._sleep)");
  m.def("set_handover_pause", &neuron::set_handover_pause, py::arg("seconds"),
        "the device sleeps `seconds` before each hand-over of an op's result (0: never): for tests");
  m.def("draws_random_numbers", &neuron::draws_random_numbers, py::arg("name"), py::arg("nondeterministic_seeded"),
        py::arg("has_generator_argument"), "whether the op may draw random numbers on neuron (CPU's kernels)");
  m.def("add_internal_source_dir", &neuron::add_internal_source_dir,
        "a folder whose frames a posted op's error skips to name the user's line (Note [Where an op was issued])");
  m.def("set_launch_blocking", &neuron::set_launch_blocking, "True: every eager op runs while its issuer waits");
  m.def("set_projection", &neuron::set_projection, "True: new neuron tensors carry no bytes, ops run their shape functions");
  m.def("projection_enabled", &neuron::projection_enabled);
  m.def("is_projected", [](const at::Tensor& t) { return t.device().type() == neuron::kNeuron && t.has_storage() && neuron::is_projected(t.storage()); },
        "whether a neuron tensor carries no bytes (made in projection mode)");
  m.def("bytes_holders", [](const at::Tensor& t) { return neuron::bytes_holders(t.storage()); },
        "how many storages hold a neuron tensor's bytes as the device counts them (0: none; -1: not counted): for tests");
  m.def("has_bytes", [](const at::Tensor& t) { return !t.has_storage() || neuron::value_made(t.storage()); },
        "whether a neuron tensor's value is made, without waiting for it (False: an op's output the device has "
        "not made yet, or whose op failed): for tests");
  m.def("output_bytes_counts", [] { return std::make_pair(neuron::steered_allocations(), neuron::rehomed_outputs()); },
        "(results a kernel allocated in their output's bytes, outputs given new bytes because an allocation kept "
        "theirs) since start: Note [A kernel's results are made in their outputs' bytes]; for tests");
  m.def("placeholder_reads", &neuron::placeholder_reads, "host reads of projected values answered with a placeholder");
  m.def("set_executor_spin", &neuron::set_executor_spin, py::arg("microseconds"),
        "how long the device's thread watches its empty queue before it sleeps");
  m.def("set_device_team_sleeps", &neuron::set_device_team_sleeps, py::arg("sleeps"),
        "True: while the host issues, the device's OpenMP workers sleep between regions (a held idle team)");
  m.def("eager_issue_counts", &neuron::eager_issue_counts, "eager ops issued so far: (posted, waited for)");
  m.def("host_alias", &neuron::owning_host_alias, "a CPU tensor on a neuron tensor's bytes");
  m.def("adopt", &neuron::adopt_host_tensor, "a neuron tensor adopting a CPU tensor's bytes");
  m.def("adopt_meta", &neuron::adopt_meta_tensor, "a neuron tensor without bytes, with a meta tensor's geometry");
  m.def("forget_values", &neuron::forget_values, "a neuron tensor written without its values: projected from now on");
  // scaled_dot_product_attention's kernel on neuron (dispatch/attention.py)
  m.def("validate_sdpa_input", &neuron::validate_sdpa_input, py::arg("query"), py::arg("key"), py::arg("value"),
        py::arg("attn_mask"), "raise CPU's error for inputs CPU's scaled_dot_product_attention refuses");
  m.def("host_sdp_choice", &neuron::host_sdp_choice, py::arg("query"), py::arg("key"), py::arg("value"),
        py::arg("attn_mask"), py::arg("dropout_p"), py::arg("is_causal"), py::arg("scale"), py::arg("enable_gqa"),
        "the SDPA kernel CPU's choice picks for these CPU tensors (Note [The overrideable SDPA backend])");
  m.def("device_sdp_choice", &neuron::device_sdp_choice, py::arg("query"), py::arg("key"), py::arg("value"),
        py::arg("attn_mask"), py::arg("dropout_p"), py::arg("is_causal"), py::arg("scale"), py::arg("enable_gqa"),
        "host_sdp_choice for plain neuron tensors, their CPU shadows made in C++");
  // the adaptive engine's route and queue (Note [Deferred launches])
  bind_route(m);
  bind_period_detector(m);
}
