"""nki.isa's data movement: DMA (copies, transposes, the DMA engines' adds, indirect gather and
scatter) and the on-chip copies, fills and predicated copies of the compute engines."""
from __future__ import annotations

import math
import warnings

import torch

from . import costs
from . import dtypes as dt
from . import operands as _op
from . import ops
from .constants import dge_mode, engine, oob_mode
from .errors import NkiValidationError
from .program import current
from .tensor import PSUM, SBUF, NkiTensor


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
    t.check_extent()  # its static part, before the runtime offset moves it
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
    flat = dt.as_bits(_flat(dst))  # any dtype: its bits move
    flat[addr[dst_keep]] = dt.as_bits(stored).reshape(addr.shape)[dst_keep]


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
