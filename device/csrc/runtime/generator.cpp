// The devices' default generators and `torch.Generator(device='neuron')`.
//
// Note [Random ops draw from CPU's generator]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// TorchNeuron (torch-neuronx 2.13/2.14) has no device kernel for a random op: normal_, uniform_,
// bernoulli_, randn, rand, randint, randperm and dropout's mask on `neuron` run CPU's kernel
// through its CPU fallback (at::native::cpu_fallback in csrc/core/NeuronBindings.cpp; its
// dropout draws the mask with torch.bernoulli on a CPU tensor), so they draw from torch's
// default CPU generator; its own per-device generator (csrc/core/NeuronGenerator.h: a Philox
// seed and offset, a 16-byte state) is seeded, read and restored, but no op draws from it (its
// tests/device/test_rng_state.py: "torch.randn(device='neuron') falls back to CPU, consuming
// CPU RNG state"). Code written for it counts on that: `torch.manual_seed(0)`, CPU draws, then
// `torch.randn_like(t_neuron)` is the CPU run's next draw, and a model with dropout trains as
// on CPU without reseeding. So here too: a random op without a generator draws from torch's
// default CPU generator, in program order against the host's own draws, in both modes
// (aten/generator_lending.cpp: Note [Deferred random ops draw at issue]); the devices' default
// generators hold a seed and an offset, as TorchNeuron's do.
//
// An explicit `torch.Generator(device='neuron')` is a CPU generator with a neuron device: the
// kernels take only CPU generators (check_generator<CPUGeneratorImpl>), so it holds one and
// hands it to the kernels it reaches (host_generator); seeded like a CPU generator, it draws
// CPU's numbers.
#include "neuron.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/ops/empty.h>
#include <c10/core/GeneratorImpl.h>

#include <cstring>
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

// A device's default generator, as TorchNeuron's: a Philox seed and offset, its state those two
// as 16 bytes (seed, then offset, each little-endian u64). No op draws from it (Note [Random ops
// draw from CPU's generator]). Callers hold mutex_, as for every GeneratorImpl.
struct DeviceSeedImpl final : public c10::GeneratorImpl {
  uint64_t seed_;
  uint64_t offset_ = 0;

  DeviceSeedImpl(c10::DeviceIndex d, uint64_t seed)
      : c10::GeneratorImpl(c10::Device(kNeuron, d), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        seed_(seed) {}

  void set_current_seed(uint64_t seed) override {
    seed_ = seed;
    offset_ = 0;
  }
  void set_offset(uint64_t offset) override { offset_ = offset; }
  uint64_t get_offset() const override { return offset_; }
  uint64_t current_seed() const override { return seed_; }
  uint64_t seed() override {
    set_current_seed(c10::detail::getNonDeterministicRandom());
    return seed_;
  }
  void set_state(const c10::TensorImpl& new_state) override {
    TORCH_CHECK_TYPE(new_state.dtype() == caffe2::TypeMeta::Make<uint8_t>() && new_state.numel() == 16,
                     "a neuron device's generator state is 16 bytes (its seed and offset, as TorchNeuron's): "
                     "got ", new_state.numel(), " elements of ", new_state.dtype().name(),
                     "; pass what torch.neuron.get_rng_state() returned");
    const auto* bytes = static_cast<const uint8_t*>(new_state.data());
    std::memcpy(&seed_, bytes, 8);
    std::memcpy(&offset_, bytes + 8, 8);
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    at::Tensor state = at::empty({16}, at::TensorOptions().dtype(at::kByte));
    auto* bytes = state.data_ptr<uint8_t>();
    std::memcpy(bytes, &seed_, 8);
    std::memcpy(bytes + 8, &offset_, 8);
    return state.getIntrusivePtr();
  }

 private:
  DeviceSeedImpl* clone_impl() const override {
    auto* copy = new DeviceSeedImpl(device().index(), seed_);
    copy->offset_ = offset_;
    return copy;
  }
};

std::mutex g_lock;
std::deque<at::Generator> g_defaults;  // one per device; a deque: references stay valid

}  // namespace

void install_generators(c10::DeviceIndex device_count, uint64_t seed) {
  std::lock_guard<std::mutex> guard(g_lock);
  TORCH_CHECK(g_defaults.empty(), "the neuron generators are installed once per process");
  for (c10::DeviceIndex d = 0; d < device_count; ++d) {
    g_defaults.push_back(at::make_generator<DeviceSeedImpl>(d, seed));
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
  if (auto* own = dynamic_cast<NeuronGeneratorImpl*>(g.unsafeGetGeneratorImpl())) {
    return own->host;
  }
  return at::detail::getDefaultCPUGenerator();  // a device's default: Note [Random ops draw from CPU's generator]
}

}  // namespace neuron
