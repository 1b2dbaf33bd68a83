"""Keeping checkpoints safe once `neuron` is the accelerator. (Pinned memory and
torch.accelerator.synchronize are the C++ core's: device/csrc.)

- Checkpoints: NeuronTensor pickles as torch's `_rebuild_device_tensor_from_cpu_tensor`
  (a CPU tensor plus the device name). `torch.load(..., map_location='neuron')` would then
  try to move the inner CPU storage to 'neuron' (`UntypedStorage.to` ->
  `torch.UntypedStorage(n, device='neuron')`), making a real PrivateUse1 storage that a
  NeuronTensor wrapper cannot use. A deserializer registered ahead of torch's PrivateUse1 one keeps such storages on the
  host; the rebuild then moves the tensor onto the device through `.to`.
"""
from __future__ import annotations

import re

import torch

_BACKEND = "neuron"
# torch.serialization sorts its registry by (priority, ...): it must be unique, and ahead of
# torch's own PrivateUse1 deserializer (23) and CUDA's (20).
_DESERIALIZER_PRIORITY = 19
_NEURON_LOCATION = re.compile(rf"{_BACKEND}(:[0-9]+)?")


def install(runtime, native_tensors: bool = False) -> None:
    if not native_tensors:  # native tensors have real storage: torch's own deserializer moves it
        _install_checkpoint_deserializer()


# -- checkpoints -----------------------------------------------------------------------
def _never_tag(storage):
    """We never save a storage on neuron (NeuronTensor pickles its CPU data)."""
    return None


def _keep_on_host(storage, location: str):
    """torch.load asks to move a just-read CPU storage to `neuron[:N]`. Keep it on the host:
    an UntypedStorage moved to 'neuron' is one no NeuronTensor can use. For our checkpoints the surrounding
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
