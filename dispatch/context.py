"""The dispatch context: the one object that wires dispatch to the runtime and the executor.

`NeuronTensor.__torch_dispatch__` is a classmethod and cannot be handed an engine, so it
reads `CONTEXT.executor`. The engine installs itself with `install_executor`; nothing
else is module-global. Plain attributes (not thread-locals): autograd's backward thread
for our device does not see Python thread-locals.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from device import Runtime

    from .executor import Executor


class DispatchContext:
    def __init__(self):
        self.runtime: "Runtime | None" = None
        self.executor: "Executor | None" = None
        # intercepted ATen ops, per device index
        self.ops: list[int] = []

    def reset_counters(self) -> None:
        self.ops = [0] * len(self.ops)


CONTEXT = DispatchContext()


def install_executor(executor: "Executor") -> "Executor | None":
    """Make executor run every op on neuron tensors; returns the previous one."""
    previous, CONTEXT.executor = CONTEXT.executor, executor
    return previous
