"""The OCP Microscaling (MX) formats as the NeuronCore-v4 stores them: packed x4 words and E8M0 scales.

OCP MX v1.0 (https://www.opencompute.org/documents/ocp-microscaling-formats-mx-v1-0-spec-final-pdf):
a block of 32 elements shares one scale X = 2^(s - 127), s an E8M0 code (0xFF is NaN); an
element's value is X times its own value in the element format (FP8 E4M3/E5M2, FP4 E2M1).

NKI stores MX data in 4-packed words (nl.float8_e4m3fn_x4, nl.float8_e5m2_x4: 32 bits, four
FP8 codes; nl.float4_e2m1fn_x4: 16 bits, four FP4 codes). Element j of a word is bits
[j*w, (j+1)*w) (w = 8 or 4), the order of the docs' tutorial helpers (aws-neuron-sdk,
nki/deep-dives/src/mxfp-matmul/mx_cpu_utils.py, pack_mx_data_into_x4: FP8 codes viewed as a
little-endian uint32, FP4 codes low nibble first). The words are shifted explicitly, so the
host's byte order does not matter.
"""
from __future__ import annotations

import dataclasses

import torch

from . import dtypes as dt

GROUP_PARTITIONS, GROUP_ELEMS = 8, 4  # a 32-element scaling group: 8 partitions x one x4 word
QUADRANT = 32  # SBUF partitions per quadrant; a quadrant's scales sit in its first partitions
SCALE_BIAS, SCALE_NAN = 127, 0xFF


@dataclasses.dataclass(frozen=True)
class ElementFormat:
    name: str
    bits: int  # per element; a word holds 4
    emax: int  # largest unbiased exponent of a normal value ("E_max" of nki.isa.quantize_mx's docs)
    max_normal: float
    torch_dtype: torch.dtype | None  # the torch twin that decodes one code, if torch has one


# FP4 E2M1 (OCP MX v1.0, 5.3.3): no infinities or NaN; codes 0-7 are these magnitudes, bit 3 the sign.
_FP4_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])

FORMATS = {
    dt.float8_e4m3fn_x4: ElementFormat("float8_e4m3fn", 8, 8, 448.0, torch.float8_e4m3fn),
    dt.float8_e5m2_x4: ElementFormat("float8_e5m2", 8, 15, 57344.0, torch.float8_e5m2),
    dt.float4_e2m1fn_x4: ElementFormat("float4_e2m1fn", 4, 2, 6.0, None),
}
SCALE_DTYPES = (dt.float8_e8m0fnu, dt.uint8)


def unpack(words: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """The float32 values of packed words (any shape): shape + (4,)."""
    mask = (1 << fmt.bits) - 1
    w = words.to(torch.int64) & ((1 << (4 * fmt.bits)) - 1)  # the word's bits, unsigned
    shifts = torch.arange(4, dtype=torch.int64) * fmt.bits
    codes = (w.unsqueeze(-1) >> shifts) & mask
    if fmt.torch_dtype is None:
        values = _FP4_MAGNITUDES[codes & 7]
        return torch.where((codes & 8) != 0, -values, values)
    return codes.to(torch.uint8).view(fmt.torch_dtype).to(torch.float32)


def pack(values: torch.Tensor, fmt: ElementFormat, storage: torch.dtype) -> torch.Tensor:
    """Packed words of float32 values (shape + (4,)), each rounded to the element format (nearest
    even); magnitudes past the largest normal saturate to it (OCP MX allows saturating
    conversion; torch's own cast would give NaN for E4M3)."""
    if fmt.torch_dtype is None:
        raise AssertionError("pack: quantize_mx writes FP8 elements only; FP4 words are read, never made here")
    saturated = values.clamp(-fmt.max_normal, fmt.max_normal)  # NaN stays NaN
    codes = saturated.to(fmt.torch_dtype).view(torch.uint8).to(torch.int64)
    shifts = torch.arange(4, dtype=torch.int64) * fmt.bits
    word = (codes << shifts).sum(-1)
    top = 1 << (4 * fmt.bits)
    word = torch.where(word >= top // 2, word - top, word)  # the unsigned word as the signed storage integer
    return word.to(storage)


def scale_codes(t: torch.Tensor) -> torch.Tensor:
    """E8M0 codes (int64) of a host view of uint8 or float8_e8m0fnu storage."""
    return t.view(torch.uint8).to(torch.int64)


def scale_values(codes: torch.Tensor) -> torch.Tensor:
    """2^(code - 127) as float32 (2^-127 is a float32 subnormal, exact); code 0xFF is NaN."""
    x = torch.ldexp(torch.ones_like(codes, dtype=torch.float32), (codes - SCALE_BIAS).to(torch.int32))
    return torch.where(codes == SCALE_NAN, torch.full_like(x, float("nan")), x)


def scale_row(group: int) -> int:
    """The partition (from the scale view's first) of the scale of the `group`-th 8-partition group
    of a data tile: each SBUF quadrant's 4 groups keep their scales in that quadrant's first 4
    partitions (nki.isa.quantize_mx, "Layout"; mx_cpu_utils.py, get_p_contiguous_scale)."""
    per_quadrant = QUADRANT // GROUP_PARTITIONS
    return (group // per_quadrant) * QUADRANT + group % per_quadrant


def scale_rows(data_partitions: int) -> torch.Tensor:
    return torch.tensor([scale_row(g) for g in range(data_partitions // GROUP_PARTITIONS)], dtype=torch.int64)
