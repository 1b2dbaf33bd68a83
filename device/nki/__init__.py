"""The emulated NeuronCore's kernel interface: NKI (the `nki` package of Neuron SDK 2.32/2.33).

`nki.language` (tensors, memories, loops, tile-level math), `nki.isa` (the instructions),
`nki.jit` (kernels, SPMD grids), run on the host with the chip's memory limits and a
per-engine timeline of modelled time. The public face is `adaptive_eager.nki`; this package
is the chip's side and knows nothing of torch's dispatcher (see kernel.set_device_runner).
"""
from . import isa, language
from .errors import NkiValidationError
from .kernel import Kernel, jit, measuring, run, set_device_runner, simulate
from .timeline import KernelProfile

__all__ = ["Kernel", "KernelProfile", "NkiValidationError", "isa", "jit", "language", "measuring", "run", "set_device_runner",
           "simulate"]
