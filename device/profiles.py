"""Device profiles: the published figures of the chips we emulate (see DESIGN.md)."""
from __future__ import annotations

import dataclasses

import torch

GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """Figures for one chip. A `neuron:N` device is a logical core: a group of NeuronCores."""

    name: str
    neuron_cores_per_chip: int
    hbm_bytes_per_chip: int
    hbm_bandwidth_bytes_per_s: float
    dense_bf16_flops: float
    fp8_flops: float
    sram_bytes_per_core: int
    psum_bytes_per_core: int
    # No official per-launch overhead is published. This default is our assumption: the
    # order of magnitude of a runtime kernel launch on an accelerator (10-20 us).
    launch_overhead_us: float

    def peak_flops(self, dtype: torch.dtype) -> float:
        """Peak FLOP/s of one chip for a dtype; FP32 runs at a quarter of BF16 (assumption)."""
        if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return self.fp8_flops
        if dtype in (torch.bfloat16, torch.float16):
            return self.dense_bf16_flops
        return self.dense_bf16_flops / 4


PROFILES: dict[str, DeviceProfile] = {
    "trn2": DeviceProfile(
        name="trn2",
        neuron_cores_per_chip=8,
        hbm_bytes_per_chip=96 * GiB,
        hbm_bandwidth_bytes_per_s=2.9e12,
        dense_bf16_flops=667e12,
        fp8_flops=1299e12,
        sram_bytes_per_core=28 * 1024**2,
        psum_bytes_per_core=2 * 1024**2,
        launch_overhead_us=15.0,
    ),
    "trn3": DeviceProfile(
        name="trn3",
        neuron_cores_per_chip=8,
        hbm_bytes_per_chip=144 * GiB,
        hbm_bandwidth_bytes_per_s=4.9e12,
        dense_bf16_flops=671e12,
        fp8_flops=2517e12,
        sram_bytes_per_core=32 * 1024**2,
        psum_bytes_per_core=2 * 1024**2,
        launch_overhead_us=15.0,
    ),
}
