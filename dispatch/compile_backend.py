"""torch.compile on neuron tensors: the `neuron` Dynamo backend, and tracing through NeuronTensor.

`torch.compile(model, backend="neuron")` finds `neuron_backend` through the
`torch_dynamo_backends` entry point (pyproject.toml), so nothing here imports torch._dynamo
until a model is compiled.

Note [Compiled graphs]: Dynamo and AOTAutograd trace a NeuronTensor by flattening it to its
host tensor `_data` (`__tensor_flatten__`) and rebuilding it around fake or functional host
tensors (`__tensor_unflatten__`). Those tracing-time wrappers (`tracing_wrapper`) run their
ops straight on the inner tensors and reach no executor, so tracing launches nothing,
counts nothing, charges no device memory, and the adaptive engine never records (or defers)
an op on a fake value. AOTAutograd's graphs are therefore written against host CPU tensors;
at run time it unwraps the real inputs to `_data` (after `__tensor_flatten__` synchronized the
device: a compiled call is a sync point, since an op the engine still holds back may write an
input in place while its `_data` is already set) and rebuilds the outputs with
`__tensor_unflatten__`, which wraps real host tensors as device tensors (`wrap_new`).

The `neuron` backend compiles each AOTAutograd graph (forward, backward, inference) into a
`CompiledGraph`: one call runs the whole FX graph on the host tensors (no per-op dispatch)
and accounts ONE launch on the device, whose cost is the summed roofline cost of its ops.
Other backends (`eager`, `aot_eager`, `inductor`) work through the same tracing path; they
return neuron tensors but account no launches (their kernels never reach the runtime).
"""
from __future__ import annotations

import contextlib

import torch
import torch.fx
from torch.utils._pytree import tree_flatten, tree_map_only

from .classify import classify
from .context import CONTEXT
from .dynamo_opaque import hide_late_module
from .kernels import (
    DefaultGeneratorLent,
    Unwrapped,
    mismatch_error,
    op_cost_us,
    wrap_new,
)
from .tensor import NeuronTensor

_HOST = torch.device("cpu")
# Input shapes whose graph cost is remembered per compiled graph (dynamic shapes add more).
_MAX_COST_ENTRIES = 64


# -- tracing through NeuronTensor --------------------------------------------------------------
def tracing_wrapper(data: torch.Tensor, device_index: int) -> NeuronTensor:
    """A neuron tensor around a fake/functional host tensor, alive only while torch.compile
    traces (Note [Compiled graphs])."""
    t = NeuronTensor(data, device_index)
    t._tracing = True
    # An instance attribute shadows the class's __torch_dispatch__ (torch looks it up on the
    # argument object), so tracing ops bypass the executor at no cost to the per-op hot path.
    # It must stay a NeuronTensor: AOTAutograd checks `type(input) is NeuronTensor` at run time
    # against the type it traced with.
    t.__torch_dispatch__ = _traced_dispatch
    return t


