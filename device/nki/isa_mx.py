"""nki.isa's MX instructions (NeuronCore-v4): quantize_mx (Vector Engine) and nc_matmul_mx (Tensor Engine).

Semantics from the aws-neuron-sdk docs (nki/api/nki/isa/__init__.py, nki.isa.quantize_mx and
nki.isa.nc_matmul_mx; guides/architecture/trainium3_arch.rst, "Quad-MXFP8/MXFP4 Matmul" and "MX
data-type Quantization"; deep-dives/mxfp-matmul.rst). A scaling group is 32 elements: 8
partitions x the 4 elements of one x4 word, along the contraction dim (mx_format.py for the
words and the scale layout). Choices where the docs are silent, each marked "(choice)" below:
a data tile starts on a quadrant boundary; a scale tile's free size equals its data tile's (x4
words); a group holding NaN or infinity gets the NaN scale 0xFF and NaN elements.
"""
from __future__ import annotations

import torch

from . import costs
from . import dtypes as dt
from . import mx_format as mx
from . import operands as _op
from .errors import NkiValidationError
from .program import current
from .tensor import PSUM, SBUF, NkiTensor

_QUANTIZE_SRC = (dt.float16, dt.bfloat16)
_QUANTIZE_DST = (dt.float8_e4m3fn_x4, dt.float8_e5m2_x4)  # "Quantize-MX does not support an FP4 output"
_SCALE_OFFSETS = (0, 4, 8, 12)  # "scales at an offset of 0, 4, 8, or 12" in a quadrant (mxfp-matmul.rst:228)


def _needs_v4(instr: str) -> None:
    target = current().target
    if target.version < 4:
        raise NkiValidationError(f"{instr} is available only on NeuronCore-v4 and newer (trn3); the target is "
                                 f"{target.name}")


def _dtype_in(instr: str, name: str, t: NkiTensor, allowed) -> None:
    if t.dtype not in allowed:
        raise NkiValidationError(f"{instr} {name} must be {' or '.join(allowed)}, got {t.dtype}")


def _data_partitions(instr: str, name: str, t: NkiTensor, limit: int = 128) -> int:
    p = t.partitions
    if p % mx.QUADRANT or p > limit:
        raise NkiValidationError(f"{instr} {name} partition dimension {p} must be a multiple of 32 and at most {limit}")
    if t.partition_start % mx.QUADRANT:  # (choice) groups and their scales are per quadrant
        raise NkiValidationError(f"{instr} {name} must start on an SBUF quadrant boundary (partition 0, 32, 64 or "
                                 f"96), starts at {t.partition_start}")
    return p


