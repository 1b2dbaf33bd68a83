"""The device's C++ core, `device._C` (device/csrc), compiled by `pip install` (setup.py).

Note [C++ device guard]: the device guard and PrivateUse1 hooks that C++ autograd and the
dispatcher call, and the current device (per thread, as on CUDA), live there.
"""
from __future__ import annotations

try:
    from . import _C
except ImportError as exc:  # a source tree that was never installed, or a build for another torch
    raise ImportError(
        "adaptive-eager's C++ core (device/_C, compiled from device/csrc at install time) is missing "
        f"or does not load ({exc}). Install the project, which compiles it: pip install -e . "
        "(a C++ compiler is needed; torch is fetched for the build).") from exc

install = _C.install
current_device = _C.current_device
set_current_device = _C.set_current_device
