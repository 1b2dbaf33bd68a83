"""Settings of the adaptive engine (documented in README)."""
from __future__ import annotations

import dataclasses
import os

from device import NeuronConfigError


@dataclasses.dataclass
class EngineConfig:
    cache_size: int = 256  # traces kept (LRU); the most a studied loop needed was 137
    repeats: int = 2  # consecutive sightings of a sequence before it is trusted
    min_trace_len: int = 4  # shortest trace between two ops that are not sync points
    min_trace_len_between_syncs: int = 2  # shortest trace bounded by sync points
    max_trace_len: int = 4096  # longest repeating unit looked for
    launch_blocking: bool = False  # NEURON_LAUNCH_BLOCKING=1: every op synchronous

    @staticmethod
    def from_env(env=None) -> "EngineConfig":
        env = os.environ if env is None else env
        cfg = EngineConfig()
        cfg.cache_size = _positive(env, "NEURON_TRACE_CACHE_SIZE", cfg.cache_size)
        cfg.repeats = _positive(env, "NEURON_TRACE_REPEATS", cfg.repeats, minimum=2)
        cfg.max_trace_len = _positive(env, "NEURON_MAX_TRACE_LEN", cfg.max_trace_len, minimum=2)
        cfg.launch_blocking = env.get("NEURON_LAUNCH_BLOCKING", "0").strip() not in ("", "0")
        return cfg


def _positive(env, key: str, default: int, minimum: int = 1) -> int:
    raw = env.get(key)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw)
    except ValueError:
        raise NeuronConfigError(f"{key}={raw!r} is not an integer; set an integer >= {minimum}.") from None
    if value < minimum:
        raise NeuronConfigError(f"{key}={value} is out of range; it must be >= {minimum}.")
    return value
