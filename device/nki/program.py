"""One running kernel program: its SPMD position, its on-chip memory and its engines' state.

The NKI language is global functions (`nl.ndarray`, `nisa.tensor_tensor`), so the program an
instruction belongs to is the one running on this thread: a kernel call sets it for each
program of its grid (LNC programs run on threads of their own) and clears it after. Outside
a kernel (an interactive session, a test of one instruction), the thread gets a program of
its own on first use, so that tiles and instructions can be tried at a prompt.

Note [On-chip capacity]: an allocation holds its bytes until its last view goes away, as a
tile does while the compiler's liveness analysis sees it used. SBUF is charged per partition
(the free bytes of each live tile, against 224 KiB per partition on trn2, 256 KiB on trn3);
PSUM by banks (each live PSUM tile takes ceil(free bytes / 2 KiB) of the 8 banks). A kernel
that keeps more live than that raises, naming the tile, its size and what is in use, where
the real compiler would fail to allocate.

Note [Placed tiles]: `nl.ndarray(..., address=(partition, byte offset))` places a tile at a
fixed spot of the program's physical SBUF or PSUM (kernels that manage their own memory do,
to reuse PSUM banks in turn). Placed tiles are views of one physical memory, so two placed
at the same address share bytes, as on the chip; they are not charged against the capacity
(the kernel placed them), but must lie inside it. The timeline sees two placed tiles as
different memories (it orders instructions by the tiles they name).
"""
from __future__ import annotations

import math
import threading
import weakref

import torch

from . import dtypes as dt
from .errors import NkiValidationError
from .target import Target, current_target
from .tensor import ON_CHIP, PSUM, SBUF, SHARED_HBM, NkiTensor, Storage

_local = threading.local()


class Launch:
    """What the programs of one kernel call share: the grid, the target, the timeline, and
    the shared_hbm tensors they allocate (the i-th allocation of every program is one tensor)."""

    def __init__(self, grid: tuple[int, ...], target: Target, timeline=None, lnc: int = 1, dialect=None):
        self.grid = grid
        # the kernel's NKI dialect ("nki" or "neuronxcc"); None outside a kernel (at a prompt)
        self.dialect = dialect
        self.target = target
        self.timeline = timeline
        self.lnc = lnc
        self.shared: list[Storage] = []
        self.arguments: set[int] = set()  # serials of the storages of the kernel's arguments
        self.lock = threading.Lock()


