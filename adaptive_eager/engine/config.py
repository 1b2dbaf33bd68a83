"""Settings of the adaptive engine, from the variables of adaptive_eager.device.settings."""
from __future__ import annotations

import dataclasses
from adaptive_eager.device import settings


_PERIODS_PER_TRACE = 2


@dataclasses.dataclass
class EngineConfig:
    cache_size: int = 256  # traces kept (LRU); the most a studied loop needed was 137
    repeats: int = 2  # consecutive sightings of a sequence before it is trusted
    min_trace_len: int = 4  # shortest trace between two ops that are not sync points
    min_trace_len_between_syncs: int = 2  # shortest trace bounded by sync points
    # Longest trace, in ops (one launch). A repeating unit up to _PERIODS_PER_TRACE times longer
    # (a very deep model's step) is found too, and split into that many consecutive traces.
    max_trace_len: int = 16384
    launch_blocking: bool = False  # NEURON_LAUNCH_BLOCKING=1: every op synchronous
    # Note [Shape-generic traces] (generic.py): NEURON_GENERIC_TRACES=0 caches exact traces only.
    generic_traces: bool = True
    # Note [Armed matching] (device/csrc/engine/route.cpp): NEURON_NATIVE_MATCH=0 matches in Python only.
    native_match: bool = True

    @property
    def max_period(self) -> int:
        """The longest repeating unit the detector looks for, in ops."""
        return _PERIODS_PER_TRACE * self.max_trace_len

    @staticmethod
    def from_env(env=None) -> "EngineConfig":
        return EngineConfig(cache_size=settings.read("NEURON_TRACE_CACHE_SIZE", env),
                            repeats=settings.read("NEURON_TRACE_REPEATS", env),
                            max_trace_len=settings.read("NEURON_MAX_TRACE_LEN", env),
                            launch_blocking=settings.read("NEURON_LAUNCH_BLOCKING", env),
                            generic_traces=settings.read("NEURON_GENERIC_TRACES", env),
                            native_match=settings.read("NEURON_NATIVE_MATCH", env))
