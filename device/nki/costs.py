"""What each instruction costs on its engine: the figures of the NKI architecture guides.

Every figure's source is in the aws-neuron-sdk repository, folder nki/ (paths below are under
it). An instruction occupies its engine for its initiation interval (II: the cycles before
the engine takes its next instruction) and its results are visible to other instructions a
latency later (timeline.py). Where the guides give a figure only for NeuronCore-v2 (trn1),
the emulator reuses it for v3/v4 and says so.

Clocks (GHz), "Compute Engine Specifications": guides/architecture/trainium2_arch.rst:44-64
(Tensor 2.4, Vector 0.96, Scalar 1.2, GpSimd 1.2) and trainium3_arch.rst:41-61 (Tensor 2.4,
the others 1.2); trn1 from trainium_inferentia2_arch.rst:65-73.

Tensor Engine (nc_matmul): "roughly max(N, MM_INIT_LATENCY), where MM_INIT_LATENCY is 64
TensorE cycles on NeuronCore-v2, and N is the free axis size of moving"
(trainium_inferentia2_arch.rst:267-268; v2's 64 reused); fp32 "roughly 4x higher than
BF16/FP16/TF32/cFP8" (:269); the onezero hints "could lead to 2x better performance if ...
float32" (api/nki/isa/__init__.py, nc_matmul); FP8 double_row: "with a 256 contraction
dimension takes the same amount of time as the regular BF16/FP16 ... with a 128 contraction
dimension" (trainium2_arch.rst:101), i.e. the same II for twice the work; transpose is a
matmul with the identity as moving (N = the input's partitions), "2x speedup in FP32
transpose" on v3+ (trainium2_arch.rst:201).

MX (NeuronCore-v4, guides/architecture/trainium3_arch.rst): nc_matmul_mx "runs at 4x the
throughput compared to a BF16/FP16 matmul" (:75) by "quadrupling the maximum contraction
dimension ... from 128 ... to 512" (:79): each PE takes one x4 word a cycle, so the II is a
bf16 nc_matmul's, max(N, MM_INIT_LATENCY) for N moving x4 words. quantize_mx "can quantize four
input elements per partition, per cycle (i.e., 4x Vector performance mode)" (:172), so
max(MIN_II, F/4) Vector cycles for F source elements per partition; with Tensor at 2.4 and
Vector at 1.2 GHz a quantize runs at half a matmul's rate, as deep-dives/mxfp-matmul.rst:253
says ("Matmul-MX produces data at double the rate that Quantize-MX can consume it").

Vector/Scalar/GpSimd: "only one input tile ... roughly N cycles", "two input tiles ...
roughly 2N cycles" (trainium_inferentia2_arch.rst:389-395, N elements per partition),
"MIN_II is roughly 64 engine cycles" (api/nki.api.shared.rst:253), "a static instruction
overhead of 100 engine cycles" when an instruction depends on the previous one's output
(trainium_inferentia2_arch.rst:402-404: modelled as the latency before a result is visible);
Vector reciprocal "max(MIN_II, 8*N)" (api/nki.api.shared.rst:244); reading out the
activation accumulators "roughly 64 ScalarE cycles" (trainium_inferentia2_arch.rst:492).
Vector Engine performance modes on v3 (trainium2_arch.rst:222-237): 4x for tensor_copy and
tensor_scalar with SBUF input and output, both bf16/fp16, contiguous innermost dim; 2x when
not contiguous or one side is in PSUM, and for tensor_tensor with both inputs in SBUF and
every tile bf16/fp16 (assumed to hold on v4, whose Vector data path is as wide,
trainium3_arch.rst:51-53). Scalar Engine on v4: "up to 2x ... for BF16/FP16" tensor_scalar and
tensor_copy (trainium3_arch.rst:218). No figures are published for bn_stats, iota or
affine_select: they are priced as one-input instructions (an assumption).

DMA: "Each NeuronCore (v2-v4) is paired with 16 DMA engines" (get-started/about/
nki-dma-overview.rst:7), each moving "23 B/ns" on trn2 and "33 B/ns" on trn3 (:56-63); "each
DMA engine is typically responsible for moving data for eight SBUF partitions" (:34), so a
transfer of P partitions uses min(16, ceil(P/8)) engines; "every DMA transfer incurs
descriptor setup, synchronization, and semaphore-to-start latency (~1300 ns cross-engine)"
(deep-dives/nki-dma-bandwidth-guide.rst:38-41); small rows are "overhead-bound" below 256 B
per partition and approach peak at 2 KiB (:77-85): modelled as efficiency b / (b + 200)
for b contiguous bytes per row, an assumption fitted to those words, not a published
figure. DMA transpose: "up to 90% DMA throughput" from HBM (trainium2_arch.rst:321), "up to
50%" SBUF to SBUF (:340).
"""
from __future__ import annotations

