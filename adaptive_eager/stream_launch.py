"""Complete launches of a cached trace, run on the device stream (device/stream.py).

Note [Launches on the stream]: once every op of a trace has run once (its costs and output
metadata checked by the host path, pending._run_one), a complete match of the trace is
submitted to the stream's worker thread and the host goes on issuing: the launch's
kernels run beside the host's Python, as a device runs beside its host. What stays the
same as a launch on the issuing thread:
- the arguments: each op's call is built by the same generated code as the replay's, and
  turned into a stack exactly as torch.ops does it (compile.compile_stream_call);
- the kernels and their bits: the worker takes the issuing thread's dispatch keys, grad
  mode and intra-op thread count;
- the values handed out: the deferred wrappers' cells are filled when the launch finishes;
- memory accounting: the worker reports its intermediates' sizes in launch order, and the
  host charges them when the launch finishes (peak included);
- errors: the failing op's index comes back; the same error is raised at the next sync point.

One launch is in flight at a time: the next launch, any op run now, any host read and any
read of a deferred value produced by the launch first wait for it to finish (engine._drain).
Launches stay on the issuing thread when a trace draws random numbers or runs a kernel
written in Python, when a Python dispatch mode or CPU autocast is active, when the
profiler records, and when the launch might not fit in device memory (the issuing thread
then raises the out-of-memory error at the exact op, as eager mode does).
"""
from __future__ import annotations

import warnings

import torch

from device import stream as device_stream
from dispatch import CONTEXT

from .compile import compile_stream_call
from .trace import returns_only_views

_ERRORS = {"IndexError": IndexError, "ValueError": ValueError, "TypeError": TypeError,
           "NotImplementedError": NotImplementedError, "LinAlgError": torch.linalg.LinAlgError,
           "OutOfMemoryError": torch.OutOfMemoryError}


class StreamProgram:
    """A trace's ops in the stream's terms, built once per trace."""

    def __init__(self, trace, module):
        self.module = module
        self.calls = []
        steps = []
        max_refs = 0
        for k, proto in enumerate(trace.protos):
            info = proto.info
            schema = info.op._schema
            call, internal = compile_stream_call(proto, trace.inputs[k])
            self.calls.append(call)
            max_refs = max(max_refs, len(internal))
            names = [a.name for a in schema.arguments]
            use_written = proto.ret_t is None and info.mutates
            written = list(info.written_args) + [names.index(n) for n in info.written_kwargs] if use_written else []
            new_slots = [] if returns_only_views(info) else [s for s, spec in enumerate(proto.out_specs)
                                                                if spec[0] == "new"]
            steps.append((schema.name, schema.overload_name, use_written, written, new_slots,
                          [tuple(x) for x in trace.last_use[k]], trace.consumed[k], list(trace.unread_slots[k]),
                          internal))
        self.program = module.make_program(steps, max_refs)
        self.placeholders = module.placeholders(self.program)
        # per op: the output slots whose deferred wrappers get a cell (new outputs)
        self.new_outputs = [[s for s, spec in enumerate(p.out_specs) if spec[0] == "new"] for p in trace.protos]
        # The most new memory the launch can hold at once: every new output, as if none died.
        self.max_bytes = sum(_spec_bytes(spec) for p in trace.protos for spec in p.out_specs if spec[0] == "new")


def program_for(trace):
    """The trace's StreamProgram, or None if its launches stay on the issuing thread."""
    module = device_stream.stream_module()
    if module is None:
        return None
    program = trace.stream_program
    if program is None:
        if None in trace.op_costs:
            return None  # not yet: retried at the next launch
        program = False
        if _eligible(trace):
            try:
                program = StreamProgram(trace, module)
            except Exception as exc:  # an op the stream cannot take: this trace stays on the host
                warnings.warn(f"adaptive-eager: trace {trace.id} runs on the issuing thread, not the device "
                              f"stream ({type(exc).__name__}: {exc}). Results are the same.", RuntimeWarning)
        trace.stream_program = program
    return program or None


def _eligible(trace) -> bool:
    for proto in trace.protos:
        info = proto.info
        # Random ops draw from the device generator in stream order on the host (Note [RNG
        # order]); a kernel written in Python would need the GIL on the worker.
        if info.is_random or not info.op._schema.name.startswith(("aten::", "prims::")):
            return False
    return True


def host_state_allows() -> bool:
    """Nothing on the issuing thread that a host kernel on the worker would have to see."""
    return (torch._C._len_torch_dispatch_stack() == 0 and not torch._C._is_torch_function_mode_enabled()
            and not torch.is_autocast_enabled("cpu"))


def submit(p, program: StreamProgram, drain) -> bool:
    """Submit pending match p (complete, nothing launched) to the stream. False if an input
    never arrived (the launch that makes it failed): the issuing thread then runs p and raises
    that error at the op that reads it. `drain` (the engine's) is what a deferred value's
    cell calls to wait for the launch."""
    trace = p.trace
    ph = program.placeholders
    try:
        calls = [call(bound, ph) for call, bound in zip(program.calls, p.bound)]
    except Exception:  # ready_data raised a failed launch's error
        return False
    exports, cells = [], []
    for k, refs in enumerate(p.outs):
        mine = []
        for slot in program.new_outputs[k]:
            cell = refs[slot]()
            if cell is not None:  # its wrapper is alive: the value leaves the launch
                mine.append((slot, len(cells)))
                cells.append(cell)
        exports.append(mine)
    # Raises before anything changed if the stream cannot take the calls (engine._launch
    # then runs the launch on the issuing thread).
    p.stream_job = program.module.submit(program.program, calls, exports, len(cells), torch.get_num_threads())
    for cell in cells:
        cell.launch = drain
    p.bound = None  # the job holds the host values now, not the wrappers
    p.stream_cells = cells
    n = len(trace)
    p.done = n
    p.device_us = CONTEXT.runtime.launch(trace.device, sum(trace.op_costs), num_ops=n)
    p.results = []
    return True


def finish(p, program: StreamProgram):
    """Wait for p's launch; fill its cells and charge its memory. Returns the deferred error
    (as a launch on the issuing thread would have raised it) or None."""
    module = program.module
    module.wait(p.stream_job)
    failed, kind, message, exports, events, survivors = module.outcome(p.stream_job)
    p.stream_job = None
    trace = p.trace
    memory = CONTEXT.runtime.devices[trace.device].memory
    charged = {}
    error = None
    try:
        for event, nbytes, index in events:
            if event == 0:
                memory.charge_transient(nbytes)
                charged[index] = nbytes
            elif event == 1:
                memory.release_transient(nbytes)
            else:
                memory.track(exports[index].untyped_storage())
        for index, storage_holder in survivors:
            memory.adopt_transient(storage_holder.untyped_storage(), charged[index])
    except torch.OutOfMemoryError as exc:  # the capacity check before submitting makes this rare
        error = exc
    for cell, value in zip(p.stream_cells, exports):
        cell.launch = None
        if value is not None:
            cell.data = value
    p.stream_cells = None
    if failed >= 0:
        CONTEXT.runtime.refund(trace.device, sum(trace.op_costs[failed:]), len(trace) - failed)
        error = p.fail(failed, _ERRORS.get(kind, RuntimeError)(message))
    return error


def _spec_bytes(spec) -> int:
    size, stride, offset, dtype = spec[1:5]
    if any(s == 0 for s in size):
        return 0
    span = offset + sum((s - 1) * st for s, st in zip(size, stride)) + 1
    return span * dtype.itemsize
