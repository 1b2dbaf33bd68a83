"""nki.jit: a kernel, and how one call of it runs on the emulated NeuronCore.

A call runs the kernel's Python body now, instruction by instruction, as the NKI simulator
does (so `breakpoint()` inside a kernel stops with real tile values), on host tensors:
every framework tensor argument becomes an HBM tensor over the same bytes (a kernel that
writes an input writes the caller's tensor), its logical row-major array (Note [Kernel
arguments are row-major arrays]), and the HBM tensors the kernel returns come back as
tensors of the caller's kind (torch or numpy). `kernel[g]` or `kernel[g0, g1]`
launches an SPMD grid (with LNC=2, `kernel[2]`, one program per NeuronCore); programs run
one after another, each with its own on-chip memory, and the modelled timeline places them
on the logical device's NeuronCores.

A call with `neuron` device tensors is handed to the runner the framework glue installs
(`set_device_runner`, from dispatch/nki_kernels.py): this layer knows nothing of torch's
devices beyond the CPU.
"""
from __future__ import annotations

import functools
import math
import threading

import numpy as np
import torch
import torch.utils._pytree as pytree

from . import dtypes as dt
from .. import settings
from .errors import NkiValidationError
from .lockstep import run_programs
from .program import Launch, Program, running
from .target import current_target
from .tensor import PRIVATE_HBM, SHARED_HBM, NkiTensor, Storage
from .timeline import Timeline

_device_runner = None
_local = threading.local()


class measuring:
    """`with measuring() as m:` sums the modelled time of the kernels run inside the block
    on this thread (how a custom op whose body calls kernels is priced)."""

    def __enter__(self):
        self.ns, self.kernels, self.timelines, self.staged = 0.0, 0, [], []
        self._saved = getattr(_local, "sink", None)
        _local.sink = self
        return self

    def __exit__(self, *exc):
        _local.sink = self._saved
        return False

    @property
    def us(self) -> float:
        return self.ns / 1000


def set_device_runner(runner) -> None:
    """Install the function that runs a kernel called with device (non-CPU) tensors:
    runner(kernel, args, kwargs) -> result."""
    global _device_runner
    _device_runner = runner


class Kernel:
    """A @nki.jit kernel. Call it with torch tensors or numpy arrays; `kernel[grid](...)` for SPMD."""

    # which NKI the body is written in: "nki" (this package) or "neuronxcc" (device/nki/legacy);
    # the running program carries it, so each dialect's own forms can refuse the other's
    dialect = "nki"

    def __init__(self, fn, grid: tuple[int, ...] = (), **options):
        if not callable(fn):
            raise TypeError(f"nki.jit decorates a kernel function, got {type(fn).__name__}")
        self.fn = fn
        self.grid = grid
        self.options = options
        functools.update_wrapper(self, fn)

    def __getitem__(self, grid) -> Kernel:
        grid = grid if isinstance(grid, tuple) else (grid,)
        try:
            grid = tuple(int(g) for g in grid)
        except TypeError:
            raise TypeError(f"kernel[...] takes the grid as ints (kernel[2] or kernel[4, 2]), got {grid!r}") from None
        if not grid or any(g < 1 for g in grid):
            raise ValueError(f"kernel[{grid}]: every grid dimension must be >= 1")
        return type(self)(self.fn, grid, **self.options)

    def __call__(self, *args, **kwargs):
        if _device_runner is not None and _has_device_tensor(args, kwargs):
            return _device_runner(self, args, kwargs)
        return run(self, args, kwargs)[0]

    def __repr__(self) -> str:
        grid = f"[{', '.join(map(str, self.grid))}]" if self.grid else ""
        return f"<nki kernel {self.fn.__qualname__}{grid}>"


