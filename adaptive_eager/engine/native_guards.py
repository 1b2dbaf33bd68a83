"""A trace position's guards for the C++ matcher (Note [A position's guards in C++] in
device/csrc/engine/guards.cpp), compiled from the same signature and template as its Python
matcher (matchers.py), and agreeing with it: the C++ guards may be stricter, never looser.

One guard per schema argument, since C++ sees the op's IValue stack, not the Python call:
an argument the Python call left out must be at its default there; one it passed must not
be, where leaving it out would change the call's shape.
"""
from __future__ import annotations

from adaptive_eager.device import native
from adaptive_eager.engine.record import CPU_SCALAR, Slot

from .matchers import _is_device_key, _is_tensor_key
from .trace import OpProto

_UNSUPPORTED = ("unsupported",)


def _guard(template, key) -> tuple:
    if type(template) is Slot:
        if _is_tensor_key(key):
            shape, stride, offset, dtype, device = key
            index = device.index if device.type == "neuron" else -1
            return ("tensor", index, tuple(shape), tuple(stride), offset, dtype)
        if isinstance(key, tuple) and len(key) == 2 and key[0] is CPU_SCALAR:
            return ("cpu_scalar", key[1])
        if key is float:
            return ("any_float",)
        if key is complex:
            return ("any_complex",)
        return _UNSUPPORTED  # an opaque object, keyed by its type
    if type(template) is list:
        return ("list", tuple(_guard(t, k) for t, k in zip(template, key)))
    if type(template) is tuple:
        return _UNSUPPORTED  # no ATen argument is a tuple
    return ("value", template)


def compile_guards(proto: OpProto) -> native.PositionGuards:
    func, arg_keys, kw_keys = proto.signature
    keyword = dict(kw_keys)
    per_argument = []
    for i, argument in enumerate(func._schema.arguments):
        if i < len(arg_keys):
            per_argument.append((_guard(proto.args_t[i], arg_keys[i]), i == len(arg_keys) - 1))
        elif argument.name in keyword:
            key = keyword.pop(argument.name)
            template = key if _is_device_key(key) else proto.kwargs_t[argument.name]
            # A keyword the route passes is keyword-only; any other one is a call shape C++
            # does not see (the route never makes it): unsupported.
            guard = _guard(template, key) if argument.kwarg_only else _UNSUPPORTED
            per_argument.append((guard, True))
        else:
            per_argument.append((("absent",), False))
    if keyword:  # a keyword the schema does not have
        per_argument[0] = (_UNSUPPORTED, False)
    return native.PositionGuards(func, per_argument)
