"""A trace position's guards for the C++ matcher (Note [A position's guards in C++] in
device/csrc/engine/guards.cpp), compiled from the same signature and template as its Python
matcher (matchers.py), and agreeing with it: the C++ guards may be stricter, never looser.

One guard per schema argument, since C++ sees the op's IValue stack, not the Python call:
an argument the Python call left out must be at its default there; one it passed must not
be, where leaving it out would change the call's shape. A shape-generic position's ints
(tensors' sizes, strides and offsets, int arguments) are checked by its spec, in the order its
matcher checks them (Note [Generic guards]).
"""
from __future__ import annotations

from adaptive_eager.device import native
from adaptive_eager.engine.record import CPU_SCALAR, Slot

from .matchers import _is_device_key, _is_tensor_key

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
        if key is bool:  # a bool passed as a Scalar: Note [Lifted scalars]
            return ("any_bool",)
        return _UNSUPPORTED  # an opaque object, keyed by its type
    if type(template) is list:
        return ("list", tuple(_guard(t, k) for t, k in zip(template, key)))
    if type(template) is tuple:
        return _UNSUPPORTED  # no ATen argument is a tuple
    return ("value", template)


def _int_spec(spec) -> tuple:
    """A generic position's int spec as C++ reads it: (symbol or -1, binds it, constant)."""
    return (-1, False, spec[1]) if spec[0] == "const" else (spec[1], spec[2], 0)


def _generic_guard(template, key, specs) -> tuple:
    """_guard for a shape-generic position: its ints taken from `specs` in the order
    generic.erase (and so its matcher) walks them."""
    if type(template) is Slot and _is_tensor_key(key):
        shape, _, _, dtype, device = key
        index = device.index if device.type == "neuron" else -1
        return ("generic_tensor", index, dtype, tuple(_int_spec(next(specs)) for _ in range(2 * len(shape) + 1)))
    if type(template) in (list, tuple):
        children = tuple(_generic_guard(t, k, specs) for t, k in zip(template, key))  # each consumes its ints
        return ("list", children) if type(template) is list else _UNSUPPORTED
    if type(template) is int:
        return ("generic_int", (_int_spec(next(specs)),))
    return _guard(template, key)


def compile_guards(proto) -> native.PositionGuards:
    """An OpProto's guards, or a GenericProto's (Note [Generic guards])."""
    if getattr(proto, "generic", False):
        func, arg_keys, kw_keys = proto.source
        specs = iter(proto.spec)
        arg_guards = [_generic_guard(t, k, specs) for t, k in zip(proto.args_t, arg_keys)]
        # Keywords in the signature's order, as erase() takes their ints; a device is no int.
        keyword = {name: (_guard(k, k) if _is_device_key(k) else _generic_guard(proto.kwargs_t[name], k, specs))
                   for name, k in kw_keys}
        if next(specs, None) is not None:
            raise AssertionError("adaptive engine bug: a generic position's guards and its matcher walk its ints apart")
    else:
        func, arg_keys, kw_keys = proto.signature
        arg_guards = [_guard(t, k) for t, k in zip(proto.args_t, arg_keys)]
        keyword = {name: _guard(k if _is_device_key(k) else proto.kwargs_t[name], k) for name, k in kw_keys}
    per_argument = []
    for i, argument in enumerate(func._schema.arguments):
        if i < len(arg_guards):
            per_argument.append((arg_guards[i], i == len(arg_guards) - 1))
        elif argument.name in keyword:
            guard = keyword.pop(argument.name)
            # A keyword the route passes is keyword-only; any other one is a call shape C++
            # does not see (the route never makes it): unsupported.
            per_argument.append((guard if argument.kwarg_only else _UNSUPPORTED, True))
        else:
            per_argument.append((("absent",), False))
    if keyword:  # a keyword the schema does not have
        per_argument[0] = (_UNSUPPORTED, False)
    return native.PositionGuards(func, per_argument)
