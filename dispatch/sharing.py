"""Sending a neuron tensor to another process: refused at the send, saying what to do.

Note [Neuron tensors stay in their process]: torch.multiprocessing sends a CPU tensor through
shared memory and a CUDA tensor through CUDA IPC; a neuron tensor's bytes are this process's
device memory, which no other process can map. torch's reducers treat any non-CUDA storage as
a CPU one and failed with "_share_fd_: only available on CPU", naming neither the tensor nor
the way out. So the reducers torch registers with multiprocessing's ForkingPickler (a queue's
put, the arguments of torch.multiprocessing.spawn and of a spawned Process) are wrapped: a
neuron tensor or storage raises a RuntimeError that says to send it as a CPU tensor; every
other object goes to torch's reducer as before. Plain pickling (torch.save) is untouched.
"""
from __future__ import annotations

from multiprocessing.reduction import ForkingPickler

import torch

_MESSAGE = (
    "Cannot send a neuron {what} to another process: its bytes are this process's device memory, which "
    "another process cannot share (torch.multiprocessing shares CPU tensors through shared memory and CUDA "
    "tensors through CUDA IPC; neuron has neither). Move it to the CPU before sending ({how}) and move it "
    "back with .to('neuron') in the receiving process, or create the tensor there.")


def _refusing_neuron(reduce):
    """torch's reducer `reduce`, refusing neuron tensors and storages first."""
    def reduce_unless_neuron(obj):
        device = getattr(obj, "device", None)
        if isinstance(device, torch.device) and device.type == "neuron":
            is_tensor = isinstance(obj, torch.Tensor)
            raise RuntimeError(_MESSAGE.format(what="tensor" if is_tensor else "storage",
                                               how="send t.cpu()" if is_tensor else "send a CPU tensor"))
        return reduce(obj)

    reduce_unless_neuron.refuses_neuron = True
    reduce_unless_neuron.__wrapped__ = reduce
    return reduce_unless_neuron


def install() -> None:
    """Wrap torch's multiprocessing reducers of tensors and storages (idempotent)."""
    from torch.multiprocessing import reductions

    torch_reducers = {reductions.reduce_tensor, reductions.reduce_storage, reductions.reduce_typed_storage,
                      reductions.reduce_typed_storage_child}
    for cls, reduce in list(ForkingPickler._extra_reducers.items()):
        if reduce in torch_reducers:
            ForkingPickler.register(cls, _refusing_neuron(reduce))
