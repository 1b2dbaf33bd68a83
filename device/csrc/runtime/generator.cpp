// `torch.Generator(device='neuron')` and the devices' default generators.
//
// A neuron generator is a CPU generator with a neuron device: the emulated device runs CPU
// kernels, which take only CPU generators (check_generator<CPUGeneratorImpl>), so every
// neuron generator holds one and hands it to the kernels it reaches (host_generator). Its
// seed and state are that CPU generator's, so a neuron generator seeded like a CPU one draws
// CPU's numbers. The devices' default generators wrap the runtime's own (device/runtime.py),
// so torch.neuron.manual_seed and a kernel's generator=None draws share one state.
#include "neuron.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <c10/core/GeneratorImpl.h>

#include <deque>
#include <mutex>

namespace neuron {
namespace {

struct NeuronGeneratorImpl final : public c10::GeneratorImpl {
  mutable at::Generator host;  // a CPUGeneratorImpl (mutable: its lock is taken in const reads)

  NeuronGeneratorImpl(c10::DeviceIndex d, at::Generator host_generator)
      : c10::GeneratorImpl(c10::Device(kNeuron, d), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        host(std::move(host_generator)) {}

  // Every access goes through the host generator's own lock: kernels lock it while drawing.
  void set_current_seed(uint64_t seed) override {
    std::lock_guard<std::mutex> guard(host.mutex());
    host.set_current_seed(seed);
  }
  void set_offset(uint64_t offset) override {
    std::lock_guard<std::mutex> guard(host.mutex());
    host.set_offset(offset);
  }
  uint64_t get_offset() const override {
    std::lock_guard<std::mutex> guard(host.mutex());
    return host.get_offset();
  }
  uint64_t current_seed() const override {
    std::lock_guard<std::mutex> guard(host.mutex());
    return host.current_seed();
  }
  uint64_t seed() override {
    std::lock_guard<std::mutex> guard(host.mutex());
    return host.seed();
  }
  void set_state(const c10::TensorImpl& new_state) override {
    std::lock_guard<std::mutex> guard(host.mutex());
    host.unsafeGetGeneratorImpl()->set_state(new_state);
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    std::lock_guard<std::mutex> guard(host.mutex());
    return host.unsafeGetGeneratorImpl()->get_state();
  }

 private:
  NeuronGeneratorImpl* clone_impl() const override {
    std::lock_guard<std::mutex> guard(host.mutex());
    return new NeuronGeneratorImpl(device().index(), host.clone());
  }
};

std::mutex g_lock;
std::deque<at::Generator> g_defaults;  // one per device; a deque: references stay valid

}  // namespace

void install_generators(std::vector<at::Generator> host_generators) {
  std::lock_guard<std::mutex> guard(g_lock);
  TORCH_CHECK(g_defaults.empty(), "the neuron generators are installed once per process");
  for (size_t d = 0; d < host_generators.size(); ++d) {
    TORCH_CHECK(host_generators[d].device().is_cpu(), "a device's generator must be a CPU generator");
    g_defaults.push_back(at::make_generator<NeuronGeneratorImpl>(static_cast<c10::DeviceIndex>(d),
                                                                  std::move(host_generators[d])));
  }
}

const at::Generator& default_generator(c10::DeviceIndex d) {
  const c10::DeviceIndex index = d < 0 ? current_device() : checked_device(d);
  std::lock_guard<std::mutex> guard(g_lock);
  TORCH_CHECK(static_cast<size_t>(index) < g_defaults.size(), "internal error: no generator for neuron:",
              static_cast<int>(index));
  return g_defaults[index];
}

at::Generator new_generator(c10::DeviceIndex d) {
  const c10::DeviceIndex index = d < 0 ? current_device() : checked_device(d);
  return at::make_generator<NeuronGeneratorImpl>(index, at::make_generator<at::CPUGeneratorImpl>(c10::default_rng_seed_val));
}

at::Generator host_generator(const at::Generator& g) {
  if (g.device().type() != kNeuron) {
    return g;
  }
  return static_cast<NeuronGeneratorImpl*>(g.unsafeGetGeneratorImpl())->host;
}

}  // namespace neuron
