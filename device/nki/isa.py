"""nki.isa: the NeuronCore's instructions, executed now on the host copy of on-chip memory.

Each instruction checks its operands as the NKI simulator does (memory, partition and tile
limits, data types), computes what the docstring of nki.isa says it computes, writes its
destination and hands a record of itself (engine, duration, what it read and wrote) to the
kernel's timeline (timeline.py). Arithmetic is float32, as on the engines: inputs are cast to
float32, the result is rounded to the destination's dtype once (round to nearest even).
Copies between equal dtypes move bits.
"""
from __future__ import annotations

import math
import warnings

import torch

from . import costs
from . import dtypes as dt
from . import ops
from .constants import (  # noqa: F401  (nki.isa's enumerations)
    dge_mode, dma_engine, engine, matmul_perf_mode, nc_version, oob_mode, reduce_cmd)
from .errors import NkiValidationError
from . import operands as _op
from .program import current
from .tensor import PSUM, SBUF, NkiTensor

tensor_engine, vector_engine, scalar_engine = engine.tensor, engine.vector, engine.scalar
gpsimd_engine, unknown_engine = engine.gpsimd, engine.unknown


def get_nc_version() -> nc_version:
    return nc_version(current().target.version)


def get_nc_sub_version() -> int:
    return 0


class VirtualRegister:
    """A 32-bit engine register (nisa.register_alloc); `value` is what it holds now."""

    def __init__(self, state=None, frozen=False):
        self.value = int(state or 0)
        self.frozen = frozen

    def __index__(self):
        return self.value

    def __int__(self):
        return self.value

    def __bool__(self):
        return self.value != 0

    def __repr__(self):
        return f"VirtualRegister({self.value})"


def register_alloc(x: int | None = None) -> VirtualRegister:
    return VirtualRegister(x or 0)


def register_move(dst: VirtualRegister, src) -> None:
    _writable_register(dst)
    dst.value = int(src.value if isinstance(src, VirtualRegister) else src)


def register_load(dst: VirtualRegister, src: NkiTensor) -> None:
    _writable_register(dst)
    _op.tile("register_load", "src", src, buffers=(SBUF,))
    if src.size != 1:
        raise NkiValidationError(f"register_load src must be a 1x1 SBUF tile, got {src.shape}")
    dst.value = int(src.values().reshape(-1)[0].item())


def register_store(dst: NkiTensor, src: VirtualRegister) -> None:
    _op.tile("register_store", "dst", dst, buffers=(SBUF,))
    _op.write(dst, torch.full((dst.partitions, dst.free_size), float(src.value)))


def _writable_register(r) -> None:
    if not isinstance(r, VirtualRegister):
        raise NkiValidationError(f"expected a VirtualRegister (nisa.register_alloc()), got {type(r).__name__}")
    if r.frozen:
        raise NkiValidationError("the induction register of a dynamic loop cannot be written")


# --- operand checks --------------------------------------------------------------------------------
# --- data movement -------------------------------------------------------------------------------
def dma_copy(dst: NkiTensor, src: NkiTensor, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown,
             engine=engine.unknown, name=None):
    buffers = (SBUF, "private_hbm", "shared_hbm")
    _op.tile("dma_copy", "dst", dst, buffers=buffers)
    _op.tile("dma_copy", "src", src, buffers=buffers)
    n_src, n_dst = src.size, dst.size
    if n_src != n_dst:
        raise NkiValidationError(f"dma_copy src has {n_src} elements {src.shape}, dst has {n_dst} {dst.shape}: "
                                 f"they must match")
    values, keep = _gather(src, oob_mode, "src")
    if src.dtype == dst.dtype and values.dtype == src.dtype.storage:
        stored = values  # bits
    else:  # DMA converts through float32
        stored = dt.encode(dt.decode(values, src.dtype).to(torch.float32), dst.dtype)
    _scatter(dst, stored, oob_mode, keep)
    _op.close_psum(dst)
    _op.issue("dma_copy", costs.DMA, _dma_cost(src, dst), [src], [dst])


def _dma_cost(src: NkiTensor, dst: NkiTensor, efficiency: float = 1.0) -> costs.Cost:
    nbytes = max(src.size * src.dtype.itemsize, dst.size * dst.dtype.itemsize)
    chip = dst if dst.on_chip else src
    partitions = chip.shape[0] if chip.on_chip else min(current().target.partitions, chip.shape[0])
    row = min(costs.contiguous_row_bytes(src), costs.contiguous_row_bytes(dst))
    return costs.dma(current().target, nbytes, partitions, row, efficiency=efficiency)


