"""Python's operators on the old dialect's tiles (Note [Operators on tiles] in tensor.py).

`a + b`, `a * 2.0`, `-a`, `a < b` are nl.add, nl.multiply, nl.negative, nl.less. `t += x`
writes the result back into t, which stays the same tile: the old tutorials accumulate a
matmul so (`res_psum += nisa.nc_matmul(a, b)`), which the chip runs as the matmul accumulating
into res_psum. Here the matmul has already written its own PSUM tile, and the Vector Engine
cannot read two PSUM tiles at once, so that one is evicted to SBUF and added: one copy and one
add more in the modelled time than the chip's accumulation. Binary functions broadcast a
one-partition tile across the other's partitions (across_partitions), as the old dialect did.
"""
from __future__ import annotations

from .. import language as _nl
from .. import ops as _ops
from ..tensor import PSUM, NkiTensor


def apply(name: str, operands: tuple, in_place: bool):
    op = _ops.by_name(name)
    if not in_place:
        return op(*operands)
    tile, other = operands
    if isinstance(other, NkiTensor) and tile.buffer == PSUM and other.buffer == PSUM:
        other = _ops.by_name("copy")(other)  # nl.copy: to SBUF
    tile[...] = op(tile, other)
    return tile


def across_partitions(x, y) -> tuple:
    """nl.add(a, b) with b of one partition and a of many (the old docs' "broadcast on
    partition dimension"): b copied to every partition first, by a DMA (nl.broadcast_to), as
    no compute engine reads one partition for all."""
    if isinstance(x, NkiTensor) and isinstance(y, NkiTensor) and x.ndim == y.ndim:
        if x.partitions == 1 < y.partitions:
            x = _nl.broadcast_to(x, (y.partitions,) + x.shape[1:])
        elif y.partitions == 1 < x.partitions:
            y = _nl.broadcast_to(y, (x.partitions,) + y.shape[1:])
    return x, y
