// Pricing ops on the modelled clock: the cost model's figures (set once, at install), the FLOPs
// of the ops that do most of a model's math, and each op's roofline, launched on its device's
// clock. The eager path (run_on_host.cpp, kernels.cpp) prices every op it runs here.
#include "aten/eager_internal.h"

#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace neuron {
namespace eager_detail {
namespace {

// -- the cost model's figures, set from Python (device/cost.py) ---------------------------
// Written once, at install.
double g_us_per_byte = 0;
double g_on_chip_bytes = 0;  // the logical device's SBUF (Note [On-chip intermediates])
struct RateTable {  // µs per unit by ScalarType
  std::unordered_map<int, double> by_type;
  double default_us = 0;

  void set(const Rates& rates) {
    by_type.insert(rates.by_type.begin(), rates.by_type.end());
    default_us = rates.default_us;
  }
  double of(at::ScalarType t) const {
    auto it = by_type.find(static_cast<int>(t));
    return it == by_type.end() ? default_us : it->second;
  }
};
RateTable g_us_per_flop;  // Note [Matmul rates] (device/profiles.py)
RateTable g_us_per_element;  // Note [The Vector Engine floor] (device/cost.py)

// Note [Matmul rates] in device/profiles.py: a dtype the Tensor Engine does not take is priced as
// converted; its first matmul says so, once (the values are still the CPU kernel's).
std::unordered_map<int, std::string> g_converted;  // written once, at install
std::mutex g_warned_mutex;
std::unordered_set<int> g_warned;

void warn_if_converted(at::ScalarType t) {
  auto it = g_converted.find(static_cast<int>(t));
  if (it == g_converted.end()) {
    return;
  }
  std::lock_guard<std::mutex> lock(g_warned_mutex);
  if (g_warned.insert(static_cast<int>(t)).second) {
    TORCH_WARN(it->second);
  }
}

// nbytes: what the op moves to or from HBM; elements: what it streams through the Vector
// Engine if the Tensor Engine does not run it (flops == 0).
double roofline_us(double flops, double nbytes, double elements, at::ScalarType dtype) {
  const double memory_us = nbytes * g_us_per_byte;
  if (flops == 0) {
    const double vector_us = elements * g_us_per_element.of(dtype);
    return vector_us > memory_us ? vector_us : memory_us;
  }
  warn_if_converted(dtype);
  const double compute_us = flops * g_us_per_flop.of(dtype);
  return compute_us > memory_us ? compute_us : memory_us;
}

// torch's conv_flop_count: 2 * batch * c_out * c_in * prod(filter) * prod(spatial), the
// spatial size being the output's (the input's, transposed).
double conv_flop_count(c10::IntArrayRef x, c10::IntArrayRef w, c10::IntArrayRef out, bool transposed) {
  if (x.size() < 3 || w.size() != x.size() || out.size() != x.size()) {
    return 0;
  }
  double flops = 2.0 * static_cast<double>(x[0]) * static_cast<double>(w[0]) * static_cast<double>(w[1]);
  const c10::IntArrayRef spatial = transposed ? x : out;
  for (size_t i = 2; i < x.size(); ++i) {
    flops *= static_cast<double>(w[i]) * static_cast<double>(spatial[i]);
  }
  return flops;
}

std::vector<int64_t> swap01(c10::IntArrayRef s) {  // torch's t(shape): channels before batch
  std::vector<int64_t> v(s.begin(), s.end());
  if (v.size() >= 2) {
    std::swap(v[0], v[1]);
  }
  return v;
}

// The ops the Tensor Engine runs (op_flops counts their FLOPs): Note [On-chip intermediates]
// streams no value into them, as they read each operand once per output tile.
const std::unordered_set<std::string> kTensorEngineOps = {
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm", "aten::_scaled_mm_v2",
    "aten::_grouped_mm", "aten::_scaled_grouped_mm", "aten::convolution", "aten::convolution_backward",
    "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_flash_attention_for_cpu_backward"};

}  // namespace

void set_costs(const EagerCosts& costs, const std::vector<std::pair<int, std::string>>& converted) {
  g_us_per_byte = costs.us_per_byte;
  g_on_chip_bytes = costs.on_chip_bytes;
  g_us_per_flop.set(costs.us_per_flop);
  g_us_per_element.set(costs.us_per_element);
  for (const auto& [type, why] : converted) {
    g_converted[type] = why;
  }
}

double transfer_us(double nbytes) { return nbytes * g_us_per_byte; }

// FLOPs as torch.utils.flop_counter counts them, for the ops that do most of a model's math
// (the matmul family and convolutions); 0 for other ops, priced by the bytes they move.
// `in` are the neuron inputs in argument order, `out` the results; a convolution's flags are
// read from its arguments before it runs (ConvFlags).
ConvFlags conv_flags(const c10::OperatorName& name, const torch::jit::Stack& stack, size_t first) {
  ConvFlags f;
  if (name.name == "aten::convolution") {
    f.transposed = stack[first + 6].toBool();
  } else if (name.name == "aten::convolution_backward") {
    f.transposed = stack[first + 7].toBool();
    const auto mask = stack[first + 10].toBoolList();
    f.grad_input = mask.get(0);
    f.grad_weight = mask.get(1);
  }
  return f;
}

double op_flops(const c10::OperatorName& name, c10::ArrayRef<at::Tensor> in, const ConvFlags& conv,
                const c10::IValue* out, size_t num_out) {
  const std::string& n = name.name;
  auto dims = [&](size_t i) { return in.size() > i ? in[i].sizes() : c10::IntArrayRef(); };
  auto out_dims = [&](size_t i) {
    return i < num_out && out[i].isTensor() && out[i].toTensor().defined() ? out[i].toTensor().sizes()
                                                                            : c10::IntArrayRef();
  };
  if (n == "aten::mm" || n == "aten::addmm") {
    const size_t a = n == "aten::mm" ? 0 : 1;
    if (dims(a).size() == 2 && dims(a + 1).size() == 2) {
      return 2.0 * dims(a)[0] * dims(a)[1] * dims(a + 1)[1];
    }
  } else if (n == "aten::bmm" || n == "aten::baddbmm") {
    const size_t a = n == "aten::bmm" ? 0 : 1;
    if (dims(a).size() == 3 && dims(a + 1).size() == 3) {
      return 2.0 * dims(a)[0] * dims(a)[1] * dims(a)[2] * dims(a + 1)[2];
    }
  } else if (n == "aten::_scaled_mm" || n == "aten::_scaled_mm_v2") {  // (self [M, K], mat2 [K, N], scales...)
    if (dims(0).size() == 2 && dims(1).size() == 2) {
      return 2.0 * dims(0)[0] * dims(0)[1] * dims(1)[1];
    }
  } else if (n == "aten::_grouped_mm" || n == "aten::_scaled_grouped_mm") {
    // (self, mat2, ...): 2D x 3D groups rows by offs, 3D x 3D is batched, 2D x 2D groups the
    // contraction (weight gradients), 3D x 2D groups mat2's columns; each row of the output
    // is one contraction of self's last dim
    const auto a = dims(0), b = dims(1);
    if (a.size() == 2 && b.size() == 3) {
      return 2.0 * a[0] * a[1] * b[2];
    }
    if (a.size() == 3 && b.size() == 3) {
      return 2.0 * a[0] * a[1] * a[2] * b[2];
    }
    if (a.size() == 2 && b.size() == 2) {
      return 2.0 * a[0] * a[1] * b[1];
    }
    if (a.size() == 3 && b.size() == 2) {
      return 2.0 * a[1] * a[2] * b[1];
    }
  } else if (n == "aten::_scaled_dot_product_flash_attention_for_cpu" ||
             n == "aten::_scaled_dot_product_flash_attention_for_cpu_backward") {
    // (query [..., L, E], key [..., S, E], value [..., S, Ev], ...), the backward's after its
    // grad_out: q @ k^T and p @ v forward; the backward recomputes p, then dv, dp, dq, dk
    const size_t q = n == "aten::_scaled_dot_product_flash_attention_for_cpu" ? 0 : 1;
    const auto qd = dims(q), kd = dims(q + 1), vd = dims(q + 2);
    if (qd.size() >= 2 && kd.size() >= 2 && vd.size() >= 2) {
      const double rows = static_cast<double>(c10::multiply_integers(qd)) / qd.back();  // batch * heads * L
      const double s = kd[kd.size() - 2];
      const double score = 2.0 * rows * s * qd.back(), mix = 2.0 * rows * s * vd.back();
      return q == 0 ? score + mix : 3.0 * score + 2.0 * mix;
    }
  } else if (n == "aten::convolution") {  // (input, weight, bias?): all neuron tensors
    return conv_flop_count(dims(0), dims(1), out_dims(0), conv.transposed);
  } else if (n == "aten::convolution_backward") {  // (grad_output, input, weight)
    double flops = 0;
    if (conv.grad_input) {
      flops += conv_flop_count(dims(0), dims(2), out_dims(0), !conv.transposed);
    }
    if (conv.grad_weight && !out_dims(1).empty()) {
      const auto gw = swap01(out_dims(1));
      flops += conv.transposed ? conv_flop_count(swap01(dims(0)), swap01(dims(1)), gw, false)
                               : conv_flop_count(swap01(dims(1)), swap01(dims(0)), gw, false);
    }
    return flops;
  }
  return 0;
}

// One op on d's clock at its roofline, less its share of a fused launch's on-chip work (Note
// [On-chip intermediates] in device/cost.py), and in the op log; its time, as launch() gives it.
double launch_op(c10::DeviceIndex d, const std::string& name, double flops, double nbytes, double elements,
                 at::ScalarType dtype) {
  FusedLaunch* fused = current_fused_launch();
  if (fused != nullptr && fused->deferred != nullptr) {  // Note [Streamed launches] (engine/queue.cpp)
    fused->deferred->push_back(DeferredPrice{fused->entry, true, name, flops, nbytes, elements, dtype, 0, 1});
    return 0;  // a streamed launch draws no profiler ranges (the engine streams none then)
  }
  const OnChipShare on_chip = take_on_chip();
  const double op_us = roofline_us(flops, std::max(0.0, nbytes - on_chip.bytes), on_chip.folded ? 0 : elements, dtype);
  log_op(name, op_us);
  return launch(d, op_us, 1, name);
}

double charge_host_round_trip(c10::DeviceIndex d, double argument_bytes, double result_bytes) {
  transfer(d, static_cast<int64_t>(argument_bytes), transfer_us(argument_bytes));
  transfer(d, static_cast<int64_t>(result_bytes), transfer_us(result_bytes));
  return transfer_us(argument_bytes + result_bytes);
}

}  // namespace eager_detail

