"""A trace being matched: how far the stream has followed it, and what was launched.

The ops themselves wait in the C++ queue (Note [Deferred launches] in device/csrc/engine/queue.cpp):
Python keeps only positions, which is what matching, sync points and errors need.
"""
from __future__ import annotations

from .trace import Trace


class Pending:
    def __init__(self, trace: Trace, base: int):
        self.trace = trace
        self.base = base  # stream position of the trace's first op
        self.pos = 0  # next op expected
        self.done = 0  # ops already launched (a sync mid-trace launches the prefix)
        self.positions: list[int] = []  # stream position of each matched op
        self.syms: list = [None] * trace.nsyms  # a generic trace's sizes, as this match binds them

    def switch(self, trace: Trace) -> None:
        """Continue as a match of `trace`, whose first `pos` ops are this trace's (same
        signatures; executor._same_prefix), none launched yet: what was deferred stays valid."""
        for k in range(self.pos):
            if trace.sources[k] is None:
                trace.sources[k] = self.trace.sources[k]
        self.trace = trace

    @property
    def complete(self) -> bool:
        return self.pos == len(self.trace)


def launch_error(trace: Trace, k: int, exc: Exception) -> Exception:
    """The error a deferred launch raises at the next sync point when op k of trace failed."""
    msg = (f"{trace.protos[k].name} failed in a deferred launch (op {k + 1} of {len(trace)} of "
           f"trace {trace.id}, issued at {trace.sources[k]}); every op before it ran, none after it. "
           f"Set NEURON_LAUNCH_BLOCKING=1 to raise it where the op is issued. Cause: {exc}")
    try:
        return type(exc)(msg)
    except Exception:
        return RuntimeError(msg)
