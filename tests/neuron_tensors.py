"""What a test may ask of a tensor on `neuron`: a plain torch.Tensor whose dispatch key is
PrivateUse1, with storage of its own."""
from __future__ import annotations

import torch


def is_neuron_tensor(t, device="neuron:0") -> bool:
    """t is a neuron tensor on `device`, made by the device, not a CPU tensor in disguise."""
    return t.device == torch.device(device) and torch._C._dispatch_keys(t).has(torch._C.DispatchKey.PrivateUse1)
