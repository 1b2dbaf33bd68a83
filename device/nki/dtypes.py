"""NKI's data types, and how the emulated NeuronCore stores each one in host memory.

NKI names its dtypes with strings (`nl.float32 == "float32"`); a kernel may also pass a numpy
or torch dtype, which `as_dtype` maps to the same names. Every NKI dtype is stored in a host
tensor whose torch dtype has the same width: most have a torch twin; two are emulated:

- `float8_e4m3` is the IEEE-style e4m3 of NeuronCore-v2/v3 (bias 7, infinities, max 240), not
  torch's OCP `float8_e4m3fn` (no infinities, max 448): stored as uint8, converted through a
  256-entry table with round-to-nearest-even (Note [IEEE float8_e4m3]).
- `tfloat32` is stored as float32 with the mantissa rounded to 10 bits on every write.

The `_x4` packed types are words of 4 elements (float8 x4 in an int32, float4 x4 in an int16):
to every instruction but copies and memset they are opaque; only `quantize_mx` (which writes
them) and `nc_matmul_mx` (which reads them) see their elements, through mx_format.py.
"""
from __future__ import annotations

import numpy as np
import torch


class NkiDType(str):
    """A dtype name (a str, as in NKI) with the facts the emulator needs about it."""

    storage: torch.dtype  # the torch dtype of the host storage, same width
    itemsize: int
    is_float: bool
    is_int: bool
    packed: bool  # an _x4 type: opaque to every instruction but copies

    def __new__(cls, name: str, storage: torch.dtype, *, is_float: bool, packed: bool = False):
        self = super().__new__(cls, name)
        self.storage = storage
        self.itemsize = torch.empty((), dtype=storage).element_size()
        self.is_float = is_float
        self.is_int = not is_float and not packed and name != "bool"
        self.packed = packed
        return self

    def __repr__(self) -> str:
        return f"nl.{self if self != 'bool' else 'bool_'}"


bool_ = NkiDType("bool", torch.bool, is_float=False)
int8 = NkiDType("int8", torch.int8, is_float=False)
int16 = NkiDType("int16", torch.int16, is_float=False)
int32 = NkiDType("int32", torch.int32, is_float=False)
uint8 = NkiDType("uint8", torch.uint8, is_float=False)
uint16 = NkiDType("uint16", torch.uint16, is_float=False)
uint32 = NkiDType("uint32", torch.uint32, is_float=False)
float16 = NkiDType("float16", torch.float16, is_float=True)
float32 = NkiDType("float32", torch.float32, is_float=True)
bfloat16 = NkiDType("bfloat16", torch.bfloat16, is_float=True)
tfloat32 = NkiDType("tfloat32", torch.float32, is_float=True)
float8_e4m3 = NkiDType("float8_e4m3", torch.uint8, is_float=True)
float8_e4m3fn = NkiDType("float8_e4m3fn", torch.float8_e4m3fn, is_float=True)
float8_e5m2 = NkiDType("float8_e5m2", torch.float8_e5m2, is_float=True)
float8_e8m0fnu = NkiDType("float8_e8m0fnu", torch.float8_e8m0fnu, is_float=True)
float8_e5m2_x4 = NkiDType("float8_e5m2_x4", torch.int32, is_float=False, packed=True)
float8_e4m3fn_x4 = NkiDType("float8_e4m3fn_x4", torch.int32, is_float=False, packed=True)
float4_e2m1fn_x4 = NkiDType("float4_e2m1fn_x4", torch.int16, is_float=False, packed=True)

ALL: dict[str, NkiDType] = {d: d for d in (
    bool_, int8, int16, int32, uint8, uint16, uint32, float16, float32, bfloat16, tfloat32,
    float8_e4m3, float8_e4m3fn, float8_e5m2, float8_e8m0fnu, float8_e5m2_x4, float8_e4m3fn_x4,
    float4_e2m1fn_x4)}
ALL["bool_"] = bool_

# The NKI dtype of a torch tensor handed to a kernel (float8_e4m3 has no torch twin).
_FROM_TORCH = {d.storage: d for d in ALL.values() if not d.packed and d not in (float8_e4m3, tfloat32)}


# torch's CPU gather, scatter and index_put have no kernels for the wide unsigned integers:
# instructions that move elements by index move their bits as the signed integer of their width.
_SIGNED_TWIN = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """t, or, for uint16/uint32/uint64, a view of its bits as the signed integer of the same
    width (for moving elements by index: gather, scatter, index_put)."""
    signed = _SIGNED_TWIN.get(t.dtype)
    return t if signed is None else t.view(signed)


