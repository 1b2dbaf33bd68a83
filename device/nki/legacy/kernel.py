"""neuronxcc.nki's entry points: `nki.jit(mode=...)`, `baremetal`, `benchmark`,
`simulate_kernel`, and launch grids given as lists (`kernel[[2, 2]]`).

A kernel of the old dialect is a Kernel that runs its programs with dialect "neuronxcc"
(what lets its tiles take Python operators: Note [Operators on tiles] in tensor.py). The
modes that ran on a NeuronDevice (baremetal, benchmark) run on the emulated NeuronCore;
benchmark's latency is the cost model's time for one call, which is the same every
iteration, so every percentile is that time.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.utils._pytree as pytree

from ..errors import NkiValidationError
from ..kernel import Kernel, run
from ..program import current
from ..tensor import NkiTensor

MODES = ("auto", "jax", "torchxla", "baremetal", "benchmark", "simulation", "trace")
PERCENTILES = (0, 1, 10, 25, 50, 90, 99, 100)

tensor = NkiTensor  # nki.tensor: the type of a kernel's tensors (annotations, isinstance)


class LegacyKernel(Kernel):
    """A @neuronxcc.nki.jit kernel."""

    dialect = "neuronxcc"

    def __getitem__(self, grid) -> Kernel:
        # neuronxcc also takes the grid as a list (kernel[[2, 2]], kernel[[n]])
        if isinstance(grid, list):
            grid = tuple(grid)
        return super().__getitem__(grid)

    def __call__(self, *args, **kwargs):
        if current().launch.dialect is not None:
            # a kernel called from a kernel (neuronxcc's nki.jit(mode="trace") sub-kernels): its
            # body runs inline, in the caller's program
            return self.fn(*args, **kwargs)
        if self.options.get("mode") in ("baremetal", "benchmark", "simulation"):
            _numpy_only(self, args, kwargs)
            return _as_numpy(super().__call__(*args, **kwargs))
        return super().__call__(*args, **kwargs)


def jit(func=None, mode="auto", **kwargs):
    """@nki.jit or @nki.jit(mode=...): mode is one of MODES; "benchmark" gives benchmark()'s kernel."""
    if mode not in MODES:
        raise NkiValidationError(f"nki.jit(mode={mode!r}): the mode must be one of {', '.join(MODES)}")
    if func is None:
        return lambda f: jit(f, mode=mode, **kwargs)
    if mode == "benchmark":
        return benchmark(func, **kwargs)
    fn = func.fn if isinstance(func, Kernel) else func
    return LegacyKernel(fn, mode=mode, **kwargs)


def baremetal(kernel=None, **kwargs):
    """@nki.baremetal(save_neff_name=..., ...): the kernel on numpy arrays (the file options
    name compiler artifacts, which the emulator does not make)."""
    if kernel is None:
        return lambda f: baremetal(f, **kwargs)
    return jit(kernel, mode="baremetal", **kwargs)


class NcLatency:
    """benchmark_result.nc_latency: the modelled latency of one call, in microseconds."""

    def __init__(self, us: float):
        self.us = us

    def get_latency_percentile(self, percentile: int) -> float:
        if percentile not in PERCENTILES:
            raise NkiValidationError(f"get_latency_percentile({percentile!r}): available percentiles are "
                                     f"{list(PERCENTILES)}")
        return self.us  # the model is deterministic: every iteration takes the same time


class BenchmarkResult:
    def __init__(self, us: float):
        self.nc_latency = NcLatency(us)


class BenchmarkKernel(LegacyKernel):
    """A @nki.benchmark(warmup=, iters=) kernel: after a call, `.benchmark_result.nc_latency`."""

    def __init__(self, fn, grid=(), warmup: int = 10, iters: int = 100, **options):
        for name, value, least in (("warmup", warmup, 0), ("iters", iters, 1)):
            if not isinstance(value, int) or value < least:
                raise NkiValidationError(f"nki.benchmark({name}={value!r}): give an int >= {least}")
        super().__init__(fn, grid, warmup=warmup, iters=iters, **options)
        self.benchmark_result: BenchmarkResult | None = None

    def __call__(self, *args, **kwargs):
        _numpy_only(self, args, kwargs)
        result, timeline = run(self, args, kwargs)
        self.benchmark_result = BenchmarkResult(timeline.total_ns / 1000)
        return _as_numpy(result)


def benchmark(kernel=None, warmup: int = 10, iters: int = 100, **kwargs):
    """@nki.benchmark(warmup=10, iters=100, ...): see BenchmarkKernel."""
    if kernel is None:
        return lambda f: benchmark(f, warmup=warmup, iters=iters, **kwargs)
    fn = kernel.fn if isinstance(kernel, Kernel) else kernel
    return BenchmarkKernel(fn, warmup=warmup, iters=iters, mode="benchmark", **kwargs)


def simulate_kernel(kernel, *args, **kwargs):
    """nki.simulate_kernel(kernel, *args): one call of the kernel on numpy arrays, on the CPU."""
    if not isinstance(kernel, Kernel):
        kernel = LegacyKernel(kernel)
    _numpy_only(kernel, args, kwargs)
    return _as_numpy(run(kernel, args, kwargs)[0])


def _as_numpy(result):
    """These modes return numpy arrays, also from a kernel given no array to take the kind from."""
    return pytree.tree_map(lambda x: x.numpy() if isinstance(x, torch.Tensor) else x, result)


def _numpy_only(kernel, args, kwargs) -> None:
    """baremetal, benchmark and simulation take numpy arrays, not framework tensors."""
    for x in list(args) + list(kwargs.values()):
        if hasattr(x, "__array__") and not isinstance(x, (np.ndarray, np.generic)) and hasattr(x, "device"):
            mode = kernel.options.get("mode", "simulation")
            raise TypeError(f"{kernel!r} (mode {mode!r}) takes numpy arrays, got {type(x).__module__}."
                            f"{type(x).__name__}: pass x.numpy(), or use nki.jit for framework tensors")
