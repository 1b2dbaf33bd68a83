"""The Executor interface between dispatch and the engine, and the plain eager executor.

Every op on a neuron tensor runs on the C++ eager path (csrc/aten/run_on_host.cpp) unless the adaptive
engine, attached to the C++ route while adaptive mode is on, takes it. What the runtime
asks of whichever executor is installed is only this: run what it holds back (a sync), and
wait for what is already launched (a drain).
"""
from __future__ import annotations


class Executor:
    name = "executor"

    def synchronize(self, device_index: int | None) -> None:
        """Run everything held back for the device (None: every device)."""

    def drain(self) -> None:
        """Wait for launches already issued (on the device stream) to finish; launch nothing."""


class EagerExecutor(Executor):
    """Op by op: every op is one launch the moment it is issued (nothing is held back)."""

    name = "eager"
