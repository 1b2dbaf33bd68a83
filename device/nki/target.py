"""The NeuronCore generation a kernel runs on, and the figures of its on-chip memories.

The target is the device profile's NeuronCore (trn2: NeuronCore-v3, "gen3"; trn3:
NeuronCore-v4, "gen4"), or, as for the NKI simulator, NEURON_PLATFORM_TARGET_OVERRIDE
(`trn1`/`gen2`, `trn2`/`gen3`, `trn3`/`gen4`). Sources, from the aws-neuron-sdk repository
(folder nki/): the trn2 and trn3 architecture guides (guides/architecture/trainium2_arch.rst,
"NeuronCore-v3 SBUF capacity is 28MiB (or, 128 partitions of 224KiB) ... PSUM capacity
remains the same at 2MiB"; trainium3_arch.rst, "SBUF capacity is 32 MiB"), the trn1 guide
(24 MiB SBUF), and nki.isa.nc_matmul's documented tile limits (stationary free size <= 128,
moving free size <= 512 on v2/v3, up to 4096 fp32 elements on v4: all 8 PSUM banks).
"""
from __future__ import annotations

import dataclasses

from .. import settings

KiB = 1024


@dataclasses.dataclass(frozen=True)
class Target:
    version: int  # NeuronCore-v<version - 1>: 2 = trn1, 3 = trn2, 4 = trn3
    name: str  # trn1, trn2, trn3
    partitions: int
    sbuf_partition_bytes: int
    psum_partition_bytes: int
    psum_banks: int
    gemm_stationary_fmax: int
    gemm_moving_fmax: int  # with a float32 PSUM destination
    bn_stats_fmax: int = 512

    @property
    def psum_bank_bytes(self) -> int:
        return self.psum_partition_bytes // self.psum_banks


TARGETS = {
    2: Target(2, "trn1", 128, 192 * KiB, 16 * KiB, 8, 128, 512),
    3: Target(3, "trn2", 128, 224 * KiB, 16 * KiB, 8, 128, 512),
    4: Target(4, "trn3", 128, 256 * KiB, 16 * KiB, 8, 128, 4096),
}
_NAMES = {"trn1": 2, "inf2": 2, "gen2": 2, "trn2": 3, "gen3": 3, "trn3": 4, "gen4": 4}


def current_target(profile_name: str | None = None) -> Target:
    """The target of a kernel called now: the override if set, else the device profile's."""
    override = settings.read("NEURON_PLATFORM_TARGET_OVERRIDE")
    if override:
        return TARGETS[_NAMES[override]]
    name = profile_name or settings.read("NEURON_PROFILE")
    return TARGETS[_NAMES.get(name.strip().lower(), 3)]