import math

from . import dtypes as dt
from .target import Target

TENSOR, VECTOR, SCALAR, GPSIMD, DMA = "tensor", "vector", "scalar", "gpsimd", "dma"
ENGINES = (TENSOR, VECTOR, SCALAR, GPSIMD, DMA)

_GHZ = {  # engine -> {target version -> clock}
    TENSOR: {2: 2.8, 3: 2.4, 4: 2.4},
    VECTOR: {2: 1.12, 3: 0.96, 4: 1.2},
    SCALAR: {2: 1.4, 3: 1.2, 4: 1.2},
    GPSIMD: {2: 1.4, 3: 1.2, 4: 1.2},
}
MM_INIT_CYCLES = 64
MIN_II_CYCLES = 64
DEPENDENCY_CYCLES = 100  # until a Vector/Scalar/GpSimd result is visible to a dependent instruction
ACC_READ_CYCLES = 64
DMA_ENGINES = 16
DMA_PARTITIONS_PER_ENGINE = 8
DMA_LATENCY_NS = 1300.0
DMA_BYTES_PER_NS = {2: 23.0, 3: 23.0, 4: 33.0}
DMA_ROW_OVERHEAD_BYTES = 200.0  # assumption: see the module docstring


class Cost:
    """An instruction's price: engine occupancy, latency until its results are visible, and
    (DMA only) how many of the core's DMA engines it spreads over."""

    __slots__ = ("ns", "latency_ns", "engines")

    def __init__(self, ns: float, latency_ns: float = 0.0, engines: int = 1):
        self.ns, self.latency_ns, self.engines = ns, latency_ns, engines


def cycles_ns(target: Target, engine: str, cycles: float) -> float:
    return cycles / _GHZ[engine][target.version]


def matmul(target: Target, moving_free: int, dtype: dt.NkiDType, *, onezero: bool = False,
           transpose: bool = False) -> Cost:
    """nc_matmul (or a Tensor Engine transpose): one column of the moving tile per cycle."""
    factor = 1
    if dtype in (dt.float32, dt.tfloat32):
        factor = 2 if (onezero or (transpose and target.version >= 3)) else 4
    return Cost(cycles_ns(target, TENSOR, max(moving_free * factor, MM_INIT_CYCLES)))


def matmul_mx(target: Target, moving_words: int) -> Cost:
    """nc_matmul_mx: one x4 word (four contraction elements) of each moving column per cycle."""
    return Cost(cycles_ns(target, TENSOR, max(moving_words, MM_INIT_CYCLES)))


def quantize_mx(target: Target, src_free_elems: int) -> Cost:
    """quantize_mx on the Vector Engine: four source elements per partition per cycle."""
    return alu(target, VECTOR, src_free_elems, speedup=4.0)


def alu(target: Target, engine: str, free_elems: int, inputs: int = 1, speedup: float = 1.0,
        extra_cycles: float = 0.0) -> Cost:
    """A Vector/Scalar/GpSimd instruction streaming `inputs` tiles of `free_elems` per partition."""
    ii = max(MIN_II_CYCLES, max(1, inputs) * free_elems / speedup) + extra_cycles
    return Cost(cycles_ns(target, engine, ii), cycles_ns(target, engine, DEPENDENCY_CYCLES))


def vector_speedup(target: Target, instr: str, dst, *srcs) -> float:
    """The Vector Engine's bf16/fp16 performance modes (v3 and later)."""
    if target.version < 3:
        return 1.0
    tiles = [dst, *srcs]
    half = all(t.dtype in (dt.bfloat16, dt.float16) for t in tiles)
    if not half:
        return 1.0
    in_sbuf = [t.buffer == "sbuf" for t in tiles]
    if instr in ("tensor_copy", "tensor_scalar"):
        contiguous = all(t.strides[-1] == 1 or t.shape[-1] == 1 for t in tiles)
        if all(in_sbuf) and contiguous:
            return 4.0
        if all(in_sbuf) or (contiguous and sum(not s for s in in_sbuf) == 1):
            return 2.0
        return 1.0
    if instr == "tensor_tensor" and all(t.buffer == "sbuf" for t in srcs):
        return 2.0
    return 1.0