class Program:
    def __init__(self, launch: Launch, ids: tuple[int, ...]):
        self.launch = launch
        self.ids = ids
        self.core = 0  # which NeuronCore of the logical device runs it (timeline.py)
        self.rank = 0  # its index in the launch
        self.lockstep = None  # the launch's Lockstep when programs may meet at collectives
        self.ranks = None  # ranks.RankContext when it is one rank of a run_ranks launch (nki.collectives)
        self.collectives: dict = {}  # (kind, pipe) -> how many this program has reached
        self.target = launch.target
        self.sbuf_used = 0  # bytes per partition
        self.psum_banks_used = 0
        self.shared_index = 0
        # engine accumulator registers (activation's reduce_regs; Vector Engine's accumulators)
        self.scalar_acc: torch.Tensor | None = None
        self.vector_acc: torch.Tensor | None = None
        self._physical: dict[str, torch.Tensor] = {}  # buffer -> its bytes, for placed tiles

    # --- allocation -------------------------------------------------------------------------
    def allocate(self, shape, dtype: dt.NkiDType, buffer: str, name: str, address=None) -> NkiTensor:
        shape = tuple(int(s) for s in shape)
        if not shape or any(s <= 0 for s in shape):
            raise NkiValidationError(f"nl.ndarray {name!r}: shape must be a tuple of positive ints, got {shape}")
        if buffer in ON_CHIP and len(shape) < 2:
            raise NkiValidationError(
                f"nl.ndarray {name!r}: an {buffer} tensor needs a partition dim and at least one free dim, "
                f"got shape {shape} (use e.g. ({shape[0]}, 1))")
        if address is not None and buffer in ON_CHIP:
            return self._placed(shape, dtype, buffer, name, address)
        if buffer == SHARED_HBM and math.prod(self.launch.grid) > 1:
            return self._shared(shape, dtype, name)
        storage = _new_storage(shape, dtype, buffer, name)
        if buffer in ON_CHIP:
            self._charge(storage)
        return NkiTensor(shape, dtype, storage, name=name)

    def _shared(self, shape, dtype, name) -> NkiTensor:
        """SPMD programs see one shared_hbm tensor per allocation site: the i-th allocation of
        every program returns the storage the first program to get there made."""
        with self.launch.lock:
            i, self.shared_index = self.shared_index, self.shared_index + 1
            if i == len(self.launch.shared):
                self.launch.shared.append(_new_storage(shape, dtype, SHARED_HBM, name))
            storage = self.launch.shared[i]
        if storage.shape != shape or storage.dtype != dtype:
            raise NkiValidationError(
                f"nl.ndarray {name!r} in shared_hbm: program {self.ids} allocates {shape} {dtype}, but the same "
                f"allocation in another program of the grid was {storage.shape} {storage.dtype}; every program "
                f"must allocate the same shared tensors in the same order")
        return NkiTensor(shape, dtype, storage, name=name)

    def _placed(self, shape, dtype: dt.NkiDType, buffer: str, name: str, address) -> NkiTensor:
        """Note [Placed tiles]: a tile at (partition, byte offset) of the physical memory."""
        t = self.target
        row = t.sbuf_partition_bytes if buffer == SBUF else t.psum_partition_bytes
        try:
            p0, f0 = (int(a) for a in address)
        except (TypeError, ValueError):
            raise NkiValidationError(f"nl.ndarray {name!r}: address must be (partition offset, byte offset), "
                                     f"got {address!r}") from None
        free_bytes = math.prod(shape[1:]) * dtype.itemsize
        if p0 < 0 or f0 < 0 or p0 + shape[0] > t.partitions or f0 + free_bytes > row:
            raise NkiValidationError(
                f"nl.ndarray {name!r} {shape} {dtype} at address ({p0}, {f0}) lies outside the {buffer}: partitions "
                f"[{p0}, {p0 + shape[0]}) of {t.partitions}, bytes [{f0}, {f0 + free_bytes}) of {row} per partition")
        if f0 % dtype.itemsize:
            raise NkiValidationError(f"nl.ndarray {name!r}: byte offset {f0} is not aligned to {dtype}'s "
                                     f"{dtype.itemsize} bytes")
        memory = self._physical.get(buffer)
        if memory is None:
            memory = self._physical[buffer] = torch.full((t.partitions * row,), 0xFF, dtype=torch.uint8)
        start = p0 * row + f0
        length = (shape[0] - 1) * row + free_bytes
        data = memory[start:start + length].view(dtype.storage)
        storage = Storage(data, dtype, buffer, shape, name, row=row // dtype.itemsize)
        if buffer == PSUM:  # bookkeeping, not memory: indexed as the tile's views index it
            storage.acc = torch.zeros(math.prod(shape), dtype=torch.bool)
        # not refilled: a tile placed where another lives aliases its bytes on purpose (the
        # physical memory itself starts all ones: NaN as any float, -1 as an integer)
        return NkiTensor(shape, dtype, storage, name=name)

    def _charge(self, storage: Storage) -> None:
        t = self.target
        free_bytes = storage.partition_stride * storage.dtype.itemsize
        if storage.buffer == SBUF:
            if self.sbuf_used + free_bytes > t.sbuf_partition_bytes:
                raise NkiValidationError(
                    f"nl.ndarray {storage.name!r} {storage.shape} {storage.dtype}: SBUF is full. It needs "
                    f"{free_bytes} bytes per partition, {self.sbuf_used} of the {t.sbuf_partition_bytes} bytes per "
                    f"partition of the {t.name} SBUF are held by live tiles (Note [On-chip capacity]); "
                    f"allocate smaller tiles or let tiles you no longer use go out of scope")
            self.sbuf_used += free_bytes
            weakref.finalize(storage, self._release_sbuf, free_bytes)
        else:
            if free_bytes > t.psum_partition_bytes:
                raise NkiValidationError(
                    f"nl.ndarray {storage.name!r} {storage.shape} {storage.dtype}: {free_bytes} bytes per partition "
                    f"exceed PSUM's {t.psum_partition_bytes} (8 banks of {t.psum_bank_bytes} bytes)")
            banks = -(-free_bytes // t.psum_bank_bytes)
            if self.psum_banks_used + banks > t.psum_banks:
                raise NkiValidationError(
                    f"nl.ndarray {storage.name!r} {storage.shape} {storage.dtype}: PSUM is full. It needs {banks} of "
                    f"the {t.psum_banks} PSUM banks ({t.psum_bank_bytes} bytes per partition each) and "
                    f"{self.psum_banks_used} are held by live PSUM tiles (Note [On-chip capacity]); evict results to "
                    f"SBUF and let the PSUM tiles go out of scope, or reuse one")
            self.psum_banks_used += banks
            weakref.finalize(storage, self._release_psum, banks)

    def _release_sbuf(self, nbytes: int) -> None:
        self.sbuf_used -= nbytes

    def _release_psum(self, banks: int) -> None:
        self.psum_banks_used -= banks

    def issue(self, instr) -> None:
        """Hand an executed instruction to the launch's timeline (the cost model), if any."""
        if self.launch.timeline is not None:
            self.launch.timeline.issue(self, instr)


def _new_storage(shape, dtype: dt.NkiDType, buffer: str, name: str) -> Storage:
    n = math.prod(shape)
    fill = dt.encode(torch.tensor([dt.sentinel(dtype)], dtype=torch.float32), dtype)[0].item() \
        if not dtype.packed and dtype is not dt.bool_ else 0
    data = torch.full((n,), fill, dtype=dtype.storage)
    storage = Storage(data, dtype, buffer, shape, name)
    if buffer == PSUM:
        storage.acc = torch.zeros(n, dtype=torch.bool)
    return storage


def current() -> Program:
    """The program running on this thread (an interactive one outside any kernel)."""
    program = getattr(_local, "program", None)
    if program is None:
        program = _local.program = Program(Launch((), current_target()), ())
    return program


class running:
    """`with running(program):` makes `program` the thread's current one for a block."""

    def __init__(self, program: Program):
        self.program = program

    def __enter__(self):
        self.saved = getattr(_local, "program", None)
        _local.program = self.program
        return self.program

    def __exit__(self, *exc):
        _local.program = self.saved
        return False
