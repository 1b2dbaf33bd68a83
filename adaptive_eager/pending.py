"""A trace being matched: the ops deferred so far, and their launch (replay).

Note [Deferred values]: outputs handed to the user while a trace is matched are wrappers
with `_data = None` (made by compile.compile_outputs) whose DeferredCell the launch fills.
We hold only weak references to the cells, never references to the wrappers: a strong
one changes autograd's reference-count decisions (whether AccumulateGrad steals a
gradient), and with them the op stream itself; a weak one on the tensor makes
torch.utils.swap_tensors (nn.Module.to) refuse it. Inputs from outside
the trace are held strongly until the launch, as a device queue holds its arguments.
Values produced inside the trace are bound by position, never by object.
"""
from __future__ import annotations

import torch

from dispatch import CONTEXT, NeuronTensor
from dispatch.kernels import priced_us
from dispatch.record import _rebind
from dispatch.tensor import resolve_data

from .trace import Trace


class Pending:
    def __init__(self, trace: Trace, base: int):
        self.trace = trace
        self.base = base  # stream position of the trace's first op
        self.pos = 0  # next op expected
        self.done = 0  # ops already launched (a sync mid-trace launches the prefix)
        self.positions: list[int] = []  # stream position of each matched op
        self.bound: list[list] = []  # per matched op: values, internal ones replaced
        self.outs: list[list] = []  # per matched op: weakrefs to new outputs' cells (or None)
        self.results: list = [None] * len(trace)  # host outputs of launched ops, while needed
        self.device_us = 0.0  # emulated device time of the latest launch
        self.stream_job = None  # the launch on the device stream (stream_launch.py), until finished
        self.stream_cells = None  # cells the launch on the stream fills

    def switch(self, trace: Trace) -> None:
        """Continue as a match of `trace`, whose first `pos` ops are this trace's (same
        signatures and dataflow), none launched yet: what was deferred stays valid."""
        for k in range(self.pos):
            if trace.sources[k] is None:
                trace.sources[k] = self.trace.sources[k]
        self.trace = trace
        if len(self.results) < len(trace):
            self.results.extend([None] * (len(trace) - len(self.results)))

    @property
    def complete(self) -> bool:
        return self.pos == len(self.trace)

    def launch(self) -> int:
        """Run ops [done, pos) on the host as one launch; returns how many ran.

        Raises the failing op's error after marking every value that depended on it.
        """
        start, end = self.done, self.pos
        if start == end:
            return 0
        trace, runtime = self.trace, CONTEXT.runtime
        device = trace.device
        memory = runtime.devices[device].memory
        costs, replays, bound, outs, results = trace.op_costs, trace.replays, self.bound, self.outs, self.results
        track = memory.track
        k = start
        try:
            for k in range(start, end):
                if costs[k] is None:  # the position's first launch: the general path
                    self._run_one(k, memory)
                else:
                    replays[k](bound[k], results, outs[k], track)
                    bound[k] = None  # inputs from outside are released as soon as their op ran
        except Exception as exc:  # the op's own error: raised at the sync point
            self.device_us = runtime.launch(device, sum(costs[start:k]), num_ops=k - start)
            raise self.fail(k, exc) from exc
        cost = sum(costs[start:end])
        self.done = end
        self.device_us = runtime.launch(device, cost, num_ops=end - start)  # for profiler ranges
        if end == len(trace):
            self.results = []
        return end - start

    def _run_one(self, k: int, memory) -> float:
        trace = self.trace
        results = self.results
        flat = trace.runners[k](self.bound[k], results)
        results[k] = flat
        for slot, ref in enumerate(self.outs[k]):
            if ref is None:
                continue
            host = flat[slot]
            memory.track(host.untyped_storage())
            cell = ref()
            if cell is not None:  # its wrapper is alive
                cell.data = host
        cost = trace.op_costs[k]
        if cost is None:
            cost = trace.op_costs[k] = self._op_cost(k, flat)
        # Note [Deferred values]: each intermediate is dropped after its last read inside the
        # trace (per output: nll_loss_forward's total_weight must not live as long as its loss).
        for j, slot in trace.last_use[k]:
            held = results[j]
            if held is not None:
                held[slot] = None
        if not trace.consumed[k]:
            results[k] = None  # read by no later op of the trace: only live wrappers keep it
        else:
            for slot in trace.unread_slots[k]:
                flat[slot] = None
        self.bound[k] = None  # inputs from outside are released as soon as their op ran
        return cost

    def _op_cost(self, k: int, flat) -> float:
        """Roofline µs of op k inside the launch, computed once: the signature fixes it.
        Only bytes that cross the launch boundary count: inputs from outside, and outputs
        that no later op of the trace reads (they leave the launch)."""
        trace = self.trace
        proto = trace.protos[k]
        for slot, spec in enumerate(proto.out_specs):
            if spec[0] == "new":
                _check_metadata(spec, flat[slot], proto)
        in_bytes, dtype = 0, None
        for ref, v in zip(trace.inputs[k], self.bound[k]):
            if ref is None and isinstance(v, NeuronTensor):
                in_bytes += v.nbytes
                dtype = dtype or v.dtype
        out_bytes = 0 if trace.consumed[k] else sum(t.nbytes for t in flat)
        info, args, kwargs = proto.info, (), {}
        if info.has_flop_formula or info.cost_hook is not None:  # both read the host arguments
            values = [resolve_data(v) if isinstance(v, NeuronTensor) else v for v in self.bound[k]]
            for s, ref in enumerate(trace.inputs[k]):
                if ref is not None:
                    values[s] = self.results[ref[0]][ref[1]]
            args = tuple(_rebind(t, values) for t in proto.args_t)
            kwargs = {name: _rebind(t, values) for name, t in proto.kwargs_t.items()}
        return priced_us(info, args, kwargs, flat[0] if len(flat) == 1 else flat, in_bytes + out_bytes, dtype)

    def fail(self, k: int, exc: Exception) -> Exception:
        """The deferred error of op k: every value from op k on carries it; nothing after k runs."""
        err = launch_error(self.trace, k, exc)
        for outs in self.outs[k:]:
            for ref in outs:
                cell = ref() if ref is not None else None
                if cell is not None:
                    cell.error = err
        self.pos = self.done = k  # nothing after the failed op will run
        self.results = []
        return err


def launch_error(trace: Trace, k: int, exc: Exception) -> Exception:
    """The error a deferred launch raises at the next sync point when op k of trace failed."""
    msg = (f"{trace.protos[k].name} failed in a deferred launch (op {k + 1} of {len(trace)} of "
           f"trace {trace.id}, issued at {trace.sources[k]}); every op before it ran, none after it. "
           f"Set NEURON_LAUNCH_BLOCKING=1 to raise it where the op is issued. Cause: {exc}")
    try:
        return type(exc)(msg)
    except Exception:
        return RuntimeError(msg)


def _check_metadata(spec, host: torch.Tensor, proto) -> None:
    # A deferred wrapper's metadata came from the cache; the launch must agree with it.
    if tuple(host.shape) != spec[1] or host.stride() != spec[2] or host.dtype != spec[4]:
        raise AssertionError(
            f"adaptive engine bug: {proto.name} produced {tuple(host.shape)}/{host.stride()}/{host.dtype} "
            f"but the cached trace promised {spec[1]}/{spec[2]}/{spec[4]}")
