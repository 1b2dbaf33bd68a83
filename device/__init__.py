"""The emulated AWS Trainium chip: profiles, memory, launches, clock, cost model, RNG.

This layer knows nothing of PyTorch dispatch or of traces; `dispatch/` and
`adaptive_eager/` sit above it.
"""
from .config import DeviceConfig
from .settings import parse_size
from .errors import NeuronConfigError, NeuronDeviceError, NeuronDeviceIndexError
from .memory import DeviceMemory, format_bytes
from .profiles import PROFILES, DeviceProfile
from .runtime import DEFAULT_SEED, Counters, NeuronDevice, Runtime

_runtime: Runtime | None = None


def get_runtime() -> Runtime:
    """The process's runtime, created from the environment on first use."""
    global _runtime
    if _runtime is None:
        _runtime = Runtime()
    return _runtime


__all__ = [
    "DEFAULT_SEED", "PROFILES", "Counters", "DeviceConfig", "DeviceMemory", "DeviceProfile",
    "NeuronConfigError", "NeuronDevice", "NeuronDeviceError", "NeuronDeviceIndexError", "Runtime", "format_bytes",
    "get_runtime", "parse_size",
]
