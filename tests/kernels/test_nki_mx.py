"""nki.isa's MX instructions on the emulated NeuronCore-v4 (issue 38, item 5): quantize_mx and
nc_matmul_mx checked against references written here from the OCP MX v1.0 spec and NKI's docs
(numpy, float64, element tables built from the formats' bit fields, not from torch's casts),
their documented limits, their price, and the tutorial's kernel patterns
(aws-neuron-sdk nki/deep-dives/src/mxfp-matmul)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import adaptive_eager.nki as nki
import adaptive_eager.nki.isa as nisa
import adaptive_eager.nki.language as nl

g = torch.Generator().manual_seed(38)


@pytest.fixture
def trn3(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")


# --- the reference: OCP MX v1.0 element formats from their bit fields -------------------------------
def _float_table(ebits: int, mbits: int, bias: int, special) -> np.ndarray:
    """The value of every code of a sign/exponent/mantissa format (sign in the top bit)."""
    n = 1 << (1 + ebits + mbits)
    values = np.empty(n)
    for code in range(n):
        sign = -1.0 if code >> (ebits + mbits) else 1.0
        exp, man = (code >> mbits) & ((1 << ebits) - 1), code & ((1 << mbits) - 1)
        if exp == 0:
            mag = man / (1 << mbits) * 2.0 ** (1 - bias)
        else:
            mag = (1 + man / (1 << mbits)) * 2.0 ** (exp - bias)
        odd = special(exp, man, sign)
        values[code] = sign * mag if odd is None else odd
    return values


# E4M3: exponent 15 with mantissa 7 is NaN, nothing is infinite; E5M2: exponent 31 is IEEE inf/NaN.
E4M3 = _float_table(4, 3, 7, lambda e, m, s: np.nan if (e, m) == (15, 7) else None)
E5M2 = _float_table(5, 2, 15, lambda e, m, s: (s * np.inf if m == 0 else np.nan) if e == 31 else None)
E2M1 = _float_table(2, 1, 1, lambda e, m, s: None)
FORMATS = {  # x4 dtype -> (element table, bits, E_max, mantissa bits)
    "float8_e4m3fn_x4": (E4M3, 8, 8, 3),
    "float8_e5m2_x4": (E5M2, 8, 15, 2),
    "float4_e2m1fn_x4": (E2M1, 4, 2, 1),
}


def _round_to_code(x: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Nearest finite code (ties to the even code, i.e. the even mantissa), saturating."""
    half = len(table) // 2
    mags = table[:half]
    finite = np.flatnonzero(np.isfinite(mags))
    diffs = np.abs(np.abs(x)[..., None] - mags[finite])
    best = diffs.min(-1, keepdims=True)
    ties = diffs == best
    # among the nearest, prefer an even code; else the only one
    even = ties & (finite % 2 == 0)
    pick = np.where(even.any(-1), even.argmax(-1), ties.argmax(-1))
    return finite[pick] | np.where(np.signbit(x), half, 0)


def ref_quantize(x: np.ndarray, x4: str):
    """(element codes (P, F), scale codes (P/8, F/4)) of a float tile: per 8 x 4 group
    X = 2^(floor(log2 amax) - (E_max - 1)) (nki.isa.quantize_mx's rule), 2^-127 for zeros."""
    table, _, emax, _ = FORMATS[x4]
    p, f = x.shape
    groups = x.reshape(p // 8, 8, f // 4, 4)
    amax = np.abs(groups).max(axis=(1, 3))
    with np.errstate(divide="ignore"):
        exp = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - (emax - 1), -127)
    scale = np.clip(exp + 127, 0, 254).astype(np.int64)
    quotient = groups / (2.0 ** (scale - 127))[:, None, :, None]
    return _round_to_code(quotient, table).reshape(p, f), scale