def _addresses(t: NkiTensor, oob, what: str):
    """Element addresses of a view with a runtime offset (and a mask of those in bounds)."""
    elements = math.prod(t.storage.shape) if t.on_chip else t.storage.data.numel()
    storage_len = elements * t.storage.dtype.itemsize // t.dtype.itemsize
    index = torch.arange(storage_len, dtype=torch.int64)
    d = t.dynamic
    rows = d.rows()
    bad = (rows < 0) | (rows >= d.bound)
    if bad.any() and oob == oob_mode.error:
        raise NkiValidationError(f"dma_copy {what}: runtime index {rows[bad][0].item()} is out of bounds "
                                 f"[0, {d.bound}) of tensor {t.name!r} (pass oob_mode=nisa.oob_mode.skip to skip it)")
    if d.vector is not None:  # partition p of the view reads row rows[p]
        if rows.numel() != t.shape[0]:
            raise NkiValidationError(f"dma_copy {what}: vector_offset has {rows.numel()} rows, the view {t.shape[0]}")
        inner = index.as_strided(t.shape[1:], t.strides[1:], t.offset) if t.ndim > 1 else index[t.offset:t.offset + 1]
        addr = inner.unsqueeze(0) + (rows.clamp(0, d.bound - 1) * d.stride).reshape((-1,) + (1,) * (t.ndim - 1))
        keep = (~bad).reshape((-1,) + (1,) * (t.ndim - 1)).expand_as(addr)
    else:
        addr = index.as_strided(t.shape, t.strides, t.offset) + rows.clamp(0, d.bound - 1)[0] * d.stride
        keep = torch.full(addr.shape, not bool(bad[0]))
    if (addr[keep] >= storage_len).any():
        raise NkiValidationError(f"dma_copy {what}: the access with its runtime offset runs past tensor {t.name!r}")
    if t.storage.placed:
        addr = t.storage.physical_index(addr, t._scale())
    return addr, keep


def _flat(t: NkiTensor) -> torch.Tensor:
    data = t.storage.data
    return data.view(t.dtype.storage) if t.dtype.storage != t.storage.dtype.storage else data


def _gather(src: NkiTensor, oob, what: str):
    """The elements a view reads, flat, and which of them are in bounds (None: all)."""
    if src.dynamic is None:
        return src.torch_view().reshape(-1), None
    addr, keep = _addresses(src, oob, what)
    values = _flat(src)[addr.clamp(max=_flat(src).numel() - 1)]
    return values.reshape(-1), keep.reshape(-1)


def _scatter(dst: NkiTensor, stored: torch.Tensor, oob, keep=None) -> None:
    """Write flat `stored` where dst points; with oob_mode.skip, only the elements `keep` marks."""
    if any(s == 0 and n > 1 for s, n in zip(dst.strides, dst.shape)):
        raise NkiValidationError(f"destination {dst.name!r} {dst.shape} is a broadcast view: it cannot be written")
    if dst.dynamic is None:
        if keep is None:
            dst.torch_view().copy_(stored.reshape(dst.shape))
        else:
            view = dst.torch_view()
            view.copy_(torch.where(keep.reshape(dst.shape), stored.reshape(dst.shape), view))
        return
    addr, dst_keep = _addresses(dst, oob, "dst")
    if keep is not None:
        dst_keep = dst_keep & keep.reshape(dst_keep.shape)
    flat = _flat(dst)
    flat[addr[dst_keep]] = stored.reshape(addr.shape)[dst_keep]


def dma_compute(dst: NkiTensor, srcs, reduce_op, scales=None, unique_indices=True, oob_mode=oob_mode.error,
                name=None):
    """dst = srcs[0] + srcs[1] + ... in float32 inside the DMA engines (reduce_op nl.add, every
    scale 1.0); a source or dst with a vector_offset reads or writes the rows it names, which
    is the read-modify-write scatter (dst[idx] += src) and gather (dst += src[idx])."""
    buffers = (SBUF, "private_hbm", "shared_hbm")
    _op.tile("dma_compute", "dst", dst, buffers=buffers)
    srcs = list(srcs)
    if not 1 <= len(srcs) <= 16:
        raise NkiValidationError(f"dma_compute takes 1 to 16 srcs, got {len(srcs)}")
    if ops.as_operator(reduce_op, instr="dma_compute", what="reduce_op") is not ops.add:
        raise NkiValidationError("dma_compute supports only reduce_op=nl.add")
    if scales is not None and any(float(x) != 1.0 for x in scales):
        raise NkiValidationError(f"dma_compute scales must all be 1.0, got {list(scales)}")
    if not unique_indices:
        raise NkiValidationError("dma_compute: unique_indices=False is not supported")
    total = None
    for i, src in enumerate(srcs):
        _op.tile("dma_compute", f"srcs[{i}]", src, buffers=buffers)
        if src.size != dst.size:
            raise NkiValidationError(f"dma_compute srcs[{i}] has {src.size} elements, dst {dst.size}: they must match")
        values, keep = _gather(src, oob_mode, f"srcs[{i}]")
        v = dt.decode(values, src.dtype).to(torch.float32)
        total = v if total is None else total + v
    _scatter(dst, dt.encode(total, dst.dtype), oob_mode)
    _op.close_psum(dst)
    # before NeuronCore-v4 the DMA compute engines run at "50% DMA throughput" (trainium3_arch.rst:270)
    efficiency = 1.0 if current().target.version >= 4 else 0.5
    _op.issue("dma_compute", costs.DMA, _dma_cost(srcs[0], dst, efficiency), srcs, [dst])


