"""Optimizers take the same implementation path on `neuron` as they take on TorchNeuron.

On a real PrivateUse1 device the parameters are plain `torch.Tensor`s, so `torch.optim`
defaults to its `foreach` implementation (PrivateUse1 is in
`_get_foreach_kernels_supported_devices()`), and `clip_grad_norm_` & co. use `_foreach_norm`.
Both decisions also check `type(p) in _foreach_supported_types`, an exact-type list that
our `NeuronTensor` (and `nn.Parameter` on it, which stays a NeuronTensor) is not in: they
would silently fall back to the per-parameter loop, with about twice the ops per step.

Registering NeuronTensor in both lists is what torch does for its own subclass
(`torch.distributed.tensor` appends DTensor the same way). The foreach kernels then
arrive in `__torch_dispatch__` as `_foreach_*` ops and run on the host data. Nothing
changes for CPU tensors: the lists are only consulted together with the device type.
"""
from __future__ import annotations

import torch.optim.optimizer as _optimizer
import torch.utils._foreach_utils as _foreach_utils

from .tensor import NeuronTensor


def install() -> None:
    """Let optimizers and grad-clipping utilities default to foreach on neuron tensors."""
    for supported in (_optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
        if NeuronTensor not in supported:
            supported.append(NeuronTensor)
