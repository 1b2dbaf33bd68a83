"""Keeping pure-CPU PyTorch working once `neuron` is the accelerator, and torch.accelerator
calls that need a backend hook we cannot register from Python.

- Pinned memory: once a PrivateUse1 accelerator exists, `Tensor.pin_memory()` asks it for
  a pinned allocator, which a Python backend cannot provide. The emulated device copies
  from pageable memory anyway, so pinning is a no-op: `pin_memory()` returns a copy and
  `is_pinned()` is False.
- `torch.accelerator.synchronize()` has no Python hook; we route it to the device's
  synchronize when neuron is the current accelerator.
"""
from __future__ import annotations

import torch


def install(runtime) -> None:
    _install_accelerator_synchronize(runtime)


def _install_accelerator_synchronize(runtime) -> None:
    original = torch.accelerator.synchronize
    if getattr(original, "_neuron", False):
        return

    def synchronize(device=None) -> None:
        acc = torch.accelerator.current_accelerator()
        if acc is not None and acc.type == "neuron":
            torch.neuron.synchronize(device)
        else:
            original(device)

    synchronize._neuron = True
    synchronize.__doc__ = original.__doc__
    torch.accelerator.synchronize = synchronize
