"""Projection mode: what a program costs on the chip, computed without its values.

Inside `with adaptive_eager.projection():` (or for a whole process, NEURON_PROJECTION=1) a
neuron tensor carries no bytes: its storage is charged to the device as it would be with bytes,
and has an address no one may read (Note [Projected bytes] in device/csrc/runtime/memory.cpp).
Every op goes through the same path as with bytes, in eager and adaptive mode; it runs its shape
function instead of its kernel (Note [Projected ops] in device/csrc/aten/run_on_host.cpp), and
the cost model prices it from its geometry, as it prices it with bytes. So the modelled time,
the launches and the memory (its peak, and an OutOfMemoryError where the chip would raise one)
are those of the run with bytes, for a model far larger than this machine could hold.

Host reads of values (`loss.item()`, `.cpu()`, `print`) answer a placeholder, 0 or zeros, are
counted (`adaptive_eager.stats().placeholder_reads`), and the first one warns: control flow that depends on values
may go another way than with values. A tensor made in projection mode has no values after it
either: reading it, or running an op on it, raises.
"""
from __future__ import annotations

import contextlib

import torch

from adaptive_eager.device import native
from adaptive_eager.dispatch import CONTEXT


@contextlib.contextmanager
def projection():
    """Runs the block in projection mode: new neuron tensors carry no bytes, ops run their
    shape functions, the device's clock and memory account as with bytes. Nested uses are one.

    What was issued before the block runs with values first, and what the block issued runs
    projected before it ends (both wait for the device), so no op changes mode in flight."""
    if native.projection_enabled():
        yield
        return
    CONTEXT.runtime.synchronize(None)
    native.set_projection(True)
    try:
        yield
    finally:
        try:
            CONTEXT.runtime.synchronize(None)
        finally:
            native.set_projection(False)


def is_projected(tensor: torch.Tensor) -> bool:
    """Whether a tensor was made (or written) in projection mode, and so has no values."""
    return isinstance(tensor, torch.Tensor) and tensor.device.type == "neuron" and native.is_projected(tensor)

