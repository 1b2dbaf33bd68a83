"""torch.compile on neuron tensors: the `neuron` Dynamo backend.

`torch.compile(model, backend="neuron")` finds `neuron_backend` through the
`torch_dynamo_backends` entry point (pyproject.toml), so nothing here imports torch._dynamo
until a model is compiled.

Note [Compiled graphs]: neuron tensors are real PrivateUse1 tensors: Dynamo and AOTAutograd
trace them as they trace any device's, with fake tensors on `neuron` (meta kernels), and
the graphs they produce are written against neuron tensors. Each AOTAutograd graph (forward,
backward, inference) runs as a CompiledGraph: its ops go through the C++ eager path, inside
one `native.FusedLaunch`, which makes them ONE launch on the device's clock, priced as the
sum of its ops' roofline costs (the adaptive engine's launches use the same accounting).

A compiled call is a sync point: what the adaptive engine holds back runs first (a queued op
may write one of the graph's inputs), and the graph's own ops take the eager path, never the
engine (they are one launch already). Other backends (`eager`, `aot_eager`) run their graphs
op by op on the eager path.
"""
from __future__ import annotations

import torch
import torch.fx

from adaptive_eager.device import native
from adaptive_eager.device.profiling import mark_device_time, profile_range, profiler_enabled

from .dynamo_opaque import hide_late_module


# -- the `neuron` backend ----------------------------------------------------------------------
def neuron_backend(gm: torch.fx.GraphModule, example_inputs):
    """Dynamo backend: AOTAutograd splits forward and backward; each graph runs as one launch."""
    devices = {t.device.index for t in example_inputs if isinstance(t, torch.Tensor) and t.device.type == "neuron"}
    device = _graph_device(devices)
    if device is None:  # nothing on neuron: a plain host graph, run as it is
        return gm.forward
    # A slow import: only when a model is compiled, never at `import torch`.
    from torch._dynamo.backends.common import aot_autograd

    def compile_graph(graph: torch.fx.GraphModule, inputs):
        return CompiledGraph(graph, device)

    return aot_autograd(fw_compiler=compile_graph, bw_compiler=compile_graph)(gm, example_inputs)


def _graph_device(devices: set[int]) -> int | None:
    """The one neuron device of a graph's inputs, None if none is on neuron."""
    devices = sorted(devices)
    if len(devices) > 1:
        raise RuntimeError(
            f"torch.compile(backend='neuron'): one compiled graph runs on one device, but its "
            f"inputs are on {', '.join(f'neuron:{d}' for d in devices)}. Move them to one device "
            f"first (e.g. with .to('neuron:{devices[0]}')), or compile each device's part separately.")
    return devices[0] if devices else None


class CompiledGraph:
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


# Imported lazily, after `import adaptive_eager` marked the rest: Note [Opaque to Dynamo].
hide_late_module(__name__)