def jit(fn=None, **options):
    """@nki.jit or @nki.jit(...): a kernel (options such as platform_target are accepted)."""
    if "mode" in options:  # neuronxcc.nki's; NKI 0.3.0 made passing it an error
        raise TypeError(f"nki.jit(mode={options['mode']!r}): nki.jit has no mode since NKI 0.3.0 (the framework is "
                        f"detected from the arguments; nki.simulate(kernel) runs on the CPU): remove it, or use "
                        f"neuronxcc.nki.jit for a kernel of the old dialect")
    if fn is None:
        return lambda f: Kernel(f, **options)
    if isinstance(fn, Kernel):
        return fn
    return Kernel(fn, **options)


def simulate(kernel):
    """nki.simulate(kernel): the kernel run on the CPU; here every call is, so the same kernel."""
    return kernel if isinstance(kernel, Kernel) else Kernel(kernel)


def _has_device_tensor(args, kwargs) -> bool:
    """Any tensor for the runner: on a device, or a tensor subclass (a fake tensor of tracing)."""
    return any(isinstance(x, torch.Tensor) and (x.device.type != "cpu" or type(x) not in (torch.Tensor, torch.nn.Parameter))
               for x in pytree.tree_leaves((args, kwargs)))


def logical_cores() -> int:
    return settings.read("NEURON_LOGICAL_NC_CONFIG")


def run(kernel: Kernel, args, kwargs, *, target=None, cores: int | None = None):
    """Run every program of the kernel's grid on host tensors; (result, timeline)."""
    call = Call(kernel, args, kwargs, target=target, cores=cores)
    if call.programs == 1:
        call.body(0)
    else:  # on threads, one at a time: they may meet at collectives (Note [Lockstep programs])
        run_programs(call.programs, call.body)
    return call.finish()


class Call:
    """One call of a kernel: its launch, its arguments as HBM tensors, and what its programs
    return. run() makes one and runs its programs; a rank launch (ranks.py) makes one per rank."""

    def __init__(self, kernel: Kernel, args, kwargs, *, target=None, cores: int | None = None):
        self.kernel = kernel
        target = target or current_target()
        self.grid = kernel.grid
        self.programs = math.prod(self.grid) if self.grid else 1
        self.cores = cores or min(self.programs, logical_cores())
        self.timeline = Timeline(target, self.cores)
        self.launch = Launch(self.grid, target, self.timeline, lnc=self.cores, dialect=kernel.dialect)
        self.wrapped: dict[tuple, tuple[Storage, list]] = {}
        self.staged: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.numpy_mode = False
        # as the simulator wraps them: nl.hbm for one program, nl.shared_hbm when a grid shares them
        buffer = PRIVATE_HBM if self.programs == 1 else SHARED_HBM

        def to_nki(x):
            if isinstance(x, np.ndarray):
                self.numpy_mode = True
                x = torch.from_numpy(x) if x.flags.writeable else torch.from_numpy(x.copy())
            if isinstance(x, torch.Tensor):
                return _hbm_tensor(x, self.wrapped, self.staged, buffer)
            return x

        self.args, self.kwargs = pytree.tree_map(to_nki, (args, kwargs))
        # the arguments' memories: collectives refuse them (collectives.py)
        self.launch.arguments = {storage.serial for storage, _ in self.wrapped.values()}
        self.results = {}

    def body(self, linear: int, lockstep=None, ranks=None) -> None:
        """Run program `linear` of the grid on this thread; `lockstep`: how it meets the call's
        other programs, `ranks`: its place in a rank launch (ranks.RankContext)."""
        program = Program(self.launch, _unravel(linear, self.grid))
        program.core, program.rank, program.lockstep = linear % self.cores, linear, lockstep
        program.ranks = ranks
        with running(program):
            self.results[linear] = self.kernel.fn(*self.args, **self.kwargs)

    def finish(self):
        """(result, timeline), once every program has run: staged arguments written back."""
        timeline = self.timeline
        timeline.staged = _write_back(self.staged)
        sink = getattr(_local, "sink", None)
        if sink is not None:
            sink.ns += timeline.total_ns
            sink.kernels += 1
            sink.timelines.append(timeline)
            sink.staged += timeline.staged
        return _from_nki(self.results[0], self.wrapped, self.numpy_mode), timeline