def dma_transpose(dst: NkiTensor, src: NkiTensor, axes=None, priority=None, dge_mode=dge_mode.unknown,
                  oob_mode=oob_mode.error, name=None):
    _op.tile("dma_transpose", "dst", dst, buffers=(SBUF,))
    _op.tile("dma_transpose", "src", src, buffers=(SBUF, "private_hbm", "shared_hbm"))
    perms = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}
    if src.ndim not in perms:
        raise NkiValidationError(f"dma_transpose src must be 2-D, 3-D or 4-D, got {src.shape}")
    axes = tuple(axes) if axes is not None else perms[src.ndim]
    if axes != perms[src.ndim]:
        raise NkiValidationError(f"dma_transpose axes {axes} are not supported for a {src.ndim}-D src; "
                                 f"use {perms[src.ndim]}")
    if src.dtype != dst.dtype:
        raise NkiValidationError(f"dma_transpose src.dtype {src.dtype} must equal dst.dtype {dst.dtype}")
    values, keep = _gather(src, oob_mode, "src")
    if keep is not None and not bool(keep.all()):
        raise NkiValidationError("dma_transpose: a runtime index is out of bounds")
    values = values.reshape(src.shape).permute(axes)
    if tuple(values.shape) != dst.shape and values.numel() != dst.size:
        raise NkiValidationError(f"dma_transpose of {src.shape} gives {tuple(values.shape)}, dst is {dst.shape}")
    dst.torch_view().copy_(values.reshape(dst.shape))
    _op.issue("dma_transpose", costs.DMA, _dma_cost(src, dst, efficiency=0.5 if src.on_chip else 0.9), [src], [dst])


def tensor_copy(dst: NkiTensor, src: NkiTensor, engine=engine.unknown, name=None, dtype=None):
    if dtype is not None and dt.as_dtype(dtype) != dst.dtype:
        # kernels written for older releases pass it; the current API has none: dst's dtype decides
        warnings.warn(f"nisa.tensor_copy(dtype={dtype}) is ignored: the result has dst's dtype {dst.dtype}",
                      stacklevel=2)
    _op.tile("tensor_copy", "dst", dst)
    _op.tile("tensor_copy", "src", src)
    _op.same_layout("tensor_copy", "src", src, "dst", dst)
    eng = _op.choose_engine("tensor_copy", engine, (costs.VECTOR, costs.SCALAR, costs.GPSIMD), costs.VECTOR)
    _op.no_gpsimd_psum("tensor_copy", eng, dst, src)
    if src.dtype == dst.dtype:
        _op.close_psum(src)
        _op.copy_bits(dst, src)
    else:
        _op.close_psum(src)
        _op.write(dst, _op.read_f32(src) if src.dtype.is_float or dst.dtype.is_float else _op.read(src))
    _op.issue("tensor_copy", eng, costs.alu(current().target, eng, src.free_size, 1, _op.speedup(eng, "tensor_copy", dst, src)),
           [src], [dst])


def memset(dst: NkiTensor, value, engine=engine.unknown, name=None):
    _op.tile("memset", "dst", dst)
    eng = _op.choose_engine("memset", engine, (costs.VECTOR, costs.GPSIMD), costs.VECTOR)
    _op.no_gpsimd_psum("memset", eng, dst)
    if dst.dtype.packed:
        if value != 0:
            raise NkiValidationError(f"memset of packed dtype {dst.dtype} supports only value=0, got {value}")
        dst.torch_view().zero_()
    else:
        # a float64 constant, rounded to dst's dtype once (-3.4028235e38 is float32's lowest)
        _op.write(dst, torch.full((dst.partitions, dst.free_size), value,
                               dtype=torch.float64 if dst.dtype.is_float else torch.int64))
    _op.issue("memset", eng, costs.alu(current().target, eng, dst.free_size, 1), [], [dst])


def tensor_copy_predicated(dst: NkiTensor, src, predicate: NkiTensor, reverse_pred=False, name=None):
    _op.tile("tensor_copy_predicated", "dst", dst)
    _op.tile("tensor_copy_predicated", "predicate", predicate)
    _op.same_layout("tensor_copy_predicated", "predicate", predicate, "dst", dst)
    if predicate.dtype not in (dt.uint8, dt.uint16, dt.uint32):
        raise NkiValidationError(f"tensor_copy_predicated predicate must be uint8, uint16 or uint32, got {predicate.dtype}")
    mask = _op.read(predicate) != 0
    if reverse_pred:
        mask = ~mask
    old = _op.read(dst)
    if isinstance(src, NkiTensor):
        _op.tile("tensor_copy_predicated", "src", src)
        _op.same_layout("tensor_copy_predicated", "src", src, "dst", dst)
        if src.buffer == PSUM and predicate.buffer == PSUM:
            raise NkiValidationError("tensor_copy_predicated: src and predicate cannot both be in PSUM")
        if src.dtype != dst.dtype:
            raise NkiValidationError(f"tensor_copy_predicated src.dtype {src.dtype} must equal dst.dtype {dst.dtype}")
        new = _op.read(src)
    else:
        new = torch.full_like(old, src)
    _op.write(dst, torch.where(mask, new, old))
    _op.issue("tensor_copy_predicated", costs.VECTOR, costs.alu(current().target, costs.VECTOR, dst.free_size, 2),
           [src, predicate, dst], [dst])


def assign(dst: NkiTensor, value) -> None:
    """`t[...] = value`: a copy of a tile (on chip: tensor_copy, else dma_copy) or a memset."""
    if isinstance(value, NkiTensor):
        if dst.on_chip and value.on_chip:
            tensor_copy(dst, value)
        else:
            dma_copy(dst, value)
    else:
        memset(dst, value)


# --- Tensor Engine ------------------------------------------------------------------------------
_MATMUL_DTYPES = (dt.float8_e4m3, dt.float8_e5m2, dt.bfloat16, dt.float16, dt.tfloat32, dt.float32)