def ref_dequantize(codes: np.ndarray, scale: np.ndarray, x4: str) -> np.ndarray:
    table = FORMATS[x4][0]
    p, f = codes.shape
    return (table[codes].reshape(p // 8, 8, f // 4, 4) * (2.0 ** (scale - 127))[:, None, :, None]).reshape(p, f)


def words_to_codes(words: torch.Tensor, x4: str) -> np.ndarray:
    """(P, W) packed words -> (P, 4W) codes; element j of a word in bits [j*b, (j+1)*b)."""
    bits = FORMATS[x4][1]
    w = words.to(torch.int64).numpy() & ((1 << (4 * bits)) - 1)
    codes = np.stack([(w >> (bits * j)) & ((1 << bits) - 1) for j in range(4)], axis=-1)
    return codes.reshape(w.shape[0], -1)


def codes_to_words(codes: np.ndarray, x4: str) -> np.ndarray:
    bits = FORMATS[x4][1]
    c = codes.reshape(codes.shape[0], -1, 4).astype(np.int64)
    return sum(c[..., j] << (bits * j) for j in range(4))


def spread_scales(contiguous: np.ndarray, partitions: int, offset: int = 0) -> np.ndarray:
    """The scale tile nc_matmul_mx reads: group g's row at quadrant g//4, partition offset + g%4
    (the layout of nki.isa.quantize_mx's docs), other partitions junk."""
    out = np.full((max(partitions, offset + contiguous.shape[0]), contiguous.shape[1]), 0xFF, dtype=np.int64)
    for grp in range(contiguous.shape[0]):
        out[grp // 4 * 32 + offset + grp % 4] = contiguous[grp]
    return out


def random_codes(shape, x4: str) -> np.ndarray:
    """Random element codes of a format, none NaN or infinite."""
    table = FORMATS[x4][0]
    finite = np.flatnonzero(np.isfinite(table))
    return finite[torch.randint(0, len(finite), shape, generator=g).numpy()]


# --- kernels ---------------------------------------------------------------------------------------
@nki.jit
def quantize_kernel(x, x4, scale_dtype):
    """quantize_mx of an HBM tile; returns the x4 words and the scale tile as stored on chip."""
    p, f = x.shape
    src = nl.ndarray(x.shape, x.dtype, nl.sbuf)
    nisa.dma_copy(dst=src, src=x)
    data = nl.ndarray((p, f // 4), x4, nl.sbuf)
    scale = nl.ndarray((p, f // 4), scale_dtype, nl.sbuf)
    nisa.memset(dst=scale.view(nl.uint8), value=0)
    nisa.quantize_mx(dst=data, src=src, dst_scale=scale)
    out_data = nl.ndarray(data.shape, nl.uint32, nl.shared_hbm)
    nisa.dma_copy(dst=out_data.view(x4), src=data)
    out_scale = nl.ndarray(scale.shape, nl.uint8, nl.shared_hbm)
    nisa.dma_copy(dst=out_scale, src=scale.view(nl.uint8))
    return out_data, out_scale


def _load_x4(words, x4):
    """An HBM uint tensor of packed words into SBUF as x4 data, viewed as the tutorial does
    (`.ap(dtype=...)` over the bytes)."""
    k = words.shape[0]
    w = words.shape[1] * words.dtype.itemsize // x4.itemsize
    t = nl.ndarray((k, w), x4, nl.sbuf)
    nisa.dma_copy(dst=t, src=words.ap(dtype=x4, pattern=[[w, k], [1, w]], offset=0))
    return t


def _load_scales(scale):
    s = nl.ndarray(scale.shape, nl.float8_e8m0fnu, nl.sbuf)
    nisa.dma_copy(dst=s.view(nl.uint8), src=scale)
    return s


@nki.jit
def matmul_kernel(st_words, st_x4, mv_words, mv_x4, st_scale, mv_scale, out_dtype, repeat=1):
    """nc_matmul_mx of loaded operands, `repeat` times into one PSUM tile."""
    st, mv = _load_x4(st_words, st_x4), _load_x4(mv_words, mv_x4)
    res = nl.ndarray((st.shape[1], mv.shape[1]), out_dtype, nl.psum)
    for _ in range(repeat):
        nisa.nc_matmul_mx(dst=res, stationary=st, moving=mv, stationary_scale=_load_scales(st_scale),
                          moving_scale=_load_scales(mv_scale))
    out = nl.ndarray(res.shape, nl.float32, nl.shared_hbm)
    sb = nl.ndarray(res.shape, nl.float32, nl.sbuf)
    nisa.tensor_copy(dst=sb, src=res)
    nisa.dma_copy(dst=out, src=sb)
    return out


def _x4(name):
    return getattr(nl, name)


def _word_tensor(codes: np.ndarray, x4: str) -> torch.Tensor:
    words = codes_to_words(codes, x4)
    if FORMATS[x4][1] == 4:  # two 16-bit words' bytes, as the tutorial packs FP4 (uint8 pairs)
        return torch.from_numpy(words.astype(np.uint16).view(np.uint8).copy())
    return torch.from_numpy(words.astype(np.uint32).copy())


# --- quantize_mx -------------------------------------------------------------------------------------
def _varied_tile(p, f, dtype):
    """Random values whose 8 x 4 groups span many binades, with one all-zero group, one group of
    float16-subnormal-sized values and exact ties between element codes."""
    x = torch.randn(p, f, generator=g, dtype=torch.float64)
    binade = torch.randint(-12, 12, (p // 8, f // 4), generator=g).to(torch.float64)
    x = x * (2.0 ** binade).repeat_interleave(8, 0).repeat_interleave(4, 1)
    x[0:8, 0:4] = 0.0
    x[8:16, 4:8] *= 2.0 ** -14
    x[16:24, 0:4] = torch.tensor([1.0, 1.0625, 3.0, -1.1875])  # 1.0625, 1.1875: halfway between E4M3 codes
    return x.to(dtype)


@pytest.mark.parametrize("x4", ["float8_e4m3fn_x4", "float8_e5m2_x4"])
@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float16])
def test_quantize_mx_matches_the_ocp_reference_with_nkis_doubled_scale(trn3, x4, src_dtype):
    x = _varied_tile(128, 64, src_dtype)
    words, scale_tile = quantize_kernel(x, _x4(x4), nl.float8_e8m0fnu)
    ref_codes, ref_scale = ref_quantize(x.double().numpy(), x4)
    scale_rows = [grp // 4 * 32 + grp % 4 for grp in range(16)]
    assert np.array_equal(scale_tile.numpy()[scale_rows].astype(np.int64), ref_scale)
    assert ref_scale[0, 0] == 0  # the all-zero group: 2^-127
    assert np.array_equal(words_to_codes(words, x4), ref_codes)
    unused = np.setdiff1d(np.arange(128), scale_rows)
    assert (scale_tile.numpy()[unused] == 0).all()  # quantize_mx wrote only the documented rows


@pytest.mark.parametrize("x4", ["float8_e4m3fn_x4", "float8_e5m2_x4"])
def test_quantize_then_dequantize_is_within_half_an_element_step_of_the_source(trn3, x4):
    x = _varied_tile(64, 128, torch.bfloat16)
    words, scale_tile = quantize_kernel(x, _x4(x4), nl.uint8)
    scale = scale_tile.numpy()[[0, 1, 2, 3, 32, 33, 34, 35]].astype(np.int64)
    back = ref_dequantize(words_to_codes(words, x4), scale, x4)
    src = x.double().numpy()
    mbits = FORMATS[x4][3]
    amax = np.abs(src).reshape(8, 8, 32, 4).max(axis=(1, 3)).repeat(8, 0).repeat(4, 1)
    # the doubled scale puts amax in the element's top binade [2^(E_max-1), 2^E_max): half a step
    # there is 2^-(mbits+1) of amax at most, and no element saturates
    assert (np.abs(back - src) <= amax * 2.0 ** -(mbits + 1)).all()
    assert np.array_equal(back, ref_dequantize(*ref_quantize(src, x4), x4))


def test_quantize_mx_marks_a_group_with_nan_or_infinity_with_the_nan_scale(trn3):
    x = torch.ones(32, 16, dtype=torch.bfloat16)
    x[3, 1] = float("nan")
    x[9, 12] = float("inf")
    words, scale_tile = quantize_kernel(x, nl.float8_e4m3fn_x4, nl.uint8)
    scales = scale_tile.numpy()[:4].astype(np.int64)
    assert scales[0, 0] == 0xFF and scales[1, 3] == 0xFF and scales[0, 1] == 127 - 7
    codes = words_to_codes(words, "float8_e4m3fn_x4")
    assert np.isnan(E4M3[codes[3, 1]]) and np.isnan(E4M3[codes[9, 12]]) and np.isnan(E4M3[codes[0, 0]])
    assert E4M3[codes[31, 15]] == 128.0  # 1.0 / X, X = 2^(0 - (8 - 1))


# --- nc_matmul_mx -------------------------------------------------------------------------------------
def _matmul_case(k, m, n, st_x4, mv_x4, offsets=(0, 0)):
    st_codes, mv_codes = random_codes((k, 4 * m), st_x4), random_codes((k, 4 * n), mv_x4)
    st_scale = torch.randint(118, 136, (k // 8, m), generator=g).numpy()
    mv_scale = torch.randint(118, 136, (k // 8, n), generator=g).numpy()
    # float64 reference: sum over partitions and the 4 elements of each word
    a = ref_dequantize(st_codes, st_scale, st_x4).reshape(k, m, 4)
    b = ref_dequantize(mv_codes, mv_scale, mv_x4).reshape(k, n, 4)
    expect = np.einsum("kiq,kjq->ij", a, b)
    args = (_word_tensor(st_codes, st_x4), _x4(st_x4), _word_tensor(mv_codes, mv_x4), _x4(mv_x4),
            torch.from_numpy(spread_scales(st_scale, k, offsets[0]).astype(np.uint8)),
            torch.from_numpy(spread_scales(mv_scale, k, offsets[1]).astype(np.uint8)))
    return args, expect


@pytest.mark.parametrize("st_x4, mv_x4", [
    ("float8_e4m3fn_x4", "float8_e4m3fn_x4"), ("float8_e5m2_x4", "float8_e4m3fn_x4"),
    ("float4_e2m1fn_x4", "float4_e2m1fn_x4"), ("float4_e2m1fn_x4", "float8_e5m2_x4")])
@pytest.mark.parametrize("k", [32, 128])
def test_nc_matmul_mx_is_a_float32_matmul_of_the_dequantized_operands(trn3, st_x4, mv_x4, k):
    args, expect = _matmul_case(k, 64, 96, st_x4, mv_x4)
    got = matmul_kernel(*args, nl.float32).double().numpy()
    np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-6 * np.abs(expect).max())


def test_nc_matmul_mx_accumulates_in_psum_and_rounds_once_to_a_bfloat16_dst(trn3):
    args, expect = _matmul_case(64, 32, 128, "float8_e4m3fn_x4", "float8_e5m2_x4")
    twice = matmul_kernel(*args, nl.float32, repeat=2).double().numpy()
    np.testing.assert_allclose(twice, 2 * expect, rtol=1e-5, atol=1e-6 * np.abs(expect).max())
    low = matmul_kernel(*args, nl.bfloat16)
    assert torch.equal(low, torch.from_numpy(expect).float().bfloat16().float())


def test_nc_matmul_mx_reads_scales_packed_at_an_offset_in_each_quadrant(trn3):
    args, expect = _matmul_case(128, 16, 16, "float8_e4m3fn_x4", "float8_e4m3fn_x4", offsets=(4, 12))
    st_words, st_x4, mv_words, mv_x4, st_scale, mv_scale = args

    @nki.jit
    def offset_scales(st_words, mv_words, st_scale, mv_scale):
        st, mv = _load_x4(st_words, st_x4), _load_x4(mv_words, mv_x4)
        sts, mvs = _load_scales(st_scale), _load_scales(mv_scale)
        res = nl.ndarray((16, 16), nl.float32, nl.psum)
        nisa.nc_matmul_mx(dst=res, stationary=st, moving=mv, stationary_scale=sts[4:, :],
                          moving_scale=mvs[12:, :])
        out = nl.ndarray(res.shape, nl.float32, nl.shared_hbm)
        sb = nl.ndarray(res.shape, nl.float32, nl.sbuf)
        nisa.tensor_copy(dst=sb, src=res)
        nisa.dma_copy(dst=out, src=sb)
        return out

    got = offset_scales(st_words, mv_words, st_scale, mv_scale).double().numpy()
    np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-6 * np.abs(expect).max())


# --- the tutorial's on-device pattern: strided copy, quantize_mx twice into one scale tile, matmul ----
@nki.jit
def copy_strided_quantize_matmul_mx_packed_scale(stationary_hbm, moving_hbm, mx_dtype):
    """After kernel_copy_strided_quantize_matmul_mx_packed_scale (aws-neuron-sdk,
    nki/deep-dives/src/mxfp-matmul/mx_kernels.py), written here: K=512 rows interleaved 128
    apart into x4 words by tensor_copy access patterns, both scales in one tile (offsets 0 and 4)."""
    k4, m = stationary_hbm.shape
    n = moving_hbm.shape[1]
    k = k4 // 4
    tiles = []
    for hbm, f in ((stationary_hbm, m), (moving_hbm, n)):
        staged = nl.ndarray((k, 4, f), hbm.dtype, nl.sbuf)
        nisa.dma_copy(dst=staged, src=hbm.reshape((4, k, f)).ap(pattern=[[f, k], [k * f, 4], [1, f]], offset=0))
        strided = nl.ndarray((k, f, 4), hbm.dtype, nl.sbuf)
        nisa.tensor_copy(dst=strided, src=staged.ap(pattern=[[4 * f, k], [1, f], [f, 4]], offset=0))
        tiles.append(strided.reshape((k, 4 * f)))
    packed_scale = nl.ndarray((k, n), nl.uint8, nl.sbuf)
    st_data, mv_data = nl.ndarray((k, m), mx_dtype, nl.sbuf), nl.ndarray((k, n), mx_dtype, nl.sbuf)
    st_scale, mv_scale = packed_scale[0:, :m], packed_scale[4:, :]
    nisa.quantize_mx(dst=st_data, src=tiles[0], dst_scale=st_scale)
    nisa.quantize_mx(dst=mv_data, src=tiles[1], dst_scale=mv_scale)
    res = nl.ndarray((m, n), nl.bfloat16, nl.psum)
    nisa.nc_matmul_mx(dst=res, stationary=st_data, moving=mv_data, stationary_scale=st_scale, moving_scale=mv_scale)
    sb = nl.ndarray((m, n), nl.bfloat16, nl.sbuf)
    nisa.tensor_copy(dst=sb, src=res)
    out = nl.ndarray((m, n), nl.bfloat16, nl.shared_hbm)
    nisa.dma_copy(dst=out, src=sb)
    return out


@pytest.mark.parametrize("x4", ["float8_e4m3fn_x4", "float8_e5m2_x4"])
def test_the_tutorials_quantize_then_matmul_kernel_gives_the_mx_product(trn3, x4):
    x = torch.randn(512, 128, generator=g).bfloat16()  # (K, M): K is the contraction
    y = torch.randn(512, 256, generator=g).bfloat16()
    got = copy_strided_quantize_matmul_mx_packed_scale(x, y, _x4(x4)).double().numpy()

    def interleaved(t):  # the SBUF layout: partition p, word w holds K rows p, p+128, p+256, p+384
        return t.double().numpy().reshape(4, 128, -1).transpose(1, 2, 0).reshape(128, -1)

    a, b = interleaved(x), interleaved(y)
    qa, qb = ref_dequantize(*ref_quantize(a, x4), x4), ref_dequantize(*ref_quantize(b, x4), x4)
    expect = qa.reshape(128, -1, 4).transpose(0, 2, 1).reshape(512, -1).T @ \
        qb.reshape(128, -1, 4).transpose(0, 2, 1).reshape(512, -1)
    np.testing.assert_allclose(got, expect, rtol=2 ** -8, atol=2 ** -8 * np.abs(expect).max())
    exact = (x.double().T @ y.double()).numpy()  # and the MX product is close to the exact one
    assert np.abs(got - exact).max() < 0.1 * np.abs(exact).max()


# --- limits and targets -------------------------------------------------------------------------------
@nki.jit
def in_kernel(x, body):
    """Run body() as a kernel: the target is resolved per launch (the interactive program outside
    kernels keeps the target of the first instruction the thread ran)."""
    body()


def _tiles(k=32, m=16, n=16, x4=nl.float8_e4m3fn_x4, scale_p=None, scale_dtype=nl.uint8):
    st, mv = nl.ndarray((k, m), x4, nl.sbuf), nl.ndarray((k, n), x4, nl.sbuf)
    sp = scale_p or k
    return st, mv, nl.ndarray((sp, m), scale_dtype, nl.sbuf), nl.ndarray((sp, n), scale_dtype, nl.sbuf)


@pytest.mark.parametrize("change, message", [
    (dict(k=48), "stationary partition dimension 48 must be a multiple of 32"),
    (dict(m=15), "stationary free size 15 must be even"),
    (dict(m=130), "stationary free size 130 must be even and at most 128"),
    (dict(n=4100), "moving free size 4100 exceeds maximum 4096 for a float32 dst"),
    (dict(k=64, scale_p=32), "stationary_scale needs at least 36 partitions for a stationary of 64"),
    (dict(scale_dtype=nl.bfloat16), "stationary_scale must be float8_e8m0fnu or uint8, got bfloat16"),
    (dict(x4=nl.float8_e4m3fn), "stationary must be float8_e4m3fn_x4 or float8_e5m2_x4 or float4_e2m1fn_x4"),
])
def test_nc_matmul_mx_limits(trn3, change, message):
    def body():
        st, mv, sts, mvs = _tiles(**change)
        dst = nl.ndarray((min(st.shape[1], 128), 16), nl.float32, nl.psum)  # moving's limit is checked first
        nisa.nc_matmul_mx(dst=dst, stationary=st, moving=mv, stationary_scale=sts, moving_scale=mvs)

    with pytest.raises(nisa.NkiValidationError, match=message):
        in_kernel(torch.zeros(1), body)


def _matmul_64(**kw):
    """A legal nc_matmul_mx (K=64, two quadrants) with the operands in kw changed."""
    st, mv, sts, mvs = _tiles(k=64)
    args = dict(dst=nl.ndarray((16, 16), nl.float32, nl.psum), stationary=st, moving=mv,
                stationary_scale=sts, moving_scale=mvs)
    return lambda: nisa.nc_matmul_mx(**(args | {k: v(args) if callable(v) else v for k, v in kw.items()}))


@pytest.mark.parametrize("change, message", [
    (dict(stationary_scale=lambda a: a["stationary_scale"][2:, :]),
     "stationary_scale must start at partition 0, 4, 8 or 12"),
    (dict(moving_scale=lambda a: a["moving_scale"][:, :8]), "moving_scale holds one scale per moving x4 word"),
    (dict(tile_position=(0, 64), tile_size=(64, 64)), "row tiling only"),
    (dict(tile_position=(32, 0), tile_size=(32, 128)),
     "stationary partition dimension 64 must be a multiple of 32 and at most 32"),
    (dict(tile_position=(0, 0)), "tile_position and tile_size must both be set"),
    (dict(dst=lambda a: nl.ndarray((16, 16), nl.float32, nl.sbuf)), "dst must be in nl.psum"),
    (dict(dst=lambda a: nl.ndarray((16, 8), nl.float32, nl.psum)), "dst must be 16 x 16"),
    (dict(dst=lambda a: nl.ndarray((16, 16), nl.float16, nl.psum)), "dst must be float32 or bfloat16, got float16"),
])
def test_nc_matmul_mx_scale_placement_tiling_and_memories(trn3, change, message):
    with pytest.raises(nisa.NkiValidationError, match=message):
        in_kernel(torch.zeros(1), lambda: _matmul_64(**change)())


@pytest.mark.parametrize("change, message", [
    (lambda t: dict(src=nl.ndarray((64, 32), nl.float32, nl.sbuf)),
     "quantize_mx src must be float16 or bfloat16, got float32"),
    (lambda t: dict(dst=nl.ndarray((64, 8), nl.float4_e2m1fn_x4, nl.sbuf)),
     "dst must be float8_e4m3fn_x4 or float8_e5m2_x4, got float4_e2m1fn_x4"),
    (lambda t: dict(src=t["src"][:48, :], dst=t["dst"][:48, :]), "src partition dimension 48 must be a multiple of 32"),
    (lambda t: dict(src=t["src"][8:40, :], dst=t["dst"][8:40, :]), "src must start on an SBUF quadrant boundary"),
    (lambda t: dict(src=t["src"][32:, :], dst=t["dst"][32:, :]),
     r"dst_scale must start at partition 0, 4, 8 or 12 of dst's SBUF quadrant \(partition 32\), starts at 0"),
    (lambda t: dict(src=t["src"][:, :30]), "src free size 30 must be a multiple of 4"),
    (lambda t: dict(dst=t["dst"][:, :4]), r"dst must be 64 x 8 x4 words"),
    (lambda t: dict(dst_scale=t["dst_scale"][:, :4]),
     "dst_scale holds one scale per dst x4 word per partition: 8, got 4"),
    (lambda t: dict(dst_scale=t["dst_scale"][:16, :]), "dst_scale needs at least 36 partitions"),
    (lambda t: dict(src=nl.ndarray((64, 32), nl.bfloat16, nl.psum)), "src must be in nl.sbuf"),
])
def test_quantize_mx_limits(trn3, change, message):
    def body():
        src = nl.ndarray((64, 32), nl.bfloat16, nl.sbuf)
        nisa.memset(dst=src, value=1.0)
        tiles = dict(dst=nl.ndarray((64, 8), nl.float8_e5m2_x4, nl.sbuf), src=src,
                     dst_scale=nl.ndarray((64, 8), nl.uint8, nl.sbuf))
        nisa.quantize_mx(**(tiles | change(tiles)))

    with pytest.raises(nisa.NkiValidationError, match=message):
        in_kernel(torch.zeros(1), body)


def test_trn2_has_no_mx_instructions(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    with pytest.raises(nisa.NkiValidationError, match="nc_matmul_mx is available only on NeuronCore-v4 and newer "
                                                      r"\(trn3\); the target is trn2"):
        in_kernel(torch.zeros(1), _matmul_64())

    def quantize():
        st, mv, sts, mvs = _tiles()
        nisa.quantize_mx(dst=mv, src=nl.ndarray((32, 64), nl.bfloat16, nl.sbuf), dst_scale=mvs)

    with pytest.raises(nisa.NkiValidationError, match="quantize_mx is available only on NeuronCore-v4"):
        in_kernel(torch.zeros(1), quantize)


# --- price ----------------------------------------------------------------------------------------------
@nki.jit
def one_of_each(x, n):
    src = nl.ndarray((128, 4 * n), nl.bfloat16, nl.sbuf)
    nisa.memset(dst=src, value=1.0)
    data, scale = nl.ndarray((128, n), nl.float8_e4m3fn_x4, nl.sbuf), nl.ndarray((128, n), nl.uint8, nl.sbuf)
    nisa.quantize_mx(dst=data, src=src, dst_scale=scale)
    res = nl.ndarray((128, n), nl.float32, nl.psum)
    nisa.nc_matmul_mx(dst=res, stationary=data[:, :128], moving=data, stationary_scale=scale[:, :128],
                      moving_scale=scale)
    bf = nl.ndarray((128, n), nl.bfloat16, nl.sbuf)
    nisa.memset(dst=bf, value=1.0)
    res2 = nl.ndarray((128, n), nl.float32, nl.psum)
    nisa.nc_matmul(dst=res2, stationary=bf[:, :128], moving=bf)


def test_an_mx_matmul_costs_a_bf16_matmul_of_a_quarter_of_the_contraction_and_quantize_runs_4_wide(trn3):
    prof = nki.profile(one_of_each, torch.zeros(1), 512)
    ns = {i.name: i.ns for i in prof.timeline.instrs if i.name in ("quantize_mx", "nc_matmul_mx", "nc_matmul")}
    assert ns["nc_matmul_mx"] == pytest.approx(512 / 2.4)  # one x4 word (4 contraction elements) per cycle
    assert ns["nc_matmul_mx"] == pytest.approx(ns["nc_matmul"])  # 4x a bf16 matmul's work in its time
    assert ns["quantize_mx"] == pytest.approx(4 * 512 / 4 / 1.2)  # four elements per partition per Vector cycle
