"""What a test may ask of a tensor on `neuron`, whichever kind of tensor the process runs
(NEURON_TENSORS=wrapper: a NeuronTensor wrapper subclass; native: a plain torch.Tensor whose
dispatch key is PrivateUse1, with storage of its own)."""
from __future__ import annotations

import torch

from dispatch import NeuronTensor
from dispatch.context import CONTEXT

NATIVE = CONTEXT.runtime.config.native_tensors


def is_neuron_tensor(t, device="neuron:0") -> bool:
    """t is a neuron tensor on `device`, made by the device, not a CPU tensor in disguise."""
    if t.device != torch.device(device):
        return False
    if NATIVE:
        return not isinstance(t, NeuronTensor) and torch._C._dispatch_keys(t).has(torch._C.DispatchKey.PrivateUse1)
    return isinstance(t, NeuronTensor)
