"""torch.distributed on `neuron`: the "neuron" process-group backend and the collective kernel.

Note [Collectives]: on TorchNeuron, `init_process_group(backend="neuron")` gives a group
whose collectives run on the device. Ours runs them on each tensor's host data through
gloo, the way every op of the emulated device runs on its host data:

- The backend. `Backend.register_backend("neuron", ...)` with a creator that returns a
  whole `ProcessGroup` holding one gloo backend for both `cpu` and `neuron`. A creator
  that returned a bare gloo backend would be registered for `neuron` only when
  `init_process_group()` is called without a backend (torch then maps just the
  accelerator), and a neuron collective unwraps to CPU tensors, which then found no
  backend. Registering "neuron" for the `neuron` device also makes it the default backend
  once neuron is the accelerator (before, `init_process_group()` raised "we don't know
  which communication backend to use").
- The kernel. `c10d.*` ops on neuron tensors reach `__torch_dispatch__`; their OpInfo says
  `is_collective` (classify.py), and this module's `run_collective` is their
  `_neuron_special`: executors treat them as sync points (every pending op they read or
  write runs first) and call it. It unwraps the neuron tensors (same-device checks as for
  any op), runs the op on the host tensors (gloo writes into them: the device's bytes),
  and returns the very input wrappers the op wrote, as eager PyTorch does.
- Async work: `async_op=True` returns gloo's Work; gloo may still be writing the host data
  until `.wait()`, exactly as a CPU tensor would be. A collective is never part of a fused
  trace: replaying it later would change when it meets the other ranks.
"""
from __future__ import annotations

import datetime

import torch

from device.profiling import mark_device_time, profile_range, profiler_enabled

from .context import CONTEXT
from .kernels import op_cost_us, unwrap, wrap_new
from .tensor import NeuronTensor

BACKEND_NAME = "neuron"
DEVICES = ("neuron", "cpu")


# -- the process-group backend ---------------------------------------------------------------
def create_process_group(store, rank: int, world_size: int, timeout: datetime.timedelta):
    """The "neuron" backend's creator: one gloo backend serving both CPU and neuron tensors
    (neuron collectives run on the host data, see Note [Collectives])."""
    from torch.distributed import ProcessGroup, ProcessGroupGloo

    gloo = ProcessGroupGloo(store, rank, world_size, timeout)
    gloo._set_sequence_number_for_group()  # what torch does for its own gloo groups
    group = ProcessGroup(store, rank, world_size)
    group._set_default_backend(ProcessGroup.BackendType.GLOO)
    for device in DEVICES:
        group._register_backend(torch.device(device), ProcessGroup.BackendType.GLOO, gloo)
    return group


def install() -> bool:
    """Register the "neuron" c10d backend and DDP's option checks (idempotent). False if this
    torch build has no torch.distributed or no gloo: `backend="neuron"` then stays unknown."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return False
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, create_process_group, devices=list(DEVICES))
    return True


# -- the collective kernel --------------------------------------------------------------------
def run_collective(info, args, kwargs):
    """Run one c10d op on the host data of its neuron tensors (a sync point: executors call
    this only after every pending op has run)."""
    if profiler_enabled():  # as an eager op: a named range with its device time (Note [Profiler ranges])
        with profile_range("neuron::" + info.op._schema.name):
            return _run_collective(info, args, kwargs, profiled=True)
    return _run_collective(info, args, kwargs, profiled=False)


def _run_collective(info, args, kwargs, profiled: bool):
    u = unwrap(info, args, kwargs)
    CONTEXT.ops[u.device] += 1
    out = info.op(*u.args, **u.kwargs)
    wrappers = {}
    _collect_wrappers(args, wrappers)
    _collect_wrappers(kwargs.values(), wrappers)
    result = _rewrap(out, wrappers, u.device)
    # Counted as one launch of a memory-bound kernel on the bytes it reads (the network
    # between ranks is not modelled).
    device_us = CONTEXT.runtime.launch(u.device, op_cost_us(info, u, None))
    if profiled:
        mark_device_time(device_us, ops=1, device=u.device)
    return result


def _collect_wrappers(values, into: dict) -> None:
    """Map id(host data) -> wrapper for every neuron tensor in the (nested) arguments."""
    for v in values:
        if isinstance(v, NeuronTensor):
            into[id(v._data)] = v
        elif isinstance(v, (list, tuple)):
            _collect_wrappers(v, into)


def _rewrap(out, wrappers: dict, device_index: int):
    """The op returns the host tensors it wrote (its inputs' data): give back their wrappers."""
    if isinstance(out, torch.Tensor):
        wrapper = wrappers.get(id(out))
        if wrapper is not None:
            return wrapper
        # A collective that made a new tensor (none of the c10d ops in torch 2.13 does):
        # it belongs to the device its inputs are on.
        return wrap_new(out, device_index)
    if isinstance(out, (list, tuple)):
        return type(out)(_rewrap(o, wrappers, device_index) for o in out)
    return out
