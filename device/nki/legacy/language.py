"""neuronxcc.nki.language: nki.language plus the old dialect's own forms.

Every name of nki.language is here too (module __getattr__), the same object, so an operator
passed to an instruction (`op=nl.add`) is the one the instructions know. What the old dialect
adds or spells differently: `nl.par_dim`, `nl.arange`/`nl.mgrid` indices (indexing.py),
`mask=` on the tile-level functions (masking.py), memories given as strings or left out
(`buffer=None` is SBUF), launch-grid helpers (`nl.nc`). The old forms refuse to run inside
an nki (new) kernel, as the new compiler refuses neuronxcc.nki inside its kernels.
"""
from __future__ import annotations

import functools

from .. import language as _nl
from ..errors import NkiValidationError
from . import masking as _masking
from .indexing import arange as _arange
from .indexing import mgrid as _mgrid

_MEMORIES = {"sbuf": _nl.sbuf, "psum": _nl.psum, "hbm": _nl.hbm, "private_hbm": _nl.private_hbm,
             "shared_hbm": _nl.shared_hbm}


class par_dim(int):  # noqa: N801 (the old dialect's name)
    """nl.par_dim(n): marks a dim of a shape as the partition dim, which must be the first:
    dims before it (block dimensions) are refused, as by the current toolchain (see _shape)."""

    def __repr__(self):
        return f"nl.par_dim({int(self)})"


def _shape(shape, what: str) -> tuple[int, ...]:
    shape = tuple(shape)
    marked = [d for d, n in enumerate(shape) if isinstance(n, par_dim)]
    if marked and marked[0] != 0:
        raise NkiValidationError(
            f"{what}: shape {shape} has block dimensions (dims before nl.par_dim), which the Neuron SDK no longer "
            f"supports: make the partition dim the first and hold the blocks in a Python list of tiles "
            f"(the NKI migration guide's 'Removing block dimensions from NKI kernels')")
    return tuple(int(n) for n in shape)


def _memory(buffer):
    if buffer is None:
        return _nl.sbuf
    if isinstance(buffer, str) and not isinstance(buffer, _nl.MemoryRegion):
        if buffer not in _MEMORIES:
            raise NkiValidationError(f"buffer {buffer!r} is not an NKI memory; use one of {', '.join(_MEMORIES)}")
        return _MEMORIES[buffer]
    return buffer


def _old(what: str):
    """Marks a function of the old dialect: refused in nki kernels (masking.require_dialect)."""
    def wrap(fn):
        @functools.wraps(fn)
        def checked(*args, **kwargs):
            _masking.require_dialect(f"nl.{what}")
            return fn(*args, **kwargs)
        return checked
    return wrap


# --- memories and shapes --------------------------------------------------------------------------
@_old("ndarray")
def ndarray(shape, dtype, buffer=None, name="", **kwargs):
    return _nl.ndarray(_shape(shape, "nl.ndarray"), dtype, _memory(buffer), name, **kwargs)


@_old("zeros")
def zeros(shape, dtype, buffer=None, name="", **kwargs):
    return _nl.zeros(_shape(shape, "nl.zeros"), dtype, _memory(buffer), name)


@_old("ones")
def ones(shape, dtype, buffer=None, name="", **kwargs):
    return _nl.ones(_shape(shape, "nl.ones"), dtype, _memory(buffer), name)


@_old("full")
def full(shape, fill_value, dtype, buffer=None, name="", **kwargs):
    return _nl.full(_shape(shape, "nl.full"), fill_value, dtype, _memory(buffer), name)


@_old("zeros_like")
def zeros_like(a, dtype=None, buffer=None, name="", **kwargs):
    return _nl.zeros_like(a, dtype, _memory(buffer) if buffer is not None else None, name)


@_old("empty_like")
def empty_like(a, dtype=None, buffer=None, name="", **kwargs):
    return _nl.empty_like(a, dtype, _memory(buffer) if buffer is not None else None, name)


# --- indices, masks and grids ------------------------------------------------------------------------
arange = _old("arange")(_arange)


class _CheckedMGrid:
    def __getitem__(self, key):
        _masking.require_dialect("nl.mgrid")
        return _mgrid[key]


mgrid = _CheckedMGrid()


def nc(n: int) -> int:
    """nl.nc(n) in a launch grid: n programs spread over the logical device's NeuronCores. The
    emulator spreads every grid that way (program i on core i mod LNC), so it is the count."""
    return int(n)


def spmd_dim(*sizes) -> int:
    """nl.spmd_dim(4, nl.nc(2)): one grid dim of the sizes' product (spread as nl.nc says)."""
    n = 1
    for s in sizes:
        n *= int(s)
    return n


class fp32:  # noqa: N801 (the old dialect's name)
    """nl.fp32.min: the most negative float32 (bit pattern 0xff7fffff)."""

    min = -3.4028234663852886e38  # noqa: A003


@_old("rand")
def rand(shape, dtype=_nl.float32, **kwargs):
    """nl.rand: float32 unless told (the old signature's default)."""
    return _nl.rand(_shape(shape, "nl.rand"), dtype, _memory(kwargs.get("buffer")), kwargs.get("name", ""))


@_old("static_cast")
def static_cast(arr, dtype):
    """A copy of a tile in another dtype."""
    return _nl.copy_tile(arr, dtype)


# --- movement and math with mask= ---------------------------------------------------------------------
def _maskable(name: str, fn):
    @functools.wraps(fn)
    def masked(*args, mask=None, **kwargs):
        return _masking.call(fn, args, kwargs, mask, f"nl.{name}")
    return masked


load = _maskable("load", _nl.load)
store = _maskable("store", _nl.store)
load_transpose2d = _maskable("load_transpose2d", _nl.load_transpose2d)
sum = _maskable("sum", _nl.sum)  # noqa: A001 (NKI's names)
max = _maskable("max", _nl.max)  # noqa: A001
min = _maskable("min", _nl.min)  # noqa: A001
mean = _maskable("mean", _nl.mean)
prod = _maskable("prod", _nl.prod)
var = _maskable("var", _nl.var)
all = _maskable("all", _nl.all)  # noqa: A001
softmax = _maskable("softmax", _nl.softmax)
transpose = _maskable("transpose", _nl.transpose)
matmul = _maskable("matmul", _nl.matmul)
where = _maskable("where", _nl.where)
broadcast_to = _maskable("broadcast_to", _nl.broadcast_to)


def __getattr__(name):  # everything else is nki.language's own (operators included: see language._call_operator)
    try:
        return getattr(_nl, name)
    except AttributeError:
        raise AttributeError(f"module 'neuronxcc.nki.language' has no attribute {name!r} in the emulator (it "
                             f"implements nki.language plus the old dialect's par_dim, arange, mgrid, mask= and nc; "
                             f"see the README's NKI section)") from None
