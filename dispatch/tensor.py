"""NeuronTensor: the wrapper subclass that every `neuron` tensor is.

A NeuronTensor carries the metadata (sizes, strides, offset, dtype, device) that PyTorch
sees, and `_data`, a host tensor holding the bytes the emulated device would hold. Views
of a NeuronTensor hold views of its `_data`, so writes through views land where eager
semantics say. Every ATen op on it enters `__torch_dispatch__` and goes to the installed
executor (see `dispatch.context`).
"""
from __future__ import annotations

import collections

import torch
from torch.utils._mode_utils import no_dispatch

from .context import CONTEXT

NEURON_DEVICES: list[torch.device] = []  # torch.device('neuron', i), filled at registration


class NeuronTensor(torch.Tensor):
    # No __slots__: nn.Module.to swaps tensors and refuses classes whose slots differ.
    _data: torch.Tensor
    # True once the wrapper carries a conj/neg bit: see Note [Math bits]. A class default, so
    # the per-argument check on the hot path is one attribute read.
    _math_bits = False
    # Note [Deferred values]: the adaptive engine hands out wrappers whose op has not run
    # yet: `_data` is None and `_cell` is a DeferredCell that the launch fills in (with the
    # value, or the error of the failed launch); `resolve_data` moves it into `_data` on
    # first read. The engine holds only weak references to cells, never to the wrappers:
    # a weakref on a tensor makes torch.utils.swap_tensors (nn.Module.to) refuse it, and a
    # strong one changes autograd's reference-count decisions (and so the op stream).
    # `_producer` = (stream position, output slot) of the op that last wrote the wrapper,
    # so the engine can tell dataflow inside a trace from inputs coming from outside.
    # Class defaults keep the hot-path reads cheap.
    _producer = None
    _cell = None
    # True on the wrappers torch.compile traces with (Note [Compiled graphs], compile_backend.py)
    _tracing = False
    # Note [Fresh allocations]: a pure allocation (`empty`, as `.to('neuron')` makes one right
    # before its copy) records the device's op count here. While the count is unchanged, no
    # op (held back, in flight, or run) can have seen this tensor, so a copy from the host
    # into it can run at once: it waits for nothing and cuts no trace.
    _fresh_at = -1

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
        # torch.compile reads `_data` right after this: a compiled call is a sync point, as an
        # op held back may still write this tensor in place (Note [Compiled graphs]).
        if not self._tracing:
            CONTEXT.runtime.synchronize(self._device_index)
            resolve_data(self)
        return ["_data"], self._device_index

    @staticmethod
    def __tensor_unflatten__(inner_tensors, device_index, outer_size, outer_stride):
        # Real host data -> a device tensor; fake/functional (tracing) -> a tracing wrapper.
        from .compile_backend import unflatten

        return unflatten(inner_tensors["_data"], device_index)

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
        # Save the host value through torch's own rebuild for storage-less devices (what
        # XLA uses): it is on the weights_only allow-list, and it honours map_location
        # ('cpu' gives real CPU tensors). The inner CPU storage must never be moved to
        # 'neuron' by torch.load (that would segfault): see host_compat's deserializer.
        if isinstance(self, torch.nn.Parameter):
            return (torch._utils._rebuild_parameter,
                    (self.detach(), self.requires_grad, collections.OrderedDict()))
        value = self.host_value().detach()
        return (torch._utils._rebuild_device_tensor_from_cpu_tensor,
                (value, self.dtype, str(self.device), self.requires_grad))


class DeferredCell:
    """Where a launch leaves a deferred wrapper's value (or its error). `launch` is set while
    the launch that fills it runs on the device stream: calling it waits for that launch."""

    __slots__ = ("__weakref__", "data", "error", "launch")

    def __init__(self):
        self.data = None
        self.error = None
        self.launch = None


def is_fresh(t) -> bool:
    """Note [Fresh allocations]: t is a neuron tensor no op has seen since it was allocated."""
    return type(t) is NeuronTensor and t._fresh_at == CONTEXT.ops[t._device_index]


def arriving(t: NeuronTensor) -> bool:
    """t's value is here, or a launch running on the device stream will bring it (or its
    error): a trace may take t as an input without waiting (the stream runs in order)."""
    if t._data is not None:
        return True
    cell = t._cell
    return cell is not None and (cell.data is not None or cell.launch is not None)


def resolve_data(t: NeuronTensor):
    """t's host data, taking it from its cell if a launch has filled it (waiting for a launch
    still running on the device stream); None if its value never arrived (a failed launch)."""
    data = t._data
    if data is None:
        cell = t._cell
        if cell is not None:
            if cell.launch is not None:
                cell.launch()
            if cell.data is not None:
                data = t._data = cell.data
                t._cell = None
    return data


def _format(t: NeuronTensor) -> str:
    if t._tracing or t.is_meta:
        # A tracing wrapper holds a fake or functional value (Note [Compiled graphs]): there is
        # nothing to read, and reading would fail (symbolic sizes). Print what torch prints for
        # a FakeTensor. torch.compile's own logs repr these (AOTAutograd's structured trace).
        return f"NeuronTensor(..., size={tuple(t.shape)}, dtype={t.dtype}, device='{t.device}')"
    host = t.host_value().detach()
    contents = torch._tensor_str._tensor_str(host, len("tensor("))
    text = torch._tensor_str._str_intern(t, tensor_contents=contents)
    # Print as a plain tensor does on any accelerator: tensor([...], device='neuron:0').
    return "tensor(" + text[len("NeuronTensor("):]


def host_view(t: NeuronTensor) -> torch.Tensor:
    """t's host data with t's conj/neg bits on it: what a kernel that reads the bits must see.

    Note [Math bits]: a conj or neg view (`x.conj()`, `_neg_view`) is a flag on the tensor,
    not new bytes. Inside `__torch_dispatch__` the Conjugate and Negative keys are excluded,
    so host kernels ignore such flags on their inputs (`mul` of a conj view silently loses the
    conjugation). The flags therefore live on the wrapper, as on CUDA's TensorImpl, and `_data`
    never carries them: the outer Conjugate/Negative fallbacks materialise flagged inputs for
    ordinary ops, and the few ops they let through (views, copy_, clone, mm and other BLAS ops
    that read the flags themselves) get the flags back here, in `unwrap`.
    """
    data = resolve_data(t)
    if t.is_conj():
        data = data.conj()
    if t.is_neg():
        data = data._neg_view()
    return data


def wrap_math_bits_view(data: torch.Tensor, device_index: int) -> NeuronTensor:
    """Wrap a host view that carries conj/neg bits: the bits move to the wrapper (Note [Math bits])."""
    conj, neg = data.is_conj(), data.is_neg()
    if conj:
        data = data.conj()  # a view with the bit cleared: same bytes
    if neg:
        data = data._neg_view()
    w = NeuronTensor(data, device_index)
    torch._C._set_conj(w, conj)
    torch._C._set_neg(w, neg)
    w._math_bits = True
    return w


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
