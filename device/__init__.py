"""adaptive_eager.device (the repository's device/): the emulated AWS Trainium chip.

Its job: what the chip is and does, whoever asks. Its settings (`settings.py`: every
environment variable, one table), profiles and cost model (`profiles.py`, `cost.py`),
memory, the runtime and clock (`runtime.py`), streams, profiler ranges, the `torch.neuron`
module (`torch_module.py`), the NeuronCore's NKI simulator (`nki/`), and its C++ core
(`csrc/`, compiled at install into `_C`, bound in `native.py`; csrc/README.md says which
folder holds what: a new ATen kernel goes in csrc/aten/).

The bottom layer: it imports nothing of adaptive_eager.dispatch or of the engine (the C++
queue in csrc/engine/ holds what the engine defers, but knows no trace); those sit above it.
"""

if __name__ != "adaptive_eager.device":  # the repository's folder, imported by its own name
    raise ImportError(
        f"the folder device/ of adaptive-eager was imported as {__name__!r}; it is the package "
        f"adaptive_eager.device (pyproject.toml's package-dir): import adaptive_eager.device. "
        f"A second copy under another name would hold a second, unregistered device.")

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