def nc_matmul(dst: NkiTensor, stationary: NkiTensor, moving: NkiTensor, is_stationary_onezero=False,
              is_moving_onezero=False, is_transpose=False, accumulate=None, tile_position=(), tile_size=(),
              perf_mode=matmul_perf_mode.none, name=None):
    target = current().target
    _op.tile("nc_matmul", "stationary", stationary, buffers=(SBUF,))
    _op.tile("nc_matmul", "moving", moving, buffers=(SBUF,))
    if not isinstance(dst, NkiTensor) or dst.buffer != PSUM:
        _op.tile("nc_matmul", "dst", dst, buffers=(PSUM,))
    rows, cols = _matmul_tiling(tile_position, tile_size, perf_mode)
    double = perf_mode == matmul_perf_mode.double_row
    allowed = _MATMUL_DTYPES + ((dt.float8_e4m3fn,) if target.version >= 4 else ())
    for nm, t in (("stationary", stationary), ("moving", moving)):
        if t.dtype not in allowed:
            raise NkiValidationError(f"nc_matmul {nm} dtype {t.dtype} is not supported on {target.name}; use one of "
                                     f"{', '.join(allowed)}")
        if double and t.dtype not in (dt.float8_e4m3, dt.float8_e5m2, dt.float8_e4m3fn):
            raise NkiValidationError(f"nc_matmul with perf_mode=double_row needs float8 inputs, {nm} is {t.dtype}")
    wide = {dt.float32, dt.tfloat32}
    if (stationary.dtype in wide) != (moving.dtype in wide):
        raise NkiValidationError(f"nc_matmul: if one input is float32/tfloat32 the other must be too; got stationary "
                                 f"{stationary.dtype} and moving {moving.dtype}")
    if {stationary.dtype, moving.dtype} == {dt.float8_e4m3, dt.float8_e4m3fn}:
        raise NkiValidationError("nc_matmul: float8_e4m3 and float8_e4m3fn cannot be mixed in one matmul")
    k = stationary.partitions
    if moving.partitions != k:
        raise NkiValidationError(f"nc_matmul stationary and moving must have the same partition (contraction) size: "
                                 f"{k} and {moving.partitions}")
    if k > rows:
        raise NkiValidationError(f"nc_matmul stationary partition dimension {k} exceeds maximum {rows}")
    if double:
        if stationary.ndim < 3 or stationary.shape[1] != 2 or moving.ndim < 3 or moving.shape[1] != 2:
            raise NkiValidationError(f"nc_matmul with double_row needs [K, 2, ...] tiles, got stationary "
                                     f"{stationary.shape} and moving {moving.shape}")
        m, n = stationary.free_size // 2, moving.free_size // 2
    else:
        m, n = stationary.free_size, moving.free_size
    if m > min(cols, target.gemm_stationary_fmax):
        raise NkiValidationError(f"nc_matmul stationary free size {m} exceeds maximum {min(cols, target.gemm_stationary_fmax)}")
    moving_max = target.gemm_moving_fmax * (2 if target.version >= 4 and dst.dtype == dt.bfloat16 else 1)
    if n > moving_max:
        raise NkiValidationError(f"nc_matmul moving free size {n} exceeds maximum {moving_max} on {target.name}")
    out_dtypes = (dt.float32, dt.bfloat16) if target.version >= 4 else (dt.float32,)
    if is_transpose:
        if dst.dtype != stationary.dtype:
            raise NkiValidationError(f"nc_matmul with is_transpose=True writes stationary's dtype {stationary.dtype}, "
                                     f"dst is {dst.dtype}")
    elif dst.dtype not in out_dtypes:
        raise NkiValidationError(f"nc_matmul dst must be {' or '.join(out_dtypes)} on {target.name}, got {dst.dtype}")
    if dst.partitions != m or dst.free_size != n:
        raise NkiValidationError(f"nc_matmul dst must be {m} x {n} (stationary free x moving free), got "
                                 f"{dst.partitions} x {dst.free_size} {dst.shape}")
    _op.tile("nc_matmul", "dst", dst, buffers=(PSUM,))
    if is_transpose:
        if n != k:
            raise NkiValidationError(f"nc_matmul with is_transpose=True needs a {k} x {k} identity as moving, got "
                                     f"{moving.shape}")
        # bit-accurate: the stationary tile's bits, transposed
        dst.torch_view().copy_(stationary.torch_view().reshape(k, m).t().reshape(dst.shape))
        _op.close_psum(dst)
    else:
        a = _op.read_f32(stationary).reshape(-1 if not double else 2 * k, m)
        b = _op.read_f32(moving).reshape(-1 if not double else 2 * k, n)
        product = a.t() @ b  # float32 accumulation, as in the Tensor Engine
        acc = _op.acc_view(dst)
        if accumulate is None:
            add = acc.reshape(m, n) if acc is not None else torch.zeros(m, n, dtype=torch.bool)
        else:
            add = torch.full((m, n), bool(accumulate))
        old = _op.read_f32(dst)
        result = torch.where(add, old + product, product)
        dst.torch_view().copy_(dt.encode(result, dst.dtype).reshape(dst.shape))
        if acc is not None:
            acc.fill_(True)
    onezero = is_stationary_onezero or is_moving_onezero
    _op.issue("nc_matmul", costs.TENSOR, costs.matmul(target, n, moving.dtype, onezero=onezero, transpose=is_transpose),
           [stationary, moving] + ([dst] if not is_transpose else []), [dst])


