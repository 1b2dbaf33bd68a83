"""Keeping pure-CPU PyTorch working once `neuron` is the accelerator, keeping checkpoints
safe, and torch.accelerator calls that need a backend hook we cannot register from Python.

- Pinned memory: once a PrivateUse1 accelerator exists, `Tensor.pin_memory()` asks it for
  a pinned allocator (`getPinnedMemoryAllocator`), which a Python backend cannot provide,
  so even `torch.ones(2).pin_memory()` and `DataLoader(pin_memory=True)` on CPU data
  would raise. The emulated device copies from pageable memory anyway, so we replace the
  CPU kernels of `aten::_pin_memory` (a plain copy) and `aten::is_pinned` (False). The
  DataLoader's pin-memory thread needs nothing else: it only calls `Tensor.pin_memory()`
  and `torch.accelerator.set_device_index(current)`. Still broken (needs C++, see
  tests/test_footguns.py): `torch.empty(..., pin_memory=True)`, which asks the allocator
  directly inside the CPU factory.
- Checkpoints: NeuronTensor pickles as torch's `_rebuild_device_tensor_from_cpu_tensor`
  (a CPU tensor plus the device name). `torch.load(..., map_location='neuron')` would then
  try to move the inner CPU storage to 'neuron' (`UntypedStorage.to` ->
  `torch.UntypedStorage(n, device='neuron')`), which segfaults: there is no allocator. A
  deserializer registered ahead of torch's PrivateUse1 one keeps such storages on the
  host; the rebuild then moves the tensor onto the device through `.to`.
- `torch.accelerator.synchronize()`, `set_device_index()` and `current_device_index()`
  have no Python hook; we route them to `torch.neuron` when neuron is the accelerator.
  (`torch.accelerator.device_index(i)`, a context manager calling C++ directly, is not
  routed: see tests/test_footguns.py.)
"""
from __future__ import annotations

import re

import torch

_BACKEND = "neuron"
# torch.serialization sorts its registry by (priority, ...): it must be unique, and ahead of
# torch's own PrivateUse1 deserializer (23) and CUDA's (20).
_DESERIALIZER_PRIORITY = 19
_NEURON_LOCATION = re.compile(rf"{_BACKEND}(:[0-9]+)?")
_libraries: list[torch.library.Library] = []


def install(runtime, native_tensors: bool = False) -> None:
    _install_pinned_memory_stand_ins()
    if not native_tensors:  # native tensors have real storage: torch's own deserializer moves it
        _install_checkpoint_deserializer()
    _install_accelerator_functions()


# -- pinned memory ---------------------------------------------------------------------
def _pin_memory(self, device=None):
    # Pageable host memory is all the emulated device needs; pin_memory() still returns a
    # new tensor, as it does on CUDA.
    return self.clone()


def _is_pinned(self, device=None):
    return False


def _install_pinned_memory_stand_ins() -> None:
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_pin_memory", _pin_memory, "CPU")
    lib.impl("is_pinned", _is_pinned, "CPU")
    _libraries.append(lib)


# -- checkpoints -----------------------------------------------------------------------
def _never_tag(storage):
    """We never save a storage on neuron (NeuronTensor pickles its CPU data)."""
    return None


def _keep_on_host(storage, location: str):
    """torch.load asks to move a just-read CPU storage to `neuron[:N]`. Keep it on the host:
    moving an UntypedStorage to 'neuron' segfaults. For our checkpoints the surrounding
    rebuild moves the tensor to the device afterwards; a plain CPU tensor saved elsewhere
    stays a CPU tensor (see tests/test_footguns.py)."""
    if _NEURON_LOCATION.fullmatch(location) and storage.device.type == "cpu":
        return storage
    return None


def _install_checkpoint_deserializer() -> None:
    registry = torch.serialization._package_registry
    if any(entry[2] is _keep_on_host for entry in registry):
        return
    torch.serialization.register_package(_DESERIALIZER_PRIORITY, _never_tag, _keep_on_host)


# -- torch.accelerator -----------------------------------------------------------------
# Its C++ synchronize reaches the device guard, which knows nothing of launches the engine
# still holds back (Python): routed to torch.neuron while neuron is the accelerator. The
# current device needs no routing: the C++ guard holds it (Note [C++ device guard]).
def _install_accelerator_functions() -> None:
    _patch_accelerator("synchronize", lambda device=None: torch.neuron.synchronize(device))


def _neuron_is_accelerator() -> bool:
    acc = torch.accelerator.current_accelerator()
    return acc is not None and acc.type == "neuron"


def _patch_accelerator(name: str, on_neuron) -> None:
    original = getattr(torch.accelerator, name)
    if getattr(original, "_neuron", False):
        return

    def patched(*args, **kwargs):
        if _neuron_is_accelerator():
            return on_neuron(*args, **kwargs)
        return original(*args, **kwargs)

    patched._neuron = True
    patched.__name__ = name
    patched.__doc__ = original.__doc__
    setattr(torch.accelerator, name, patched)
