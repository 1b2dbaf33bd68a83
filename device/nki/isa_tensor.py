"""nki.isa's Tensor Engine instructions: nc_matmul (float32 accumulation in PSUM, Note [PSUM
accumulation] in operands.py) and nc_transpose."""
from __future__ import annotations

import torch

from . import costs
from . import dtypes as dt
from . import operands as _op
from .constants import engine, matmul_perf_mode
from .errors import NkiValidationError
from .program import current
from .tensor import PSUM, SBUF, NkiTensor


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
        _op.write_matmul(dst, a.t() @ b, accumulate)  # float32 accumulation, as in the Tensor Engine
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
