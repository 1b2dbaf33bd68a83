"""Launches, transfers and sync points as named `torch.profiler` ranges.

(A profile that asks for the device's activity also gets the device's own track on the
modelled clock: Note [The device timeline], device/csrc/runtime/device_timeline.cpp.)

Every launch shows up in a CPU profiler trace as a range on the thread that issued it:
`neuron::aten::addmm` (an eager launch), `neuron::fused[trace 3, 118 ops]` (a fused one),
`neuron::transfer[host->device]`, `neuron::sync[host read]`. The layers above open the
ranges (they know the names) with the helpers here; each launch and transfer carries its
emulated device time in a nested `neuron::device_time` range (below).

Note [Profiler ranges]:
- Cost when no profiler runs: callers test `profiler_enabled()` (a C function reading a
  global flag, ~0.05 µs) once per eager op, and take a separate profiled path only when it
  is true. Ops the adaptive engine defers pay nothing (only their fused launch checks).
- The device time of a launch is known only after its work ran (the cost model reads the
  output sizes), but a range's arguments are fixed when it opens. So each launch or
  transfer ends with a short nested range `neuron::device_time` inside its own range,
  whose arguments are `device_us` (what `Runtime.launch`/`transfer` charged) and `ops` or
  `bytes`. The outer range keeps one stable name per op or trace, so `key_averages()`
  aggregates it; its duration is the host time the emulator spent. Launch callers emit
  the mark from their profiled path (so an eager op pays no second check inside
  `Runtime.launch`); `Runtime.transfer` emits it itself (transfers are rare).
- Range arguments reach the exported chrome trace only with `record_shapes=True`
  (torch drops them otherwise). The user's source lines of a fused launch (its first and
  last ops) are wanted exactly when `with_stack=True` is asked for, which does not imply
  `record_shapes`, so they go into the range's name then.
- `_RecordFunctionFast(name, None, ...)` aborts the process in torch 2.13 ("input_values
  must be a list or tuple"): always pass a tuple.
"""
from __future__ import annotations

import contextlib
import sys

import torch
from torch._C._profiler import _RecordFunctionFast

from . import settings

# The one check on the hot path: True while any torch profiler (kineto or legacy) records.
profiler_enabled = torch._C._autograd._profiler_enabled

DEVICE_TIME = "neuron::device_time"
_NO_INPUTS = ()  # never None: see Note [Profiler ranges]


_sources: bool | None = None  # None: NEURON_PROFILER_SOURCES's, read at the first question


def profiler_sources() -> bool:
    """Whether fused launches' ranges always name their source lines, even without
    `with_stack=True` (NEURON_PROFILER_SOURCES=1 sets it at start-up)."""
    global _sources
    if _sources is None:
        _sources = settings.read("NEURON_PROFILER_SOURCES")
    return _sources


def set_profiler_sources(on: bool) -> bool:
    """Show (True) or hide the user's source lines in fused launch ranges whether or not
    the profiler has `with_stack=True`; returns the previous setting."""
    global _sources
    previous, _sources = profiler_sources(), bool(on)
    return previous


def profile_range(name: str, **args) -> _RecordFunctionFast:
    """A context manager recording one named range (args: see Note [Profiler ranges])."""
    return _RecordFunctionFast(name, _NO_INPUTS, args)


def mark_device_time(device_us: float, **args) -> None:
    """The emulated device time of the enclosing launch or transfer, as a nested range."""
    with _RecordFunctionFast(DEVICE_TIME, _NO_INPUTS, dict(args, device_us=device_us)):
        pass


def sources_wanted() -> bool:
    """True if source lines belong in range names: the setting, or a profiler with
    with_stack=True on this thread (its Python tracer is installed as the thread's
    profile function; torch offers no other way to read the running profiler's config)."""
    if profiler_sources():
        return True
    tracer = sys.getprofile()
    return tracer is not None and type(tracer).__name__ == "TraceContext"


def fused_range_name(trace_id: int, num_ops: int, first_source=None, last_source=None) -> str:
    """`neuron::fused[trace 3, 118 ops]`, with `: first -> last` source lines when given."""
    if first_source is None:
        return f"neuron::fused[trace {trace_id}, {num_ops} ops]"
    return f"neuron::fused[trace {trace_id}, {num_ops} ops: {first_source} -> {last_source}]"


TRANSFER_NAMES = {
    "h2d": "neuron::transfer[host->device]",
    "d2h": "neuron::transfer[device->host]",
    "d2d": "neuron::transfer[device->device]",
}


_NO_RANGE = contextlib.nullcontext()  # stateless: one instance serves every caller


def transfer_range(direction: str, device_index: int):
    """The range of one copy across the host/device boundary ('h2d', 'd2h', 'd2d'), or a
    no-op context while no profiler runs (transfers are sync points, not the per-op path)."""
    if not profiler_enabled():
        return _NO_RANGE
    return _RecordFunctionFast(TRANSFER_NAMES[direction], _NO_INPUTS, {"device": device_index})


def sync_range(reason: str, pending_ops: int) -> _RecordFunctionFast:
    """The range of one sync point of an engine that holds work back."""
    if reason.startswith("sync: "):  # `sync: aten::_local_scalar_dense` -> the op's name
        reason = reason[6:]
    return _RecordFunctionFast(f"neuron::sync[{reason}]", _NO_INPUTS, {"pending_ops": pending_ops})