def _check_scale(instr: str, name: str, scale: NkiTensor, data_name: str, data: NkiTensor) -> None:
    """The scale tile of a data tile of P partitions and W words per partition: each quadrant of
    data keeps its P/8 groups' scales in the first 4 partitions (+ 0, 4, 8 or 12) of the same
    quadrant, W scales per partition."""
    _op.tile(instr, name, scale, buffers=(SBUF,))
    _dtype_in(instr, name, scale, mx.SCALE_DTYPES)
    rows = mx.scale_row(data.partitions // mx.GROUP_PARTITIONS - 1) + 1
    if scale.partitions < rows:
        raise NkiValidationError(f"{instr} {name} needs at least {rows} partitions for a {data_name} of "
                                 f"{data.partitions} partitions (4 per SBUF quadrant, in each quadrant's first "
                                 f"partitions), got {scale.partitions}")
    offset = scale.partition_start % mx.QUADRANT
    if offset not in _SCALE_OFFSETS or scale.partition_start // mx.QUADRANT != data.partition_start // mx.QUADRANT:
        raise NkiValidationError(f"{instr} {name} must start at partition 0, 4, 8 or 12 of {data_name}'s SBUF "
                                 f"quadrant (partition {data.partition_start}), starts at {scale.partition_start}")
    if scale.free_size != data.free_size:  # (choice) the docs' shapes are always equal; the tutorial slices to fit
        raise NkiValidationError(f"{instr} {name} holds one scale per {data_name} x4 word per partition: "
                                 f"{data.free_size}, got {scale.free_size} {scale.shape}")


def _read_scales(scale: NkiTensor, data_partitions: int) -> torch.Tensor:
    """Each data partition's scale values, (P, W) float32."""
    codes = mx.scale_codes(scale.torch_view()).reshape(scale.partitions, scale.free_size)
    groups = mx.scale_values(codes[mx.scale_rows(data_partitions)])
    return groups.repeat_interleave(mx.GROUP_PARTITIONS, dim=0)


def _write_scales(scale: NkiTensor, codes: torch.Tensor) -> None:
    """Store (P/8, W) E8M0 codes at their rows; the tile's other partitions keep what they hold
    (another quantize_mx's scales may live there)."""
    view = scale.torch_view()
    rows = mx.scale_rows(codes.shape[0] * mx.GROUP_PARTITIONS)
    full = mx.scale_codes(view).reshape(scale.partitions, scale.free_size).clone()
    full[rows] = codes
    view.copy_(full.to(torch.uint8).view(scale.dtype.storage).reshape(view.shape))


def quantize_mx(dst: NkiTensor, src: NkiTensor, dst_scale: NkiTensor, name=None):
    """FP16/BF16 src -> MXFP8 dst (x4 words) and E8M0 dst_scale, one scale per 8 x 4 group.

    The scale is NKI's, twice OCP's sample rule: X = 2^(floor(log2(amax)) - (E_max - 1)), E_max
    8 for float8_e4m3fn, 15 for float8_e5m2, so amax / X < 2^E_max never saturates; an all-zero
    group gets 2^-127. Elements are src / X rounded to nearest even."""
    instr = "quantize_mx"
    _needs_v4(instr)
    _op.tile(instr, "src", src, buffers=(SBUF,))
    _op.tile(instr, "dst", dst, buffers=(SBUF,))
    _dtype_in(instr, "src", src, _QUANTIZE_SRC)
    _dtype_in(instr, "dst", dst, _QUANTIZE_DST)
    p, f = _data_partitions(instr, "src", src), src.free_size
    if f % mx.GROUP_ELEMS:
        raise NkiValidationError(f"{instr} src free size {f} must be a multiple of 4")
    words = f // mx.GROUP_ELEMS
    if dst.partitions != p or dst.free_size != words:
        raise NkiValidationError(f"{instr} dst must be {p} x {words} x4 words (src's partitions, a quarter of its "
                                 f"{f} elements per partition), got {dst.partitions} x {dst.free_size} {dst.shape}")
    _data_partitions(instr, "dst", dst)
    _check_scale(instr, "dst_scale", dst_scale, "dst", dst)
    fmt = mx.FORMATS[dst.dtype]
    groups = _op.read_f32(src).reshape(p // mx.GROUP_PARTITIONS, mx.GROUP_PARTITIONS, words, mx.GROUP_ELEMS)
    codes = _group_scales(groups.abs().amax(dim=(1, 3)), fmt)
    factor = torch.pow(2.0, (mx.SCALE_BIAS - codes).to(torch.float64))  # 1/X, exact in float64 for every code
    quotient = (groups.double() * factor[:, None, :, None]).float()  # exact unless far below the element's range
    quotient = torch.where((codes == mx.SCALE_NAN)[:, None, :, None], torch.full_like(quotient, float("nan")),
                           quotient)
    packed = mx.pack(quotient.reshape(p, words, mx.GROUP_ELEMS), fmt, dst.dtype.storage)
    dst.torch_view().copy_(packed.reshape(dst.shape))
    _write_scales(dst_scale, codes)
    _op.issue(instr, costs.VECTOR, costs.quantize_mx(current().target, f), [src], [dst, dst_scale])


def _group_scales(amax: torch.Tensor, fmt: mx.ElementFormat) -> torch.Tensor:
    """E8M0 codes (int64) of the groups' scales from their absolute maxima."""
    _, e = torch.frexp(amax)  # amax = m * 2^e, 0.5 <= m < 1: floor(log2(amax)) = e - 1 (subnormals too)
    codes = (e.to(torch.int64) - 1 - (fmt.emax - 1) + mx.SCALE_BIAS).clamp(0, 254)
    codes = torch.where(amax == 0, torch.zeros_like(codes), codes)
    return torch.where(torch.isfinite(amax), codes, torch.full_like(codes, mx.SCALE_NAN))  # (choice) NaN/inf


def nc_matmul_mx(dst: NkiTensor, stationary: NkiTensor, moving: NkiTensor, stationary_scale: NkiTensor,
                 moving_scale: NkiTensor, tile_position=None, tile_size=None, accumulate=None, name=None):
    """dst = stationary.T @ moving over the partitions and the 4 elements of each word, each
    element times its group's scale, accumulated in float32 into PSUM as nc_matmul does."""
    instr = "nc_matmul_mx"
    _needs_v4(instr)
    target = current().target
    for nm, t in (("stationary", stationary), ("moving", moving)):
        _op.tile(instr, nm, t, buffers=(SBUF,))
        _dtype_in(instr, nm, t, tuple(mx.FORMATS))
    _op.tile(instr, "dst", dst, buffers=(PSUM,))
    _dtype_in(instr, "dst", dst, (dt.float32, dt.bfloat16))
    rows = _row_tile(instr, tile_position, tile_size)
    k = _data_partitions(instr, "stationary", stationary, rows)
    if moving.partitions != k:
        raise NkiValidationError(f"{instr} stationary and moving must have the same partition (contraction) size: "
                                 f"{k} and {moving.partitions}")
    _data_partitions(instr, "moving", moving)
    m, n = stationary.free_size, moving.free_size
    if m % 2 or m > target.gemm_stationary_fmax:
        raise NkiValidationError(f"{instr} stationary free size {m} must be even and at most "
                                 f"{target.gemm_stationary_fmax}")
    moving_max = target.gemm_moving_fmax * (2 if dst.dtype == dt.bfloat16 else 1)  # the 8 PSUM banks
    if n > moving_max:
        raise NkiValidationError(f"{instr} moving free size {n} exceeds maximum {moving_max} for a {dst.dtype} dst")
    if dst.partitions != m or dst.free_size != n:
        raise NkiValidationError(f"{instr} dst must be {m} x {n} (stationary free x moving free), got "
                                 f"{dst.partitions} x {dst.free_size} {dst.shape}")
    _check_scale(instr, "stationary_scale", stationary_scale, "stationary", stationary)
    _check_scale(instr, "moving_scale", moving_scale, "moving", moving)
    a = _dequantize(stationary, stationary_scale)  # (k, m, 4)
    b = _dequantize(moving, moving_scale)  # (k, n, 4)
    # the contraction runs over (partition, element of the word): flatten both into one K of 4k
    product = a.permute(0, 2, 1).reshape(4 * k, m).t() @ b.permute(0, 2, 1).reshape(4 * k, n)
    reads = [stationary, moving, stationary_scale, moving_scale, dst]
    _op.write_matmul(dst, product, accumulate)
    _op.issue(instr, costs.TENSOR, costs.matmul_mx(target, n), reads, [dst])


def _dequantize(data: NkiTensor, scale: NkiTensor) -> torch.Tensor:
    """(P, W, 4) float32: each element's value times its group's scale (exact: a power of two)."""
    p, w = data.partitions, data.free_size
    values = mx.unpack(data.torch_view().reshape(p, w), mx.FORMATS[data.dtype])
    return values * _read_scales(scale, p).unsqueeze(-1)


def _row_tile(instr: str, tile_position, tile_size) -> int:
    """The PE rows a row-tiled nc_matmul_mx may use (the only tiling it has): 128 untiled."""
    if not tile_position and not tile_size:
        return 128
    if not tile_position or not tile_size:
        raise NkiValidationError(f"{instr}: tile_position and tile_size must both be set to use tiling mode")
    (r0, c0), (rs, cs) = tile_position, tile_size
    if cs != 128 or c0 != 0:
        raise NkiValidationError(f"{instr} supports row tiling only: tile_size column must be 128 and tile_position "
                                 f"column 0, got tile_size={tuple(tile_size)} tile_position={tuple(tile_position)}")
    if rs not in (32, 64, 128) or r0 % rs or r0 + rs > 128:
        raise NkiValidationError(f"{instr} tile_size row {rs} must be 32, 64 or 128 and tile_position row {r0} a "
                                 f"multiple of it inside the 128 rows")
    return rs
