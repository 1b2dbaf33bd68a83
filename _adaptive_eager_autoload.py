"""The `torch.backends` entry point of adaptive-eager: `import torch` calls `load()` last.

It lives outside our three packages on purpose: importing a submodule of a package runs
the package's __init__, and when the user's own `import adaptive_eager` (or `dispatch`,
`device`) is what pulled torch in, that package is half-initialized right now. In that
case we return and let that import finish the registration itself.
"""
import sys


def _initializing(name: str) -> bool:
    spec = getattr(sys.modules.get(name), "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def load() -> None:
    if any(_initializing(n) for n in ("adaptive_eager", "dispatch", "device")):
        return
    import adaptive_eager  # noqa: F401  (registers the device and installs the engine)
