"""neuronxcc.nki.language: nki.language plus the old dialect's own forms.

Every name of nki.language is here too (module __getattr__), the same object, so an operator
passed to an instruction (`op=nl.add`) is the one the instructions know. What the old dialect
adds or spells differently: `nl.par_dim`, `nl.arange`/`nl.mgrid` indices (indexing.py),
`mask=` on the tile-level functions (masking.py), block dimensions (blocks.py), memories given as strings or left out
(`buffer=None` is SBUF), launch-grid helpers (`nl.nc`). The old forms refuse to run inside
an nki (new) kernel, as the new compiler refuses neuronxcc.nki inside its kernels.
"""
from __future__ import annotations

import functools

from .. import isa as _isa
from .. import language as _nl
from .. import ops as _ops
from ..errors import NkiValidationError
from . import blocks as _blocks
from . import masking as _masking
from .indexing import arange as _arange
from .indexing import mgrid as _mgrid

_MEMORIES = {"sbuf": _nl.sbuf, "psum": _nl.psum, "hbm": _nl.hbm, "private_hbm": _nl.private_hbm,
             "shared_hbm": _nl.shared_hbm}


class par_dim(int):  # noqa: N801 (the old dialect's name)
    """nl.par_dim(n): marks a dim of a shape as the partition dim; dims before it are blocks
    (blocks.py)."""

    def __repr__(self):
        return f"nl.par_dim({int(self)})"


def _split(shape, what: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(block dims, tile shape) of a shape that may mark its partition dim with nl.par_dim."""
    shape = tuple(shape)
    marked = [d for d, n in enumerate(shape) if isinstance(n, par_dim)]
    if len(marked) > 1:
        raise NkiValidationError(f"{what}: shape {shape} marks {len(marked)} dims with nl.par_dim; mark one")
    first = marked[0] if marked else 0
    return tuple(int(n) for n in shape[:first]), tuple(int(n) for n in shape[first:])


def _allocate(shape, what: str, make, buffer=None):
    """make(tile_shape) for a plain shape; a BlockTensor of such tiles for one with blocks."""
    blocks, tile = _split(shape, what)
    if _nl.is_hbm(_memory(buffer)):  # HBM has no partitions: par_dim marks nothing there
        return make(blocks + tile)
    if not blocks:
        return make(tile)
    return _blocks.allocate(blocks, lambda b: make(tile))


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
    return _allocate(shape, "nl.ndarray", lambda s: _nl.ndarray(s, dtype, _memory(buffer), name, **kwargs), buffer)


@_old("zeros")
def zeros(shape, dtype, buffer=None, name="", **kwargs):
    return _allocate(shape, "nl.zeros", lambda s: _nl.zeros(s, dtype, _memory(buffer), name), buffer)


@_old("ones")
def ones(shape, dtype, buffer=None, name="", **kwargs):
    return _allocate(shape, "nl.ones", lambda s: _nl.ones(s, dtype, _memory(buffer), name), buffer)


@_old("full")
def full(shape, fill_value, dtype, buffer=None, name="", **kwargs):
    return _allocate(shape, "nl.full", lambda s: _nl.full(s, fill_value, dtype, _memory(buffer), name), buffer)


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
    buffer = kwargs.get("buffer")
    return _allocate(shape, "nl.rand", lambda s: _nl.rand(s, dtype, _memory(buffer), kwargs.get("name", "")), buffer)


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


def _load(src, dtype=None):
    """nl.load: a 1-D source is a column, its one dim the partition dim (the old dialect puts
    the partition dim first in every index), where nki's load makes it a row."""
    if src.ndim == 1:
        tile = _nl.ndarray((src.shape[0], 1), dtype or src.dtype, _nl.sbuf)
        _isa.dma_copy(tile, src.expand_dim(1))
        return tile
    return _nl.load(src, dtype)


load = _maskable("load", _load)
store = _maskable("store", _nl.store)
def _load_transpose2d(src, dtype=None):
    """nl.load_transpose2d(src, dtype=): the DMA moves src's dtype; a cast is a copy after."""
    tile = _nl.load_transpose2d(src)
    return tile if dtype is None or dtype == tile.dtype else _nl.copy_tile(tile, dtype)


load_transpose2d = _maskable("load_transpose2d", _load_transpose2d)
def any_axes(reduce):
    """A reduction over any free axes: the old dialect's nl.sum(t, axis=[2, 4]); nki's reduce
    the trailing free dims, so the others are moved in front by a view first."""
    @functools.wraps(reduce)
    def reduced(x, axis, *args, keepdims=False, **kwargs):
        axes = sorted(a % x.ndim for a in ((axis,) if isinstance(axis, int) else axis))
        kept = [d for d in range(x.ndim) if d not in axes]
        if not isinstance(x, _nl.NkiTensor) or axes == list(range(x.ndim - len(axes), x.ndim)) or 0 in axes:
            return reduce(x, axis, *args, keepdims=keepdims, **kwargs)
        order = kept + axes
        out = reduce(x.permute(order), list(range(len(kept), x.ndim)), *args, keepdims=keepdims, **kwargs)
        return out.permute([order.index(d) for d in range(x.ndim)]) if keepdims else out
    return reduced


sum = _maskable("sum", any_axes(_nl.sum))  # noqa: A001 (NKI's names)
max = _maskable("max", any_axes(_nl.max))  # noqa: A001
min = _maskable("min", any_axes(_nl.min))  # noqa: A001
mean = _maskable("mean", any_axes(_nl.mean))
prod = _maskable("prod", any_axes(_nl.prod))
var = _maskable("var", any_axes(_nl.var))
all = _maskable("all", any_axes(_nl.all))  # noqa: A001
softmax = _maskable("softmax", _nl.softmax)
transpose = _maskable("transpose", _nl.transpose)
matmul = _maskable("matmul", _nl.matmul)
where = _maskable("where", _nl.where)
broadcast_to = _maskable("broadcast_to", _nl.broadcast_to)


class LoopReduce:
    """nl.loop_reduce(x, op, loop_indices)'s value: assigned into a tile (`acc[...] = ...`) it
    makes the tile op(tile, x), so each iteration of the loop reduces x into it, the tile
    holding its start value before the loop (the old docs' example zeroes it)."""

    def __init__(self, x, op, dtype, mask):
        self.x, self.op, self.dtype, self.mask = x, op, dtype, mask

    def reduce_into(self, dst):
        op = _ops.as_operator(self.op, instr="nl.loop_reduce")
        return op(dst, self.x, dtype=self.dtype or dst.dtype, mask=self.mask)


@_old("loop_reduce")
def loop_reduce(x, op, loop_indices, dtype=None, mask=None, **kwargs):
    """Only as `acc[...] = nl.loop_reduce(...)`: bound to a name (`b = nl.loop_reduce(...)`) the
    emulator cannot see the tile to reduce into, and using the value raises saying so."""
    return LoopReduce(x, op, dtype, mask)


def __getattr__(name):  # everything else is nki.language's own (operators included: see language._call_operator)
    try:
        return getattr(_nl, name)
    except AttributeError:
        raise AttributeError(f"module 'neuronxcc.nki.language' has no attribute {name!r} in the emulator (it "
                             f"implements nki.language plus the old dialect's par_dim, arange, mgrid, mask= and nc; "
                             f"see the README's NKI section)") from None
