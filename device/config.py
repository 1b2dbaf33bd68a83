"""The device's configuration, from the NEURON_* variables of the settings table."""
from __future__ import annotations

import dataclasses

from . import settings
from .profiles import PROFILES, DeviceProfile


@dataclasses.dataclass(frozen=True)
class DeviceConfig:
    profile: DeviceProfile
    logical_cores: int  # NeuronCores per logical device (NEURON_LOGICAL_NC_CONFIG)
    num_devices: int
    capacity_bytes: int  # per device
    launch_overhead_us: float
    spend_launch_overhead: bool  # also spend the modelled overhead in wall-clock time

    @staticmethod
    def from_env(env=None) -> "DeviceConfig":
        """The configuration the NEURON_* variables ask for (adaptive_eager.device.settings)."""
        profile = PROFILES[settings.read("NEURON_PROFILE", env)]
        lnc = settings.read("NEURON_LOGICAL_NC_CONFIG", env)
        count = settings.read("NEURON_NUM_DEVICES", env) or profile.neuron_cores_per_chip // lnc
        capacity = (settings.read("NEURON_DEVICE_MEMORY", env)
                    or profile.hbm_bytes_per_chip * lnc // profile.neuron_cores_per_chip)
        overhead = settings.read("NEURON_LAUNCH_OVERHEAD_US", env)
        overhead = profile.launch_overhead_us if overhead is None else overhead
        spend = settings.read("NEURON_SPEND_LAUNCH_OVERHEAD", env)
        return DeviceConfig(profile, lnc, count, capacity, overhead, spend)
