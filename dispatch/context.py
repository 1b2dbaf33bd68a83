"""The dispatch context: the one object that wires dispatch to the runtime and the executor.

The runtime's sync and drain hooks, the C++ synchronizer and the mode switch all reach the
installed executor through `CONTEXT.executor`; `install_executor` swaps it. Nothing else is
module-global. Plain attributes (not thread-locals): autograd's backward thread for our
device does not see Python thread-locals.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from adaptive_eager.device import Runtime

    from .executor import Executor


class DispatchContext:
    def __init__(self):
        self.runtime: "Runtime | None" = None
        self.executor: "Executor | None" = None


CONTEXT = DispatchContext()


def install_executor(executor: "Executor") -> "Executor | None":
    """Make executor the one the runtime syncs and drains; returns the previous one."""
    previous, CONTEXT.executor = CONTEXT.executor, executor
    return previous
