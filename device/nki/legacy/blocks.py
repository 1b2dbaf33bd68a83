"""neuronxcc.nki's block dimensions: `nl.ndarray((B, nl.par_dim(P), F), buffer=nl.sbuf)`.

Dims before the partition dim are blocks: the tensor is B tiles of (P, F), `t[b]` is one of
them and `t[b, i_p, i_f]` indexes into it (the NKI migration guide's "What are block
dimensions?"). NKI 0.2 removed them; the old dialect's kernels (nki-samples' tutorials) use
them throughout, so here a block tensor is a list of tiles, each its own allocation. The
compiler could give two blocks one address when their lifetimes do not overlap; here every
block holds its bytes while the tensor lives, which charges SBUF more than the chip would.
"""
from __future__ import annotations

import math

from ..errors import NkiValidationError
from ..tensor import NkiTensor


class BlockTensor:
    """B1 x B2 x ... tiles of one shape; indexed by ints on the block dims first."""

    def __init__(self, blocks: tuple[int, ...], tiles: list[NkiTensor]):
        self.blocks = blocks
        self.tiles = tiles

    @property
    def shape(self) -> tuple[int, ...]:
        return self.blocks + self.tiles[0].shape

    @property
    def dtype(self):
        return self.tiles[0].dtype

    @property
    def buffer(self):
        return self.tiles[0].buffer

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def _tile(self, key: tuple) -> NkiTensor:
        if len(key) < len(self.blocks) or any(k is Ellipsis or isinstance(k, slice) for k in key[:len(self.blocks)]):
            raise NkiValidationError(
                f"block tensor {self.shape} (blocks {self.blocks}): index its block dims with ints first "
                f"(t[b] or t[b, i_p, i_f]), got {key!r}; a view across blocks is not a tile")
        flat = 0
        for k, n in zip(key, self.blocks):
            i = int(k)
            if not 0 <= i < n:
                raise NkiValidationError(f"block index {i} is out of range [0, {n}) of block tensor {self.shape}")
            flat = flat * n + i
        return self.tiles[flat]

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        if len(key) < len(self.blocks) and all(isinstance(k, int) for k in key):
            return self._sub_blocks(key)  # t[b] of a (B1, B2, P, F) tensor: B2 tiles
        tile = self._tile(key)
        rest = key[len(self.blocks):]
        return tile[rest] if rest else tile

    def _sub_blocks(self, key: tuple) -> BlockTensor:
        inner = self.blocks[len(key):]
        first = self._tile(key + (0,) * len(inner))
        start = self.tiles.index(first)
        return BlockTensor(inner, self.tiles[start:start + math.prod(inner)])

    def __setitem__(self, key, value):
        key = key if isinstance(key, tuple) else (key,)
        tile = self._tile(key)
        rest = key[len(self.blocks):]
        tile[rest if rest else (Ellipsis,)] = value

    def __repr__(self):
        return f"BlockTensor(blocks={self.blocks}, tile={self.tiles[0].describe()})"


def allocate(blocks: tuple[int, ...], make_tile) -> BlockTensor:
    """A block tensor of math.prod(blocks) tiles, each make_tile(b) for b in order."""
    return BlockTensor(blocks, [make_tile(b) for b in range(math.prod(blocks))])
