"""The Executor interface between dispatch and the engine, and the plain eager executor.

Every op on a neuron tensor runs on the C++ eager path (csrc/aten/run_on_host.cpp) unless the adaptive
engine, attached to the C++ route while adaptive mode is on, takes it. What the runtime
asks of whichever executor is installed is only this: run what it holds back (a sync), and
wait for what is already launched (a drain).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

from adaptive_eager.device.native import RUN_EAGER, DeferPlan

# Note [The route's answers]: what an executor attached to the C++ route (the adaptive engine's
# `route(op, args, kwargs)`) answers for each op; device/csrc/engine/route.cpp reads it back as
# its `Answer`, the same five kinds:
#   RUN_EAGER            run it on the eager path now (what is held back for it has run);
#   (RUN_EAGER, after)   run it now, then call after(results): the engine records it;
#   a DeferPlan          queue it (Note [Deferred launches]) and hand out its results at once;
#   (DeferPlan, after)   queue it, then call after(): the engine launches the queue;
#   anything else        the op's result, which the engine computed itself.
# Plain values and pairs, no wrapper object: the answer is made once per op on the hot path.
RouteAnswer = Union[type(RUN_EAGER), tuple[type(RUN_EAGER), Callable[[Any], None]], DeferPlan,
                    tuple[DeferPlan, Callable[[], None]], Any]


class Executor:
    name = "executor"

    def synchronize(self, device_index: int | None) -> None:
        """Run everything held back for the device (None: every device)."""

    def drain(self) -> None:
        """Wait for launches already issued (on the device stream) to finish; launch nothing."""

    def settle_before_fork(self) -> None:
        """Before the process forks: nothing may be on its way to the device, whose executor
        the child does not have. Errors stay for the next sync point."""
        self.drain()


class EagerExecutor(Executor):
    """Op by op: every op is one launch the moment it is issued (nothing is held back)."""

    name = "eager"