def _matmul_tiling(tile_position, tile_size, perf_mode):
    if not tile_position and not tile_size:
        return 128, 128
    if not tile_position or not tile_size:
        raise NkiValidationError("nc_matmul: tile_position and tile_size must both be set to use tiling mode")
    (r0, c0), (rs, cs) = tile_position, tile_size
    if rs not in (32, 64, 128) or cs not in (32, 64, 128):
        raise NkiValidationError(f"nc_matmul tile_size {tile_size}: row and column sizes must be 32, 64 or 128")
    if r0 % rs or c0 % cs or r0 + rs > 128 or c0 + cs > 128:
        raise NkiValidationError(f"nc_matmul tile_position {tile_position} must be multiples of tile_size {tile_size} "
                                 f"inside the 128 x 128 array")
    if perf_mode == matmul_perf_mode.double_row and cs != 128:
        raise NkiValidationError("nc_matmul: double_row performance mode cannot be combined with column tiling")
    return rs, cs


def nc_transpose(dst: NkiTensor, data: NkiTensor, engine=engine.unknown, name=None):
    _op.tile("nc_transpose", "data", data)
    _op.tile("nc_transpose", "dst", dst)
    p, f = data.partitions, data.free_size
    default = costs.TENSOR if (data.buffer == SBUF and dst.buffer == PSUM) else costs.VECTOR
    eng = _op.choose_engine("nc_transpose", engine, (costs.TENSOR, costs.VECTOR), default)
    limit = 128 if eng == costs.TENSOR else 32
    if p > limit or f > limit:
        raise NkiValidationError(f"nc_transpose on the {eng} engine handles tiles up to [{limit}, {limit}], got [{p}, {f}]")
    if eng == costs.TENSOR and (data.buffer != SBUF or dst.buffer != PSUM):
        raise NkiValidationError("nc_transpose on the Tensor Engine reads data from SBUF and writes dst in PSUM")
    if dst.dtype != data.dtype:
        raise NkiValidationError(f"nc_transpose dst dtype {dst.dtype} must equal data dtype {data.dtype}")
    if dst.partitions != f or dst.free_size != p:
        raise NkiValidationError(f"nc_transpose of a [{p}, {f}] tile needs a [{f}, {p}] dst, got {dst.shape}")
    _op.close_psum(data)
    dst.torch_view().copy_(data.torch_view().reshape(p, f).t().reshape(dst.shape))
    _op.close_psum(dst)
    cost = costs.matmul(current().target, p, data.dtype, transpose=True) if eng == costs.TENSOR else \
        costs.alu(current().target, eng, f)
    _op.issue("nc_transpose", eng, cost, [data], [dst])


# --- Vector / Scalar / GpSimd: element-wise ------------------------------------------------------------
def tensor_tensor(dst: NkiTensor, data1: NkiTensor, data2: NkiTensor, op, engine=engine.unknown, name=None):
    op = ops.as_operator(op, instr="tensor_tensor")
    _op.two_inputs("tensor_tensor", ("data1", data1), ("data2", data2), dst)
    if op.arity != 2:
        raise NkiValidationError(f"tensor_tensor needs a binary operator, got {op!r}")
    native_int = _op.all_int(dst, data1, data2) and all(t.dtype in (dt.int32, dt.uint32) for t in (dst, data1, data2))
    default = costs.GPSIMD if (op is ops.power or native_int) and not any(
        t.buffer == PSUM for t in (dst, data1, data2)) else costs.VECTOR
    eng = _op.choose_engine("tensor_tensor", engine, (costs.VECTOR, costs.GPSIMD), default)
    _op.no_gpsimd_psum("tensor_tensor", eng, dst, data1, data2)
    _op.close_psum(data1), _op.close_psum(data2)
    if op.kind == ops.BITVEC:
        _op.bitvec_dtypes("tensor_tensor", dst, data1, data2)
        result = op.fn(_op.read(data1).to(torch.int64), _op.read(data2).to(torch.int64))
    elif native_int and eng == costs.GPSIMD:
        result = op.fn(_op.read(data1).to(torch.int64), _op.read(data2).to(torch.int64))
    else:
        result = op.fn(_op.read_f32(data1), _op.read_f32(data2))
    _op.write(dst, result)
    _op.issue("tensor_tensor", eng, costs.alu(current().target, eng, dst.free_size, 2,
                                           _op.speedup(eng, "tensor_tensor", dst, data1, data2)), [data1, data2], [dst])


def tensor_scalar(dst: NkiTensor, data: NkiTensor, op0, operand0, reverse0=False, op1=None, operand1=None,
                  reverse1=False, engine=engine.unknown, name=None):
    _op.tile("tensor_scalar", "dst", dst)
    _op.tile("tensor_scalar", "data", data)
    _op.same_layout("tensor_scalar", "data", data, "dst", dst)
    op0 = ops.as_operator(op0, instr="tensor_scalar", what="op0")
    op1 = ops.as_operator(op1, instr="tensor_scalar", what="op1") if op1 is not None else None
    if op1 is None and operand1 is not None:
        raise NkiValidationError("tensor_scalar: operand1 given without op1")
    if op1 is not None and (op0.kind == ops.BITVEC) != (op1.kind == ops.BITVEC):
        raise NkiValidationError(f"tensor_scalar op0 {op0!r} and op1 {op1!r} must both be bitvec or both arithmetic")
    eng = _op.choose_engine("tensor_scalar", engine, (costs.VECTOR, costs.SCALAR, costs.GPSIMD), costs.VECTOR)
    _op.no_gpsimd_psum("tensor_scalar", eng, dst, data, operand0, operand1)
    p = data.partitions
    _op.close_psum(data)
    if op0.kind == ops.BITVEC:
        _op.bitvec_dtypes("tensor_scalar", dst, data)
        x = _op.read(data).to(torch.int64)
        x = _op.alu(op0, x, _op.int_operand(operand0, p), reverse=reverse0)
        if op1 is not None:
            x = _op.alu(op1, x, _op.int_operand(operand1, p), reverse=reverse1)
    else:
        x = _op.read_f32(data)
        x = _op.alu(op0, x, _op.column("tensor_scalar", "operand0", 0.0 if operand0 is None else operand0, p), reverse=reverse0)
        if op1 is not None:
            x = _op.alu(op1, x, _op.column("tensor_scalar", "operand1", 0.0 if operand1 is None else operand1, p),
                     reverse=reverse1)
    _op.write(dst, x)
    _op.issue("tensor_scalar", eng, costs.alu(current().target, eng, dst.free_size, 1, _op.speedup(eng, "tensor_scalar", dst, data)),
           [data, operand0, operand1], [dst])


