"""Device configuration, read from NEURON_* environment variables (documented in README)."""
from __future__ import annotations

import dataclasses
import math
import os
import re

from .errors import NeuronConfigError
from .profiles import PROFILES, DeviceProfile

_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kib": 1024, "m": 1024**2, "mib": 1024**2,
               "g": 1024**3, "gib": 1024**3, "t": 1024**4, "tib": 1024**4}


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
        env = os.environ if env is None else env
        name = env.get("NEURON_PROFILE", "trn2").strip().lower()
        if name not in PROFILES:
            raise NeuronConfigError(
                f"NEURON_PROFILE={name!r} is not a known device profile; "
                f"use one of {sorted(PROFILES)}.")
        profile = PROFILES[name]
        lnc = int_env(env, "NEURON_LOGICAL_NC_CONFIG", 2, 1)
        if profile.neuron_cores_per_chip % lnc:
            raise NeuronConfigError(
                f"NEURON_LOGICAL_NC_CONFIG={lnc} must divide the {profile.neuron_cores_per_chip} "
                f"NeuronCores of a {name} chip; use 1, 2, 4 or 8.")
        default_count = profile.neuron_cores_per_chip // lnc
        count = int_env(env, "NEURON_NUM_DEVICES", default_count, 1)
        default_capacity = profile.hbm_bytes_per_chip * lnc // profile.neuron_cores_per_chip
        capacity = _size_env(env, "NEURON_DEVICE_MEMORY", default_capacity)
        overhead = _float_env(env, "NEURON_LAUNCH_OVERHEAD_US", profile.launch_overhead_us)
        spend = env.get("NEURON_SPEND_LAUNCH_OVERHEAD", "0").strip() not in ("", "0", "false", "no")
        tensors = env.get("NEURON_TENSORS", "native").strip().lower()
        if tensors not in ("", "native"):
            # The wrapper-subclass tensors are gone: a setting that asks for them must not be
            # ignored silently.
            raise NeuronConfigError(
                f"NEURON_TENSORS={tensors!r}: neuron tensors are always real PrivateUse1 tensors now "
                f"(the 'wrapper' kind was removed); unset NEURON_TENSORS.")
        return DeviceConfig(profile, lnc, count, capacity, overhead, spend)


def int_env(env, key: str, default: int, minimum: int) -> int:
    """An integer setting >= minimum from env, or default when unset; clear errors otherwise."""
    raw = env.get(key)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise NeuronConfigError(f"{key}={raw!r} is not an integer; set it to an integer >= {minimum}.") from None
    if value < minimum:
        raise NeuronConfigError(f"{key}={value} is out of range; it must be >= {minimum}.")
    return value


def _float_env(env, key: str, default: float) -> float:
    raw = env.get(key)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise NeuronConfigError(f"{key}={raw!r} is not a number; set it to microseconds, e.g. 15.") from None
    if not math.isfinite(value):  # float() takes 'nan' and 'inf': every device time would be one
        raise NeuronConfigError(f"{key}={raw!r} is not a finite number; set it to microseconds, e.g. 15.")
    if value < 0:
        raise NeuronConfigError(f"{key}={value} is negative; a launch overhead must be >= 0 us.")
    return value


def parse_size(text: str) -> int:
    """'24GiB', '512m', '1000' (bytes) -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(text)
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def _size_env(env, key: str, default: int) -> int:
    raw = env.get(key)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = parse_size(raw)
    except ValueError:
        raise NeuronConfigError(
            f"{key}={raw!r} is not a size; write bytes or a number with a unit, e.g. 24GiB or 512MiB.") from None
    if value <= 0:
        raise NeuronConfigError(f"{key}={raw!r} must be a positive size.")
    return value
