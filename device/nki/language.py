"""nki.language: tensors, memories, dtypes, loops, the SPMD grid and tile-level math.

The tile-level functions (`nl.add(a, b)`, `nl.exp(t)`, `nl.matmul(x, y)`, `nl.load`, ...) are
convenience wrappers that allocate their result and run the nki.isa instructions that
compute it, as the NKI compiler lowers them: so they are priced on the same engines.
"""
from __future__ import annotations

import builtins
import contextlib
import functools
import math

import numpy as np
import torch

from . import costs as _costs
from . import dtypes as _dt
from . import isa as _isa
from . import operands as _operands
from . import ops as _ops
from .dtypes import (  # noqa: F401  (nki.language's dtypes)
                     bfloat16, bool_, float4_e2m1fn_x4, float8_e4m3, float8_e4m3fn, float8_e4m3fn_x4, float8_e5m2,
                     float8_e5m2_x4, float8_e8m0fnu, float16, float32, int8, int16, int32, tfloat32, uint8, uint16,
                     uint32)
from .errors import NkiValidationError
from .ops import (  # noqa: F401  (nki.language's operators)
                  abs, abs_max, abs_min, add, arctan, bitwise_and, bitwise_or, bitwise_xor, ceil, copy, cos, divide,
                  equal, erf, erf_dx, exp, floor, fmod, gelu, gelu_apprx_sigmoid, gelu_apprx_sigmoid_dx,
                  gelu_apprx_tanh, gelu_dx, greater, greater_equal, invert, left_shift, less, less_equal, log,
                  logical_and, logical_not, logical_or, logical_xor, maximum, minimum, mish, mod, multiply, negative,
                  not_equal, power, prelu, reciprocal, relu, right_shift, rsqrt, sigmoid, sign, silu, silu_dx, sin,
                  softplus, sqrt, square, subtract, tan, tanh, trunc)
from .program import current
from .tensor import PRIVATE_HBM, PSUM, SBUF, SHARED_HBM, DynamicSlice, MemoryRegion, NkiTensor  # noqa: F401


sbuf, psum, private_hbm, shared_hbm = SBUF, PSUM, PRIVATE_HBM, SHARED_HBM
hbm = private_hbm
bypass = None  # tensor_scalar / activate2 stage that does nothing
average = "average"


class NKIObject:
    """Base class of kernel classes, with the NKI language guide's class rules: every field
    (each annotated name, and each plain class attribute that is not a method) is a parameter
    of the generated __init__, positional or by keyword, defaulting to its class value or None;
    __post_init__ runs after. A class that defines its own __init__ keeps it; @dataclass on top
    keeps these rules (no field is then required)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in cls.__dict__.get("__annotations__", {}):
            if name not in cls.__dict__:  # NKI: a field without a value defaults to None
                setattr(cls, name, None)
        if "__init__" not in cls.__dict__:
            cls.__init__ = _nki_object_init

    def __post_init__(self):
        pass


def _nki_object_fields(cls) -> dict:
    """name -> default, base classes' first, in definition order."""
    import dataclasses
    fields: dict = {}
    for klass in reversed(cls.__mro__):
        if klass is object or klass is NKIObject:
            continue
        if dataclasses.is_dataclass(klass):
            for f in dataclasses.fields(klass):
                fields[f.name] = f
        for name in klass.__dict__.get("__annotations__", {}):
            fields.setdefault(name, klass.__dict__.get(name))
        for name, value in klass.__dict__.items():
            if not name.startswith("__") and not callable(value) and not isinstance(value, (property, staticmethod,
                                                                                            classmethod)):
                fields.setdefault(name, value)
    return fields


def _nki_object_init(self, *args, **kwargs):
    import copy
    import dataclasses
    fields = _nki_object_fields(type(self))
    names = list(fields)
    if len(args) > len(names):
        raise TypeError(f"{type(self).__name__}() takes {len(names)} fields ({', '.join(names)}), got {len(args)} "
                        f"positional arguments")
    values = dict(zip(names, args))
    for k, v in kwargs.items():
        if k not in fields:
            raise TypeError(f"{type(self).__name__}() has no field {k!r}; its fields are {', '.join(names) or 'none'}")
        if k in values:
            raise TypeError(f"{type(self).__name__}() got field {k!r} twice")
        values[k] = v
    for name, default in fields.items():
        if name not in values:
            if isinstance(default, dataclasses.Field):
                if default.default_factory is not dataclasses.MISSING:
                    default = default.default_factory()
                else:
                    default = None if default.default is dataclasses.MISSING else default.default
            values[name] = copy.copy(default) if isinstance(default, (list, dict, set)) else default
        object.__setattr__(self, name, values[name])
    self.__post_init__()