def scalar_tensor_tensor(dst: NkiTensor, data: NkiTensor, op0, operand0, op1, operand1: NkiTensor, reverse0=False,
                         reverse1=False, name=None):
    _op.two_inputs("scalar_tensor_tensor", ("data", data), ("operand1", operand1), dst)
    op0 = ops.as_operator(op0, instr="scalar_tensor_tensor", what="op0")
    op1 = ops.as_operator(op1, instr="scalar_tensor_tensor", what="op1")
    if ops.BITVEC in (op0.kind, op1.kind):
        raise NkiValidationError("scalar_tensor_tensor takes arithmetic operators only")
    _op.close_psum(data), _op.close_psum(operand1)
    x = _op.alu(op0, _op.read_f32(data), _op.column("scalar_tensor_tensor", "operand0", operand0, data.partitions),
             reverse=reverse0)
    x = _op.alu(op1, x, _op.read_f32(operand1), reverse=reverse1)
    _op.write(dst, x)
    _op.issue("scalar_tensor_tensor", costs.VECTOR, costs.alu(current().target, costs.VECTOR, dst.free_size, 2),
           [data, operand0, operand1], [dst])


def reciprocal(dst: NkiTensor, data: NkiTensor, name=None):
    _op.tile("reciprocal", "dst", dst)
    _op.tile("reciprocal", "data", data)
    _op.same_layout("reciprocal", "data", data, "dst", dst)
    _op.close_psum(data)
    _op.write(dst, torch.reciprocal(_op.read_f32(data)))
    # Vector Engine reciprocal: about 8 cycles per element (the NKI API docs' engine selection table)
    _op.issue("reciprocal", costs.VECTOR, costs.alu(current().target, costs.VECTOR, 8 * data.free_size), [data], [dst])


def activation(dst: NkiTensor, op, data: NkiTensor, bias=None, scale=1.0, reduce_op=None, reduce_res=None,
               reduce_cmd=reduce_cmd.idle, name=None):
    out = _activate("activation", dst, op, data, bias, scale, reduce_res)
    _op.accumulate(current(), "scalar_acc", "activation", out, reduce_op, reduce_cmd, reduce_res)


def activation_reduce(dst: NkiTensor, op, data: NkiTensor, reduce_op, reduce_res: NkiTensor, bias=None, scale=1.0,
                      name=None):
    out = _activate("activation_reduce", dst, op, data, bias, scale, reduce_res)
    _op.accumulate(current(), "scalar_acc", "activation_reduce", out, reduce_op, reduce_cmd.reset_reduce, reduce_res)


def _activate(instr: str, dst, op, data, bias, scale, read_out) -> torch.Tensor:
    _op.tile(instr, "dst", dst)
    _op.tile(instr, "data", data)
    _op.same_layout(instr, "data", data, "dst", dst)
    op = ops.as_operator(op, instr=instr)
    if not op.activation:
        raise NkiValidationError(f"{instr}: {op!r} is not an activation function of the Scalar Engine "
                                 f"(see the NKI docs' 'Supported Activation Functions')")
    p = data.partitions
    if isinstance(scale, NkiTensor) and scale.dtype != dt.float32:
        raise NkiValidationError(f"{instr} scale must be float32, got {scale.dtype}")
    _op.close_psum(data)
    x = _op.read_f32(data) * _op.column(instr, "scale", scale, p)
    if bias is not None:
        x = x + _op.column(instr, "bias", bias, p)
    out = op.fn(x)
    _op.write(dst, out)
    # reading the accumulators out into reduce_res is one more short instruction
    extra = costs.ACC_READ_CYCLES if read_out else 0
    _op.issue(instr, costs.SCALAR, costs.alu(current().target, costs.SCALAR, data.free_size, extra_cycles=extra),
           [data, bias, scale], [dst] + ([read_out] if read_out is not None else []))
    return out


