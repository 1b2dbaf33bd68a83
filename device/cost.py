"""The cost model: emulated device time of a launch (DESIGN.md, "Cost model").

A launch costs a fixed overhead plus, per op, the roofline time
max(flops / peak_flops(dtype), bytes / hbm_bandwidth), with the chip's figures scaled
to the share of NeuronCores that one logical device owns; an op without FLOPs is bounded
below by the Vector Engine too (Note [The Vector Engine floor]), and a fused launch keeps
its intermediates on chip (Note [On-chip intermediates]).

Note [The Vector Engine floor]: the ops the Tensor Engine does not run (elementwise,
reductions, casts, copies) stream their operands through the Vector Engine: "one input tile
... roughly N cycles", "two input tiles ... roughly 2N cycles" (nki guides/architecture/
trainium_inferentia2_arch.rst:389-395), so an op streams the sum of its inputs' elements (or its
largest output, if more: a fill). The rate is the engine's widest data path, as the Tensor
Engine's is its peak: "512 BF16/FP16 input/output; 256 input/output for other data types" per
cycle at 0.96 GHz on trn2 (trainium2_arch.rst:54-56), "512 BF16/FP16/FP8 ...; 256 ... other" at
1.2 GHz on trn3 (trainium3_arch.rst:51-53), per NeuronCore, by the op's dtype (its first
tensor's). The widest paths are the performance modes of some instructions (trainium2_arch.rst:
222-237); outside them the engine takes one element per partition per cycle (128), so the floor
is the fast side, as peak FLOPs are; the Scalar and GpSimd engines beside it are not counted. On
trn2 a bf16 add streams 2 elements per 6 bytes it moves and HBM bounds it in eager mode; the
floor bounds the ops whose bytes a fused launch keeps on chip.

Note [On-chip intermediates] (DESIGN.md: "In a fused launch, intermediates that never leave
the launch count no HBM traffic"): in a launch of the adaptive engine's queue
(csrc/engine/queue.cpp), the value an op makes is read by the launch's later ops from SBUF, not HBM,
while it is resident there; and it is written to HBM only if it leaves the launch, i.e. the
program still holds it when the launch is issued (an output, a tensor autograd saved for a
backward in another launch). A value stays resident from the op that makes it to its last
reader in the launch if it fits beside the values resident then in the logical device's SBUF
(sram_bytes_per_core x NeuronCores), first come first served; one that does not fit spills:
it is written to HBM and each later read is charged. Inputs from outside the launch (weights,
the batch) are read from HBM by every op that reads them. Each op keeps its own roofline; only
its byte count changes. Everything is decided at issue, from the queue alone: the modelled time
does not depend on when the device stream runs the launch. Launches made another way (a
compiled graph's, a Python kernel's) are charged all their bytes.
"""
from __future__ import annotations

import torch

from .config import DeviceConfig


class CostModel:
    def __init__(self, config: DeviceConfig):
        share = config.logical_cores / config.profile.neuron_cores_per_chip
        self.launch_overhead_us = config.launch_overhead_us
        self._us_per_byte = 1e6 / (config.profile.hbm_bandwidth_bytes_per_s * share)
        self._profile = config.profile
        self._share = share
        self._us_per_flop: dict[torch.dtype, float] = {}
        cores = config.logical_cores
        self._cores = cores
        self.on_chip_bytes = config.profile.sram_bytes_per_core * cores  # Note [On-chip intermediates]

    @property
    def us_per_byte(self) -> float:
        return self._us_per_byte

    def us_per_flop(self, dtype: torch.dtype) -> float:
        v = self._us_per_flop.get(dtype)
        if v is None:
            v = self._us_per_flop[dtype] = 1e6 / (self._profile.peak_flops(dtype) * self._share)
        return v

    def us_per_vector_element(self, dtype: torch.dtype) -> float:
        """Note [The Vector Engine floor]: µs per element of `dtype` the logical device streams."""
        return 1e6 / (self._profile.vector_elements_per_s(dtype) * self._cores)

    def op_us(self, flops: float, nbytes: int, dtype: torch.dtype) -> float:
        """Roofline time of one op, in microseconds."""
        memory_us = nbytes * self._us_per_byte
        if not flops:
            return memory_us
        compute_us = flops * self.us_per_flop(dtype)
        return compute_us if compute_us > memory_us else memory_us

    def collective_costs(self) -> dict:
        """What one rank (one logical device) spends in a collective (Note [Collectives on the
        link] in csrc/aten/collective_pricing.cpp; the figures: Note [Collective figures] in
        profiles.py): µs per byte over its share of the chip's NeuronLink (at most what its share
        of the chip's DMA engines move, which carry the data), over its share of the instance's
        EFA, per byte reduced, a hop's latency, and how many ranks one scale-up domain holds."""
        p = self._profile
        ranks_per_chip = max(1, p.neuron_cores_per_chip // self._cores)
        dma = p.dma_bytes_per_s * self._share
        link = min(p.neuronlink_bytes_per_s / ranks_per_chip, dma)
        return {"link_us_per_byte": 1e6 / link, "efa_us_per_byte": 1e6 * ranks_per_chip / p.efa_bytes_per_s_per_chip,
                "hop_us": p.collective_hop_us, "reduce_us_per_byte": 1e6 / (dma * p.collective_reduce_efficiency),
                "ranks_per_domain": p.chips_per_domain * ranks_per_chip}

    def transfer_us(self, nbytes: int) -> float:
        """A host<->device copy, bounded by HBM bandwidth (the host link is not modelled)."""
        return nbytes * self._us_per_byte
