"""NeuronTensor: the wrapper subclass that every `neuron` tensor is.

A NeuronTensor carries the metadata (sizes, strides, offset, dtype, device) that PyTorch
sees, and `_data`, a host tensor holding the bytes the emulated device would hold. Views
of a NeuronTensor hold views of its `_data`, so writes through views land where eager
semantics say. Every ATen op on it enters `__torch_dispatch__` and goes to the installed
executor (see `dispatch.context`).
"""
from __future__ import annotations

import torch
from torch.utils._mode_utils import no_dispatch

from .context import CONTEXT

NEURON_DEVICES: list[torch.device] = []  # torch.device('neuron', i), filled at registration


class NeuronTensor(torch.Tensor):
    # No __slots__: nn.Module.to swaps tensors and refuses classes whose slots differ.
    _data: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, device_index: int):
        t = torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=data.dtype, device=NEURON_DEVICES[device_index], requires_grad=False)
        t._data = data
        t._device_index = device_index
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return CONTEXT.executor.execute(func, args, kwargs or {})

    # -- subclass protocol (nn.Module.to, torch.compile) -----------------------------------
    def __tensor_flatten__(self):
        return ["_data"], self.device.index

    @staticmethod
    def __tensor_unflatten__(inner_tensors, device_index, outer_size, outer_stride):
        return NeuronTensor(inner_tensors["_data"], device_index)

    # -- host reads: C++ rejects these on subclasses, and each is a sync point ----------
    def host_value(self) -> torch.Tensor:
        """A host tensor with this tensor's current value (a sync point; the copy is fresh)."""
        return CONTEXT.executor.read(self)

    def tolist(self):
        return self.host_value().tolist()

    def numpy(self, *, force: bool = False):
        if force:
            return self.host_value().detach().numpy()
        raise TypeError(
            f"can't convert {self.device} device type tensor to numpy. "
            f"Use Tensor.cpu() to copy the tensor to host memory first.")

    def __array__(self, dtype=None, copy=None):
        return self.numpy()

    def __repr__(self, *, tensor_contents=None):
        return _format(self)

    def __format__(self, spec):
        if self.dim() == 0 and not self.is_meta:
            return self.item().__format__(spec)
        return object.__format__(self, spec)

    def __reduce_ex__(self, proto):
        # Save the host value: checkpoints then load with weights_only=True, on CPU or back
        # onto the device (map_location / load_state_dict copy it over).
        value = self.host_value().detach()
        if self.requires_grad:
            value.requires_grad_(True)
        return (_rebuild_on_device, (value, self.device.index, isinstance(self, torch.nn.Parameter)))


def _rebuild_on_device(value: torch.Tensor, device_index: int, is_param: bool):
    t = value.to(NEURON_DEVICES[device_index])
    return torch.nn.Parameter(t, requires_grad=value.requires_grad) if is_param else t


def _format(t: NeuronTensor) -> str:
    host = t.host_value().detach()
    contents = torch._tensor_str._tensor_str(host, len("tensor("))
    text = torch._tensor_str._str_intern(t, tensor_contents=contents)
    # Print as a plain tensor does on any accelerator: tensor([...], device='neuron:0').
    return "tensor(" + text[len("NeuronTensor("):]


def fix_wrapper_metadata(w: NeuronTensor) -> None:
    """Make the wrapper's sizes/strides/offset match its data after out=/resize_ ops.

    The wrapper's own storage is a fake that holds no bytes; a larger one is borrowed from
    a fresh wrapper, then the metadata is set under Meta dispatch so no kernel runs.
    """
    d = w._data
    size, stride, off = d.size(), d.stride(), d.storage_offset()
    if w.size() == size and w.stride() == stride and w.storage_offset() == off:
        return
    need = off + sum((s - 1) * st for s, st in zip(size, stride) if s > 0) + 1
    if any(s == 0 for s in size):
        need = off
    borrowed = None
    if w.untyped_storage().nbytes() < need * w.element_size():
        borrowed = torch.Tensor._make_wrapper_subclass(NeuronTensor, (need,), dtype=w.dtype, device=w.device)
    with no_dispatch():
        meta_in_tls = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            if borrowed is not None:
                torch.ops.aten.set_.source_Storage_storage_offset(w, borrowed.untyped_storage(), off, size, stride)
            else:
                torch.ops.aten.as_strided_.default(w, size, stride, off)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta_in_tls)