void settle_deferred_prices(FusedLaunch& launch, const std::function<OnChipShare(int64_t)>& share) {
  std::vector<DeferredPrice>* prices = launch.deferred;
  launch.deferred = nullptr;
  int64_t shared = -1;  // the last entry whose share a roofline took
  for (const DeferredPrice& p : *prices) {
    if (!p.roofline) {
      launch.op_us += p.op_us;
      launch.num_ops += p.num_ops;
      if (timeline_recording()) {  // a streamed launch sealed while a profiler records
        launch.timeline_ops.push_back(TimelineOp{"kernel", p.op_us, {}});
      }
      continue;
    }
    OnChipShare on_chip;
    if (p.entry != shared) {
      on_chip = share(p.entry);
      shared = p.entry;
    }
    const double op_us = eager_detail::roofline_us(p.flops, std::max(0.0, p.nbytes - on_chip.bytes),
                                                   on_chip.folded ? 0 : p.elements, p.dtype);
    log_op(p.name, op_us);
    if (timeline_recording()) {
      launch.timeline_ops.push_back(TimelineOp{p.name, op_us, {}});
    }
    launch.op_us += op_us;  // as launch() adds it inside a fused launch
    launch.num_ops += 1;
  }
  prices->clear();
}

double on_chip_bytes() { return eager_detail::g_on_chip_bytes; }

