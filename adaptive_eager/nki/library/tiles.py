"""Helpers the library's kernels share: row tiles, loads, zero tiles, casts and transposes.

They are NKI code (inlined into each kernel at its call, as all NKI functions are); each
PSUM tile they use lives only inside them (PSUM has 8 banks: Note [On-chip capacity])."""
from __future__ import annotations

import adaptive_eager.nki.isa as nisa
import adaptive_eager.nki.language as nl

P = 128
LOWEST = -3.4028234663852886e38  # float32's lowest finite value: exp of it minus a max is 0, never NaN


def row_tiles(n: int, size: int = P) -> list[tuple[int, int]]:
    """(start, rows) of each tile of `size` rows covering n (the last may be short)."""
    return [(i * size, min(size, n - i * size)) for i in range((n + size - 1) // size)]


def load(src, dtype=None):
    """A new SBUF tile holding src, by DMA (converting to dtype if given)."""
    tile = nl.ndarray(src.shape, dtype=dtype or src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=src)
    return tile


def zeros(shape):
    t = nl.ndarray(shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=t, value=0.0)
    return t


def cast(tile, dtype):
    out = nl.ndarray(tile.shape, dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=out, src=tile)
    return out


def transposed(tile, dtype):
    """tile (p, f) in SBUF -> its transpose (f, p) in SBUF, in `dtype`, via the Tensor Engine."""
    p, f = tile.shape
    t_psum = nl.ndarray((f, p), dtype=tile.dtype, buffer=nl.psum)
    nisa.nc_transpose(dst=t_psum, data=tile)
    return cast(t_psum, dtype)
