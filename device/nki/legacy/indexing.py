"""neuronxcc.nki's index expressions: `nl.arange`, `nl.mgrid`, and a tensor indexed by them.

In the old dialect a tile is addressed by affine expressions of index ranges, numpy style:
`i_p = nl.arange(128)[:, None]` is a range of 128 values placed on dim 0 of a 2-D result,
`i_f = nl.arange(512)[None, :]` one on dim 1, and `a[i_p + 128 * i, i_f]` (or, with three
ranges, `t[i_p, i_f1 * 4 + i_f2]`) is the strided view whose element (p, f) is
a[p + 128 * i, f]. Every expression here is affine (a constant plus a coefficient times each
range), so the view is exact: one stride per result dim, the sum over the indexed dims of the
coefficient times that dim's stride. Comparisons make predicates (`i_p < 64`, `i_q >= i_k`):
one that bounds a single range is a mask (masking.py applies it), any is affine_select's.
"""
from __future__ import annotations

from ..errors import NkiValidationError
from ..tensor import DynamicSlice, NkiTensor


class Range:
    """One index range: values 0..n-1, on dim `pos` of a `rank`-D result (None: not placed)."""

    __slots__ = ("n", "pos", "rank")

    def __init__(self, n: int, pos: int | None, rank: int):
        self.n, self.pos, self.rank = n, pos, rank

    def __repr__(self):
        return f"range({self.n}) on dim {self.pos} of {self.rank}"


class Affine:
    """const + sum(coef * range): an index expression of the old dialect."""

    nki_affine = True  # NkiTensor.__getitem__ hands keys holding one of these to resolve()
    __slots__ = ("terms", "const")

    def __init__(self, terms: dict, const: int = 0):
        self.terms = {r: c for r, c in terms.items() if c != 0}
        self.const = const

    # --- placement: nl.arange(n)[:, None] ---------------------------------------------------
    def __getitem__(self, key) -> Affine:
        key = key if isinstance(key, tuple) else (key,)
        slots = [i for i, k in enumerate(key) if isinstance(k, slice) and k == slice(None)]
        if len(self.terms) != 1 or len(slots) != 1 or len(slots) + key.count(None) != len(key):
            raise NkiValidationError(
                f"an index range is placed with one ':' and Nones (nl.arange(n)[:, None] or [None, :]), got {key!r}")
        (old, coef), = self.terms.items()
        return Affine({Range(old.n, slots[0], len(key)): coef}, self.const)

    # --- arithmetic: integers and other expressions --------------------------------------------
    def __add__(self, other):
        if isinstance(other, Affine):
            terms = dict(self.terms)
            for r, c in other.terms.items():
                terms[r] = terms.get(r, 0) + c
            return Affine(terms, self.const + other.const)
        return Affine(self.terms, self.const + _int(other, "+"))

    __radd__ = __add__

    def __neg__(self):
        return Affine({r: -c for r, c in self.terms.items()}, -self.const)

    def __sub__(self, other):
        return self + (-other if isinstance(other, Affine) else -_int(other, "-"))

    def __rsub__(self, other):
        return (-self) + _int(other, "-")

    def __mul__(self, other):
        if isinstance(other, Affine):
            raise NkiValidationError("an index expression times another is not affine: multiply ranges by ints only")
        k = _int(other, "*")
        return Affine({r: c * k for r, c in self.terms.items()}, self.const * k)

    __rmul__ = __mul__

    # --- predicates: i_p < 64, i_q >= i_k ----------------------------------------------------------
    # Each comparison is normalized to `expr < limit`; Python turns `64 > i_p` into `i_p < 64`.
    def __lt__(self, other):
        return Predicate(self - other, 0) if isinstance(other, Affine) else Predicate(self, _int(other, "<"))

    def __le__(self, other):
        return Predicate(self - other, 1) if isinstance(other, Affine) else Predicate(self, _int(other, "<=") + 1)

    def __gt__(self, other):
        return Predicate(other - self, 0) if isinstance(other, Affine) else Predicate(-self, -_int(other, ">"))

    def __ge__(self, other):
        return Predicate(other - self, 1) if isinstance(other, Affine) else Predicate(-self, 1 - _int(other, ">="))

    def extent(self, ranges=None) -> tuple[int, int]:
        """The smallest and largest value, over each range's [lo, hi) (whole by default)."""
        lo = hi = self.const
        for r, c in self.terms.items():
            a, b = (ranges or {}).get(r, (0, r.n))
            lo, hi = lo + min(c * a, c * (b - 1)), hi + max(c * a, c * (b - 1))
        return lo, hi

    def __repr__(self):
        return " + ".join([f"{c}*{r}" for r, c in self.terms.items()] + [str(self.const)])


class Predicate:
    """`expr < limit` at every point of expr's ranges: a mask (when it bounds one range) or
    nisa.affine_select's predicate (any affine expression)."""

    def __init__(self, expr: Affine, limit: int):
        self.expr, self.limit = expr, limit

    def mask(self) -> Mask:
        return _bound(self.expr, self.limit)

    def __and__(self, other):
        return self.mask() & other

    def __rand__(self, other):
        return self.mask() & other


