"""Ops that move data across the host/device boundary or between devices.

They are transfers, not kernel launches: counted by `Runtime.transfer`. A copy to the host
is a host read, so an executor that holds work back must first run what it depends on;
executors call these functions only once that is done.
"""
from __future__ import annotations

import torch

from device.profiling import transfer_range

from .context import CONTEXT
from .kernels import ready_data, run_kernel, wrap_new
from .tensor import NeuronTensor, host_view, is_fresh

aten = torch.ops.aten


def to_host(t: NeuronTensor) -> torch.Tensor:
    """A fresh host copy of t's value (device -> host transfer)."""
    _check_ready(t)
    data = t._data
    with transfer_range("d2h", t._device_index):  # Note [Profiler ranges]
        CONTEXT.runtime.transfer(t._device_index, data.nbytes)
        if t._math_bits:  # a conj/neg view: its value is the flagged data, resolved (Note [Math bits])
            return host_view(t).resolve_conj().resolve_neg().clone()
        return data.clone()


def _count(device_index: int) -> None:
    CONTEXT.ops[device_index] += 1


def _check_ready(*tensors) -> None:
    """Executors call transfers only once pending work ran; a value still missing then is
    one whose launch failed, and reading it raises that launch's error."""
    for t in tensors:
        if isinstance(t, NeuronTensor):
            ready_data(t, "a copy")


def to_copy(info, args, kwargs):
    src = args[0]
    _check_ready(src)
    dev = kwargs.get("device")
    dev = src.device if dev is None else torch.device(dev)
    host_kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "pin_memory")}
    if dev.type == "neuron":
        index = CONTEXT.runtime.check_index(dev.index)
        if index == src._device_index:  # a dtype/layout change on the device: a kernel
            return run_kernel(info, args, kwargs)
    _count(src._device_index)
    if dev.type == "neuron":
        with transfer_range("d2d", index):
            out = aten._to_copy.default(src._data, **host_kwargs)
            CONTEXT.runtime.transfer(index, out.nbytes)
        return wrap_new(out, index)
    with transfer_range("d2h", src._device_index):
        CONTEXT.runtime.transfer(src._device_index, src._data.nbytes)
        return aten._to_copy.default(src._data, device=dev, **host_kwargs)


def copy_(info, args, kwargs):
    dst, src = args[0], args[1]
    _check_ready(dst, src)
    non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    dst_on = isinstance(dst, NeuronTensor)
    src_on = isinstance(src, NeuronTensor)
    if dst_on and src_on and dst._device_index == src._device_index:
        return run_kernel(info, args, kwargs)
    if dst_on:
        _count(dst._device_index)
        # host -> device, or device -> device: the bytes land in dst's host storage now.
        with transfer_range("d2d" if src_on else "h2d", dst._device_index):
            host_view(dst).copy_(host_view(src) if src_on else src, non_blocking)  # Note [Math bits]
            CONTEXT.runtime.transfer(dst._device_index, dst._data.nbytes)
        return dst
    _count(src._device_index)
    with transfer_range("d2h", src._device_index):
        CONTEXT.runtime.transfer(src._device_index, src._data.nbytes)
        dst.copy_(host_view(src), non_blocking)
    return dst


def local_scalar_dense(info, args, kwargs):
    t = args[0]
    _check_ready(t)
    _count(t._device_index)
    with transfer_range("d2h", t._device_index):
        CONTEXT.runtime.transfer(t._device_index, t._data.element_size())
        return t._data.item()


def stays_on_device(func, args, kwargs) -> bool:
    """True for a copy op that is really a kernel on one device (a dtype cast, a copy
    between two tensors of the same device): an executor may hold it back like any op."""
    if func is aten._to_copy.default:
        dev = kwargs.get("device")
        if dev is None:
            return True
        dev = torch.device(dev)
        return dev.type == "neuron" and CONTEXT.runtime.check_index(dev.index) == args[0]._device_index
    if func is aten.copy_.default:
        dst, src = args[0], args[1]
        return (isinstance(dst, NeuronTensor) and isinstance(src, NeuronTensor)
                and dst._device_index == src._device_index and not dst._math_bits and not src._math_bits)
    return False


SPECIAL_OPS = {
    aten._to_copy.default: to_copy,
    aten.copy_.default: copy_,
    aten._local_scalar_dense.default: local_scalar_dense,
}
for _op, _handler in SPECIAL_OPS.items():
    _op._neuron_special = _handler  # read per op by executors: no dict lookup (see classify)


def _copy_from_kernel(src, dst, non_blocking=False):
    """PrivateUse1 kernel of aten::_copy_from, reached with the Python key excluded:
    `torch.tensor(data, device='neuron')` builds the data on the host and copies it over
    under that guard, so `copy_` never reaches `__torch_dispatch__`."""
    # Reached without the executor (Python key excluded): drain held-back work first, so
    # the source is computed and no pending op still reads the destination, unless the
    # source is the host's and no op has seen the destination (Note [Fresh allocations]).
    if isinstance(src, NeuronTensor) or not is_fresh(dst):
        CONTEXT.executor.synchronize(None)
    _check_ready(src, dst)
    dst_on, src_on = isinstance(dst, NeuronTensor), isinstance(src, NeuronTensor)
    source = host_view(src) if src_on else src  # Note [Math bits]
    target = host_view(dst) if dst_on else dst
    index = dst._device_index if dst_on else src._device_index
    _count(index)
    with transfer_range("d2d" if dst_on and src_on else "h2d" if dst_on else "d2h", index):
        target.copy_(source, non_blocking)
        CONTEXT.runtime.transfer(index, target.nbytes)
    return dst


def register_copy_kernels(lib: torch.library.Library) -> None:
    lib.impl("_copy_from", _copy_from_kernel, "PrivateUse1")
