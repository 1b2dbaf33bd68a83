"""neuronxcc.nki.isa: the old dialect's instructions, which return their result tile.

In NKI 0.1 an instruction allocated its destination and returned it (`t = nisa.tensor_copy(src)`,
`psum[...] += nisa.nc_matmul(a, b)`); since NKI 0.2 `dst` is the first argument. Each function
here allocates the tile the old docs say the instruction returns (shape, dtype, memory) and runs
nki.isa's instruction into it, under `mask=` if given (masking.py). `dma_copy` keeps its keyword
form and takes `dst_rmw_op` as dma_compute. Every other name is nki.isa's own.
"""
from __future__ import annotations

from .. import isa as _isa
from .. import language as _nl
from ..dtypes import as_dtype
from ..errors import NkiValidationError
from ..program import current
from ..tensor import PSUM, SBUF, NkiTensor
from . import masking as _masking
from .indexing import Affine, Predicate
from .language import any_axes as _any_axes


def _new(shape, dtype, buffer=SBUF) -> NkiTensor:
    return current().allocate(tuple(shape), as_dtype(dtype), buffer, "", None)


def _wider(*tiles):
    """The dtype of the tile with the higher precision (the old docs' default result dtype)."""
    found = [t.dtype for t in tiles if isinstance(t, NkiTensor)]
    return max(found, key=lambda d: (d.is_float, d.itemsize))


def _returning(name: str, body):
    """An old-dialect instruction: body(*args, **kwargs) allocates and returns its result."""
    def instruction(*args, mask=None, **kwargs):
        return _masking.call(body, args, kwargs, mask, f"nisa.{name}")
    instruction.__name__ = instruction.__qualname__ = name
    instruction.__doc__ = f"neuronxcc.nki.isa.{name}: returns its result tile (see the module's doc)."
    return instruction


def _tensor_tensor(data1, data2, op, dtype=None, engine=_isa.engine.unknown, **kwargs):
    out = _new(data1.shape, dtype or _wider(data1, data2))
    _isa.tensor_tensor(out, data1, data2, op, engine=engine)
    return out


def _tensor_scalar(data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False, dtype=None,
                   engine=_isa.engine.unknown, **kwargs):
    out = _new(data.shape, dtype or data.dtype)
    _isa.tensor_scalar(out, data, op0, operand0, reverse0=reverse0, op1=op1, operand1=operand1, reverse1=reverse1,
                       engine=engine)
    return out


def _activation(op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None,
                reduce_cmd=_isa.reduce_cmd.idle, dtype=None, **kwargs):
    out = _new(data.shape, dtype or data.dtype)
    _isa.activation(out, op, data, bias=bias, scale=scale, reduce_op=reduce_op, reduce_res=reduce_res,
                    reduce_cmd=reduce_cmd)
    return out


def _activation_reduce(op, data, reduce_op, reduce_res, bias=None, scale=1.0, dtype=None, **kwargs):
    out = _new(data.shape, dtype or data.dtype)
    _isa.activation_reduce(out, op, data, reduce_op, reduce_res, bias=bias, scale=scale)
    return out


def _scalar_tensor_tensor(data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, dtype=None,
                          **kwargs):
    out = _new(data.shape, dtype or _wider(data, operand1))
    _isa.scalar_tensor_tensor(out, data, op0, operand0, op1, operand1, reverse0=reverse0, reverse1=reverse1)
    return out


def _tensor_copy(src, dtype=None, engine=_isa.engine.unknown, **kwargs):
    out = _new(src.shape, dtype or src.dtype)
    _isa.tensor_copy(out, src, engine=engine)
    return out


def _reciprocal(data, dtype=None, **kwargs):
    out = _new(data.shape, dtype or data.dtype)
    _isa.reciprocal(out, data)
    return out


def _tensor_reduce(op, data, axis, dtype=None, negate=False, keepdims=False, **kwargs):
    return _any_axes(lambda x, a, keepdims: _nl._reduce(op, x, a, dtype, keepdims, negate))(data, axis,
                                                                                             keepdims=keepdims)


def _tensor_tensor_scan(data0, data1, initial, op0, op1, reverse0=False, reverse1=False, dtype=None, **kwargs):
    out = _new(data0.shape, dtype or _wider(data0, data1))
    _isa.tensor_tensor_scan(out, data0, data1, initial, op0, op1, reverse0=reverse0, reverse1=reverse1)
    return out