def _traced_dispatch(func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    info = classify(func)
    if info.decomposes:
        out = func.decompose(*args, **kwargs)
        if out is not NotImplemented:
            return out
    device = _traced_device(info.name, args, kwargs)
    to_host = False
    if info.device_arg is not None and kwargs.get(info.device_arg) is not None:
        target = torch.device(kwargs[info.device_arg])
        if target.type == "neuron":
            device = CONTEXT.runtime.check_index(target.index)
            kwargs = {**kwargs, info.device_arg: _HOST}
        else:
            to_host = True  # .cpu()/.to('cpu') inside a graph: the result is a host tensor
    inner_args = tree_map_only(torch.Tensor, _inner, args)
    inner_kwargs = tree_map_only(torch.Tensor, _inner, kwargs)
    out = func(*inner_args, **inner_kwargs)
    if to_host:
        return out
    return _wrap_traced(out, info, args, kwargs, device)


def _inner(t: torch.Tensor) -> torch.Tensor:
    if type(t) is not NeuronTensor:
        if t.device.type == "neuron":
            # A factory's result (`torch.ones(..., device=x.device)`): under tracing, a plain
            # fake tensor on `neuron`. The graph computes on host tensors, so it is copied to
            # the host here, in the graph, and CompiledGraph makes the factory itself a host one.
            return torch.ops.aten._to_copy.default(t, device=_HOST)
        return t
    if t._data is None:  # a real deferred value inside a traced op: Note [Compiled graphs]
        raise RuntimeError(
            "internal error: a neuron tensor whose value is still pending reached torch.compile "
            "tracing without a sync; please report it. NEURON_ADAPTIVE_EAGER=0 avoids it.")
    return t._data


def _traced_device(op_name: str, args, kwargs) -> int:
    device = -1
    for a in tree_flatten((args, kwargs))[0]:
        if isinstance(a, NeuronTensor):
            if device >= 0 and a._device_index != device:
                raise mismatch_error(f"neuron:{device}", f"neuron:{a._device_index}", op_name)
            device = a._device_index
    return device if device >= 0 else CONTEXT.runtime.current_index


def _wrap_traced(out, info, args, kwargs, device: int):
    """Wrap traced results; an in-place/out= op returns the very input it wrote, as eager does."""
    if isinstance(out, torch.Tensor):
        return _wrap_one(out, info.return_aliases[0] if info.return_aliases else None, args, kwargs, device)
    if isinstance(out, (tuple, list)):
        aliases = info.return_aliases
        return type(out)(
            _wrap_one(o, aliases[i] if i < len(aliases) and not info.returns_tensor_list else None,
                      args, kwargs, device)
            for i, o in enumerate(out))
    return out


def _wrap_one(o, alias, args, kwargs, device: int):
    if isinstance(o, list):
        return [_wrap_one(x, None, args, kwargs, device) for x in o]
    if not isinstance(o, torch.Tensor):
        return o
    if alias is not None:
        return args[alias[1]] if alias[0] == "arg" else kwargs[alias[1]]
    return tracing_wrapper(o, device)


def unflatten(data: torch.Tensor, device_index: int) -> NeuronTensor:
    """NeuronTensor.__tensor_unflatten__: a real host tensor becomes a device tensor (its
    storage charged to the device); a fake or functional one a tracing wrapper."""
    if type(data) is torch.Tensor and data.device.type == "cpu" and not torch._is_functional_tensor(data):
        return wrap_new(data, device_index)
    return tracing_wrapper(data, device_index)


# -- the `neuron` backend ----------------------------------------------------------------------
def neuron_backend(gm: torch.fx.GraphModule, example_inputs):
    """Dynamo backend: AOTAutograd splits forward and backward; each graph runs as one launch."""
    if CONTEXT.runtime.config.native_tensors:  # real PrivateUse1 tensors: compile_native.py
        from .compile_native import NativeCompiledGraph as graph_class

        devices = {t.device.index for t in example_inputs if isinstance(t, torch.Tensor) and t.device.type == "neuron"}
    else:
        graph_class = CompiledGraph
        devices = {t._device_index for t in example_inputs if isinstance(t, NeuronTensor)}
    device = _graph_device(devices)
    if device is None:  # nothing on neuron: a plain host graph, run as it is
        return gm.forward
    # A slow import: only when a model is compiled, never at `import torch`.
    from torch._dynamo.backends.common import aot_autograd

    def compile_graph(graph: torch.fx.GraphModule, inputs):
        return graph_class(graph, device)

    return aot_autograd(fw_compiler=compile_graph, bw_compiler=compile_graph)(gm, example_inputs)


def _graph_device(devices: set[int]) -> int | None:
    """The one neuron device of a graph's inputs, None if none is on neuron."""
    devices = sorted(devices)
    if len(devices) > 1:
        raise RuntimeError(
            f"torch.compile(backend='neuron'): one compiled graph runs on one device, but its "
            f"inputs are on {', '.join(f'neuron:{d}' for d in devices)}. Move them to one device "
            f"first (e.g. with .to('neuron:{devices[0]}')), or compile each device's part separately.")
    return devices[0] if devices else None


class CompiledGraph:
    """One AOTAutograd graph, run on host tensors as one launch on its device.

    Called with the boxed convention: one list of the graph's host tensors (unwrapped by
    AOTAutograd after the sync of Note [Compiled graphs]), which the call empties so they can
    be freed early; returns host tensors, which AOTAutograd wraps."""

    def __init__(self, gm: torch.fx.GraphModule, device_index: int):
        self.gm = gm
        # On the instance: Dynamo wraps the backward with functools.wraps, which copies the
        # instance's __dict__ (not class attributes) onto the wrapper AOTAutograd then calls.
        self._boxed_call = True
        self.device_index = device_index
        _factories_on_host(gm)
        ops = [n.target for n in gm.graph.nodes
               if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]
        self.num_ops = len(ops)
        self.is_random = any(classify(op).is_random for op in ops)
        self._costs: dict = {}  # input shapes -> summed roofline cost (us)

    def __call__(self, args):
        key = tuple(a.shape if isinstance(a, torch.Tensor) else a for a in args)
        cost = self._costs.get(key)
        with _device_rng(self.device_index, self.is_random):
            if cost is None:
                interpreter = _CostInterpreter(self.gm)
                out = interpreter.run(*args)
                cost = interpreter.cost_us
                if len(self._costs) < _MAX_COST_ENTRIES:
                    self._costs[key] = cost
            else:
                out = self.gm(*args)
        args.clear()
        self._track(out)
        CONTEXT.runtime.launch(self.device_index, cost, self.num_ops)
        return out

    def _track(self, out) -> None:
        """Outputs (activations saved for backward included) are device memory."""
        memory = CONTEXT.runtime.devices[self.device_index].memory
        for o in out:
            if isinstance(o, torch.Tensor):
                memory.track(o.untyped_storage())


def _factories_on_host(gm: torch.fx.GraphModule) -> None:
    """A factory node on `neuron` whose result the graph only uses inside (through the copy
    `_inner` added) makes a host tensor instead: it runs in this launch, like every other op.
    One the graph returns stays a neuron factory, whose result is then a device tensor."""
    changed = False
    for node in gm.graph.nodes:
        device = node.kwargs.get("device") if node.op == "call_function" else None
        if (isinstance(device, torch.device) and device.type == "neuron"
                and not any(user.op == "output" for user in node.users)):
            node.kwargs = {**node.kwargs, "device": _HOST}
            changed = True
    if changed:
        gm.recompile()


def _device_rng(device_index: int, active: bool):
    """Random ops in a graph use torch's default CPU generator: lend it the device's state
    for the call (Note [RNG order]), as run_on_host does for one op."""
    return DefaultGeneratorLent(CONTEXT.runtime.devices[device_index].generator) if active else _NO_RNG


_NO_RNG = contextlib.nullcontext()


class _CostInterpreter(torch.fx.Interpreter):
    """Runs the graph node by node once per input shapes, summing each op's roofline cost
    with the eager path's formula (dispatch.kernels.op_cost_us)."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm, garbage_collect_values=True)
        self.cost_us = 0.0

    def call_function(self, target, args, kwargs):
        out = super().call_function(target, args, kwargs)
        if isinstance(target, torch._ops.OpOverload):
            self.cost_us += _op_cost(target, args, kwargs, out)
        return out


def _op_cost(op, args, kwargs, out) -> float:
    u = Unwrapped()
    u.args, u.kwargs = args, kwargs
    for a in tree_flatten((args, kwargs))[0]:
        if isinstance(a, torch.Tensor):
            u.in_bytes += a.nbytes
            if u.dtype is None:
                u.dtype = a.dtype
    return op_cost_us(classify(op), u, out)


# Imported lazily, after `import adaptive_eager` marked the rest: Note [Opaque to Dynamo].
hide_late_module(__name__)
