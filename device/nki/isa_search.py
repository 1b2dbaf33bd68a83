"""nki.isa's data-dependent movement within a NeuronCore: shuffles across partitions, gathers
within a partition, finding and replacing the largest values, and nonzero indices (the
instructions top-k, routing and sparse kernels use)."""
from __future__ import annotations

import torch

from . import costs
from . import dtypes as dt
from .errors import NkiValidationError
from .operands import close_psum, issue, read, read_f32, same_layout, tile, write
from .program import current
from .tensor import SBUF, NkiTensor

NO_SHUFFLE = 255
QUADRANT = 32


def nc_stream_shuffle(dst: NkiTensor, src: NkiTensor, shuffle_mask, name=None):
    """Within each quadrant of 32 partitions, output partition i copies input partition
    shuffle_mask[i] (255: partition i is left unmodified); the same mask for every quadrant."""
    tile("nc_stream_shuffle", "src", src)
    tile("nc_stream_shuffle", "dst", dst)
    mask = [int(m) for m in shuffle_mask]
    if len(mask) != QUADRANT or any(not (0 <= m < QUADRANT or m == NO_SHUFFLE) for m in mask):
        raise NkiValidationError(f"nc_stream_shuffle shuffle_mask must be 32 partition indices in [0, 32) or 255, got "
                                 f"{shuffle_mask!r}")
    if src.dtype != dst.dtype or src.free_size != dst.free_size:
        raise NkiValidationError(f"nc_stream_shuffle dst must have src's dtype and elements per partition: src is "
                                 f"{src.dtype} x {src.free_size}, dst {dst.dtype} x {dst.free_size}")
    active = -(-max(src.partitions, dst.partitions) // QUADRANT) * QUADRANT
    allowed = {128: (0,), 96: (0,), 64: (0, 64), 32: (0, 32, 64, 96)}[active]
    for nm, t in (("src", src), ("dst", dst)):
        if t.partition_start not in allowed:
            raise NkiValidationError(f"nc_stream_shuffle {nm} starts at partition {t.partition_start}; with {active} "
                                     f"active partitions it must start at {' or '.join(map(str, allowed))}")
    close_psum(src)
    values = src.torch_view().reshape(src.partitions, -1)
    out = dst.torch_view().reshape(dst.partitions, -1).clone()
    for p in range(dst.partitions):
        m = mask[p % QUADRANT]
        if m == NO_SHUFFLE:
            continue
        q = (p // QUADRANT) * QUADRANT + m
        if q >= src.partitions:
            raise NkiValidationError(f"nc_stream_shuffle: partition {p} copies src partition {q}, past src's "
                                     f"{src.partitions}")
        out[p] = values[q]
    dst.torch_view().copy_(out.reshape(dst.shape))
    close_psum(dst)
    issue("nc_stream_shuffle", costs.VECTOR, costs.alu(current().target, costs.VECTOR, dst.free_size), [src], [dst])


def nc_n_gather(dst: NkiTensor, data: NkiTensor, indices: NkiTensor, name=None):
    """dst[p, j] = data[p, indices[p, j]], the free dims of data flattened."""
    for nm, t in (("dst", dst), ("data", data), ("indices", indices)):
        tile("nc_n_gather", nm, t, buffers=(SBUF,))
    if indices.dtype != dt.uint32:
        raise NkiValidationError(f"nc_n_gather indices must be uint32, got {indices.dtype}")
    if dst.dtype != data.dtype:
        raise NkiValidationError(f"nc_n_gather dst dtype {dst.dtype} must equal data's {data.dtype}")
    same_layout("nc_n_gather", "indices", indices, "dst", dst)
    if data.partitions != dst.partitions:
        raise NkiValidationError(f"nc_n_gather data has {data.partitions} partitions, dst {dst.partitions}")
    idx = read(indices).to(torch.int64)
    bad = (idx < 0) | (idx >= data.free_size)
    if bad.any():
        raise NkiValidationError(f"nc_n_gather: index {idx[bad][0].item()} is outside [0, {data.free_size}) of data")
    values = dt.as_bits(data.torch_view().reshape(data.partitions, -1))  # any dtype: its bits move
    dt.as_bits(dst.torch_view()).copy_(torch.gather(values, 1, idx).reshape(dst.shape))
    issue("nc_n_gather", costs.GPSIMD, costs.alu(current().target, costs.GPSIMD, dst.free_size, 2), [data, indices],
          [dst])


def _data8(instr: str, data: NkiTensor) -> None:
    tile(instr, "data", data)
    if not 8 <= data.free_size <= 16384:
        raise NkiValidationError(f"{instr} reads 8 to 16384 elements per partition, got {data.free_size}")


def _dst8(instr: str, name: str, dst: NkiTensor, partitions: int) -> None:
    tile(instr, name, dst)
    if dst.partitions != partitions or dst.free_size != 8:
        raise NkiValidationError(f"{instr} {name} must be ({partitions}, 8), got {dst.shape}")


def max8(dst: NkiTensor, src: NkiTensor, name=None):
    """The 8 largest values of each partition, in descending order."""
    _data8("max8", src)
    _dst8("max8", "dst", dst, src.partitions)
    close_psum(src)
    write(dst, read_f32(src).topk(8, dim=1).values)
    issue("max8", costs.VECTOR, costs.alu(current().target, costs.VECTOR, src.free_size), [src], [dst])


def _vals(instr: str, vals: NkiTensor, partitions: int) -> torch.Tensor:
    tile(instr, "vals", vals)
    if vals.partitions != partitions or vals.free_size != 8:
        raise NkiValidationError(f"{instr} vals must hold 8 values per partition for {partitions} partitions, got "
                                 f"{vals.shape}")
    return read_f32(vals)


def _match(data: torch.Tensor, vals: torch.Tensor, order) -> torch.Tensor:
    """For each partition and each val (taken in `order`), the first position holding it that no
    earlier val took; -1 where there is none."""
    p, _ = data.shape
    found = torch.full((p, 8), -1, dtype=torch.int64)
    taken = torch.zeros_like(data, dtype=torch.bool)
    for i in order:
        hit = (data == vals[:, i:i + 1]) & ~taken
        any_hit = hit.any(1)
        first = hit.to(torch.int8).argmax(1)
        found[:, i] = torch.where(any_hit, first, torch.tensor(-1))
        taken[torch.arange(p)[any_hit], first[any_hit]] = True
    return found


def nc_find_index8(dst: NkiTensor, data: NkiTensor, vals: NkiTensor, name=None):
    """The index of the first occurrence of each of 8 values per partition (duplicates of a
    value take successive occurrences); all ones where the value is absent."""
    _data8("nc_find_index8", data)
    _dst8("nc_find_index8", "dst", dst, data.partitions)
    if dst.dtype not in (dt.uint16, dt.uint32):
        raise NkiValidationError(f"nc_find_index8 dst must be uint16 or uint32, got {dst.dtype}")
    close_psum(data)
    found = _match(read_f32(data), _vals("nc_find_index8", vals, data.partitions), range(8))
    sentinel = 0xFFFF if dst.dtype == dt.uint16 else 0xFFFFFFFF
    write(dst, torch.where(found < 0, torch.tensor(sentinel), found))
    issue("nc_find_index8", costs.VECTOR, costs.alu(current().target, costs.VECTOR, data.free_size), [data, vals],
          [dst])


def nc_match_replace8(dst: NkiTensor, data: NkiTensor, vals: NkiTensor, imm: float, dst_idx: NkiTensor | None = None,
                      name=None):
    """data with the first occurrence of each of 8 values per partition replaced by imm (vals
    taken from the last to the first, so duplicates pair with occurrences in descending
    slots); their indices into dst_idx."""
    _data8("nc_match_replace8", data)
    if dst_idx is not None:
        _dst8("nc_match_replace8", "dst_idx", dst_idx, data.partitions)
    tile("nc_match_replace8", "dst", dst)
    same_layout("nc_match_replace8", "data", data, "dst", dst)
    close_psum(data)
    x = read_f32(data)
    found = _match(x, _vals("nc_match_replace8", vals, data.partitions), range(7, -1, -1))
    out = x.clone()
    rows = torch.arange(x.shape[0]).unsqueeze(1).expand(-1, 8)
    hit = found >= 0
    out[rows[hit], found[hit]] = float(imm)
    write(dst, out)
    if dst_idx is not None:
        write(dst_idx, torch.where(hit, found, torch.tensor(0xFFFFFFFF if dst_idx.dtype == dt.uint32 else -1)))
    issue("nc_match_replace8", costs.VECTOR, costs.alu(current().target, costs.VECTOR, data.free_size),
          [data, vals], [dst] + ([dst_idx] if dst_idx is not None else []))


def nonzero_with_count(dst: NkiTensor, src: NkiTensor, index_offset=0, padding_val=-1, name=None):
    """On partitions 0, 16, ..., 112 (each GpSimd core's first): the indices of the nonzero
    elements (plus index_offset), padding_val after them, and their count last."""
    if current().target.version < 3:
        raise NkiValidationError("nonzero_with_count is available on NeuronCore-v3 (trn2) and newer")
    tile("nonzero_with_count", "src", src, buffers=(SBUF,))
    tile("nonzero_with_count", "dst", dst, buffers=(SBUF,))
    if src.dtype not in (dt.float32, dt.int32) or dst.dtype != dt.int32:
        raise NkiValidationError(f"nonzero_with_count takes a float32 or int32 src and an int32 dst, got {src.dtype} "
                                 f"and {dst.dtype}")
    if dst.partitions != src.partitions or dst.free_size != src.free_size + 1:
        raise NkiValidationError(f"nonzero_with_count dst must be ({src.partitions}, {src.free_size + 1}) for src "
                                 f"{src.shape}, got {dst.shape}")
    x = read(src)
    out = read(dst).to(torch.int64).clone()
    for p in range(0, src.partitions, 16):
        nz = torch.nonzero(x[p] != 0).reshape(-1)
        row = torch.full((src.free_size + 1,), int(padding_val), dtype=torch.int64)
        row[:nz.numel()] = nz + int(index_offset)
        row[-1] = nz.numel()
        out[p] = row
    write(dst, out)
    issue("nonzero_with_count", costs.GPSIMD, costs.alu(current().target, costs.GPSIMD, src.free_size), [src, dst],
          [dst])


GPSIMD_CORE_PARTITIONS = 16


def local_gather(dst: NkiTensor, src_buffer: NkiTensor, index: NkiTensor, num_elem_per_idx=1, num_valid_indices=None,
                 name=None):
    """Each GpSimd core (16 partitions) reads its 16-partition slice of `index` column by
    column (partitions first) into one list of element offsets, and each of its partitions
    gathers num_elem_per_idx contiguous elements of its own row of src_buffer at every offset."""
    for nm, t in (("src_buffer", src_buffer), ("index", index), ("dst", dst)):
        tile("local_gather", nm, t, buffers=(SBUF,))
    if index.dtype != dt.uint16:
        raise NkiValidationError(f"local_gather index must be uint16, got {index.dtype}")
    if src_buffer.partitions != index.partitions or src_buffer.partitions % GPSIMD_CORE_PARTITIONS:
        raise NkiValidationError(f"local_gather src_buffer and index must have the same partitions, a multiple of 16: "
                                 f"got {src_buffer.partitions} and {index.partitions}")
    if num_elem_per_idx not in (1, 2, 4, 8, 16, 32):
        raise NkiValidationError(f"local_gather num_elem_per_idx must be 1, 2, 4, 8, 16 or 32, got {num_elem_per_idx}")
    per_core = index.free_size * GPSIMD_CORE_PARTITIONS
    valid = per_core if num_valid_indices is None else int(num_valid_indices)
    if not 0 < valid <= min(per_core, 4096):
        raise NkiValidationError(f"local_gather num_valid_indices {valid} must be in [1, {min(per_core, 4096)}]")
    if dst.dtype != src_buffer.dtype or dst.partitions != src_buffer.partitions \
            or dst.free_size != valid * num_elem_per_idx:
        raise NkiValidationError(f"local_gather dst must be {src_buffer.dtype} ({src_buffer.partitions}, "
                                 f"{valid * num_elem_per_idx} elements per partition), got {dst.dtype} {dst.shape}")
    src = src_buffer.torch_view().reshape(src_buffer.partitions, -1)
    idx = read(index).to(torch.int64)
    span = torch.arange(num_elem_per_idx)
    out = torch.empty((dst.partitions, valid * num_elem_per_idx), dtype=src.dtype)
    for p0 in range(0, src_buffer.partitions, GPSIMD_CORE_PARTITIONS):
        offsets = idx[p0:p0 + GPSIMD_CORE_PARTITIONS].t().reshape(-1)[:valid]
        where = (offsets.unsqueeze(1) + span).reshape(-1)
        if (where >= src.shape[1]).any():
            raise NkiValidationError(f"local_gather: an index reaches past src_buffer's {src.shape[1]} elements per "
                                     f"partition (core {p0 // GPSIMD_CORE_PARTITIONS})")
        out[p0:p0 + GPSIMD_CORE_PARTITIONS] = src[p0:p0 + GPSIMD_CORE_PARTITIONS][:, where]
    dst.torch_view().copy_(out.reshape(dst.shape))
    issue("local_gather", costs.GPSIMD, costs.alu(current().target, costs.GPSIMD, dst.free_size), [src_buffer, index],
          [dst])