def _unravel(linear: int, grid: tuple[int, ...]) -> tuple[int, ...]:
    ids = []
    for g in reversed(grid):
        ids.append(linear % g)
        linear //= g
    return tuple(reversed(ids))


# Note [Kernel arguments are row-major arrays]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# On the chip a kernel's tensor argument is an HBM array: its logical elements in row-major
# order from its first element (the framework hands the kernel a contiguous tensor, copying a
# transposed or permuted one first), and kernels address it so (`.ap()` patterns and offsets,
# `reshape`, indirect DMA). Wrapping a view's bytes as they lie, a transposed torch tensor or a
# Fortran-order numpy array read wrong values with no error through `.ap()`, `reshape` raised,
# and an explicit `.ap(offset=k)` of a slice counted from its storage's start. So an argument
# is an HBM tensor over exactly its own elements: a contiguous one over its bytes (a kernel
# that writes it writes the caller's tensor), any other over a row-major copy (staged), written
# back to the caller's tensor if the kernel wrote it. A framework on neuron prices the copies
# (dispatch/nki_kernels.py) from the bytes run() reports.
def _hbm_tensor(t: torch.Tensor, wrapped: dict, staged: list, buffer: str) -> NkiTensor:
    """An HBM NkiTensor over a host tensor's logical elements (Note [Kernel arguments are
    row-major arrays])."""
    if t.device.type != "cpu":
        raise TypeError(f"an NKI kernel takes CPU or neuron tensors, got one on {t.device}")
    if t.numel() == 0:
        raise NkiValidationError(f"kernel argument of shape {tuple(t.shape)} is empty: NKI tensors have positive sizes")
    if t.is_sparse or t.layout != torch.strided:
        raise TypeError("an NKI kernel takes dense tensors")
    dtype = dt.of_torch(t, what="kernel argument")
    original = t
    if not t.is_contiguous():
        t = t.contiguous()
        staged.append((original, t, t.clone()))  # the caller's, the kernel's, what it was given
    key = (t.data_ptr(), t.numel(), t.dtype)  # the same array passed twice is one HBM tensor
    entry = wrapped.get(key)
    if entry is None:
        flat = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(), (t.numel(),), (1,))
        storage = Storage(flat, dtype, buffer, tuple(t.shape) or (1,), name="")
        wrapped[key] = entry = (storage, [])
    storage, originals = entry
    originals.append(original)
    return NkiTensor(tuple(t.shape) or (1,), dtype, storage)


def _write_back(staged: list) -> list[int]:
    """Copy what the kernel wrote into a staged argument back to the caller's tensor; returns
    the bytes of each copy the framework makes (each staged argument in, and back if written)."""
    copies = []
    for original, kernel_view, given in staged:
        copies.append(kernel_view.nbytes)
        # bit for bit (a NaN the kernel left alone is no write)
        if not torch.equal(kernel_view.view(-1).view(torch.uint8), given.view(-1).view(torch.uint8)):
            original.copy_(kernel_view)
            copies.append(kernel_view.nbytes)
    return copies


def _from_nki(result, wrapped: dict, numpy_mode: bool):
    by_storage = {id(s): originals for s, originals in wrapped.values()}

    def convert(x):
        if not isinstance(x, NkiTensor):
            return x
        for original in by_storage.get(id(x.storage), ()):
            # the whole argument, as it was wrapped: the caller's own tensor
            if tuple(original.shape or (1,)) == x.shape and x.offset == 0 and x.is_contiguous():
                return original.numpy() if numpy_mode else original
        if x.on_chip:
            raise NkiValidationError(f"a kernel returns HBM tensors; {x.describe()} is on chip: store it with dma_copy into an "
                                     f"nl.ndarray(..., buffer=nl.shared_hbm) and return that")
        view = x.torch_view()
        return view.numpy() if numpy_mode else view

    return pytree.tree_map(convert, result, is_leaf=lambda x: isinstance(x, NkiTensor))
