// Random ops on neuron draw from torch's default CPU generator in program order (Note [Random
// ops draw from CPU's generator] in runtime/generator.cpp), whether they run at issue or later.
#include "aten/eager_internal.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/empty_strided.h>

#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace neuron {

// Note [Seeded ops that never draw]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// torch tags an op nondeterministic_seeded when some backend's kernel may draw; the kernel
// neuron runs is CPU's, and some CPU kernels never do. _scaled_dot_product_flash_attention_for_cpu
// (every transformer's attention on neuron, as on CPU) takes a dropout_p its CPU kernel refuses
// unless it is 0. Counted as random, it could never be posted (the host would wait for every
// attention), would make its draws at issue for nothing, and would keep a fused trace off the
// device stream (_may_use_stream in engine/executor.py).
bool draws_random_numbers(const std::string& name, bool nondeterministic_seeded, bool has_generator_argument) {
  if (has_generator_argument) {
    return true;
  }
  return nondeterministic_seeded && name != "aten::_scaled_dot_product_flash_attention_for_cpu";
}

// Note [Deferred random ops draw at issue]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A random op draws from torch's default CPU generator, which the host draws from too: its
// numbers are the ones it would get at its place in the program. An op run at issue (eager
// mode runs every random op while its issuer waits: issue.cpp's may_post) just draws. An op the
// adaptive engine defers runs later, after the host may have drawn (a CPU `torch.randn`, a
// DataLoader's shuffle), and its trace must not be cut at it (dropout in every layer would cut
// a training step into pieces). So at issue it gets a copy of the default generator as it is
// then, to draw from when it runs, and the default is moved on as the op's draws will move it:
// by running the op's CPU kernel on scratch host tensors of its arguments' geometry (the ones it
// reads filled with 1, which every such kernel's checks accept: a probability, a standard
// deviation, a row of multinomial weights). That takes an op whose number of draws depends on
// its arguments' geometry only: the fills (normal_, uniform_, bernoulli_, ...), the factories,
// native_dropout, bernoulli and normal with tensor parameters, multinomial (CPU's kernel draws
// an exponential per weight, or a uniform per sample). A custom kernel takes a `draws` function
// that makes its body's draws (set_draw_hook; custom_kernel in dispatch/custom_kernels.py). The
// others (poisson, binomial, gamma and dirichlet, which reject and draw again as their values
// say; rrelu's noise, drawn for negative inputs only; a custom kernel without `draws`) are never
// deferred: the engine runs them at issue (a barrier: engine/trace.py).
namespace {

const std::unordered_set<std::string>& drawn_by_geometry() {
  static const std::unordered_set<std::string> ops{
      "aten::normal_.", "aten::uniform_.", "aten::bernoulli_.float", "aten::bernoulli.p", "aten::random_.",
      "aten::random_.from", "aten::random_.to", "aten::exponential_.", "aten::geometric_.", "aten::cauchy_.",
      "aten::log_normal_.", "aten::native_dropout.", "aten::normal.float_float", "aten::normal.float_float_out",
      "aten::rand.", "aten::rand.generator", "aten::rand.names", "aten::rand.generator_with_names", "aten::rand.out",
      "aten::rand.generator_out", "aten::randn.", "aten::randn.generator", "aten::randn.names",
      "aten::randn.generator_with_names", "aten::randn.out", "aten::randn.generator_out", "aten::randint.",
      "aten::randint.generator", "aten::randint.low", "aten::randint.low_generator", "aten::randint.out",
      "aten::randint.generator_out", "aten::randint.low_out", "aten::randint.low_generator_out", "aten::randperm.",
      "aten::randperm.generator", "aten::randperm.out", "aten::randperm.generator_out", "aten::rand_like.",
      "aten::randn_like.", "aten::randint_like.", "aten::randint_like.low_dtype",
      "aten::normal.Tensor_float", "aten::normal.Tensor_float_out", "aten::normal.float_Tensor",
      "aten::normal.float_Tensor_out", "aten::normal.Tensor_Tensor", "aten::normal.Tensor_Tensor_out",
      "aten::normal_functional.", "aten::bernoulli.", "aten::bernoulli.out", "aten::bernoulli_.Tensor",
      "aten::bernoulli.Tensor", "aten::bernoulli.Tensor_out", "aten::multinomial.", "aten::multinomial.out"};
  return ops;
}

std::mutex g_hooks_lock;
std::unordered_map<std::string, DrawHook> g_draw_hooks;  // "ns::op.overload" -> its draws

const DrawHook* draw_hook(const std::string& key) {
  std::lock_guard<std::mutex> guard(g_hooks_lock);
  auto it = g_draw_hooks.find(key);
  return it == g_draw_hooks.end() ? nullptr : &it->second;  // never erased: the pointer stays valid
}

thread_local const std::optional<at::Generator>* t_draws_from = nullptr;

}  // namespace

bool has_explicit_generator(const torch::jit::Stack& stack, size_t first) {
  for (size_t i = first; i < stack.size(); ++i) {
    if (stack[i].isGenerator()) {
      return true;
    }
  }
  return false;
}

