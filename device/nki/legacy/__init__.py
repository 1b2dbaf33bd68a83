"""The neuronxcc.nki dialect (NKI 0.1: the `neuronxcc.nki` namespace that nki-samples, the SDK's
older tutorials and TorchNeuron's NKI tests use), as a layer over this package, not a second
simulator: its kernels run on the same instructions, memories and cost model.

What it adds: kernels that run with dialect "neuronxcc" (kernel.py: `nki.jit(mode=...)`,
`baremetal`, `benchmark`, `simulate_kernel`, grids as lists), Python operators on their tiles
(Note [Operators on tiles] in tensor.py), `nl.par_dim`, `nl.arange`/`nl.mgrid` indices
(indexing.py), `mask=` (masking.py), instructions that return their result tile (isa.py).
`nki.typing` is shared as it is.
"""
from . import isa, language
from .kernel import BenchmarkKernel, LegacyKernel, baremetal, benchmark, jit, simulate_kernel, tensor

__all__ = ["BenchmarkKernel", "LegacyKernel", "baremetal", "benchmark", "isa", "jit", "language", "simulate_kernel",
           "tensor"]
