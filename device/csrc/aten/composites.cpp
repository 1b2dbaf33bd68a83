// Note [Third-party composite ops]: a library's C++ op registered as CompositeImplicitAutograd
// (vLLM's CPU kernels are) runs its C++ body at the Autograd key, before any backend sees it:
// on neuron tensors that body reads the device's bytes through raw pointers, unseen by the
// adaptive engine and unpriced, and fails on a deferred value ("its data is not allocated
// yet"). Each such op gets the eager path's kernel at PrivateUse1 instead (which also takes the
// CompositeImplicitAutograd kernel off AutogradPrivateUse1): the engine sees the op, launches
// what it holds back, and the op runs on host aliases of the device's bytes at the CPU key,
// where its C++ body is the CPU's kernel, in-place writes landing in device memory. The ops
// covered: outside torch's own namespaces, with a C++ (unboxed) CompositeImplicitAutograd
// kernel and no kernel of their own for PrivateUse1. Python composites (torch.library) are left
// alone: they compose ATen ops, which neuron runs, and autograd differentiates through them.
// On neuron such an op has no autograd formula (torch's autograd fallback handles it as for
// any op without one). Libraries loaded after ours are found by a registration listener (which sees
// definitions, under the dispatcher's lock) and covered before the next op runs on neuron.
#include "neuron.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_set>
#include <vector>

namespace neuron {
namespace {

std::mutex g_lock;  // the pending names (the listener, under the dispatcher's lock, takes it)
std::mutex g_cover_lock;  // one look at a time: g_covered and the registrations
std::vector<c10::OperatorName> g_pending;  // defined since the last look
std::atomic<bool> g_has_pending{false};
std::unordered_set<std::string> g_covered;
// Never destroyed: the registrations must outlive every op call, exit included.
auto* g_libraries = new std::vector<std::unique_ptr<torch::Library>>;

const std::unordered_set<std::string> kTorchNamespaces = {
    "aten", "prim", "prims", "c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor", "quantized",
    "_quantized", "profiler", "debugprims", "inductor", "mkldnn", "mkl", "onednn", "rngprims", "higher_order",
    "_test", "_nested", "sparse", "xnnpack", "_inductor_test", "symm_mem", "streams"};

std::string namespace_of(const c10::OperatorName& name) {
  const auto at = name.name.find("::");
  return at == std::string::npos ? std::string() : name.name.substr(0, at);
}

// Whether the op's CompositeImplicitAutograd kernel is C++: a C++ kernel is callable unboxed,
// a Python one (torch.library) only boxed. The dispatcher says so in its dump only.
bool has_cpp_composite(const c10::OperatorHandle& op) {
  std::istringstream dump(op.dumpState());
  for (std::string line; std::getline(dump, line);) {
    if (line.rfind("CompositeImplicitAutograd", 0) == 0) {
      return line.find("unboxed") != std::string::npos;
    }
  }
  return false;
}

enum class Look { kCovered, kSkipped, kNotYet };

Look cover(const c10::OperatorName& name) {
  if (kTorchNamespaces.count(namespace_of(name)) > 0) {
    return Look::kSkipped;
  }
  const auto op = c10::Dispatcher::singleton().findOp(name);
  if (!op) {
    return Look::kNotYet;
  }
  if (!op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) {
    // Defined, no kernel yet: another library may give it one later (def and impl can live apart).
    const bool none = !op->hasKernelForDispatchKey(c10::DispatchKey::CPU) &&
                      !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd);
    return none ? Look::kNotYet : Look::kSkipped;
  }
  if (op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1) || !has_cpp_composite(*op)) {
    return Look::kSkipped;
  }
  const std::string full = name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
  if (!g_covered.insert(full).second) {
    return Look::kCovered;
  }
  auto library = std::make_unique<torch::Library>(torch::Library::IMPL, namespace_of(name),
                                                  c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  library->impl(full.substr(full.find("::") + 2).c_str(),
                torch::CppFunction::makeFromBoxedFunction<&eager_fallback>());
  g_libraries->push_back(std::move(library));
  return Look::kCovered;
}

struct Listener final : c10::OpRegistrationListener {
  // Under the dispatcher's lock: only note the name (registering now would deadlock).
  void onOperatorRegistered(const c10::OperatorHandle& op) override {
    std::lock_guard<std::mutex> guard(g_lock);
    g_pending.push_back(op.operator_name());
    g_has_pending.store(true);
  }
  void onOperatorDeregistered(const c10::OperatorHandle&) override {}
};

}  // namespace

void watch_third_party_composites() {
  // Kept for the process: the listener must hear every library loaded after ours. Adding it
  // reports every op defined so far, which the first look then covers.
  static auto* handle = new c10::RegistrationHandleRAII(
      c10::Dispatcher::singleton().addRegistrationListener(std::make_unique<Listener>()));
  (void)handle;
  cover_third_party_composites();
}

void cover_third_party_composites() {
  if (!g_has_pending.load(std::memory_order_relaxed)) {
    return;
  }
  std::vector<c10::OperatorName> names;
  {
    std::lock_guard<std::mutex> guard(g_lock);
    names.swap(g_pending);
    g_has_pending.store(false);
  }
  std::vector<c10::OperatorName> later;
  const std::lock_guard<std::mutex> covering(g_cover_lock);
  for (const c10::OperatorName& name : names) {
    if (cover(name) == Look::kNotYet) {
      later.push_back(name);
    }
  }
  if (!later.empty()) {
    std::lock_guard<std::mutex> guard(g_lock);
    g_pending.insert(g_pending.end(), later.begin(), later.end());
    // Not flagged again: a def-only op is looked at once more when the next library registers.
  }
}

std::vector<std::string> covered_third_party_composites() {
  cover_third_party_composites();
  const std::lock_guard<std::mutex> covering(g_cover_lock);
  return {g_covered.begin(), g_covered.end()};
}

}  // namespace neuron
