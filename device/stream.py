"""The device's stream: whether fused launches run beside the host.

A real accelerator runs a launch while the host goes on issuing the next ones; only a read
of a result (or an explicit synchronize) makes the host wait. The emulated device does the
same on a C++ worker thread of the device extension (Note [The device stream] in
csrc/engine/queue.cpp), which never takes the GIL, so the host's Python and the launch's kernels
use two cores. (A Python thread cannot: measured by bench/feasibility/device_thread_overlap.py,
removed with the wrapper tensors it measured, see commit 4e13a75, its GIL hand-offs made
overlap slower than running one after the other.)

NEURON_ASYNC_LAUNCH=0 (or set_enabled(False)) keeps every launch on the issuing thread,
with the same results.
"""
from __future__ import annotations

from . import settings


def async_launch_setting() -> str:
    """NEURON_ASYNC_LAUNCH: '1' or 'auto' (the default: launches use the stream), '0' (never)."""
    return settings.read("NEURON_ASYNC_LAUNCH")


_enabled: bool | None = None  # None: NEURON_ASYNC_LAUNCH's, read at the first question (no setting at import)


def set_enabled(use: bool) -> bool:
    """Use the stream from now on, or not; returns the previous setting. NEURON_ASYNC_LAUNCH
    sets the initial value."""
    global _enabled
    previous, _enabled = enabled(), bool(use)
    from . import native  # the C++ core: imported once the stream is used, not with the settings

    native.set_stream_allowed(_enabled)  # the route's armed rounds look at it (Note [Armed rounds])
    return previous


def enabled() -> bool:
    """Whether fused launches may run on the device stream (NEURON_ASYNC_LAUNCH, set_enabled)."""
    global _enabled
    if _enabled is None:
        _enabled = async_launch_setting() != "0"
    return _enabled


def stream_status() -> str:
    """What the stream does now, for `adaptive-eager info` and explain()."""
    if enabled():
        return "async: fused launches run on the device stream's worker thread, beside the host"
    why = "NEURON_ASYNC_LAUNCH=0" if async_launch_setting() == "0" else "set_enabled(False)"
    return f"off ({why}): launches run on the issuing thread"
