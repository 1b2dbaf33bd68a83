"""Settings of the adaptive engine (documented in README)."""
from __future__ import annotations

import dataclasses
import os

from device.config import int_env


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

    @property
    def max_period(self) -> int:
        """The longest repeating unit the detector looks for, in ops."""
        return _PERIODS_PER_TRACE * self.max_trace_len

    @staticmethod
    def from_env(env=None) -> "EngineConfig":
        env = os.environ if env is None else env
        cfg = EngineConfig()
        cfg.cache_size = int_env(env, "NEURON_TRACE_CACHE_SIZE", cfg.cache_size, 1)
        cfg.repeats = int_env(env, "NEURON_TRACE_REPEATS", cfg.repeats, 2)
        cfg.max_trace_len = int_env(env, "NEURON_MAX_TRACE_LEN", cfg.max_trace_len, 2)
        cfg.launch_blocking = env.get("NEURON_LAUNCH_BLOCKING", "0").strip() not in ("", "0")
        cfg.generic_traces = env.get("NEURON_GENERIC_TRACES", "1").strip() not in ("", "0")
        return cfg