class Mask:
    """A conjunction of bounds, one [lo, hi) per range (`(i_p < 64) & (i_f < 256)`)."""

    def __init__(self, bounds: dict):
        self.bounds = bounds

    def __and__(self, other):
        other = other.mask() if isinstance(other, Predicate) else other
        if not isinstance(other, Mask):
            raise NkiValidationError(f"a mask combines with another mask by '&', got {type(other).__name__}")
        bounds = dict(self.bounds)
        for r, (lo, hi) in other.bounds.items():
            a, b = bounds.get(r, (0, r.n))
            bounds[r] = (max(a, lo), min(b, hi))
        return Mask(bounds)

    def by_dim(self) -> dict[int, tuple[int, int]]:
        """Result dim -> the [lo, hi) the mask keeps of it."""
        return {r.pos if r.pos is not None else 0: b for r, b in self.bounds.items()}


def _bound(expr: Affine, limit: int) -> Mask:
    """expr < limit, as a bound on its one range."""
    if len(expr.terms) != 1:
        raise NkiValidationError(f"a mask bounds one index range (i_p < 64, i * 128 + i_p < n), got {expr!r}")
    (r, c), = expr.terms.items()
    # c * v + const < limit
    if c > 0:
        return Mask({r: (0, max(0, min(r.n, -(-(limit - expr.const) // c))))})
    # c < 0: v > (limit - const) / c, so v >= floor((limit - const) / c) + 1
    return Mask({r: (max(0, (limit - expr.const) // c + 1), r.n)})


def _int(x, what: str) -> int:
    try:
        return int(x)
    except TypeError:
        raise NkiValidationError(f"an index expression takes ints in '{what}', got {type(x).__name__}") from None


def arange(*args) -> Affine:
    """nl.arange(stop) or nl.arange(start, stop): a range of indices (place it with [:, None])."""
    if len(args) not in (1, 2):
        raise NkiValidationError(f"nl.arange(stop) or nl.arange(start, stop), got {len(args)} arguments")
    start, stop = (0, args[0]) if len(args) == 1 else args
    start, stop = int(start), int(stop)
    if stop <= start:
        raise NkiValidationError(f"nl.arange({start}, {stop}) is empty: stop must exceed start")
    return Affine({Range(stop - start, None, 1): 1}, start)


class _MGrid:
    """nl.mgrid[0:128, 0:512]: one placed range per slice (numpy's mgrid)."""

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        out = []
        for d, k in enumerate(key):
            if not isinstance(k, slice) or k.stop is None or k.step not in (None, 1):
                raise NkiValidationError(f"nl.mgrid takes start:stop slices (step 1), got {k!r} at dim {d}")
            start = 0 if k.start is None else int(k.start)
            if k.stop <= start:
                raise NkiValidationError(f"nl.mgrid slice {start}:{k.stop} at dim {d} is empty")
            out.append(Affine({Range(int(k.stop) - start, d, len(key)): 1}, start))
        return out[0] if len(out) == 1 else Grid(out)


class Grid(tuple):
    """nl.mgrid's result: unpacks as a tuple (i_p, i_f = nl.mgrid[...]) or names its ranges
    (grid.p, then grid.x, grid.y, grid.z for the free dims)."""

    p = property(lambda self: self[0])
    x = property(lambda self: self._free(1))
    y = property(lambda self: self._free(2))
    z = property(lambda self: self._free(3))

    def _free(self, d: int):
        if d >= len(self):
            raise NkiValidationError(f"this nl.mgrid has {len(self)} dims: no range {'pxyz'[d]!r}")
        return self[d]


mgrid = _MGrid()


class PendingAccess:
    """A view whose index reaches outside its tensor: usable only under a mask that keeps it
    inside (`nl.load(a[i * 128 + i_p, i_f], mask=(i * 128 + i_p < n))`), as on the chip,
    where the out-of-bounds elements are simply not accessed."""

    __slots__ = ("tensor", "key", "problem", "shape", "dtype")

    def __init__(self, tensor: NkiTensor, key: tuple, problem: str, shape: tuple):
        self.tensor, self.key, self.problem, self.shape, self.dtype = tensor, key, problem, shape, tensor.dtype

    def under(self, bounds: dict[int, tuple[int, int]]) -> NkiTensor:
        """The view with each result dim cut to a mask's bounds; raises if still outside."""
        return resolve(self.tensor, self.key, bounds)

    def __getattr__(self, name):
        raise NkiValidationError(self.problem)


def resolve(t: NkiTensor, key: tuple, bounds=None, strict: bool = False):
    """t[key] for a key holding index expressions: an exact strided view, or (not strict, out
    of bounds) a PendingAccess for a masked instruction to cut down."""
    indirect = bool(key) and isinstance(key[0], NkiTensor)
    if indirect:  # a[idx_tile, i_f]: row p of the result is row idx_tile[p] of a (a vector-offset DMA)
        t, key = _indirect_rows(t, key)
    key = tuple(_as_affine(k, d, t) for d, k in enumerate(key))
    if len(key) > t.ndim:
        raise NkiValidationError(f"too many indices for tensor {t.name!r} of shape {t.shape}: {len(key)}")
    rank = max([r.rank for k in key for r in k.terms] + [0])
    key = _place_slices(key + tuple(slice(None) for _ in range(t.ndim - len(key))), t, rank)
    rank = max([r.rank for k in key for r in k.terms] + [1])
    by_pos: dict[int, Range] = {}
    for k in key:
        for r in k.terms:
            if by_pos.setdefault(r.pos, r) is not r:
                raise NkiValidationError(
                    f"index of {t.name!r}: two different ranges are placed on dim {r.pos} of the result; "
                    f"place each range on a dim of its own ([:, None], [None, :])")
    cut = {r: (bounds or {}).get(pos, (0, r.n)) for pos, r in by_pos.items()}
    cut = {r: (max(0, lo), min(r.n, hi)) for r, (lo, hi) in cut.items()}
    if t.on_chip:
        _check_partition_index(t, key)
    shape, strides = [1] * rank, [0] * rank
    offset = t.offset
    for d, k in enumerate(key):
        offset += k.const * t.strides[d]
        for r, c in k.terms.items():
            strides[r.pos] += c * t.strides[d]
    for pos, r in by_pos.items():
        lo, hi = cut[r]
        shape[pos] = hi - lo
        offset += lo * strides[pos]
    for d, k in enumerate(key):
        if d == 0 and indirect:  # the rows are read at run time, and checked by the DMA then
            continue
        low, high = k.extent(cut)
        if low < 0 or high >= t.shape[d] or any(n <= 0 for n in shape):
            problem = (f"index of dim {d} of {t.name or 'tensor'!r} {t.shape} reaches [{low}, {high}], outside "
                       f"[0, {t.shape[d]}): keep it inside, or give the instruction a mask= that does")
            if strict or any(n <= 0 for n in shape):
                raise NkiValidationError(problem)
            full = tuple(by_pos[p].n if p in by_pos else 1 for p in range(rank))
            return PendingAccess(t, key, problem, full)
    return t._view(shape, strides, offset)


def _indirect_rows(t: NkiTensor, key: tuple):
    """t[idx_tile, ...] as nki's t.vector_select(0, idx_tile), with dim 0 of the result the
    index tile's partitions (a vector offset replaces dim 0's stride)."""
    idx = key[0]
    if t.on_chip or not idx.on_chip:
        raise NkiValidationError(f"an index tile selects rows of an HBM tensor by an SBUF tile of row numbers; got "
                                 f"{idx.describe()} indexing {t.describe()}")
    if idx.free_size != 1:
        raise NkiValidationError(f"an index tile gives one row number per partition: shape (n, 1), got {idx.shape}")
    rank = max([r.rank for k in key[1:] if isinstance(k, Affine) for r in k.terms] + [2])
    rows = Affine({Range(idx.partitions, 0, rank): 1}, 0)
    return t.vector_select(0, idx), (rows,) + tuple(key[1:])


def _as_affine(k, d: int, t: NkiTensor):
    if isinstance(k, Affine) or isinstance(k, slice):
        return k
    if isinstance(k, DynamicSlice):
        return slice(k.start, k.start + k.size)
    if isinstance(k, NkiTensor) or k is Ellipsis or k is None:
        raise NkiValidationError(f"index {d} of {t.name!r}: an index with nl.arange/mgrid ranges takes ints, "
                                 f"slices and range expressions, got {k!r}")
    return Affine({}, int(k))


def _place_slices(key, t: NkiTensor, rank: int):
    """Slices beside ranges become ranges of their own, after the ranges' dims (numpy's rule
    for basic indices beside advanced ones)."""
    out, extra = [], [k for k in key if isinstance(k, slice)]
    total = rank + len(extra)
    for d, k in enumerate(key):
        if isinstance(k, slice):
            start, stop, step = k.indices(t.shape[d])
            n = len(range(start, stop, step))
            if n <= 0 or step < 1:
                raise NkiValidationError(f"slice {k} of dim {d} of {t.name!r} {t.shape} is empty or steps back")
            out.append(Affine({Range(n, rank, total): step}, start))
            rank += 1
        else:
            out.append(k)
    return tuple(out)


def _check_partition_index(t: NkiTensor, key) -> None:
    """On chip, dim 0 (the partitions) is indexed by the result's dim 0 alone."""
    first = [r for r in key[0].terms]
    rest = [r for k in key[1:] for r in k.terms]
    if any(r.pos != 0 for r in first) or any(r.pos == 0 for r in rest):
        raise NkiValidationError(
            f"on-chip tile {t.name!r} {t.shape}: its partition dim (dim 0) must be indexed by the result's first "
            f"dim alone (e.g. t[nl.arange(n)[:, None], nl.arange(m)[None, :]]); moving data across partitions "
            f"takes nc_transpose or a DMA")

