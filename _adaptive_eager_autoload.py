"""The `torch.backends` entry point of adaptive-eager: `import torch` calls `load()` last.

It lives outside the adaptive_eager package on purpose: importing a submodule of a package
runs the package's __init__, and when the user's own `import adaptive_eager` is what pulled
torch in, that package is half-initialized right now. In that case we return and let that
import finish the registration itself. Its name is one no user would give a file of theirs.

A setting we cannot use must not break `import torch` (Note [A bad setting fails at first
use], adaptive_eager/device/settings.py): `import adaptive_eager` raises NeuronConfigError
before it registers anything, and we make `neuron` a device that refuses with that message
instead. The modules that does it with were imported by the failed import before it raised
(the import system drops only the package that failed, not its loaded submodules), and are
taken from sys.modules: importing them again would run the package's __init__ again.
"""
import sys


def _initializing(name: str) -> bool:
    spec = getattr(sys.modules.get(name), "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def load() -> None:
    if _initializing("adaptive_eager"):
        return
    try:
        import adaptive_eager  # noqa: F401  (registers the device and installs the engine)
    except Exception as error:
        errors = sys.modules.get("adaptive_eager.device.errors")
        refusal = sys.modules.get("adaptive_eager.dispatch.refusal")
        if errors is None or refusal is None or not isinstance(error, errors.NeuronConfigError):
            raise
        refusal.refuse_the_device(error)
