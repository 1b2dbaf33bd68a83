"""neuronxcc.nki's `mask=`: an instruction that runs on part of its tiles only.

`nl.square(t, mask=(i_p < 64) & (i_f < 256))` computes the [0:64, 0:256] corner of its result
and leaves the rest unwritten, as the chip does (the mask narrows the instruction's access
pattern). Here every operand is cut to the mask's bounds (a PendingAccess, a view indexed
past its tensor, is resolved under them), the function runs on the cut operands, and its
result is copied into the corner of a full-size tile: that copy is one more instruction in
the modelled time than the chip would run, the price of reusing the unmasked function.
"""
from __future__ import annotations

from .. import isa as _isa
from ..errors import NkiValidationError
from ..program import current
from ..tensor import NkiTensor
from .indexing import Mask, PendingAccess, Predicate


def require_dialect(what: str) -> None:
    """The old dialect's forms refuse to run in an nki (new) kernel, as the new toolchain's
    compiler refuses neuronxcc.nki inside its kernels (NKI 0.4.0 and later)."""
    if current().launch.dialect == "nki":
        raise NkiValidationError(
            f"{what} is neuronxcc.nki (the old dialect) inside an nki.jit kernel, which the NKI compiler refuses "
            f"since NKI 0.4.0: decorate the kernel with neuronxcc.nki.jit, or migrate it (slices or .ap() for "
            f"nl.arange/mgrid indices, min() in the slice for mask=)")


def strict(x):
    """An operand used without a mask: a PendingAccess here is an out-of-bounds index."""
    if isinstance(x, PendingAccess):
        raise NkiValidationError(x.problem)
    return x


def call(fn, args, kwargs, mask, what: str):
    """fn(*args, **kwargs) under `mask` (None: as it is)."""
    require_dialect(f"{what}(mask=...)" if mask is not None else what)
    if mask is True:  # a mask the kernel computed from Python values: a constant predicate
        mask = None
    if mask is False:
        return _nothing(args)
    if mask is None:
        return fn(*[strict(a) for a in args], **kwargs)
    mask = mask.mask() if isinstance(mask, Predicate) else mask
    if not isinstance(mask, Mask):
        raise NkiValidationError(f"{what}: mask= takes a comparison of index ranges ((i_p < 64) & (i_f < 256)), "
                                 f"got {type(mask).__name__}")
    bounds = mask.by_dim()
    if any(lo >= hi for lo, hi in bounds.values()):
        return _nothing(args)
    result = fn(*[cut(a, bounds) for a in args], **{k: cut(v, bounds) for k, v in kwargs.items()})
    if not isinstance(result, NkiTensor):
        return result
    return _in_full(result, bounds, _full_shape(result, bounds, args))


def cut(x, bounds: dict[int, tuple[int, int]]):
    """An operand narrowed to the mask: each masked dim of a tile cut to [lo, hi)."""
    if isinstance(x, PendingAccess):
        return x.under(bounds)
    if not isinstance(x, NkiTensor):
        return x
    key = []
    for d, n in enumerate(x.shape):
        lo, hi = bounds.get(d, (0, n))
        key.append(slice(lo, min(hi, n)) if n > 1 else slice(None))  # size 1: a broadcast operand
    return x[tuple(key)]


def _full_shape(result: NkiTensor, bounds, args) -> tuple[int, ...]:
    """The result's shape without the mask: a masked dim at its operands' extent."""
    extents = {}
    for a in args:
        if isinstance(a, (NkiTensor, PendingAccess)):
            for d, n in enumerate(a.shape):
                extents[d] = max(extents.get(d, 1), n)
    shape = list(result.shape)
    for d, (lo, hi) in bounds.items():
        if d < len(shape) and shape[d] == hi - lo and hi - lo != extents.get(d, shape[d]):
            shape[d] = extents[d]
    return tuple(shape)


def _in_full(part: NkiTensor, bounds, shape) -> NkiTensor:
    if part.shape == shape:
        return part
    full = current().allocate(shape, part.dtype, "sbuf", part.name, None)
    key = []
    for d, n in enumerate(shape):
        lo = bounds.get(d, (0, n))[0] if part.shape[d] != n else 0
        key.append(slice(lo, lo + part.shape[d]))
    _isa.tensor_copy(full[tuple(key)], part)
    return full


def _nothing(args):
    """A mask that keeps nothing: the instruction does not run, its result is unwritten."""
    first = next((a for a in args if isinstance(a, (NkiTensor, PendingAccess))), None)
    return None if first is None else current().allocate(first.shape, first.dtype, "sbuf", "", None)