class _TileSize:
    """nl.tile_size: the current target's tile limits (see target.py for the sources)."""

    pmax = property(lambda self: current().target.partitions)
    psum_bank_fmax = property(lambda self: current().target.psum_bank_bytes // 4)
    psum_fmax = psum_bank_fmax
    psum_bank_fmax_bytes = property(lambda self: current().target.psum_bank_bytes)
    psum_num_banks = property(lambda self: current().target.psum_banks)
    gemm_stationary_fmax = property(lambda self: current().target.gemm_stationary_fmax)
    gemm_moving_fmax = property(lambda self: current().target.gemm_moving_fmax)
    bn_stats_fmax = property(lambda self: current().target.bn_stats_fmax)
    sbuf_size_bytes = property(lambda self: current().target.sbuf_partition_bytes * current().target.partitions)
    sbuf_fmax_bytes = property(lambda self: current().target.sbuf_partition_bytes)
    sbuf_fmax = property(lambda self: current().target.sbuf_partition_bytes // 4)
    total_available_sbuf_size = sbuf_fmax_bytes
    psum_min_align = 4
    sbuf_min_align = 4


tile_size = _TileSize()


def _buffer(buffer) -> str:
    name = str(getattr(buffer, "value", buffer))
    name = "private_hbm" if name == "hbm" else name
    if name not in (SBUF, PSUM, PRIVATE_HBM, SHARED_HBM):
        raise NkiValidationError(f"buffer {buffer!r} is not an NKI memory; use nl.sbuf, nl.psum, nl.hbm or nl.shared_hbm")
    return MemoryRegion(name)


def is_hbm(buffer) -> bool:
    return _buffer(buffer) in (PRIVATE_HBM, SHARED_HBM)


def is_on_chip(buffer) -> bool:
    return _buffer(buffer) in (SBUF, PSUM)


def is_psum(buffer) -> bool:
    return _buffer(buffer) == PSUM


def is_sbuf(buffer) -> bool:
    return _buffer(buffer) == SBUF


# --- creation ----------------------------------------------------------------------------------------
def ndarray(shape, dtype, buffer=sbuf, name="", address=None) -> NkiTensor:
    """A new tensor; its memory holds NaN (floats) or 4 (integers) until written."""
    return current().allocate(tuple(shape), _dt.as_dtype(dtype), _buffer(buffer), name, address)


def zeros(shape, dtype, buffer=sbuf, name="") -> NkiTensor:
    return full(shape, 0, dtype, buffer, name)


def ones(shape, dtype, buffer=sbuf, name="") -> NkiTensor:
    return full(shape, 1, dtype, buffer, name)


def full(shape, fill_value, dtype, buffer=sbuf, name="") -> NkiTensor:
    t = ndarray(shape, dtype, buffer, name)
    if t.on_chip:
        _isa.memset(t, fill_value)
    else:  # an HBM constant: written by a DMA from a filled SBUF tile, priced as such
        t.torch_view().copy_(_dt.encode(torch.full(t.shape, fill_value, dtype=torch.float32), t.dtype))
    return t


def zeros_like(x: NkiTensor, dtype=None, buffer=None, name="") -> NkiTensor:
    return zeros(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def empty_like(x: NkiTensor, dtype=None, buffer=None, name="") -> NkiTensor:
    return ndarray(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def rand(shape, dtype, buffer=sbuf, name="") -> NkiTensor:
    t = ndarray(shape, dtype, buffer, name)
    _operands.write(t, torch.rand((t.partitions, t.free_size), generator=_generator()))
    return t


def random_seed(seed: NkiTensor) -> None:
    _generator().manual_seed(int(seed.values().reshape(-1)[0].item()))


def _generator() -> torch.Generator:
    program = current()
    gen = getattr(program, "generator", None)
    if gen is None:
        gen = program.generator = torch.Generator().manual_seed(0)
    return gen


def shared_constant(constant) -> NkiTensor:
    if isinstance(constant, str):
        constant = np.load(constant)
    data = torch.as_tensor(np.ascontiguousarray(constant))
    t = ndarray(tuple(data.shape) or (1,), _dt.of_torch(data, what="shared_constant"), shared_hbm)
    t.torch_view().copy_(data.reshape(t.shape))
    return t


def shared_identity_matrix(n, dtype=uint8, dst: NkiTensor | None = None) -> NkiTensor:
    t = dst if dst is not None else ndarray((n, n), dtype, sbuf, name=f"identity{n}")
    _isa.iota(t, [[1, n]], offset=0, channel_multiplier=-1)  # value = i - p, then == 0
    _isa.tensor_scalar(t, t, op0=equal, operand0=0.0)
    return t


# --- movement --------------------------------------------------------------------------------------------
def load(src: NkiTensor, dtype=None) -> NkiTensor:
    """A new SBUF tile holding src (an HBM view), by DMA."""
    tile = ndarray(_tile_shape(src), dtype or src.dtype, sbuf, name=f"{src.name}_sbuf" if src.name else "")
    _isa.dma_copy(tile, src)
    return tile


def load_transpose2d(src: NkiTensor, dtype=None) -> NkiTensor:
    tile = ndarray((src.free_size, src.partitions), dtype or src.dtype, sbuf)
    _isa.dma_transpose(tile, src.reshape((src.shape[0], src.free_size)) if src.ndim != 2 else src)
    return tile


def store(dst: NkiTensor, value: NkiTensor) -> None:
    if not isinstance(value, NkiTensor):
        return _isa.memset(dst, value) if dst.on_chip else dst.torch_view().fill_(value)
    if value.buffer == PSUM:  # DMA reads SBUF: evict first
        value = copy(value)
    _isa.dma_copy(dst, value)


def _tile_shape(src: NkiTensor) -> tuple[int, ...]:
    return src.shape if src.ndim >= 2 else (1, src.shape[0])


def copy_tile(x: NkiTensor, dtype=None) -> NkiTensor:
    out = ndarray(x.shape, dtype or x.dtype, sbuf)
    _isa.tensor_copy(out, x)
    return out


# --- tile-level math ------------------------------------------------------------------------------------
def _is_tile(x) -> bool:
    return isinstance(x, NkiTensor)


def _shape_of(x, y) -> tuple[int, ...]:
    shapes = [t.shape for t in (x, y) if _is_tile(t)]
    try:
        return tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        raise NkiValidationError(f"tile shapes {' and '.join(map(str, shapes))} do not broadcast") from None


def _expand(t: NkiTensor, shape) -> NkiTensor:
    """t viewed at a broadcast shape (stride 0 on the broadcast dims; the partition dim must match)."""
    if t.shape == shape:
        return t
    if len(t.shape) != len(shape):
        raise NkiValidationError(f"tile {t.shape} cannot be broadcast to {shape}: the ranks differ")
    v = t
    for d, (a, b) in enumerate(zip(t.shape, shape)):
        if a != b:
            if a != 1 or d == 0:
                raise NkiValidationError(f"tile {t.shape} cannot be broadcast to {shape}"
                                         + (" across partitions" if d == 0 else ""))
            v = v.broadcast(d, b)
    return v


def _binary(op: _ops.Operator, x, y, dtype=None):
    if not _is_tile(x) and not _is_tile(y):
        return op.fn(torch.tensor(float(x)), torch.tensor(float(y))).item()
    shape = _shape_of(x, y)
    base = x if _is_tile(x) else y
    out = ndarray(shape, dtype or base.dtype, sbuf)
    if _is_tile(x) and _is_tile(y):
        if _column_like(y) and y.shape != shape:  # a (P, 1) operand: tensor_scalar broadcasts it
            _isa.tensor_scalar(out, _expand(x, shape), op0=op, operand0=y)
        elif _column_like(x) and x.shape != shape:
            _isa.tensor_scalar(out, _expand(y, shape), op0=op, operand0=x, reverse0=True)
        else:
            _isa.tensor_tensor(out, _expand(x, shape), _expand(y, shape), op=op)
    elif _is_tile(x):
        _isa.tensor_scalar(out, _expand(x, shape), op0=op, operand0=y)
    else:
        _isa.tensor_scalar(out, _expand(y, shape), op0=op, operand0=x, reverse0=True)
    return out


def _column_like(t) -> bool:
    return _is_tile(t) and t.free_size == 1


def _unary(op: _ops.Operator, x, dtype=None):
    if not _is_tile(x):
        return op.fn(torch.tensor(float(x))).item()
    out = ndarray(x.shape, dtype or x.dtype, sbuf)
    if op.activation:
        _isa.activation(out, op, x)
    else:  # an ALU operator (one pass; several instructions on the hardware for cos, floor, ...)
        _isa.tensor_scalar(out, x, op0=op, operand0=None)
    return out


_COMPARISONS = (equal, not_equal, less, less_equal, greater, greater_equal)


def _call_operator(op: _ops.Operator, *args, dtype=None, **kwargs):
    mask = kwargs.pop("mask", None)
    if mask is not None or builtins.any(type(a).__name__ == "PendingAccess" for a in args):
        # neuronxcc.nki's mask= (and indices past a tensor's end that a mask keeps in): the old
        # dialect's, refused in an nki kernel (legacy/masking.py)
        from .legacy import masking
        return masking.call(functools.partial(_call_operator, op, dtype=dtype), args, kwargs, mask, f"nl.{op.name}")
    if op.arity == 2 and len(args) == 2 and current().launch.dialect == "neuronxcc":
        from .legacy import operators  # the old dialect broadcasts a (1, F) tile across partitions
        args = operators.across_partitions(*args)
    if op is copy:  # nl.copy(x): a copy of the tile on SBUF
        return copy_tile(args[0], dtype)
    if op.arity == 2:
        if len(args) != 2:
            raise TypeError(f"nl.{op.name}(x, y, dtype=None) takes two operands, got {len(args)}")
        out = _binary(op, args[0], args[1], dtype)
        if op in _COMPARISONS and isinstance(out, NkiTensor):
            out.predicate = True  # Note [Tile truth]
        return out
    if len(args) != 1:
        raise TypeError(f"nl.{op.name}(x, dtype=None) takes one operand, got {len(args)}")
    return _unary(op, args[0], dtype)


_ops.Operator.high_level = staticmethod(_call_operator)


def _axes(x: NkiTensor, axis) -> tuple[int, ...]:
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    return tuple(sorted(a % x.ndim for a in axes))


def _reduce(op, x: NkiTensor, axis, dtype=None, keepdims=False, negate=False) -> NkiTensor:
    axes = _axes(x, axis)
    kept = [n for d, n in enumerate(x.shape) if d not in axes]
    shape = tuple(1 if d in axes else n for d, n in enumerate(x.shape)) if keepdims else tuple(kept)
    if len(shape) < 2:
        shape = shape + (1,)
    out = ndarray(shape, dtype or x.dtype, sbuf)
    _isa.tensor_reduce(out, op, x, axis=axes, negate=negate, keepdims=keepdims)
    return out


def sum(x, axis, dtype=None, keepdims=False):  # noqa: A001 (NKI's names)
    return _reduce(add, x, axis, dtype, keepdims)


def max(x, axis, dtype=None, keepdims=False):  # noqa: A001
    return _reduce(maximum, x, axis, dtype, keepdims)


def min(x, axis, dtype=None, keepdims=False):  # noqa: A001
    return _reduce(minimum, x, axis, dtype, keepdims)


def prod(x, axis, dtype=None, keepdims=False):
    return _reduce(multiply, x, axis, dtype, keepdims)


def all(x, axis, dtype=None):  # noqa: A001
    return _reduce(logical_and, x, axis, dtype)


def mean(x, axis, dtype=None, keepdims=False):
    s = _reduce(add, x, axis, float32, keepdims)
    n = math.prod(x.shape[a] for a in _axes(x, axis))
    out = ndarray(s.shape, dtype or x.dtype, sbuf)
    _isa.tensor_scalar(out, s, op0=multiply, operand0=1.0 / n)
    return out


def var(x, axis, dtype=None, keepdims=False):
    m = mean(x, axis, float32, keepdims=True)
    d = _binary(subtract, x, _expand(m, x.shape) if m.shape != x.shape else m, float32)
    return mean(_unary(square, d), axis, dtype or x.dtype, keepdims=True)


def softmax(x, axis=-1, dtype=None):
    axes = _axes(x, axis)
    m = _reduce(maximum, x, axes, float32, keepdims=True, negate=True)  # -max
    e = ndarray(x.shape, float32, sbuf)
    s = ndarray(m.shape, float32, sbuf)
    if m.free_size == 1:
        _isa.activation(e, exp, x, bias=m, reduce_op=add, reduce_res=s, reduce_cmd=_isa.reduce_cmd.reset_reduce)
    else:
        e = exp(_binary(add, x, _expand(m, x.shape), float32))
        s = _reduce(add, e, axes, float32, keepdims=True)
    r = _unary(reciprocal, s, float32)
    return _binary(multiply, e, _expand(r, x.shape) if r.free_size != 1 else r, dtype or x.dtype)


def rms_norm(x, w, axis, n, epsilon=1e-6, dtype=None, compute_dtype=None):
    sq = _unary(square, x, float32)
    ms = _reduce(add, sq, axis, float32, keepdims=True)
    inv = ndarray(ms.shape, float32, sbuf)
    _isa.tensor_scalar(inv, ms, op0=multiply, operand0=1.0 / n, op1=add, operand1=float(epsilon))
    _isa.activation(inv, rsqrt, inv)
    y = _binary(multiply, x, _expand(inv, x.shape) if inv.free_size != 1 else inv, float32)
    return _binary(multiply, y, w, dtype or x.dtype)


def where(condition, x, y, dtype=None):
    base = next(t for t in (x, y, condition) if _is_tile(t))
    shape = _shape_of(condition, base) if _is_tile(condition) else base.shape
    out = ndarray(shape, dtype or (x.dtype if _is_tile(x) else base.dtype), sbuf)
    fill = y if not _is_tile(y) else None
    if fill is None:
        _isa.tensor_copy(out, _expand(y, shape)) if y.dtype == out.dtype else _operands.write(out, _operands.read_f32(y))
    else:
        _isa.memset(out, fill)
    mask = ndarray(shape, uint8, sbuf)
    _isa.tensor_scalar(mask, _expand(condition, shape), op0=not_equal, operand0=0.0)
    src = _expand(x, shape) if _is_tile(x) else float(x)
    if _is_tile(src) and src.dtype != out.dtype:
        src = copy_tile(src, out.dtype)
    _isa.tensor_copy_predicated(out, src, mask)
    return out


def expand_dims(x: NkiTensor, axis: int) -> NkiTensor:
    return x.expand_dim(axis)


def broadcast_to(x: NkiTensor, shape, dtype=None) -> NkiTensor:
    """A new tile of `shape` holding x broadcast (numpy's rules); across partitions too, which
    takes a data movement (a DMA reading the partition again and again), not a view."""
    shape = tuple(shape)
    if x.shape == shape and (dtype is None or dtype == x.dtype):
        return x
    if len(shape) != x.ndim:
        raise NkiValidationError(f"broadcast_to: tile {x.shape} and shape {shape} must have the same rank")
    if x.shape[0] == shape[0]:
        return copy_tile(_expand(x, shape), dtype)
    if x.shape[0] != 1:
        raise NkiValidationError(f"broadcast_to: tile {x.shape} cannot be broadcast to {shape} (partition dim "
                                 f"{x.shape[0]} is neither 1 nor {shape[0]})")
    row = _expand(x, (1,) + shape[1:]) if x.shape[1:] != shape[1:] else x
    out = ndarray(shape, dtype or x.dtype, sbuf)
    # the source pattern reads partition 0 for every partition: DMA may, a compute engine may not
    src = row._view(shape, (0,) + row.strides[1:], row.offset)
    _isa.dma_copy(out, src)
    return out


def transpose(x: NkiTensor, dtype=None) -> NkiTensor:
    out = ndarray((x.free_size, x.partitions), x.dtype, psum if x.buffer == SBUF else sbuf)
    _isa.nc_transpose(out, x)
    if dtype is not None and dtype != x.dtype:
        return copy_tile(out, dtype)
    return out


def matmul(x: NkiTensor, y: NkiTensor, transpose_x=False) -> NkiTensor:
    """x @ y (x.T @ y with transpose_x=True) on the Tensor Engine; the result is in PSUM."""
    if not transpose_x:
        xt = ndarray((x.free_size, x.partitions), x.dtype, psum)
        _isa.nc_transpose(xt, x)
        x = copy_tile(xt)
    out = ndarray((x.free_size, y.free_size), float32, psum)
    _isa.nc_matmul(out, x, y)
    return out


def gather_flattened(data: NkiTensor, indices: NkiTensor, axis=0, dtype=None) -> NkiTensor:
    out = ndarray(indices.shape, dtype or data.dtype, sbuf)
    src = _operands.read(data)
    idx = _operands.read(indices).to(torch.int64)
    if (idx < 0).any() or (idx >= data.free_size).any():
        raise NkiValidationError(f"gather_flattened: an index is outside [0, {data.free_size})")
    _operands.write(out, torch.gather(src, 1, idx))
    _operands.issue("gather_flattened", "gpsimd", _costs.alu(current().target, "gpsimd", indices.free_size),
                [data, indices], [out])
    return out


def dropout(x: NkiTensor, rate, dtype=None) -> NkiTensor:
    out = ndarray(x.shape, dtype or x.dtype, sbuf)
    p = rate if not _is_tile(rate) else _operands.read_f32(rate).reshape(-1, 1)
    keep = torch.rand((x.partitions, x.free_size), generator=_generator()) >= p
    _operands.write(out, torch.where(keep, _operands.read_f32(x), torch.zeros(())))
    _operands.issue("dropout", "vector", _costs.alu(current().target, "vector", x.free_size), [x], [out])
    return out


def device_print(print_prefix: str, tensor: NkiTensor) -> None:
    print(print_prefix, tensor.values().numpy())


# --- loops and the SPMD grid ----------------------------------------------------------------------------
def ds(start, size) -> DynamicSlice:
    return DynamicSlice(start, size)


def _range(start, stop=None, step=1):
    if stop is None:
        start, stop = 0, start
    return builtins.range(int(start), int(stop), int(step))


affine_range = sequential_range = static_range = _range

# nl.range, which the NKI library's 2026 kernels call (`for i in nl.range(n)`). The SDK's docs
# (nki/api/nki/language/__init__.py as of 2026-08) do not list it; they say the three iterators
# above are "an alias for Python's range()" and, from NKI 0.7, "deprecated and default to Python
# range" (nki/deep-dives/nki-loops.rst). So nl.range is that same specialization-time iterator,
# the one object under a fourth name: a loop over it unrolls as the kernel runs.
range = _range  # noqa: A001 (NKI's name; this module calls builtins.range explicitly)


def dynamic_range(start, stop=None, step=1):
    if stop is None:
        start, stop = 0, start
    for i in builtins.range(int(start), int(stop), int(step)):
        yield _isa.VirtualRegister(i, frozen=True)


def fori_loop(lower, upper, body_fun, step=1) -> None:
    for i in builtins.range(int(lower), int(upper), int(step)):
        body_fun(_isa.VirtualRegister(i, frozen=True))


def while_loop(init, body_fun) -> None:
    r = init
    while int(r) != 0:
        r = body_fun(r)


def program_id(axis=0) -> int:
    program = current()
    if not 0 <= axis < builtins.max(1, len(program.ids)):
        raise NkiValidationError(f"nl.program_id({axis}): the launch grid has {len(program.launch.grid)} dims")
    return program.ids[axis] if program.ids else 0


def num_programs(axes=None) -> int:
    grid = current().launch.grid or (1,)
    if axes is None:
        return math.prod(grid)
    if isinstance(axes, int):
        return grid[axes] if axes < len(grid) else 1
    return math.prod(grid[a] for a in axes)


def program_ndim() -> int:
    return len(current().launch.grid)


@contextlib.contextmanager
def no_reorder():
    yield  # instructions run in program order here anyway


def __getattr__(name):  # nl.tile_size and friends resolve per call; anything else: a clear error
    raise AttributeError(f"module 'nki.language' has no attribute {name!r} in the emulator "
                         f"(it implements the NKI 0.6/0.7 language; see adaptive_eager.nki's README section)")