def tensor_reduce(dst: NkiTensor, op, data: NkiTensor, axis, negate=False, keepdims=False, name=None):
    _op.tile("tensor_reduce", "dst", dst)
    _op.tile("tensor_reduce", "data", data)
    op = ops.as_operator(op, instr="tensor_reduce")
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    axes = tuple(sorted(a % data.ndim for a in axes))
    if 0 in axes:
        raise NkiValidationError("tensor_reduce cannot reduce axis 0, the partition axis (use nc_transpose first, or "
                                 "nc_matmul with a ones vector)")
    if axes != tuple(range(data.ndim - len(axes), data.ndim)):
        raise NkiValidationError(f"tensor_reduce axis {axis}: the reduced axes must be the last contiguous free "
                                 f"dims ending at the final one, e.g. {tuple(range(data.ndim - len(axes), data.ndim))}")
    kept = math.prod(data.shape[1:data.ndim - len(axes)])
    if dst.partitions != data.partitions or dst.free_size != kept:
        raise NkiValidationError(f"tensor_reduce of {data.shape} over axes {axes} gives {data.partitions} x {kept}, "
                                 f"dst is {dst.partitions} x {dst.free_size} {dst.shape}")
    _op.close_psum(data)
    if op.kind == ops.BITVEC:
        _op.bitvec_dtypes("tensor_reduce", dst, data)
        x = dt.decode(data.torch_view(), data.dtype).to(torch.int64)
    else:
        x = dt.decode(data.torch_view(), data.dtype).to(torch.float32)
    r = _op.reduce(op, x, axes).reshape(data.partitions, kept)
    if negate:
        if op.kind == ops.BITVEC:
            raise NkiValidationError("tensor_reduce negate applies to arithmetic operators only")
        r = -r
    _op.write(dst, r)
    _op.issue("tensor_reduce", costs.VECTOR, costs.alu(current().target, costs.VECTOR, data.free_size), [data], [dst])


def tensor_scalar_reduce(dst: NkiTensor, data: NkiTensor, op0, operand0, reduce_op, reduce_res=None, reverse0=False,
                         reduce_cmd=reduce_cmd.reset_reduce, reduce_init=None, reduce_res_negate=False, name=None):
    _op.tile("tensor_scalar_reduce", "dst", dst)
    _op.tile("tensor_scalar_reduce", "data", data)
    _op.same_layout("tensor_scalar_reduce", "data", data, "dst", dst)
    op0 = ops.as_operator(op0, instr="tensor_scalar_reduce", what="op0")
    if op0.kind == ops.BITVEC:
        raise NkiValidationError("tensor_scalar_reduce takes an arithmetic op0 only")
    _op.close_psum(data)
    x = _op.alu(op0, _op.read_f32(data), _op.column("tensor_scalar_reduce", "operand0", 0.0 if operand0 is None else operand0,
                                           data.partitions), reverse=reverse0)
    _op.write(dst, x)
    _op.accumulate(current(), "vector_acc", "tensor_scalar_reduce", x, reduce_op, reduce_cmd, reduce_res,
                init=reduce_init, negate=reduce_res_negate)
    _op.issue("tensor_scalar_reduce", costs.VECTOR, costs.alu(current().target, costs.VECTOR, data.free_size),
           [data, operand0], [dst] + ([reduce_res] if reduce_res is not None else []))


# --- GpSimd: patterns and selection --------------------------------------------------------------------
def _affine(instr: str, p: int, free: int, pattern, offset: int, channel_multiplier: int) -> torch.Tensor:
    pattern = [list(x) for x in pattern]
    if not 1 <= len(pattern) <= 4 or any(len(x) != 2 for x in pattern):
        raise NkiValidationError(f"{instr} pattern {pattern} must be 1 to 4 [step, num] pairs")
    count = math.prod(n for _, n in pattern)
    if count != free:
        raise NkiValidationError(f"{instr} pattern {pattern} describes {count} elements per partition, the tile has {free}")
    value = torch.full((p, 1), int(offset), dtype=torch.int64) + \
        torch.arange(p, dtype=torch.int64).reshape(p, 1) * int(channel_multiplier)
    grids = torch.zeros(1, dtype=torch.int64)
    for step, num in pattern:
        grids = (grids.reshape(-1, 1) + torch.arange(num, dtype=torch.int64).reshape(1, -1) * int(step)).reshape(-1)
    # 32-bit integer arithmetic, as on the GpSimd Engine
    return ((value + grids.reshape(1, -1) + 2**31) % 2**32) - 2**31


def iota(dst: NkiTensor, pattern, offset=0, channel_multiplier=0, name=None):
    _op.tile("iota", "dst", dst, buffers=(SBUF,))
    values = _affine("iota", dst.partitions, dst.free_size, pattern, offset, channel_multiplier)
    _op.write(dst, values.to(torch.float32) if dst.dtype.is_float else values)
    _op.issue("iota", costs.GPSIMD, costs.alu(current().target, costs.GPSIMD, dst.free_size), [], [dst])


def affine_select(dst: NkiTensor, pattern, channel_multiplier, on_true_tile: NkiTensor, on_false_value,
                  cmp_op=ops.equal, offset=0, name=None):
    _op.tile("affine_select", "dst", dst, buffers=(SBUF,))
    _op.tile("affine_select", "on_true_tile", on_true_tile, buffers=(SBUF,))
    _op.same_layout("affine_select", "on_true_tile", on_true_tile, "dst", dst)
    cmp_op = ops.as_operator(cmp_op, instr="affine_select", what="cmp_op")
    values = _affine("affine_select", dst.partitions, dst.free_size, pattern, offset, channel_multiplier)
    predicate = cmp_op.fn(values.to(torch.float32), torch.zeros(())) != 0
    if on_true_tile.dtype == dst.dtype:
        chosen = _op.read(on_true_tile)
        false = torch.full_like(chosen, 0) + dt.decode(dt.encode(torch.tensor([float(on_false_value)]), dst.dtype),
                                                       dst.dtype)[0].to(chosen.dtype)
        _op.write(dst, torch.where(predicate, chosen, false))
    else:
        _op.write(dst, torch.where(predicate, _op.read_f32(on_true_tile), torch.tensor(float(on_false_value))))
    _op.issue("affine_select", costs.GPSIMD, costs.alu(current().target, costs.GPSIMD, dst.free_size),
           [on_true_tile], [dst])


