// Random ops on neuron draw from the device's generator (Note [RNG order] in dispatch/rng.py),
// though their CPU kernels run on the host: a `generator=None` argument gets it, and an op
// without one (native_dropout) runs with torch's default CPU generator lent its state.
#include "aten/eager_internal.h"

#include <ATen/CPUGeneratorImpl.h>

#include <memory>
#include <utility>

namespace neuron {
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
  } else if (op.hasTag(at::Tag::nondeterministic_seeded)) {
    lent = std::make_unique<DefaultGeneratorLent>(host_generator(default_generator(d)));
  }
  return lent;
}

}  // namespace eager_detail
}  // namespace neuron