def as_dtype(dtype, *, what: str = "dtype") -> NkiDType:
    """The NKI dtype named by `dtype`: an NKI dtype, its name, a numpy or a torch dtype."""
    if isinstance(dtype, NkiDType):
        return dtype
    if isinstance(dtype, torch.dtype):
        found = _FROM_TORCH.get(dtype)
    elif isinstance(dtype, str):
        found = ALL.get(dtype)
    else:
        try:
            found = ALL.get(np.dtype(dtype).name)
        except TypeError:
            found = None
    if found is None:
        raise TypeError(
            f"{what} {dtype!r} is not an NKI data type; use one of nl.{', nl.'.join(sorted(set(ALL.values())))} "
            f"(int64 and float64 have no NeuronCore equivalent: cast to int32 or float32 first).")
    return found


def of_torch(t: torch.Tensor, *, what: str) -> NkiDType:
    """The NKI dtype of a torch tensor handed to a kernel."""
    return as_dtype(t.dtype, what=f"{what} of torch dtype")


# Note [IEEE float8_e4m3]: the 128 non-negative codes 0x00-0x7f decoded; 0x78 is +inf and
# 0x79-0x7f are NaN, as in IEEE 754 (exponent all ones). Encoding rounds |x| to the nearest
# finite code (ties to the even code), sends |x| >= 240 + 8 (half an ulp above the largest
# finite value) to inf, and NaN to 0x7f; the sign is bit 7.
def _e4m3_table() -> torch.Tensor:
    codes = torch.arange(128, dtype=torch.int32)
    exp, man = codes >> 3, (codes & 7).float()
    normal = (1 + man / 8) * torch.pow(2.0, (exp - 7).float())
    sub = man / 8 * 2.0 ** -6
    values = torch.where(exp == 0, sub, normal)
    values[0x78] = float("inf")
    values[0x79:] = float("nan")
    return values


_E4M3_POS = _e4m3_table()
_E4M3_FINITE = _E4M3_POS[:0x78].contiguous()
_E4M3_DECODE = torch.cat([_E4M3_POS, -_E4M3_POS])


def _encode_e4m3(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    mag = x.abs()
    hi = torch.searchsorted(_E4M3_FINITE, mag.clamp(max=240.0)).clamp(max=0x77)
    lo = (hi - 1).clamp(min=0)
    d_hi = (_E4M3_FINITE[hi] - mag).abs()
    d_lo = (mag - _E4M3_FINITE[lo]).abs()
    pick_lo = (d_lo < d_hi) | ((d_lo == d_hi) & (lo % 2 == 0))
    code = torch.where(pick_lo, lo, hi)
    code = torch.where(mag >= 248.0, torch.full_like(code, 0x78), code)
    code = torch.where(torch.isnan(x), torch.full_like(code, 0x7F), code)
    code = code | (torch.signbit(x).to(code.dtype) << 7)
    return code.to(torch.uint8)


def _round_tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 with its mantissa rounded to tfloat32's 10 bits (nearest, ties to even)."""
    bits = x.float().contiguous().view(torch.int32)
    finite = torch.isfinite(x)
    lsb = (bits >> 13) & 1
    rounded = ((bits + 0x0FFF + lsb) >> 13) << 13
    return torch.where(finite, rounded, bits).view(torch.float32)


def decode(stored: torch.Tensor, dtype: NkiDType) -> torch.Tensor:
    """Values of stored elements for arithmetic: float32 for float dtypes, the integer itself
    (int32/int64 for unsigned) for integer ones."""
    if dtype is float8_e4m3:
        return _E4M3_DECODE[stored.long()]
    if dtype.is_float:
        return stored.float()
    if dtype in (uint16, uint32):
        return stored.to(torch.int64)
    if dtype is bool_:
        return stored.to(torch.uint8)
    return stored


def encode(values: torch.Tensor, dtype: NkiDType) -> torch.Tensor:
    """Storage elements for values (any torch dtype), converted as the engines convert to
    `dtype`: round to nearest even for floats, truncation for integers."""
    if dtype is float8_e4m3:
        return _encode_e4m3(values)
    if dtype is tfloat32:
        return _round_tf32(values)
    if dtype in (uint16, uint32) and values.is_floating_point():
        # torch has no float -> uint16/uint32 kernels; via int64, as numpy's astype does
        return values.to(torch.int64).to(dtype.storage)
    if values.dtype in (torch.uint16, torch.uint32) and not dtype.is_int:
        values = values.to(torch.int64)
    return values.to(dtype.storage)


def sentinel(dtype: NkiDType):
    """What fresh memory holds (as the NKI simulator fills it): NaN for floats, 4 for integers,
    so that a read of a tile nothing wrote shows in the result."""
    if dtype.packed or dtype is bool_:
        return 0
    return float("nan") if dtype.is_float else 4
