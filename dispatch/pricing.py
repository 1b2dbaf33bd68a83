"""What one op costs on the device, from its host arguments: the roofline model's inputs.

The C++ eager path prices aten ops itself (csrc/aten/pricing.cpp); custom kernels, whose host
implementation runs in Python, are priced here (Note [Custom kernel cost]).
"""
from __future__ import annotations

import torch
from torch.utils.flop_counter import flop_registry, shape_wrapper

from .classify import OpInfo
from .context import CONTEXT


def priced_us(info: OpInfo, args, kwargs, out, nbytes: int, dtype) -> float:
    """Roofline µs of one op on these host arguments moving nbytes: a custom kernel's own
    estimate (Note [Custom kernel cost]), else FLOPs where torch has a formula."""
    if info.cost_hook is not None:
        flops, nbytes = info.cost_hook(args, kwargs, nbytes)
    else:
        flops = op_flops(info, args, kwargs, out) if info.has_flop_formula else 0
    return CONTEXT.runtime.cost.op_us(flops, nbytes, dtype or torch.float32)


def op_flops(info: OpInfo, args, kwargs, out) -> float:
    """FLOPs of the op on these host arguments, where torch has a formula; else 0."""
    formula = _flop_formulas.get(info.op, _UNSEEN)
    if formula is _UNSEEN:
        formula = _flop_formulas[info.op] = _shape_flop_formula(info.op)
    if formula is None:
        return 0
    fn, on_shapes = formula
    try:
        if on_shapes:
            return fn(*[_shape_of(a) for a in args], out_shape=_shape_of(out),
                      **{k: _shape_of(v) for k, v in kwargs.items()})
        return fn(*args, **kwargs, out_val=out)
    except Exception:  # a formula that cannot read these arguments: count bytes only
        return 0


# torch's FLOP formulas, per OpOverload, called on shapes. flop_registry holds them wrapped in
# flop_counter.shape_wrapper, whose pytree tree_map over every argument cost ~35 us per mm
# (more than the whole rest of the eager path); we map tensors to shapes ourselves instead.
_flop_formulas: dict = {}
_UNSEEN = object()
_SHAPE_WRAPPER_CODE = shape_wrapper(lambda: None).__code__


def _mm_flops(a, b, out_shape=None, **_):
    m, k = a
    n = b[-1]
    return m * n * 2 * k


def _bmm_flops(a, b, out_shape=None, **_):
    batch, m, k = a
    n = b[-1]
    return batch * m * n * 2 * k


# The matmul family, as flop_counter's formulas compute it: its addmm/baddbmm formulas call the
# *wrapped* mm/bmm formulas, so unwrapping them alone would still pay a tree_map per op.
_MATMUL_FLOPS = {
    torch.ops.aten.mm: _mm_flops,
    torch.ops.aten.addmm: lambda c, a, b, out_shape=None, **_: _mm_flops(a, b),
    torch.ops.aten.bmm: _bmm_flops,
    torch.ops.aten.baddbmm: lambda c, a, b, out_shape=None, **_: _bmm_flops(a, b),
}


def _shape_flop_formula(op):
    """(formula, takes_shapes) for the op, or None: the formula unwrapped when it is
    shape_wrapper's, else as registered (get_raw=True formulas take the values)."""
    formula = flop_registry.get(op._overloadpacket)
    if formula is None:
        return None
    if op._overloadpacket in _MATMUL_FLOPS:
        return _MATMUL_FLOPS[op._overloadpacket], True
    inner = getattr(formula, "__wrapped__", None)
    if inner is not None and getattr(formula, "__code__", None) is _SHAPE_WRAPPER_CODE:
        return inner, True
    return formula, False


def _shape_of(a):
    """flop_counter.get_shape, mapped through lists and tuples as its tree_map does."""
    if isinstance(a, torch.Tensor):
        return a.shape
    if isinstance(a, (list, tuple)):
        return type(a)(_shape_of(x) for x in a)
    return a
