// Note [A position's guards in C++]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The checks a trace position's generated Python matcher makes (adaptive_eager/engine/
// matchers.py), made on the op's IValue stack instead, so that matching a cached trace's next
// op needs no Python object (issue 35). Built once per interned proto from the guards
// adaptive_eager/engine/native_guards.py compiles, one per schema argument:
//   - an argument the Python call leaves out (a trailing positional default, or a keyword-only
//     argument at its default) must equal the schema's default, as route.cpp's to_python_call
//     would leave it out; an argument it passes must not, where leaving it out would change
//     the call's shape (the last positional one, and keyword-only ones);
//   - a tensor by device, sizes, strides, offset and dtype; a CPU 0-dim tensor by dtype; a
//     lifted float or complex, or a bool passed as a Scalar, by type (its value is bound per
//     call: Note [Lifted scalars]);
//   - ints, bools, floats, strings, None, dtypes, layouts, memory formats and devices by value,
//     bools apart from ints; lists by length, then element by element. A Python number the
//     dispatcher wrapped as a CPU tensor (for a Tensor argument) counts as the number: the
//     route hands it to Python so.
// Note [Generic guards]: a shape-generic position (adaptive_eager/engine/generic.py) checks its
// tensors by device, dtype and rank, and each int (a size, a stride, an offset, an int
// argument) as its matcher does: a constant by value, a symbol's first occurrence binds it,
// each later one must equal it. The symbols are the match's (Armed::syms in route.cpp),
// handed over at arm and back at disarm.
// A guard may only be stricter than its Python matcher, never looser: a miss goes to the
// Python route, which matches or diverges as it does today. What it cannot check (an
// opaque object keyed by type) makes the position unsupported: always a miss.
#include "engine/guards.h"

#include <ATen/core/ivalue.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Layout.h>
#include <torch/csrc/MemoryFormat.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