void set_draw_hook(const std::string& op, DrawHook hook) {
  std::lock_guard<std::mutex> guard(g_hooks_lock);
  TORCH_CHECK(g_draw_hooks.count(op) == 0, "the draws of ", op, " are given once");
  g_draw_hooks.emplace(op, std::move(hook));
}

bool draws_at_issue(const std::string& name, const std::string& overload) {
  const std::string key = name + "." + overload;
  return drawn_by_geometry().count(key) > 0 || draw_hook(key) != nullptr;
}

std::optional<at::Generator> drawing_from() {
  return t_draws_from == nullptr ? std::nullopt : *t_draws_from;
}

at::Generator draw_at_issue(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first) {
  const c10::OperatorName& name = op.operator_name();
  const std::string key = name.name + "." + name.overload_name;
  const DrawHook* hook = draw_hook(key);
  TORCH_CHECK(hook != nullptr || drawn_by_geometry().count(key) > 0, "adaptive engine bug: ", name,
              " was deferred, but its draws depend on its arguments' values. Set NEURON_ADAPTIVE_EAGER=0 to "
              "avoid it, and please report it.");
  at::Generator host = at::detail::getDefaultCPUGenerator();
  at::Generator mine;
  {
    std::lock_guard<std::mutex> guard(host.mutex());
    mine = host.clone();
  }
  if (projection_enabled()) {
    return mine;  // a projected op draws nothing (Note [Projected ops]): nor does its issue
  }
  torch::jit::Stack scratch(stack.begin() + static_cast<std::ptrdiff_t>(first), stack.end());
  if (hook != nullptr) {
    (*hook)(scratch);  // the kernel's own account of its draws, from its arguments' geometry
    return mine;
  }
  const auto& arguments = op.schema().arguments();
  for (size_t i = 0; i < scratch.size(); ++i) {
    c10::IValue& v = scratch[i];
    if (v.isTensor() && v.toTensor().defined()) {
      const at::Tensor& t = v.toTensor();  // its bytes may not exist yet; its geometry does
      at::Tensor host_copy = at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kCPU));
      const auto* alias = arguments[i].alias_info();
      if (alias == nullptr || !alias->isWrite()) {
        // Values every kernel here accepts (see the Note), over its whole storage: an expanded
        // argument's elements share bytes, which a fill through its own view refuses. Its
        // strides stay its own: a result made like it draws as its strides say (normal_).
        const auto elements = static_cast<int64_t>(host_copy.storage().nbytes() / host_copy.itemsize());
        host_copy.as_strided({elements}, {1}, 0).fill_(1);
      }
      v = std::move(host_copy);
    } else if (v.isDevice()) {
      v = c10::IValue(c10::Device(c10::kCPU));
    } else if (v.isGenerator()) {
      v = c10::IValue();  // the default's draws: the only generator a deferred op has
    }
  }
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), &scratch);
  return mine;
}

DrawsFrom::DrawsFrom(const std::optional<at::Generator>& g) : previous_(t_draws_from) {
  if (g.has_value()) {
    t_draws_from = &g;
  }
}

DrawsFrom::~DrawsFrom() { t_draws_from = previous_; }

namespace eager_detail {

bool is_optional_generator(const c10::Argument& a) {
  const auto& type = a.type();
  if (type->kind() == c10::TypeKind::GeneratorType) {
    return true;
  }
  if (type->kind() == c10::TypeKind::OptionalType) {
    return type->containedType(0)->kind() == c10::TypeKind::GeneratorType;
  }
  return false;
}

DefaultGeneratorLent::DefaultGeneratorLent(at::Generator g)
    : lender(std::move(g)), def(at::detail::getDefaultCPUGenerator()) {
  saved = def.get_state().getIntrusivePtr();
  def.set_state(lender.get_state());
}

DefaultGeneratorLent::~DefaultGeneratorLent() {
  try {
    lender.set_state(def.get_state());
    def.set_state(at::Tensor(saved));
  } catch (...) {  // a destructor never throws; the states are plain byte tensors
  }
}

std::unique_ptr<DefaultGeneratorLent> lend_generator(const c10::OperatorHandle& op, torch::jit::Stack* stack,
                                                     size_t first, int generator_arg) {
  // Run at issue, an op without a generator draws from torch's default CPU generator as it is;
  // deferred, from the copy draw_at_issue made (Note [Deferred random ops draw at issue]).
  std::unique_ptr<DefaultGeneratorLent> lent;
  if (generator_arg >= 0) {
    c10::IValue& g = (*stack)[first + generator_arg];
    if (!g.isNone()) {
      g = c10::IValue(host_generator(g.toGenerator()));
    } else if (t_draws_from != nullptr) {
      g = c10::IValue(**t_draws_from);
    }
  } else if (t_draws_from != nullptr &&
             draws_random_numbers(op.operator_name().name, op.hasTag(at::Tag::nondeterministic_seeded), false)) {
    // native_dropout, which takes no generator: the default is lent the copy's state while the
    // host waits for the launch (a launch with random ops is not streamed: engine/executor.py).
    lent = std::make_unique<DefaultGeneratorLent>(**t_draws_from);
  }
  return lent;
}

}  // namespace eager_detail
}  // namespace neuron
