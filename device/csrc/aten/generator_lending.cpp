// Random ops on neuron draw from the device's generator (Note [RNG order] in dispatch/rng.py),
// though their CPU kernels run on the host: a `generator=None` argument gets it, and an op
// without one (native_dropout) runs with torch's default CPU generator lent its state.
#include "aten/eager_internal.h"

#include <ATen/CPUGeneratorImpl.h>

#include <memory>
#include <utility>

namespace neuron {

// Note [Seeded ops that never draw]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// torch tags an op nondeterministic_seeded when some backend's kernel may draw; the kernel
// neuron runs is CPU's, and some CPU kernels never do. _scaled_dot_product_flash_attention_for_cpu
// (every transformer's attention on neuron, as on CPU) takes a dropout_p its CPU kernel refuses
// unless it is 0. Counted as random, it could never be posted (the host would wait for every
// attention), would borrow the generator's state for nothing, and would keep a fused trace
// off the device stream (Note [RNG order] in dispatch/rng.py).
bool draws_random_numbers(const std::string& name, bool nondeterministic_seeded, bool has_generator_argument) {
  if (has_generator_argument) {
    return true;
  }
  return nondeterministic_seeded && name != "aten::_scaled_dot_product_flash_attention_for_cpu";
}

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
                                                     size_t first, int generator_arg, c10::DeviceIndex d) {
  std::unique_ptr<DefaultGeneratorLent> lent;
  if (generator_arg >= 0) {
    c10::IValue& g = (*stack)[first + generator_arg];
    g = c10::IValue(host_generator(g.isNone() ? default_generator(d) : g.toGenerator()));
  } else if (draws_random_numbers(op.operator_name().name, op.hasTag(at::Tag::nondeterministic_seeded), false)) {
    lent = std::make_unique<DefaultGeneratorLent>(host_generator(default_generator(d)));
  }
  return lent;
}

}  // namespace eager_detail
}  // namespace neuron