def _tensor_scalar_reduce(data, op0, operand0, reduce_op, reduce_res, reverse0=False, dtype=None, **kwargs):
    out = _new(data.shape, dtype or data.dtype)
    _isa.tensor_scalar_reduce(out, data, op0, operand0, reduce_op, reduce_res=reduce_res, reverse0=reverse0)
    return out


def _nc_matmul(stationary, moving, is_stationary_onezero=False, is_moving_onezero=False, is_transpose=False,
               tile_position=(), tile_size=(), **kwargs):
    """stationary (K, M) and moving (K, N): the (M, N) product in PSUM, float32. An operand in
    PSUM (a Tensor Engine transpose's result, which nki-samples' flash attention backward feeds
    straight in; the old compiler took it) is evicted to SBUF by a copy, priced as one."""
    stationary, moving = (_nl.copy_tile(t) if t.buffer == PSUM else t for t in (stationary, moving))
    out = _new((stationary.free_size, moving.free_size), _nl.float32, PSUM)
    _isa.nc_matmul(out, stationary, moving, is_stationary_onezero=is_stationary_onezero,
                   is_moving_onezero=is_moving_onezero, is_transpose=is_transpose, tile_position=tile_position,
                   tile_size=tile_size)
    return out


def _nc_transpose(data, dtype=None, engine=_isa.engine.unknown, **kwargs):
    """The transposed tile, in SBUF: from the Vector Engine (the old default for tiles of at
    most 32 x 32), or from the Tensor Engine through PSUM and a copy out. The copy is what the
    old compiler inserted for the usual consumer, a matmul, which reads SBUF only; returning
    the PSUM tile instead holds a PSUM bank as long as the kernel's Python variable lives
    (nki-samples' flash attention backward then runs out of banks the compiler would reuse)."""
    small = data.partitions <= 32 and data.free_size <= 32
    if engine == _isa.engine.vector or (engine == _isa.engine.unknown and small):
        out = _new((data.free_size, data.partitions), dtype or data.dtype, SBUF)
        _isa.nc_transpose(out, data, engine=_isa.engine.vector)
        return out
    staged = _new((data.free_size, data.partitions), data.dtype, PSUM)
    _isa.nc_transpose(staged, data, engine=_isa.engine.tensor)
    return _nl.copy_tile(staged, dtype or data.dtype)


def _bn_stats(data, dtype=None, **kwargs):
    out = _new((data.partitions, 6), dtype or _nl.float32)
    _isa.bn_stats(out, data)
    return out


def _bn_aggr(data, dtype=None, **kwargs):
    out = _new((data.partitions, 2), dtype or _nl.float32)
    _isa.bn_aggr(out, data)
    return out


def _memset(shape, value, dtype, engine=_isa.engine.unknown, **kwargs):
    out = _new(shape, dtype)
    _isa.memset(out, value, engine=engine)
    return out


def _iota(expr, dtype, **kwargs):
    """The tile of an index expression's values (`nisa.iota(nl.arange(128)[:, None] * 2 + 5,
    dtype)`): its ranges become nki.isa.iota's channel multiplier (dim 0) and pattern (the rest)."""
    expr = expr if isinstance(expr, Affine) else Affine({}, int(expr))
    rank = max([r.rank for r in expr.terms] + [2])
    by_pos = {r.pos if r.pos is not None else rank - 1: (c, r.n) for r, c in expr.terms.items()}
    shape = [by_pos.get(d, (0, 1))[1] for d in range(rank)]
    out = _new(shape, dtype)
    pattern = [[by_pos.get(d, (0, 1))[0], shape[d]] for d in range(1, rank)]
    _isa.iota(out, pattern, offset=expr.const, channel_multiplier=by_pos.get(0, (0, 1))[0])
    return out


