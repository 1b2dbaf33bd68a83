"""What each instruction costs on its engine: the figures of the NKI architecture guides.

Sources (aws-neuron-sdk, folder nki/): guides/architecture/trainium2_arch.rst and
trainium3_arch.rst ("Compute Engine Specifications": Tensor 2.4 GHz; Vector 0.96 GHz on
Trainium2, 1.2 GHz on Trainium3; Scalar 1.2 GHz; GpSimd 1.2 GHz), and
guides/architecture/trainium_inferentia2_arch.rst (the instruction cost rules of thumb:
a matmul takes roughly max(N, MM_INIT_LATENCY) Tensor Engine cycles with N the moving free
size and MM_INIT_LATENCY 64 cycles, fp32 at a quarter of the bf16 rate; most Vector Engine
instructions take roughly N cycles for one input tile and 2N for two, plus a static
overhead of about 100 engine cycles when an instruction depends on the previous one's
output; DMA: 16 queues per NeuronCore, each moving about 23 bytes/ns on trn2, 33 on trn3,
after a fixed cost of about 1.3 us). All costs are in nanoseconds.
"""
from __future__ import annotations

from . import dtypes as dt
from .target import Target

TENSOR, VECTOR, SCALAR, GPSIMD, DMA = "tensor", "vector", "scalar", "gpsimd", "dma"
ENGINES = (TENSOR, VECTOR, SCALAR, GPSIMD, DMA)

_GHZ = {  # (target version, engine) -> clock
    TENSOR: {2: 1.4, 3: 2.4, 4: 2.4},
    VECTOR: {2: 1.12, 3: 0.96, 4: 1.2},
    SCALAR: {2: 1.4, 3: 1.2, 4: 1.2},
    GPSIMD: {2: 1.4, 3: 1.2, 4: 1.2},
}
MM_INIT_CYCLES = 64
STATIC_OVERHEAD_CYCLES = 100  # a dependent ALU instruction's fixed cost (Vector/Scalar/GpSimd)
DMA_QUEUES = 16
DMA_FIXED_NS = 1300.0
DMA_BYTES_PER_NS = {2: 23.0, 3: 23.0, 4: 33.0}


def cycles_ns(target: Target, engine: str, cycles: float) -> float:
    return cycles / _GHZ[engine][target.version]


def matmul_ns(target: Target, moving_free: int, dtype: dt.NkiDType, *, double_row: bool = False,
              onezero: bool = False) -> float:
    """nc_matmul: the moving tile streams through the array, one column of it per cycle."""
    cycles = max(moving_free, MM_INIT_CYCLES)
    if dtype in (dt.float32, dt.tfloat32) and not onezero:
        cycles *= 4
    if double_row:
        cycles /= 2
    return cycles_ns(target, TENSOR, cycles)


def alu_ns(target: Target, engine: str, free_elems: int, inputs: int = 1) -> float:
    """A Vector/Scalar/GpSimd instruction over `free_elems` elements per partition."""
    return cycles_ns(target, engine, STATIC_OVERHEAD_CYCLES + max(1, inputs) * free_elems)


def dma_ns(target: Target, nbytes: int) -> float:
    """One DMA on one queue: the fixed cost, then the bytes at the queue's bandwidth."""
    return DMA_FIXED_NS + nbytes / DMA_BYTES_PER_NS[target.version]