namespace neuron {

using c10::IValue;

namespace {

std::vector<int64_t> ints_of(const py::handle& seq) {
  std::vector<int64_t> out;
  for (const auto& e : seq) {
    out.push_back(e.cast<int64_t>());
  }
  return out;
}

std::vector<Guard::IntSpec> int_specs_of(const py::handle& seq) {
  std::vector<Guard::IntSpec> out;
  for (const auto& e : seq) {
    const auto spec = e.cast<py::tuple>();
    out.push_back(Guard::IntSpec{spec[0].cast<int32_t>(), spec[1].cast<bool>(), spec[2].cast<int64_t>()});
  }
  return out;
}

// A Python number the dispatcher wrapped as a CPU 0-dim tensor, where the schema wants a tensor:
// the route hands it to Python as the number again (toPyObject), so it is checked as one.
const at::Tensor* wrapped_number(const IValue& v, at::ScalarType type) {
  if (!v.isTensor()) {
    return nullptr;
  }
  const at::Tensor& t = v.toTensor();
  return t.defined() && t.unsafeGetTensorImpl()->is_wrapped_number() && t.scalar_type() == type ? &t : nullptr;
}

// The tensor Python sees in v (not a number the dispatcher wrapped), or null.
const at::Tensor* tensor_of(const IValue& v) {
  if (!v.isTensor()) {
    return nullptr;
  }
  const at::Tensor& t = v.toTensor();
  return t.defined() && !t.unsafeGetTensorImpl()->is_wrapped_number() ? &t : nullptr;
}

// A tensor guard's device index: the neuron index, -1 on the CPU, -2 elsewhere.
int64_t device_index_of(const at::Tensor& t) {
  const c10::Device d = t.device();
  return d.type() == kNeuron ? d.index() : (d.is_cpu() ? -1 : -2);
}

bool fits(const Guard::IntSpec& spec, int64_t x, int64_t* syms) {
  if (spec.sym < 0) {
    return x == spec.value;
  }
  if (spec.bind) {
    syms[spec.sym] = x;
    return true;
  }
  return x == syms[spec.sym];
}

bool matches_value(const Guard& g, const IValue& v, int64_t* syms) {
  switch (g.kind) {
    case Guard::kTensor: {
      const at::Tensor* tensor = tensor_of(v);  // a wrapped number: Python sees a number
      if (tensor == nullptr) {
        return false;
      }
      const at::Tensor& t = *tensor;
      return device_index_of(t) == g.device_index && t.scalar_type() == static_cast<at::ScalarType>(g.value) &&
             t.sizes() == c10::IntArrayRef(g.sizes) && t.strides() == c10::IntArrayRef(g.strides) &&
             t.storage_offset() == g.offset;
    }
    case Guard::kGenericTensor: {
      const at::Tensor* tensor = tensor_of(v);
      if (tensor == nullptr) {
        return false;
      }
      const at::Tensor& t = *tensor;
      const size_t rank = (g.ints.size() - 1) / 2;
      if (device_index_of(t) != g.device_index || t.scalar_type() != static_cast<at::ScalarType>(g.value) ||
          static_cast<size_t>(t.dim()) != rank) {
        return false;
      }
      const auto sizes = t.sizes();
      const auto strides = t.strides();
      for (size_t i = 0; i < rank; ++i) {  // the matcher's order: sizes, strides, offset
        if (!fits(g.ints[i], sizes[i], syms)) {
          return false;
        }
      }
      for (size_t i = 0; i < rank; ++i) {
        if (!fits(g.ints[rank + i], strides[i], syms)) {
          return false;
        }
      }
      return fits(g.ints[2 * rank], t.storage_offset(), syms);
    }
    case Guard::kGenericInt: {
      const at::Tensor* t = wrapped_number(v, at::kLong);
      if (t != nullptr) {
        return fits(g.ints[0], *t->const_data_ptr<int64_t>(), syms);
      }
      return v.isInt() && fits(g.ints[0], v.toInt(), syms);
    }
    case Guard::kCpuScalar: {
      if (!v.isTensor()) {
        return false;
      }
      const at::Tensor& t = v.toTensor();
      return t.defined() && t.device().is_cpu() && t.dim() == 0 && t.scalar_type() == static_cast<at::ScalarType>(g.value) &&
             !t.unsafeGetTensorImpl()->is_wrapped_number();  // Python sees that one as a number
    }
    case Guard::kAnyDouble:
      return v.isDouble() || wrapped_number(v, at::kDouble) != nullptr;
    case Guard::kAnyComplex:
      return v.isComplexDouble() || wrapped_number(v, at::kComplexDouble) != nullptr;
    case Guard::kAnyBool:  // a Scalar argument's: never a wrapped tensor
      return v.isBool();
    case Guard::kInt: {
      const at::Tensor* t = wrapped_number(v, at::kLong);
      return t != nullptr ? *t->const_data_ptr<int64_t>() == g.value : v.isInt() && v.toInt() == g.value;
    }
    case Guard::kBool: {
      const at::Tensor* t = wrapped_number(v, at::kBool);
      return t != nullptr ? *t->const_data_ptr<bool>() == (g.value != 0) : v.isBool() && v.toBool() == (g.value != 0);
    }
    case Guard::kDouble: {
      const at::Tensor* t = wrapped_number(v, at::kDouble);
      return t != nullptr ? *t->const_data_ptr<double>() == g.dvalue : v.isDouble() && v.toDouble() == g.dvalue;
    }
    case Guard::kString:
      return v.isString() && v.toStringRef() == g.svalue;
    case Guard::kNone:
      return v.isNone() || (v.isTensor() && !v.toTensor().defined());
    case Guard::kEnum:  // a dtype, layout or memory format: an int in the IValue
      return v.isInt() && v.toInt() == g.value;
    case Guard::kDevice:
      return v.isDevice() && v.toDevice() == g.device;
    case Guard::kList: {
      if (!v.isList()) {
        return false;
      }
      const auto list = v.toListRef();
      if (list.size() != g.children.size()) {
        return false;
      }
      for (size_t i = 0; i < list.size(); ++i) {
        if (!matches_value(g.children[i], list[i], syms)) {
          return false;
        }
      }
      return true;
    }
    case Guard::kAbsent:
    case Guard::kUnsupported:
      return false;
  }
  return false;
}

}  // namespace

Guard parse_guard(const py::handle& spec) {
  // (kind, ...) as native_guards.py emits it.
  const auto t = spec.cast<py::tuple>();
  const auto kind = t[0].cast<std::string>();
  Guard g;
  if (kind == "absent") {
    g.kind = Guard::kAbsent;
  } else if (kind == "tensor") {  // (device index: -1 CPU, -2 other; sizes; strides; offset; dtype)
    g.kind = Guard::kTensor;
    g.device_index = t[1].cast<int64_t>();
    g.sizes = ints_of(t[2]);
    g.strides = ints_of(t[3]);
    g.offset = t[4].cast<int64_t>();
    TORCH_CHECK(THPDtype_Check(t[5].ptr()), "a tensor guard's dtype must be a torch.dtype");
    g.value = static_cast<int64_t>(reinterpret_cast<THPDtype*>(t[5].ptr())->scalar_type);
  } else if (kind == "cpu_scalar") {
    g.kind = Guard::kCpuScalar;
    TORCH_CHECK(THPDtype_Check(t[1].ptr()), "a CPU scalar guard's dtype must be a torch.dtype");
    g.value = static_cast<int64_t>(reinterpret_cast<THPDtype*>(t[1].ptr())->scalar_type);
  } else if (kind == "any_float") {
    g.kind = Guard::kAnyDouble;
  } else if (kind == "any_complex") {
    g.kind = Guard::kAnyComplex;
  } else if (kind == "any_bool") {
    g.kind = Guard::kAnyBool;
  } else if (kind == "value") {
    const py::handle v = t[1];
    if (v.is_none()) {
      g.kind = Guard::kNone;
    } else if (PyBool_Check(v.ptr())) {
      g.kind = Guard::kBool;
      g.value = v.cast<bool>() ? 1 : 0;
    } else if (PyLong_CheckExact(v.ptr())) {
      g.kind = Guard::kInt;
      g.value = v.cast<int64_t>();
    } else if (PyFloat_CheckExact(v.ptr())) {
      g.kind = Guard::kDouble;
      g.dvalue = v.cast<double>();
    } else if (PyUnicode_CheckExact(v.ptr())) {
      g.kind = Guard::kString;
      g.svalue = v.cast<std::string>();
    } else if (THPDtype_Check(v.ptr())) {
      g.kind = Guard::kEnum;
      g.value = static_cast<int64_t>(reinterpret_cast<THPDtype*>(v.ptr())->scalar_type);
    } else if (THPLayout_Check(v.ptr())) {
      g.kind = Guard::kEnum;
      g.value = static_cast<int64_t>(reinterpret_cast<THPLayout*>(v.ptr())->layout);
    } else if (THPMemoryFormat_Check(v.ptr())) {
      g.kind = Guard::kEnum;
      g.value = static_cast<int64_t>(reinterpret_cast<THPMemoryFormat*>(v.ptr())->memory_format);
    } else if (THPDevice_Check(v.ptr())) {
      g.kind = Guard::kDevice;
      g.device = reinterpret_cast<THPDevice*>(v.ptr())->device;
    } else {
      g.kind = Guard::kUnsupported;
    }
  } else if (kind == "generic_tensor") {  // (device index, dtype, ((sym, bind, value), ...))
    g.kind = Guard::kGenericTensor;
    g.device_index = t[1].cast<int64_t>();
    TORCH_CHECK(THPDtype_Check(t[2].ptr()), "a tensor guard's dtype must be a torch.dtype");
    g.value = static_cast<int64_t>(reinterpret_cast<THPDtype*>(t[2].ptr())->scalar_type);
    g.ints = int_specs_of(t[3]);
    TORCH_CHECK(g.ints.size() % 2 == 1, "a generic tensor guard needs 2 * rank + 1 ints");
  } else if (kind == "generic_int") {  // ((sym, bind, value),)
    g.kind = Guard::kGenericInt;
    g.ints = int_specs_of(t[1]);
    TORCH_CHECK(g.ints.size() == 1, "a generic int guard needs one int");
  } else if (kind == "list") {
    g.kind = Guard::kList;
    for (const auto& child : t[1]) {
      g.children.push_back(parse_guard(child));
    }
  } else {
    g.kind = Guard::kUnsupported;
  }
  return g;
}

bool has_unsupported(const Guard& g) {
  if (g.kind == Guard::kUnsupported) {
    return true;
  }
  for (const Guard& c : g.children) {
    if (has_unsupported(c)) {
      return true;
    }
  }
  return false;
}

int32_t symbols_named(const Guard& g) {
  int32_t n = 0;
  for (const auto& spec : g.ints) {
    n = std::max(n, spec.sym + 1);
  }
  for (const Guard& c : g.children) {
    n = std::max(n, symbols_named(c));
  }
  return n;
}

bool PositionGuards::matches(const c10::OperatorHandle& op, const torch::jit::Stack& stack, int64_t* syms) const {
  if (!supported || op != this->op || (nsyms > 0 && syms == nullptr)) {
    return false;
  }
  const auto& arguments = op.schema().arguments();
  const size_t n = arguments.size();
  if (stack.size() < n || args.size() != n) {
    return false;
  }
  const IValue* values = stack.data() + (stack.size() - n);
  for (size_t i = 0; i < n; ++i) {
    const ArgGuard& a = args[i];
    const auto& d = arguments[i].default_value();
    const bool at_default = d.has_value() && *d == values[i];
    if (a.guard.kind == Guard::kAbsent) {
      if (!at_default) {
        return false;
      }
      continue;
    }
    if (a.not_default && at_default) {
      return false;  // the Python call would leave it out: another call shape
    }
    if (!matches_value(a.guard, values[i], syms)) {
      return false;
    }
  }
  return true;
}

}  // namespace neuron
