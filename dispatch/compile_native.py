"""torch.compile(backend="neuron") on native neuron tensors (NEURON_TENSORS=native): the
graphs compile_backend.neuron_backend gets from AOTAutograd run as NativeCompiledGraph.

Native tensors are real PrivateUse1 tensors: Dynamo and AOTAutograd trace them as they trace
any device's, with fake tensors on `neuron` (meta kernels), and the graphs they produce are
written against neuron tensors. So, unlike the wrapper's backend (compile_backend.py), nothing
is unwrapped: each AOTAutograd graph (forward, backward, inference) runs its ops through the
C++ eager path, inside one `native.FusedLaunch`, which makes them ONE launch on the device's
clock, priced as the sum of its ops' roofline costs (Note [Deferred launches] uses the same
accounting for the adaptive engine's launches).

A compiled call is a sync point: what the adaptive engine holds back runs first (a queued op
may write one of the graph's inputs), and the graph's own ops take the eager path, never the
engine (they are one launch already).
"""
from __future__ import annotations

import torch
import torch.fx

from device import native
from device.profiling import mark_device_time, profile_range, profiler_enabled


class NativeCompiledGraph:
    """One AOTAutograd graph, run as one launch on its device (boxed calling convention)."""

    def __init__(self, gm: torch.fx.GraphModule, device_index: int):
        self.gm = gm
        # On the instance: Dynamo wraps the backward with functools.wraps, which copies the
        # instance's __dict__ (not class attributes) onto the wrapper AOTAutograd then calls.
        self._boxed_call = True
        self.device_index = device_index
        self.num_ops = sum(1 for n in gm.graph.nodes
                           if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload))

    def __call__(self, args):
        native.host_sync("sync: compiled graph")  # what the engine holds back runs first
        if profiler_enabled():
            with profile_range(f"neuron::graph[{self.num_ops} ops]", ops=self.num_ops):
                out = self._run(args)
                device_us, ops = native.last_fused_launch()
                mark_device_time(device_us, ops=ops, device=self.device_index)
            return out
        return self._run(args)

    def _run(self, args):
        previous = native.set_bypass(True)  # its ops are this launch's, never the engine's
        try:
            with native.FusedLaunch(self.device_index):
                return self.gm(*args)
        finally:
            native.set_bypass(previous)
            args.clear()  # the boxed convention: the inputs may be freed as the graph runs