def _affine_select(pred, on_true_tile, on_false_value, dtype=None, **kwargs):
    """on_true_tile where the predicate holds, else on_false_value: nki.isa.affine_select with
    the predicate `expr < limit` as `limit - expr > 0`, its ranges the channel multiplier (dim 0)
    and the pattern (the free dims, by on_true_tile's shape)."""
    if not isinstance(pred, Predicate):
        raise NkiValidationError(f"nisa.affine_select: pred must compare index expressions (i_q >= i_k), "
                                 f"got {type(pred).__name__}; for a tile of booleans use nl.where")
    value = Affine({}, pred.limit) - pred.expr
    by_pos = {r.pos if r.pos is not None else 0: c for r, c in value.terms.items()}
    shape = on_true_tile.shape
    out = _new(shape, dtype or on_true_tile.dtype)
    # the old compiler took a PSUM tile here (nki-samples' flash attention passes its scores)
    # though the GpSimd Engine reads SBUF only: evicted by a copy, priced as one
    src = on_true_tile
    if src.dtype != out.dtype or src.buffer == PSUM:
        src = _nl.copy_tile(on_true_tile, out.dtype)
    _isa.affine_select(out, [[by_pos.get(d, 0), shape[d]] for d in range(1, len(shape))], by_pos.get(0, 0), src,
                       on_false_value, cmp_op=_nl.greater, offset=value.const)
    return out


def _max8(src, dtype=None, **kwargs):
    out = _new((src.partitions, 8), dtype or src.dtype)
    _isa.max8(out, src)
    return out


def _dma_transpose(src, dtype=None, **kwargs):
    out = _new(tuple(reversed(src.shape)) if src.ndim == 2 else (src.shape[-1],) + src.shape[1:-1] + (src.shape[0],),
               src.dtype)
    _isa.dma_transpose(out, src)
    return out


def _dropout(data, prob, dtype=None, **kwargs):
    return _nl.dropout(data, prob, dtype)


def _dma_copy(dst=None, src=None, dst_rmw_op=None, oob_mode=_isa.oob_mode.error, dge_mode=_isa.dge_mode.unknown):
    if dst_rmw_op is not None:  # NKI 0.2 moved the read-modify-write to dma_compute
        _isa.dma_compute(dst, [src, dst], dst_rmw_op, oob_mode=oob_mode)
    else:
        _isa.dma_copy(dst, src, oob_mode=oob_mode, dge_mode=dge_mode)


tensor_tensor = _returning("tensor_tensor", _tensor_tensor)
scalar_tensor_tensor = _returning("scalar_tensor_tensor", _scalar_tensor_tensor)
tensor_scalar = _returning("tensor_scalar", _tensor_scalar)
activation = _returning("activation", _activation)
activation_reduce = _returning("activation_reduce", _activation_reduce)
tensor_copy = _returning("tensor_copy", _tensor_copy)
reciprocal = _returning("reciprocal", _reciprocal)
tensor_reduce = _returning("tensor_reduce", _tensor_reduce)
tensor_tensor_scan = _returning("tensor_tensor_scan", _tensor_tensor_scan)
tensor_scalar_reduce = _returning("tensor_scalar_reduce", _tensor_scalar_reduce)
nc_matmul = _returning("nc_matmul", _nc_matmul)
nc_transpose = _returning("nc_transpose", _nc_transpose)
bn_stats = _returning("bn_stats", _bn_stats)
bn_aggr = _returning("bn_aggr", _bn_aggr)
memset = _returning("memset", _memset)
iota = _returning("iota", _iota)
max8 = _returning("max8", _max8)
affine_select = _returning("affine_select", _affine_select)
dma_transpose = _returning("dma_transpose", _dma_transpose)
dropout = _returning("dropout", _dropout)


class fp32:  # noqa: N801 (the old dialect's name)
    """nisa.fp32.min: the most negative float32 (bit pattern 0xff7fffff)."""

    min = -3.4028234663852886e38  # noqa: A003


def dma_copy(*, dst, src, mask=None, dst_rmw_op=None, oob_mode=_isa.oob_mode.error, dge_mode=_isa.dge_mode.unknown):
    """neuronxcc's dma_copy: keywords only; under a mask both sides are cut to it."""
    _masking.call(_dma_copy, (), dict(dst=dst, src=src, dst_rmw_op=dst_rmw_op, oob_mode=oob_mode,
                                      dge_mode=dge_mode), mask, "nisa.dma_copy")


def __getattr__(name):  # the enumerations, registers and every instruction without an old form
    return getattr(_isa, name)
