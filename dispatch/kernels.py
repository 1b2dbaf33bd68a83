"""Running one ATen op on the emulated device, in terms of the host data.

This is the eager path every executor builds on: unwrap the arguments (checking devices
the way CUDA does), run the op on the host tensors (random ops drawing from the device's
generator), wrap the results (returning the very input objects an in-place or out= op
wrote, as eager PyTorch does), and say what the launch costs.
"""
from __future__ import annotations

import torch
from torch.utils.flop_counter import flop_registry

from .classify import OpInfo
from .context import CONTEXT
from .tensor import NeuronTensor, fix_wrapper_metadata


class DeviceMismatchError(RuntimeError):
    pass


def mismatch_error(a: str, b: str, op_name: str) -> RuntimeError:
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, {a} and {b}! "
        f"(when running {op_name}). Move them to one device first, e.g. with .to('{a}').")


class Unwrapped:
    """Host-side arguments of one op, the device it runs on, and the bytes it reads."""

    __slots__ = ("args", "kwargs", "device", "in_bytes", "dtype", "target")

    def __init__(self):
        self.device = -1
        self.target = None  # the device index a `device=` argument names, if any
        self.in_bytes = 0
        self.dtype = None


def _unwrap(a, u: Unwrapped, info: OpInfo):
    if isinstance(a, NeuronTensor):
        d = a._device_index
        if d != u.device:
            if u.device >= 0:
                raise mismatch_error(f"neuron:{u.device}", f"neuron:{d}", info.name)
            u.device = d
        data = a._data
        u.in_bytes += data.nbytes
        if u.dtype is None:
            u.dtype = data.dtype
        return data
    if isinstance(a, torch.Tensor):
        # CPU 0-dim tensors are scalars, as on CUDA; CPU index tensors are allowed for indexing.
        if a.dim() != 0 and not info.allows_cpu_indices and a.device.type != "meta":
            raise mismatch_error("neuron:0" if u.device < 0 else f"neuron:{u.device}", str(a.device), info.name)
        return a
    if isinstance(a, (list, tuple)) and a and not isinstance(a[0], (int, float, bool)):
        return type(a)(_unwrap(x, u, info) for x in a)
    return a


_HOST = torch.device("cpu")


def unwrap(info: OpInfo, args, kwargs) -> Unwrapped:
    u = Unwrapped()
    u.args = [_unwrap(a, u, info) for a in args]
    u.kwargs = {k: _unwrap(v, u, info) for k, v in kwargs.items()} if kwargs else {}
    if info.device_arg is not None:
        _take_device_arg(info, u)
    if u.device < 0:
        u.device = CONTEXT.runtime.current_index if u.target is None else u.target
    return u


def _take_device_arg(info: OpInfo, u: Unwrapped) -> None:
    """Ops with a device= argument (new_empty, empty_like, _to_copy) run on the host and
    record which neuron device the result belongs to."""
    dev = u.kwargs.get(info.device_arg)
    if dev is None:
        return
    dev = torch.device(dev)
    if dev.type == "neuron":
        u.target = CONTEXT.runtime.check_index(dev.index)
        u.kwargs[info.device_arg] = _HOST


def run_on_host(info: OpInfo, device_index: int, args, kwargs):
    """Run the op on the host tensors; random ops draw from the device's generator.

    Note [RNG order]: every random op takes its numbers from the generator of the device it
    runs on, in the order the ops run on the device, never from torch's CPU default
    generator. So CPU random calls in between do not change device results, and any
    executor that runs the same ops in the same order gives the same numbers.
    """
    if not info.is_random:
        return info.op(*args, **kwargs)
    gen = CONTEXT.runtime.devices[device_index].generator
    name = info.generator_arg
    if name is not None and kwargs.get(name) is None and _generator_is_kwarg(info):
        kwargs[name] = gen
        return info.op(*args, **kwargs)
    # The op uses torch's default CPU generator (native_dropout, ...): lend it our state.
    default = torch.default_generator
    saved = default.get_state()
    default.set_state(gen.get_state())
    try:
        return info.op(*args, **kwargs)
    finally:
        gen.set_state(default.get_state())
        default.set_state(saved)


def _generator_is_kwarg(info: OpInfo) -> bool:
    return any(a.name == info.generator_arg and a.kwarg_only for a in info.op._schema.arguments)


def wrap_new(data: torch.Tensor, device_index: int) -> NeuronTensor:
    """Wrap a host tensor produced by a kernel; its storage now counts against the device."""
    CONTEXT.runtime.devices[device_index].memory.track(data.untyped_storage())
    return NeuronTensor(data, device_index)


def wrap_result(out, info: OpInfo, args, kwargs, device_index: int):
    """Map the host result back: written inputs are returned as themselves."""
    if isinstance(out, torch.Tensor):
        return _wrap_one(out, info.return_aliases[0] if info.return_aliases else None, info, args, kwargs, device_index)
    if isinstance(out, (tuple, list)):
        aliases = info.return_aliases
        if info.returns_tensor_list and len(aliases) == 1:
            return type(out)(_wrap_one(o, None, info, args, kwargs, device_index) for o in out)
        return type(out)(
            _wrap_one(o, aliases[i] if i < len(aliases) else None, info, args, kwargs, device_index)
            for i, o in enumerate(out))
    return out


def _wrap_one(o, alias, info: OpInfo, args, kwargs, device_index: int):
    if not isinstance(o, torch.Tensor):
        if isinstance(o, list):
            return [_wrap_one(x, None, info, args, kwargs, device_index) for x in o]
        return o
    if alias is not None:
        written = args[alias[1]] if alias[0] == "arg" else kwargs[alias[1]]
        if info.may_resize and isinstance(written, NeuronTensor):
            CONTEXT.runtime.devices[device_index].memory.track(written._data.untyped_storage())
            fix_wrapper_metadata(written)
        return written
    return wrap_new(o, device_index)


def op_cost_us(info: OpInfo, u: Unwrapped, out) -> float:
    """Roofline time of the op: bytes read and written, FLOPs where torch has a formula."""
    nbytes = u.in_bytes
    if isinstance(out, torch.Tensor):
        nbytes += out.nbytes
    elif isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                nbytes += o.nbytes
    flops = 0
    formula = flop_registry.get(info.op._overloadpacket)
    if formula is not None:
        try:
            flops = formula(*u.args, **u.kwargs, out_val=out)
        except Exception:  # a formula that cannot read these arguments: count bytes only
            flops = 0
    return CONTEXT.runtime.cost.op_us(flops, nbytes, u.dtype or torch.float32)


def run_kernel(info: OpInfo, args, kwargs):
    """Run one op now, as one launch on its device (the eager path)."""
    u = unwrap(info, args, kwargs)
    CONTEXT.ops[u.device] += 1
    out = run_on_host(info, u.device, u.args, u.kwargs)
    result = wrap_result(out, info, args, kwargs, u.device if u.target is None else u.target)
    CONTEXT.runtime.launch(u.device, op_cost_us(info, u, out))
    return result
