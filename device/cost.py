"""The cost model: emulated device time of a launch (DESIGN.md, "Cost model").

A launch costs a fixed overhead plus, per op, the roofline time
max(flops / peak_flops(dtype), bytes / hbm_bandwidth), with the chip's figures scaled
to the share of NeuronCores that one logical device owns.
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

    @property
    def us_per_byte(self) -> float:
        return self._us_per_byte

    def us_per_flop(self, dtype: torch.dtype) -> float:
        v = self._us_per_flop.get(dtype)
        if v is None:
            v = self._us_per_flop[dtype] = 1e6 / (self._profile.peak_flops(dtype) * self._share)
        return v

    def op_us(self, flops: float, nbytes: int, dtype: torch.dtype) -> float:
        """Roofline time of one op, in microseconds."""
        memory_us = nbytes * self._us_per_byte
        if not flops:
            return memory_us
        compute_us = flops * self.us_per_flop(dtype)
        return compute_us if compute_us > memory_us else memory_us

    def transfer_us(self, nbytes: int) -> float:
        """A host<->device copy, bounded by HBM bandwidth (the host link is not modelled)."""
        return nbytes * self._us_per_byte
