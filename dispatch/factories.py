"""PrivateUse1 kernels for factory ops (ops with a `device` argument and no tensor input).

`__torch_dispatch__` never sees these: nothing in their arguments is a NeuronTensor. So
each gets a `torch.library` kernel on the PrivateUse1 key, found from the schemas (not a
hand-kept list): the op runs on the host and its result is wrapped on the named device.
"""
from __future__ import annotations

import math

import torch

from device.profiling import mark_device_time, profile_range, profiler_enabled

from .classify import classify
from .context import CONTEXT
from .kernels import run_on_host, wrap_new
from .tensor import NEURON_DEVICES

_HOST = torch.device("cpu")
# Pure allocations: no kernel runs on the device, so no launch is counted.
_ALLOCATING_ONLY = ("empty", "empty_strided", "empty_permuted", "new_empty")


def factory_ops() -> list[torch._ops.OpOverload]:
    ops = []
    for qualname in torch._C._dispatch_get_all_op_names():
        if not qualname.startswith("aten::"):
            continue
        packet_name, _, overload = qualname[len("aten::"):].partition(".")
        packet = getattr(torch.ops.aten, packet_name, None)
        if packet is None:
            continue
        try:
            op = getattr(packet, overload or "default")
        except AttributeError:
            continue
        if _is_factory(op):
            ops.append(op)
    return ops


def _is_factory(op) -> bool:
    args = op._schema.arguments
    has_device = any(a.name == "device" and "Device" in str(a.type) for a in args)
    has_tensor = any("Tensor" in str(a.type) for a in args)
    has_layout_only_sparse = "sparse" in op._schema.name or "quantized" in op._schema.name
    return has_device and not has_tensor and not has_layout_only_sparse and not classify(op).mutates


def _device_index(dev) -> int:
    dev = torch.device(dev) if dev is not None else None
    return CONTEXT.runtime.check_index(dev.index if dev is not None else None)


def _check_capacity(op, index: int, args, kwargs) -> None:
    """Refuse an allocation that cannot fit before the host allocates it."""
    names = [a.name for a in op._schema.arguments]
    if "size" not in names:
        return
    i = names.index("size")
    size = args[i] if i < len(args) else kwargs.get("size")
    if not isinstance(size, (list, tuple)):
        return
    dtype = kwargs.get("dtype") or torch.get_default_dtype()
    itemsize = torch.empty((), dtype=dtype).element_size()
    CONTEXT.runtime.devices[index].memory.reserve(math.prod(int(s) for s in size) * itemsize)


def make_factory_kernel(op):
    info = classify(op)
    launches = op._schema.name.split("::")[-1] not in _ALLOCATING_ONLY
    device_pos = next(i for i, a in enumerate(op._schema.arguments) if a.name == "device")
    range_name = "neuron::" + op._schema.name  # Note [Profiler ranges]

    def kernel(*args, **kwargs):
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if launches and CONTEXT.executor.takes_factories and device_pos >= len(args):
            # The executor may hold the factory back like any op (a fill in a traced step).
            # Pure allocations (empty) stay immediate: no kernel runs, and `.to('neuron')`
            # allocates with one right before its copy, a sync point.
            kwargs["device"] = NEURON_DEVICES[_device_index(kwargs.get("device"))]
            return CONTEXT.executor.execute(op, args, kwargs)
        args = list(args)
        if device_pos < len(args):
            index = _device_index(args[device_pos])
            args[device_pos] = _HOST
        else:
            index = _device_index(kwargs.get("device"))
            kwargs["device"] = _HOST
        _check_capacity(op, index, args, kwargs)
        if info.is_random:
            # Note [RNG order]: ops held back by the executor draw before this factory does.
            CONTEXT.executor.synchronize(index)
        CONTEXT.ops[index] += 1
        if profiler_enabled():  # the one check per factory op: Note [Profiler ranges]
            with profile_range(range_name):
                return _run_factory(info, index, args, kwargs, launches, profiled=True)
        return _run_factory(info, index, args, kwargs, launches, profiled=False)

    kernel.__name__ = f"neuron_{op._schema.name.split('::')[-1]}"
    return kernel


def _run_factory(info, index: int, args, kwargs, launches: bool, profiled: bool):
    out = run_on_host(info, index, args, kwargs)
    result = wrap_new(out, index)
    if not launches:
        result._fresh_at = CONTEXT.ops[index]  # Note [Fresh allocations]
    if launches:
        device_us = CONTEXT.runtime.launch(index, CONTEXT.runtime.cost.op_us(0, out.nbytes, out.dtype))
        if profiled:
            mark_device_time(device_us, ops=1, device=index)
    return result


def register_factories(lib: torch.library.Library) -> list[str]:
    names = []
    for op in factory_ops():
        name = op._schema.name.split("::")[-1] + ("." + op._overloadname if op._overloadname != "default" else "")
        lib.impl(name, make_factory_kernel(op), "PrivateUse1")
        names.append(name)
    return names
