"""A `neuron` device that refuses to work, with the reason: what a bad setting leaves.

Note [A bad setting fails at first use] (adaptive_eager.device.settings): a `NEURON_*`
variable we cannot use must not make `import torch` fail in a program that never touches
neuron (torch re-raises any error of a backend entry point). So the autoload keeps the error
and makes `neuron` a device that raises it, with its message, at the first use: an op on a
neuron tensor or a factory on the device (a PrivateUse1 fallback), `torch.neuron.<anything>`,
and `import adaptive_eager` itself (which reads the settings again). As torch.cuda does when
its driver is broken, the probes that libraries call to choose a device answer without
raising: `torch.neuron.is_available()` (and so `torch.accelerator.is_available()`) is False,
with a warning that gives the message, `device_count()` is 0, and `hasattr(torch.neuron, ...)`
is False (the error is an AttributeError too).
"""
from __future__ import annotations

import sys
import types
import warnings

import torch

from adaptive_eager.device import native
from adaptive_eager.device.errors import NeuronConfigError

_refusal: list[torch.library.Library] = []  # the libraries of the kernels that raise, while refused


def refuse_the_device(error: NeuronConfigError) -> None:
    """Make `neuron` a device whose every use raises `error` (Note [A bad setting fails at first use])."""
    message = str(error)

    class NeuronUnusable(NeuronConfigError, AttributeError):
        """The configuration error, raised where the device is used."""

    def refuse(*args, **kwargs):
        raise NeuronConfigError(message)

    def attribute(name: str):
        if name.startswith("__"):  # the import system's and inspection's probes
            raise AttributeError(name)
        raise NeuronUnusable(message)

    torch.utils.rename_privateuse1_backend("neuron")  # so that 'neuron' parses as a device
    # `device='neuron'` asks the guard for the current device before any kernel runs.
    native.install_refusing_guard(message)
    lib = torch.library.Library("_", "IMPL")
    lib.fallback(refuse, "PrivateUse1")
    _refusal.append(lib)
    # Composite kernels apply to PrivateUse1 and run before a fallback: `.to('neuron')` is the
    # composite _to_copy, which would fail on the missing device guard ("PyTorch is not linked
    # with support for neuron devices"). Only in this broken configuration, so cost is no matter.
    aten = torch.library.Library("aten", "IMPL")
    for name in torch._C._dispatch_get_all_op_names():
        if (name.startswith("aten::")
                and not torch._C._dispatch_has_kernel_for_dispatch_key(name, "PrivateUse1")
                and torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd")):
            aten.impl(name[len("aten::"):], refuse, "PrivateUse1")
    _refusal.append(aten)

    def is_available() -> bool:
        warnings.warn(f"neuron is unavailable: {message}", RuntimeWarning, stacklevel=2)
        return False

    module = types.ModuleType("torch.neuron", "The neuron device, unusable: " + message)
    module.__getattr__ = attribute
    module.is_available = is_available
    module.device_count = lambda: 0
    torch._register_device_module("neuron", module)


def withdraw_refusal() -> None:
    """Undo refuse_the_device (the setting was fixed in this process): registration follows."""
    if not _refusal:
        return
    while _refusal:
        _refusal.pop()._destroy()
    sys.modules.pop("torch.neuron", None)
    if hasattr(torch, "neuron"):
        delattr(torch, "neuron")