def range_select(dst: NkiTensor, on_true_tile: NkiTensor, comp_op0, comp_op1, bound0: NkiTensor, bound1: NkiTensor,
                 reduce_cmd=reduce_cmd.reset_reduce, reduce_res=None, reduce_op=ops.maximum, range_start=0,
                 on_false_value=-3.4028234663852886e38, name=None):
    if current().target.version < 3:
        raise NkiValidationError("range_select is available on NeuronCore-v3 (trn2) and newer")
    _op.tile("range_select", "dst", dst)
    _op.tile("range_select", "on_true_tile", on_true_tile)
    _op.same_layout("range_select", "on_true_tile", on_true_tile, "dst", dst)
    allowed = (ops.equal, ops.less, ops.less_equal, ops.greater, ops.greater_equal)
    c0 = ops.as_operator(comp_op0, instr="range_select", what="comp_op0")
    c1 = ops.as_operator(comp_op1, instr="range_select", what="comp_op1")
    if c0 not in allowed or c1 not in allowed:
        raise NkiValidationError("range_select comparison operators must be nl.equal, nl.less, nl.less_equal, "
                                 "nl.greater or nl.greater_equal")
    p, f = on_true_tile.partitions, on_true_tile.free_size
    b0 = _op.column("range_select", "bound0", bound0, p)
    b1 = _op.column("range_select", "bound1", bound1, p)
    index = (range_start + torch.arange(f, dtype=torch.float32)).reshape(1, f)
    mask = (c0.fn(index, b0) != 0) & (c1.fn(index, b1) != 0)
    out = torch.where(mask, _op.read_f32(on_true_tile), torch.tensor(float(on_false_value), dtype=torch.float64).float())
    _op.write(dst, out)
    _op.accumulate(current(), "vector_acc", "range_select", out, reduce_op, reduce_cmd, reduce_res)
    _op.issue("range_select", costs.VECTOR, costs.alu(current().target, costs.VECTOR, f), [on_true_tile, bound0, bound1],
           [dst] + ([reduce_res] if reduce_res is not None else []))


# --- Vector: statistics ---------------------------------------------------------------------------------
def bn_stats(dst: NkiTensor, data: NkiTensor, name=None):
    _op.tile("bn_stats", "dst", dst)
    _op.tile("bn_stats", "data", data)
    fmax = current().target.bn_stats_fmax
    if data.free_size > fmax:
        raise NkiValidationError(f"bn_stats data has {data.free_size} elements per partition, exceeding maximum {fmax} "
                                 f"(nl.tile_size.bn_stats_fmax): run bn_stats per {fmax}-element tile, then one bn_aggr")
    if dst.partitions != data.partitions or dst.free_size != 6:
        raise NkiValidationError(f"bn_stats dst must be ({data.partitions}, 6), got {dst.shape}")
    _op.close_psum(data)
    x = _op.read_f32(data)
    parts = []
    for half in (x[:, 0::2], x[:, 1::2]):
        n = half.shape[1]
        mean = half.mean(1) if n else torch.zeros(x.shape[0])
        m2 = ((half - mean.unsqueeze(1)) ** 2).sum(1) if n else torch.zeros(x.shape[0])
        parts += [torch.full_like(mean, float(n)), mean, m2]
    _op.write(dst, torch.stack(parts, 1))
    _op.issue("bn_stats", costs.VECTOR, costs.alu(current().target, costs.VECTOR, data.free_size), [data], [dst])


def bn_aggr(dst: NkiTensor, data: NkiTensor, name=None):
    _op.tile("bn_aggr", "dst", dst)
    _op.tile("bn_aggr", "data", data)
    if data.free_size % 3:
        raise NkiValidationError(f"bn_aggr data must hold (count, mean, variance*count) triples: {data.free_size} "
                                 f"elements per partition is not a multiple of 3")
    if dst.partitions != data.partitions or dst.free_size != 2:
        raise NkiValidationError(f"bn_aggr dst must be ({data.partitions}, 2), got {dst.shape}")
    _op.close_psum(data)
    t = _op.read_f32(data).reshape(data.partitions, -1, 3)
    count, mean, m2 = t[..., 0], t[..., 1], t[..., 2]
    n = count.sum(1)
    total_mean = (count * mean).sum(1) / n
    total_m2 = (m2 + count * (mean - total_mean.unsqueeze(1)) ** 2).sum(1)
    _op.write(dst, torch.stack([total_mean, total_m2 / n], 1))
    _op.issue("bn_aggr", costs.VECTOR, costs.alu(current().target, costs.VECTOR, data.free_size), [data], [dst])


# the instructions of isa_search.py and isa_scan.py, under nki.isa as the kernels name them
from .isa_lnc import core_barrier, sendrecv  # noqa: E402,F401
from .isa_scan import (exponential, select_reduce, tensor_partition_reduce, tensor_scalar_cumulative,  # noqa: E402,F401
                       tensor_tensor_scan)
from .isa_search import (local_gather, max8, nc_find_index8, nc_match_replace8, nc_n_gather,  # noqa: E402,F401
                         nc_stream_shuffle, nonzero_with_count)