def scalar_speedup(target: Target, instr: str, dst, *srcs) -> float:
    if target.version >= 4 and instr in ("tensor_copy", "tensor_scalar") and \
            all(t.dtype in (dt.bfloat16, dt.float16) for t in (dst, *srcs)):
        return 2.0
    return 1.0


def dma(target: Target, nbytes: int, partitions: int, row_bytes: float, *, efficiency: float = 1.0) -> Cost:
    """A DMA spread over the engines its partitions map to; rows of `row_bytes` contiguous bytes."""
    engines = max(1, min(DMA_ENGINES, math.ceil(partitions / DMA_PARTITIONS_PER_ENGINE)))
    row_eff = row_bytes / (row_bytes + DMA_ROW_OVERHEAD_BYTES)
    ns = nbytes / (engines * DMA_BYTES_PER_NS[target.version] * row_eff * efficiency)
    return Cost(ns, DMA_LATENCY_NS, engines)


def contiguous_row_bytes(t) -> float:
    """Bytes of the innermost contiguous run of a view (a DMA descriptor's element); on chip a
    run never crosses a partition."""
    run, expect = 1, 1
    dims = list(zip(t.shape, t.strides))[1 if t.on_chip else 0:]
    for n, s in reversed(dims):
        if n == 1:
            continue
        if s != expect:
            break
        run *= n
        expect *= n
    return run * t.dtype.itemsize


# --- nki.collectives ------------------------------------------------------------------------------
# Sources are in the aws-neuron-sdk repository (paths from its root).
# NeuronLink bandwidth per chip: trn2 "Intra-instance NeuronLink-v3 bandwidth (GB/sec/chip) 1,024"
# (about-neuron/arch/neuron-hardware/trn2-arch.rst:97-99); trn3 "NeuronLink-v4 ... provides 2.56
# TB/sec bandwidth per device" (about-neuron/arch/neuron-hardware/trainium3.rst:41). No figure is
# published for trn1's NeuronLink-v2 (trn1-arch.rst:76 says only "high-bandwidth"): trn2's is reused
# (an assumption). A chip's link is shared by its ranks, as collectives.rst:110 (neuron-runtime/
# about/) shares a chip's EFA bandwidth ("each rank gets 3.2 Tbps / 64"): ranks per chip = cores per
# chip / LNC, with "eight NeuronCore-v3 cores" (trainium2.rst:7), eight v4 (trainium3.rst:27) and
# "2 x NeuronCore-v2" (trainium.rst:7).
NEURONLINK_BYTES_PER_NS = {2: 1024.0, 3: 1024.0, 4: 2560.0}  # GB/s per chip = B/ns
CORES_PER_CHIP = {2: 2, 3: 8, 4: 8}
# "the per-hop latency of Ring/KangaRing is about 1-2 us (HBM load dependent)"
# (neuron-runtime/explore/intranode-collective-comm.rst:61): the midpoint, an assumption.
COLLECTIVE_HOP_NS = 1500.0
# Reductions run on the DMA engines' collective compute: "50% DMA throughput via DMA collective
# compute engines prior to NeuronCore-v4", full DMA throughput on v4 (nki/guides/architecture/
# trainium3_arch.rst:270).
COLLECTIVE_REDUCE_EFFICIENCY = {2: 0.5, 3: 0.5, 4: 1.0}


def collective_link_bytes_per_ns(target: Target, lnc: int) -> float:
    """What one rank moves per ns: its share of the chip's NeuronLink, at most what its 16 DMA
    engines move (they carry the data)."""
    ranks_per_chip = max(1, CORES_PER_CHIP[target.version] // max(1, lnc))
    link = NEURONLINK_BYTES_PER_NS[target.version] / ranks_per_chip
    return min(link, DMA_ENGINES * DMA_BYTES_PER_NS[target.version])


def collective(target: Target, lnc: int, wire_bytes: float, hops: int, reduce_bytes: float = 0.0) -> Cost:
    """One collective on one rank: `hops` link latencies, the bytes it sends over its link share,
    and the bytes it reduces on the DMA engines' collective compute. It holds all 16 DMA queues
    of its core for that time (the collective's transfers are spread over them)."""
    rate = collective_link_bytes_per_ns(target, lnc)
    reduce_rate = DMA_ENGINES * DMA_BYTES_PER_NS[target.version] * COLLECTIVE_REDUCE_EFFICIENCY[target.version]
    ns = hops * COLLECTIVE_HOP_NS + wire_bytes / rate + reduce_bytes / reduce_rate
    return Cost(ns, 0.0, DMA_ENGINES)
