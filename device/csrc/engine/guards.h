// Note [A position's guards in C++] (guards.cpp): a trace position's matcher, on the IValue stack.
#pragma once

#include "neuron.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/extension.h>

#include <cstdint>
#include <string>
#include <vector>

namespace neuron {

struct Guard {
  enum Kind : uint8_t {
    kAbsent,  // left out of the Python call: equals the schema's default
    kTensor,
    kCpuScalar,
    kAnyDouble,
    kAnyComplex,
    kAnyBool,  // a bool passed as a Scalar, lifted (Note [Lifted scalars] in adaptive_eager/engine/record.py)
    kInt,
    kBool,
    kDouble,
    kString,
    kNone,
    kEnum,
    kDevice,
    kList,
    kGenericTensor,  // a shape-generic position's: sizes, strides and offset by IntSpec
    kGenericInt,     // a shape-generic position's int argument, by IntSpec
    kUnsupported,
  };
  Kind kind = kUnsupported;
  int64_t device_index = -1;  // a tensor's: the neuron index, -1 on the CPU
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  int64_t value = 0;  // an int's, a bool's, a dtype's (a tensor's too), a layout's, a memory format's
  double dvalue = 0;
  std::string svalue;
  c10::Device device{c10::kCPU};
  std::vector<Guard> children;  // a list's elements
  // Note [Generic guards]: kGenericTensor's sizes, strides, offset (2 * rank + 1), kGenericInt's one.
  struct IntSpec {
    int32_t sym = -1;  // -1: a constant, `value`; else the trace's symbol it is
    bool bind = false;  // the symbol's first occurrence in the trace: binds it
    int64_t value = 0;
  };
  std::vector<IntSpec> ints;
};

struct ArgGuard {
  Guard guard;
  bool not_default = false;  // given in the Python call where its default would be left out
};

struct PositionGuards {
  c10::OperatorHandle op;
  std::vector<ArgGuard> args;  // one per schema argument
  bool supported = true;  // false: a guard C++ cannot check; every call misses
  int32_t nsyms = 0;  // a generic position's: 1 + the highest symbol it names (0: none)
  // syms: a generic trace's sizes as this match binds them (Note [Generic guards]); may be
  // null for a position that names none. A call that does not fit may leave some bound.
  bool matches(const c10::OperatorHandle& op, const torch::jit::Stack& stack, int64_t* syms = nullptr) const;
};

Guard parse_guard(const py::handle& spec);
bool has_unsupported(const Guard& g);
int32_t symbols_named(const Guard& g);  // 1 + the highest symbol g's ints name (0: none)

// route.cpp: the dispatcher's handle of an OpOverload, and the IValue stack of a Python call
// of it (missing arguments at their defaults), as the C++ fallback would see the call.
const c10::OperatorHandle& op_of(const py::object& func);
torch::jit::Stack stack_of(const c10::OperatorHandle& op, const py::tuple& args, const py::dict& kwargs);

}  // namespace neuron
