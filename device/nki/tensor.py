"""NkiTensor: a strided view (shape, strides, offset, dtype) on one storage in HBM, SBUF or PSUM.

As in NKI, a view never copies: indexing, `slice`, `reshape`, `permute`, `ap` and the rest
compute a new (shape, strides, offset) over the same storage, and an instruction reads or
writes exactly the elements the view addresses. A storage's bytes are a flat host tensor; an
on-chip storage of shape (P, f1, f2, ...) has partition stride f1*f2*... (partitions are
independent memories, so the partition dimension is always dim 0 of an on-chip view).
"""
from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import torch

from . import dtypes as dt
from .errors import NkiValidationError

class MemoryRegion(str):
    """A memory's name, as NKI spells it (nl.sbuf == "sbuf")."""

    def __repr__(self):
        return f"nl.{str(self)}"


SBUF, PSUM = MemoryRegion("sbuf"), MemoryRegion("psum")
PRIVATE_HBM, SHARED_HBM = MemoryRegion("private_hbm"), MemoryRegion("shared_hbm")
REGIONS = {r: r for r in (SBUF, PSUM, PRIVATE_HBM, SHARED_HBM)}
ON_CHIP = (SBUF, PSUM)


class Storage:
    """The memory behind one allocation (or one framework tensor handed to a kernel)."""

    __slots__ = ("data", "dtype", "buffer", "shape", "name", "acc", "serial", "pstride", "row", "__weakref__")
    _serials = itertools.count()

    def __init__(self, data: torch.Tensor, dtype: dt.NkiDType, buffer: str, shape: tuple[int, ...], name: str,
                 row: int | None = None):
        self.data = data  # flat, dtype.storage
        self.dtype = dtype
        self.buffer = REGIONS[buffer]
        self.shape = shape  # as allocated: strides of the base tensor
        self.name = name
        # PSUM only: which elements hold a matmul accumulation still open (Note [PSUM accumulation])
        self.acc: torch.Tensor | None = None
        # names the storage in a timeline, which must not keep it alive (an id() could be reused)
        self.serial = next(Storage._serials)
        # elements from one partition to the next, as NKI's views count them: the free size
        self.pstride = math.prod(shape[1:])
        # ... and in `data`: a whole partition's row of the physical memory for a tile placed at
        # an address (program.py, Note [Placed tiles]), else the same
        self.row = self.pstride if row is None else row

    @property
    def partition_stride(self) -> int:
        return self.pstride

    @property
    def placed(self) -> bool:
        return self.row != self.pstride

    def physical(self, strides, offset: int, scale: float = 1.0):
        """A placed tile's strides and offset in `data` for a view's (whose dim 0 moves whole
        partitions): partitions are `row` elements apart there, not the free size."""
        free, row = int(self.pstride * scale), int(self.row * scale)
        if strides and strides[0] % free:
            raise NkiValidationError(f"a view of placed tile {self.name!r} must step whole partitions in dim 0")
        p, rest = divmod(offset, free)
        return ((strides[0] // free * row,) + tuple(strides[1:]) if strides else ()), p * row + rest

    def physical_index(self, index: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        free, row = int(self.pstride * scale), int(self.row * scale)
        return index // free * row + index % free


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


class DynamicSlice:
    """`nl.ds(start, size)`: the slice start:start+size."""

    __slots__ = ("start", "size")

    def __init__(self, start, size):
        self.start, self.size = start, size

    def __repr__(self):
        return f"nl.ds({self.start}, {self.size})"


# Note [Old tensor methods]: the names legacy/tensor_methods.py gives tiles in neuronxcc kernels
_OLD_TENSOR_METHODS = frozenset({"broadcast_to", "astype", "expand_dims", "assert_shape", "itemsize"})


class NkiTensor:
    """A view on a Storage. See the NKI language guide, "Tensor Values"."""

    __slots__ = ("storage", "shape", "strides", "offset", "dtype", "name", "dynamic", "predicate")

    def __init__(self, shape, dtype, storage, buffer=SBUF, name: str = "", *, strides=None, offset: int = 0,
                 dynamic=None):
        self.storage: Storage = storage
        self.shape = tuple(int(s) for s in shape)
        self.strides = tuple(strides) if strides is not None else contiguous_strides(self.shape)
        self.offset = int(offset)
        self.dtype = dt.as_dtype(dtype)
        self.name = name or (storage.name if storage is not None else "")
        # A runtime offset (scalar or per-partition), resolved when an instruction reads it.
        self.dynamic: Dynamic | None = dynamic
        # the result of a comparison (nl.equal, ...): its truth is "every element" (Note [Tile truth])
        self.predicate = False
        if storage is not None:
            self._check_bounds()

    # --- attributes -------------------------------------------------------------------------
    @property
    def buffer(self) -> str:
        return self.storage.buffer

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def on_chip(self) -> bool:
        return self.storage.buffer in ON_CHIP

    @property
    def partitions(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def free_size(self) -> int:
        """Elements per partition (every dim but the first)."""
        return math.prod(self.shape[1:])

    @property
    def partition_start(self) -> int:
        return self.offset // self.storage.partition_stride if self.on_chip else 0

    def describe(self) -> str:
        name = f" {self.name!r}" if self.name else ""
        return f"NkiTensor{name}(shape={self.shape}, dtype={self.dtype!r}, buffer={self.buffer!r})"

    def __repr__(self) -> str:
        """The description and the values (what a debugger's `p tile` shows)."""
        if self.dynamic is not None:
            return self.describe() + " with a runtime offset"
        return f"{self.describe()}\n{self.values()}"

    def __len__(self) -> int:
        return self.shape[0]

    def is_contiguous(self) -> bool:
        dims = range(1 if self.on_chip else 0, self.ndim)
        expect = 1
        for d in reversed(dims):
            if self.shape[d] != 1 and self.strides[d] != expect:
                return False
            expect *= self.shape[d]
        return True

    def get_pattern(self) -> list[list[int]]:
        return [[s, n] for s, n in zip(self.strides, self.shape)]

    def is_indirect(self) -> bool:
        return self.dynamic is not None

    # --- the values (for instructions, device_print and debuggers) ------------------------------
    def torch_view(self) -> torch.Tensor:
        """The host tensor of exactly the elements this view addresses (writable, no copy)."""
        if self.dynamic is not None:
            raise NkiValidationError(
                f"{self.describe()} has a runtime offset: only dma_copy can read or write it (it is resolved per access)")
        self.check_extent()
        data = self.storage.data
        if self.dtype.storage != self.storage.dtype.storage:
            data = data.view(self.dtype.storage)
        if self.storage.placed:
            strides, offset = self.storage.physical(self.strides, self.offset, self._scale())
            # as_strided's offset counts from the start of the whole memory, not of `data`
            return data.as_strided(self.shape, strides, data.storage_offset() + offset)
        # (a kernel argument's `data` starts where its tensor does, inside the caller's storage)
        return data.as_strided(self.shape, self.strides, data.storage_offset() + self.offset)

    def _scale(self) -> float:
        """Elements of this view's dtype per element of the storage's."""
        return self.storage.dtype.itemsize / self.dtype.itemsize

    def values(self) -> torch.Tensor:
        """A copy of the values as torch tensors compute with: float32 for float dtypes."""
        return dt.decode(self.torch_view(), self.dtype).clone()

    def __bool__(self) -> bool:
        """Note [Tile truth]: a tile is an object at specialization time, so `if tile:` asks
        whether there is one (the NKI library tests optional tensors that way) and is True;
        the result of a comparison (`nl.equal(a, b)`) is True when every element is, so that
        the NKI docs' `assert nl.equal(c, expected)` checks what it says."""
        if not self.predicate:
            return True
        return bool(torch.all(self.values() != 0))

    def __array__(self, dtype=None, copy=None):
        import numpy as np
        v = self.values()
        return np.asarray(v.numpy() if dtype is None else v.numpy().astype(dtype))

    # Note [Operators on tiles]: neuronxcc.nki (the old dialect) writes tile math with Python's
    # operators (`a * 2.0`, `a + b`); nki's NkiTensor has none, so in an nki kernel (or at a
    # prompt) they return NotImplemented and Python raises its usual TypeError, as the new
    # toolchain does. In a neuronxcc.nki kernel each is the nl function of the same name.
    def __add__(self, other):
        return _tile_operator("add", self, other)

    def __radd__(self, other):
        return _tile_operator("add", other, self)

    def __sub__(self, other):
        return _tile_operator("subtract", self, other)

    def __rsub__(self, other):
        return _tile_operator("subtract", other, self)

    def __mul__(self, other):
        return _tile_operator("multiply", self, other)

    def __rmul__(self, other):
        return _tile_operator("multiply", other, self)

    def __truediv__(self, other):
        return _tile_operator("divide", self, other)

    def __rtruediv__(self, other):
        return _tile_operator("divide", other, self)

    def __pow__(self, other):
        return _tile_operator("power", self, other)

    def __rpow__(self, other):
        return _tile_operator("power", other, self)

    def __neg__(self):
        return _tile_operator("negative", self)

    def __lt__(self, other):
        return _tile_operator("less", self, other)

    def __le__(self, other):
        return _tile_operator("less_equal", self, other)

    def __gt__(self, other):
        return _tile_operator("greater", self, other)

    def __ge__(self, other):
        return _tile_operator("greater_equal", self, other)

    def __getattr__(self, name):
        """Note [Old tensor methods]: in a neuronxcc.nki kernel a tile also has the old
        `nki.tensor`'s methods (legacy/tensor_methods.py); anywhere else they do not exist,
        as on nki's NkiTensor."""
        if name in _OLD_TENSOR_METHODS:  # (any other name: no lookup of the running program)
            from .program import current
            if current().launch.dialect == "neuronxcc":
                from .legacy import tensor_methods
                if name in tensor_methods.PROPERTIES:
                    return tensor_methods.PROPERTIES[name](self)
                return functools.partial(tensor_methods.METHODS[name], self)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __iadd__(self, other):  # psum += nisa.nc_matmul(...): accumulates in place, in the old dialect
        return _tile_operator("add", self, other, in_place=True)

    def __isub__(self, other):
        return _tile_operator("subtract", self, other, in_place=True)

    def __imul__(self, other):
        return _tile_operator("multiply", self, other, in_place=True)

    def __setitem__(self, key, value):
        from . import isa  # the language's `t[...] = value` is a copy instruction
        if hasattr(value, "reduce_into"):  # neuronxcc's `t[...] = nl.loop_reduce(x, op, ...)`: t = op(t, x)
            value = value.reduce_into(self[key])
        isa.assign(self[key], value)

    # --- views ------------------------------------------------------------------------------------
    def _view(self, shape, strides, offset, *, dtype=None, dynamic=None) -> NkiTensor:
        return NkiTensor(shape, dtype or self.dtype, self.storage, strides=strides, offset=offset,
                         name=self.name, dynamic=dynamic if dynamic is not None else self.dynamic)

    def _check_bounds(self) -> None:
        """What a view must be to exist. Where it reaches is checked when it is accessed
        (check_extent), as the simulator does: a kernel may build a view past a tile's end and
        use it only where an `if` allows (the NKI library's output_projection_tkg does)."""
        if any(n <= 0 for n in self.shape):
            raise NkiValidationError(f"tensor {self.name!r}: every dimension must be positive, got shape {self.shape}")
        if any(s < 0 for s in self.strides):
            raise NkiValidationError(f"tensor {self.name!r}: strides must be >= 0, got {self.strides}")

    def check_extent(self) -> None:
        """Raises if the view reaches outside its storage: at every access of its elements."""
        last = self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.strides))
        elements = math.prod(self.storage.shape) if self.on_chip else self.storage.data.numel()
        total = elements * self.storage.dtype.itemsize // self.dtype.itemsize
        if self.offset < 0 or last >= total:
            raise NkiValidationError(
                f"view of tensor {self.name!r} (shape {self.shape}, strides {self.strides}, offset {self.offset}) "
                f"reaches element {last}, past the end of its storage of {total} elements "
                f"(allocated as {self.storage.shape})")

    def _dim(self, dim: int, what: str) -> int:
        if not -self.ndim <= dim < self.ndim:
            raise NkiValidationError(f"{what}: dim {dim} is out of range for a {self.ndim}-D tensor of shape {self.shape}")
        return dim % self.ndim

    def _not_partition(self, dim: int, what: str) -> None:
        if self.on_chip and dim == 0:
            raise NkiValidationError(
                f"{what}: dim 0 is the partition dimension of on-chip tensor {self.name!r} {self.shape}; "
                f"views cannot move data across partitions (use nc_transpose or dma_copy)")

    def __getitem__(self, key) -> NkiTensor:
        key = key if isinstance(key, tuple) else (key,)
        if any(getattr(k, "nki_affine", False) for k in key):  # neuronxcc's nl.arange/mgrid indices
            from .legacy import indexing
            return indexing.resolve(self, key)
        if sum(k is Ellipsis for k in key) > 1:
            raise NkiValidationError(f"index {key!r}: at most one '...'")
        if Ellipsis in key:
            i = key.index(Ellipsis)
            key = key[:i] + (slice(None),) * (self.ndim - len(key) + 1) + key[i + 1:]
        if len(key) > self.ndim:
            raise NkiValidationError(f"too many indices for tensor {self.name!r} of shape {self.shape}: {key!r}")
        key = key + (slice(None),) * (self.ndim - len(key))
        shape, strides, offset, dropped = [], [], self.offset, []
        for d, k in enumerate(key):
            n, s = self.shape[d], self.strides[d]
            if isinstance(k, DynamicSlice):
                k = slice(k.start, k.start + k.size)
            if isinstance(k, slice):
                start, stop, step = _slice_bounds(k, n, d, self)
                offset += start * s
                shape.append(len(range(start, stop, step)))
                strides.append(s * step)
            elif isinstance(k, NkiTensor):
                raise NkiValidationError(
                    f"index {d} of tensor {self.name!r} is a tensor: use .select(dim, index_tensor) or "
                    f".ap(..., scalar_offset=...) for a runtime index")
            else:
                i = _int_index(k, n, d, self)
                offset += i * s
                if self.on_chip and d == 0:  # the partition dim stays, at size 1
                    shape.append(1)
                    strides.append(s)
                else:
                    dropped.append(len(shape))
                    shape.append(1)
                    strides.append(s)
        minimum = 2 if self.on_chip else 1
        keep = [i for i in range(len(shape)) if i not in dropped]
        while len(keep) < minimum and dropped:  # keep the last dropped dim(s) to stay >= 2-D (1-D on HBM)
            keep.append(dropped.pop())
            keep.sort()
        return self._view([shape[i] for i in keep], [strides[i] for i in keep], offset)

    def slice(self, dim: int, start: int, end: int, step: int = 1) -> NkiTensor:
        dim = self._dim(dim, "slice")
        if not 0 <= start < end <= self.shape[dim] or step < 1:
            raise NkiValidationError(
                f"slice(dim={dim}, start={start}, end={end}, step={step}) of tensor {self.name!r} {self.shape}: "
                f"need 0 <= start < end <= {self.shape[dim]} and step >= 1")
        key = [slice(None)] * self.ndim
        key[dim] = slice(start, end, step)
        return self[tuple(key)]

    def select(self, dim: int, index) -> NkiTensor:
        dim = self._dim(dim, "select")
        if isinstance(index, NkiTensor) or _is_register(index):
            if self.dynamic is not None:
                raise NkiValidationError(f"select: tensor {self.name!r} already has a runtime offset (no chaining)")
            self._not_partition(dim, "select with a runtime index")
            shape = self.shape[:dim] + self.shape[dim + 1:]
            strides = self.strides[:dim] + self.strides[dim + 1:]
            return self._view(shape, strides, self.offset,
                              dynamic=Dynamic(scalar=index, stride=self.strides[dim], bound=self.shape[dim]))
        if not 0 <= index < self.shape[dim]:
            raise NkiValidationError(f"select: index {index} is out of range [0, {self.shape[dim]}) of dim {dim}")
        shape = self.shape[:dim] + self.shape[dim + 1:]
        strides = self.strides[:dim] + self.strides[dim + 1:]
        if self.on_chip and dim == 0:
            raise NkiValidationError("select: dim 0 of an on-chip tensor is the partition dim; index it with t[i] "
                                     "(which keeps it at size 1)")
        return self._view(shape, strides, self.offset + index * self.strides[dim])

    def vector_select(self, dim: int, vector_offset: NkiTensor) -> NkiTensor:
        if dim != 0 or self.on_chip:
            raise NkiValidationError("vector_select: only dim 0 of an HBM tensor can take per-partition offsets")
        if self.dynamic is not None:
            raise NkiValidationError(f"vector_select: tensor {self.name!r} already has a runtime offset (no chaining)")
        shape = (vector_offset.shape[0],) + self.shape[1:]
        return self._view(shape, self.strides, self.offset,
                          dynamic=Dynamic(vector=vector_offset, stride=self.strides[0], bound=self.shape[0]))

    def permute(self, dims) -> NkiTensor:
        dims = tuple(dims)
        if sorted(dims) != list(range(self.ndim)):
            raise NkiValidationError(f"permute{dims}: not a permutation of the {self.ndim} dims of {self.shape}")
        if self.on_chip and dims[0] != 0:
            raise NkiValidationError(f"permute{dims}: on-chip tensor {self.name!r} must keep its partition dim first")
        return self._view([self.shape[d] for d in dims], [self.strides[d] for d in dims], self.offset)

    def broadcast(self, dim: int, size: int) -> NkiTensor:
        dim = self._dim(dim, "broadcast")
        if self.shape[dim] != 1:
            raise NkiValidationError(f"broadcast(dim={dim}, size={size}): dim {dim} has size {self.shape[dim]}, not 1")
        self._not_partition(dim, "broadcast")
        shape, strides = list(self.shape), list(self.strides)
        shape[dim], strides[dim] = size, 0
        return self._view(shape, strides, self.offset)

    def expand_dim(self, dim: int) -> NkiTensor:
        if not 0 <= dim <= self.ndim:
            raise NkiValidationError(f"expand_dim({dim}): out of range for a {self.ndim}-D tensor")
        self._not_partition(dim, "expand_dim")
        inner = self.strides[dim] * self.shape[dim] if dim < self.ndim else 1
        return self._view(self.shape[:dim] + (1,) + self.shape[dim:], self.strides[:dim] + (inner,) + self.strides[dim:],
                          self.offset)

    def squeeze_dim(self, dim: int) -> NkiTensor:
        dim = self._dim(dim, "squeeze_dim")
        if self.shape[dim] != 1:
            raise NkiValidationError(f"squeeze_dim({dim}): dim {dim} has size {self.shape[dim]}, not 1")
        self._not_partition(dim, "squeeze_dim")
        return self._view(self.shape[:dim] + self.shape[dim + 1:], self.strides[:dim] + self.strides[dim + 1:],
                          self.offset)

    def reshape_dim(self, dim: int, shape) -> NkiTensor:
        dim = self._dim(dim, "reshape_dim")
        shape = _infer(tuple(shape), self.shape[dim], f"reshape_dim({dim}, {shape})")
        if self.on_chip and dim == 0 and len(shape) != 1:
            self._not_partition(dim, "reshape_dim")
        sub = contiguous_strides(shape)
        strides = tuple(s * self.strides[dim] for s in sub)
        return self._view(self.shape[:dim] + shape + self.shape[dim + 1:],
                          self.strides[:dim] + strides + self.strides[dim + 1:], self.offset)

    def flatten_dims(self, start_dim: int, end_dim: int) -> NkiTensor:
        start_dim, end_dim = self._dim(start_dim, "flatten_dims"), self._dim(end_dim, "flatten_dims")
        if self.on_chip and start_dim == 0:
            self._not_partition(0, "flatten_dims")
        for d in range(start_dim, end_dim):
            if self.shape[d] != 1 and self.shape[d + 1] != 1 and self.strides[d] != self.strides[d + 1] * self.shape[d + 1]:
                raise NkiValidationError(
                    f"flatten_dims({start_dim}, {end_dim}) of {self.shape} with strides {self.strides}: "
                    f"dims {d} and {d + 1} are not contiguous in memory")
        n = math.prod(self.shape[start_dim:end_dim + 1])
        return self._view(self.shape[:start_dim] + (n,) + self.shape[end_dim + 1:],
                          self.strides[:start_dim] + (self.strides[end_dim],) + self.strides[end_dim + 1:], self.offset)

    def reshape(self, shape) -> NkiTensor:
        shape = _infer(tuple(int(s) for s in shape), self.size, f"reshape({shape})")
        if self.on_chip and shape[0] != self.shape[0]:
            raise NkiValidationError(
                f"reshape{shape}: on-chip tensor {self.name!r} {self.shape} must keep its partition dim "
                f"({self.shape[0]}); moving data across partitions needs nc_transpose or dma_copy")
        try:  # torch's view rules on a meta tensor: the strides of a view, or an error when there is none
            strides = torch.empty_strided(self.shape, self.strides, device="meta").view(shape).stride()
        except RuntimeError:
            raise NkiValidationError(
                f"reshape{shape}: the layout of {self.name!r} (shape {self.shape}, strides {self.strides}) cannot "
                f"be viewed with that shape without a copy (after a permute or a strided slice)") from None
        return self._view(shape, strides, self.offset)

    def rearrange(self, src_pattern, dst_pattern, fixed_sizes=None) -> NkiTensor:
        fixed = dict(fixed_sizes or {})
        if len(src_pattern) != self.ndim:
            raise NkiValidationError(f"rearrange: source pattern {src_pattern} names {len(src_pattern)} dims, "
                                     f"the tensor has {self.ndim}")
        t, names = self, []
        for d in reversed(range(self.ndim)):  # split grouped source dims, last first so indices hold
            group = src_pattern[d]
            if isinstance(group, (tuple, list)):
                t = t.reshape_dim(d, tuple(fixed.get(g, -1) for g in group))
                names[0:0] = list(group)
            else:
                names.insert(0, group)
        flat = [g for e in dst_pattern for g in (e if isinstance(e, (tuple, list)) else (e,))]
        if sorted(flat) != sorted(names):
            raise NkiValidationError(f"rearrange: {dst_pattern} must name the dims of {src_pattern}, each once")
        t = t.permute(tuple(names.index(g) for g in flat))
        d = 0
        for e in dst_pattern:
            if isinstance(e, (tuple, list)):
                t = t.flatten_dims(d, d + len(e) - 1)
            d += 1
        return t

    def ap(self, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim: int = 0,
           dtype=None) -> NkiTensor:
        """Note: `.ap` addresses the storage directly, ignoring this view's shape and strides
        (NKI's access-pattern deep dive: "not composable"); `offset=None` keeps this view's offset."""
        dtype = dt.as_dtype(dtype) if dtype is not None else self.dtype
        pattern = [list(p) for p in pattern]
        if any(len(p) != 2 for p in pattern):
            raise NkiValidationError(f"ap: pattern {pattern} must be a list of [stride, count] pairs")
        if scalar_offset is not None and vector_offset is not None:
            raise NkiValidationError("ap: scalar_offset and vector_offset are mutually exclusive")
        scale = self.storage.dtype.itemsize / dtype.itemsize
        if self.on_chip:
            pstride = self.storage.partition_stride * scale
            if pattern[0][0] != pstride:
                raise NkiValidationError(
                    f"ap: the partition stride of on-chip tensor {self.name!r} must be its storage's free size "
                    f"{int(pstride)} (every partition performs the same access), got {pattern[0][0]}")
        base = self.offset if offset is None else int(offset)
        dynamic = None
        if scalar_offset is not None or vector_offset is not None:
            if vector_offset is not None and (indirect_dim != 0 or self.on_chip):
                raise NkiValidationError("ap: vector_offset needs indirect_dim=0 on an HBM tensor")
            # The runtime offset counts along indirect_dim of the tensor .ap() is called on: for an
            # HBM tensor, that view (the NKI library's router_topk scatters into
            # `affinities.reshape((T * E,))` with offsets into all T * E elements); on chip, the
            # tile as allocated (its partitions).
            base_shape = self.storage.shape if self.on_chip else self.shape
            if not 0 <= indirect_dim < len(base_shape):
                raise NkiValidationError(f"ap: indirect_dim {indirect_dim} is out of range for {base_shape}")
            if self.on_chip:
                stride = int(math.prod(base_shape[indirect_dim + 1:]) * scale)
            else:  # the view's own step along that dim, in elements of the access's dtype
                stride = int(self.strides[indirect_dim] * self.dtype.itemsize // dtype.itemsize)
            dynamic = Dynamic(scalar=scalar_offset, vector=vector_offset, stride=stride,
                              bound=base_shape[indirect_dim])
        view = NkiTensor([n for _, n in pattern], dtype, self.storage, strides=[s for s, _ in pattern], offset=base,
                         name=self.name, dynamic=dynamic)
        return view

    def view(self, dtype) -> NkiTensor:
        dtype = dt.as_dtype(dtype)
        if self.dynamic is not None:
            raise NkiValidationError("view(dtype): not after a runtime (dynamic) select")
        old, new = self.dtype.itemsize, dtype.itemsize
        if old == new:
            return self._view(self.shape, self.strides, self.offset, dtype=dtype)
        if self.strides[-1] != 1:
            raise NkiValidationError(f"view({dtype}): the last dim of {self.name!r} must be contiguous")
        if new < old:
            r = old // new
            return self._view(self.shape[:-1] + (self.shape[-1] * r,), tuple(s * r for s in self.strides[:-1]) + (1,),
                              self.offset * r, dtype=dtype)
        r = new // old
        if self.shape[-1] % r or self.offset % r or any(s % r for s in self.strides[:-1]):
            raise NkiValidationError(f"view({dtype}): the last dim ({self.shape[-1]}) and the layout of {self.name!r} "
                                     f"must divide by {r}")
        return self._view(self.shape[:-1] + (self.shape[-1] // r,), tuple(s // r for s in self.strides[:-1]) + (1,),
                          self.offset // r, dtype=dtype)

    reinterpret_cast = view


class Dynamic:
    """A runtime offset of a view: one value (a 1x1 tensor or a register) or one per partition,
    times `stride` elements, checked against `bound` rows when an instruction resolves it."""

    __slots__ = ("scalar", "vector", "stride", "bound")

    def __init__(self, scalar=None, vector=None, stride: int = 1, bound: int = 1):
        self.scalar, self.vector, self.stride, self.bound = scalar, vector, stride, bound

    def rows(self) -> torch.Tensor:
        """The row index (or one per partition) as an int64 tensor, read now."""
        if self.vector is not None:
            return self.vector.values().reshape(-1).to(torch.int64)
        v = self.scalar
        if _is_register(v):
            return torch.tensor([int(v.value)])
        return v.values().reshape(-1)[:1].to(torch.int64)


def _tile_operator(name: str, *operands, in_place: bool = False):
    """Note [Operators on tiles]: the nl function, in a neuronxcc.nki kernel only."""
    from .program import current
    if current().launch.dialect != "neuronxcc":
        return NotImplemented
    from .legacy import operators
    return operators.apply(name, operands, in_place)


def _is_register(x) -> bool:
    return type(x).__name__ == "VirtualRegister"


def _int_index(k, n: int, d: int, t: NkiTensor) -> int:
    try:
        i = int(k)
    except TypeError:
        raise NkiValidationError(f"index {k!r} of dim {d} is not an int, a slice, nl.ds or '...'") from None
    if not -n <= i < n:
        raise NkiValidationError(f"index {i} is out of bounds for dim {d} of size {n} of tensor {t.name!r} {t.shape}")
    return i % n


def _slice_bounds(k: slice, n: int, d: int, t: NkiTensor):
    step = 1 if k.step is None else int(k.step)
    if step < 1:
        raise NkiValidationError(f"slice {k} of dim {d}: the step must be >= 1")
    start = 0 if k.start is None else int(k.start)
    stop = n if k.stop is None else int(k.stop)
    start += n if start < 0 else 0
    stop += n if stop < 0 else 0
    if not 0 <= start < stop <= n:
        raise NkiValidationError(
            f"slice {start}:{stop} of dim {d} of tensor {t.name!r} {t.shape} is out of bounds or empty "
            f"(dim {d} has size {n})")
    return start, stop, step


def _infer(shape: tuple[int, ...], total: int, what: str) -> tuple[int, ...]:
    if shape.count(-1) > 1:
        raise NkiValidationError(f"{what}: at most one size may be -1")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        if known == 0 or total % known:
            raise NkiValidationError(f"{what}: cannot infer -1 for {total} elements")
        shape = tuple(total // known if s == -1 else s for s in shape)
    if math.prod(shape) != total:
        raise NkiValidationError(f"{what}: {math.prod(shape)} elements, the tensor has {total}")
    return shape