bool runs_on_tensor_engine(const c10::OperatorName& name) {
  return eager_detail::kTensorEngineOps.count(name.name) > 0;
}

// Note [Ops TorchNeuron runs on the host]: TorchNeuron registers CPU fallbacks for the linalg
// ops whose results CPU makes column-major (torch-neuronx's python_ops/cpu_fallback_registrations.py):
// each tensor argument goes to the host (`.cpu()`, which waits for the device), CPU's kernel
// runs there, and each result comes back (`.to(device)`). The chip runs no kernel for them and
// moves their bytes twice, so that is their price here: the arguments' bytes out and the
// results' bytes in, as two transfers, and no launch (charge_host_round_trip). In a fused launch
// their arguments are written to HBM and their results read from there (plan_on_chip), not
// kept in SBUF. Their values are CPU's kernel's either way.
bool torchneuron_runs_on_host(const c10::OperatorName& name) {
  static const std::unordered_set<std::string> kOps = {
      "aten::linalg_qr",         "aten::_linalg_svd",         "aten::_linalg_eigh",
      "aten::linalg_cholesky_ex", "aten::linalg_inv_ex",       "aten::linalg_lu_factor_ex",
      "aten::linalg_ldl_factor_ex", "aten::_linalg_slogdet",   "aten::_linalg_det",
      "aten::cholesky_inverse",  "aten::triangular_solve"};
  return name.overload_name.empty() && kOps.count(name.name) > 0;  // it registers the default overloads
}

}  // namespace neuron
