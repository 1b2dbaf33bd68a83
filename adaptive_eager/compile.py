"""Straight-line Python for each op of a trace: a matcher, a runner and a replay.

The steady-state cost of the engine is paid per op, so each trace position gets code of
its own, generated once when the trace is cached:

- the matcher checks an incoming call against that position without describing it first
  (no OpRecord, no key tuples): internal inputs by producer identity only (their metadata
  was fixed by the trace), outside inputs by metadata, constants by value, lifted floats
  by type. It returns the call's slot values, or None (a divergence).
- the runner calls the op on host data with the arguments wired in: internal inputs from
  the launch's results, outside inputs from their wrappers, scalars as bound.
- the replay is the runner plus the launch's bookkeeping for that position (filling
  deferred wrappers, freeing values at their last read), used once the op's cost is known.

Both must agree exactly with `dispatch.record.OpRecord` (the slow path that builds the
trace): the same slot numbering, the same keys. tests/test_adaptive*.py run every loop in
both modes and compare bit for bit.
"""
from __future__ import annotations

import contextlib
import weakref

import torch

from dispatch import NeuronTensor
from dispatch.kernels import has_normal_tensor, ready_data, run_on_host
from dispatch.record import CPU_SCALAR, Slot
from dispatch.tensor import NEURON_DEVICES, DeferredCell, arriving

from .trace import OpProto, flat_tensors, returns_only_views


class _Source:
    """Accumulates generated lines and the constants they refer to."""

    def __init__(self):
        self.lines: list[str] = []
        self.consts: dict[str, object] = {}

    def const(self, value) -> str:
        name = f"C{len(self.consts)}"
        self.consts[name] = value
        return name

    def emit(self, line: str, indent: int = 1) -> None:
        self.lines.append("    " * indent + line)


def _is_tensor_key(key) -> bool:
    return isinstance(key, tuple) and len(key) == 5 and isinstance(key[4], torch.device)


def _match_value(src: _Source, expr: str, template, key, refs, native: bool = False) -> None:
    """Emit checks that the value at `expr` fits (template, key); store slot values.
    native: plain neuron tensors (native_engine.py), matched by metadata alone."""
    if type(template) is Slot:
        s = template.index
        if _is_tensor_key(key) and native:
            # Any tensor class (nn.Parameter too); the device by index (`v.device` builds a
            # torch.device on every read): get_device() is -1 on the CPU.
            shape, stride, offset, dtype = (src.const(x) for x in key[:4])
            index = key[4].index if key[4].type == "neuron" else -1
            src.emit(f"v = {expr}")
            src.emit(f"if not isinstance(v, TENSOR) or v.get_device() != {index} or v.shape != {shape} "
                     f"or v.stride() != {stride} or v.storage_offset() != {offset} or v.dtype != {dtype}: return None")
            src.emit(f"vals[{s}] = v")
        elif _is_tensor_key(key):
            ref = refs[s]
            if ref is not None:
                want = src.const(ref)
                # Produced by op ref[0] of this trace: its metadata is the trace's by construction.
                src.emit(f"v = {expr}")
                src.emit(f"if v.__class__ is not NT or v._producer != (p.positions[{want}[0]], {want}[1]): return None")
            elif key[4].type == "neuron":
                # The common case, cheapest checks first: a neuron tensor from outside the trace
                # (the device by index: `v.device` builds a torch.device on every read).
                shape, stride, offset, dtype = (src.const(x) for x in key[:4])
                src.emit(f"v = {expr}")
                src.emit(f"if v.__class__ is not NT or v._device_index != {key[4].index} or v.shape != {shape} "
                         f"or v.stride() != {stride} or v.storage_offset() != {offset} or v.dtype != {dtype}: return None")
                src.emit("pr = v._producer")
                # A value a launch on the device stream will bring is taken without waiting.
                src.emit("if pr is not None and pr[0] >= p.base or v._data is None and not ARRIVING(v): return None")
            else:
                shape, stride, offset, dtype, device = (src.const(x) for x in key)
                src.emit(f"v = {expr}")
                src.emit(f"if not isinstance(v, TENSOR) or v.shape != {shape} or v.stride() != {stride} "
                         f"or v.storage_offset() != {offset} or v.dtype != {dtype} or v.device != {device}: return None")
                src.emit("if v.__class__ is NT:")
                src.emit("pr = v._producer", 2)
                src.emit("if pr is not None and pr[0] >= p.base or v._data is None and not ARRIVING(v): return None", 2)
            src.emit(f"vals[{s}] = v")
        elif isinstance(key, tuple) and len(key) == 2 and key[0] is CPU_SCALAR:
            dtype = src.const(key[1])
            src.emit(f"v = {expr}")
            src.emit(f"if not isinstance(v, TENSOR) or v.__class__ is NT or not v.is_cpu or v.dim() != 0 "
                     f"or v.dtype != {dtype}: return None")
            src.emit(f"vals[{s}] = v.detach().clone()")  # Note [CPU scalar tensors]: read now
        else:  # a lifted float/complex, or an unhashable object: keyed by type
            cls = src.const(key if isinstance(key, type) else type(None))
            src.emit(f"v = {expr}")
            src.emit(f"if v.__class__ is not {cls}: return None")
            src.emit(f"vals[{s}] = v")
    elif type(template) in (list, tuple):
        cls = "list" if type(template) is list else "tuple"
        src.emit(f"v = {expr}")
        src.emit(f"if v.__class__ is not {cls} or len(v) != {len(template)}: return None")
        name = f"l{len(src.lines)}"
        src.emit(f"{name} = v")
        for i, (t, k) in enumerate(zip(template, key)):
            _match_value(src, f"{name}[{i}]", t, k, refs, native)
    else:  # a structural constant: keyed by value (bools apart from ints)
        c = src.const(template)
        cls = src.const(type(template))
        src.emit(f"v = {expr}")
        src.emit(f"if v.__class__ is not {cls} or v != {c}: return None")


def compile_matcher(proto: OpProto, refs: tuple, n_values: int, native: bool = False):
    """match(args, kwargs, pending) -> list of slot values, or None."""
    src = _Source()
    _, arg_keys, kw_keys = proto.signature
    src.emit(f"if len(args) != {len(arg_keys)} or len(kwargs) != {len(kw_keys)}: return None")
    src.emit(f"vals = [None] * {n_values}")
    for i, (t, k) in enumerate(zip(proto.args_t, arg_keys)):
        _match_value(src, f"args[{i}]", t, k, refs, native)
    for name, k in kw_keys:
        t = proto.kwargs_t[name] if not _is_device_key(k) else k
        src.emit(f"if {name!r} not in kwargs: return None")
        _match_value(src, f"kwargs[{name!r}]", t, k, refs, native)
    src.emit("return vals")
    return _define("match", "args, kwargs, p", src, NT=NeuronTensor, TENSOR=torch.Tensor, ARRIVING=arriving)


def _is_device_key(key) -> bool:
    return isinstance(key, torch.device)


def _results_expr(ref) -> str:
    return f"results[{ref[0]}][{ref[1]}]"


def _run_value(src: _Source, template, key, refs, internal=_results_expr) -> str:
    """An expression for the host value of one argument at launch time; `internal(ref)` is
    the expression for a value produced inside the trace."""
    if type(template) is Slot:
        s = template.index
        if _is_tensor_key(key):
            ref = refs[s]
            if ref is not None:
                return internal(ref)
            if key[4].type == "neuron":
                return f"READY(bound[{s}])"
        return f"bound[{s}]"
    if type(template) in (list, tuple):
        items = [_run_value(src, t, k, refs, internal) for t, k in zip(template, key)]
        inner = ", ".join(items) + ("," if type(template) is tuple and len(items) == 1 else "")
        return f"[{inner}]" if type(template) is list else f"({inner})"
    return src.const(template)


def compile_runner(proto: OpProto, refs: tuple):
    """run(bound, results) -> the op's host outputs in slot order (see trace.py)."""
    src = _Source()
    _emit_call(src, proto, refs)
    return _define("run", "bound, results", src, **_call_env(proto))


def compile_replay(trace, k: int):
    """replay(bound, results, outs, track): op k of a launch once its cost is known, with
    Pending._run_one's bookkeeping written out for this position (which outputs are new,
    which values die here, whether a later op reads the outputs): the per-op cost of a
    steady-state launch. Must do exactly what _run_one does; the tests run both (the first
    launch of a position takes _run_one)."""
    proto, refs = trace.protos[k], trace.inputs[k]
    src = _Source()
    _emit_call(src, proto, refs, result="flat")
    views_only = returns_only_views(proto.info)
    for slot, spec in enumerate(proto.out_specs):
        if spec[0] == "new":  # Note [Deferred values]: fill the wrapper's cell if it lives
            src.emit(f"h = flat[{slot}]")
            if not views_only:
                src.emit("track(h.untyped_storage())")
            src.emit(f"c = outs[{slot}]()")
            src.emit("if c is not None: c.data = h")
    for j, slot in trace.last_use[k]:  # values read for the last time by this op
        src.emit(f"r = results[{j}]")
        src.emit(f"if r is not None: r[{slot}] = None")
    if trace.consumed[k]:
        for slot in trace.unread_slots[k]:
            src.emit(f"flat[{slot}] = None")
        src.emit(f"results[{k}] = flat")
    return _define("replay", "bound, results, outs, track", src, **_call_env(proto))


def compile_stream_call(proto: OpProto, refs: tuple):
    """(call, internal) for the device stream (adaptive_eager/stream_launch.py): call(bound, PH)
    -> (args, kwargs) of op k on host values, exactly the arguments the replay passes, with
    the values produced inside the trace given as placeholder tensors PH[r]; internal[r] is
    the (op, output slot) that placeholder r stands for. The stream patches them in at run time."""
    src = _Source()
    internal: list[tuple[int, int]] = []

    def placeholder(ref) -> str:
        internal.append(tuple(ref))
        return f"PH[{len(internal) - 1}]"

    _, arg_keys, kw_keys = proto.signature
    items = [_run_value(src, t, k, refs, placeholder) for t, k in zip(proto.args_t, arg_keys)]
    kw_items = [f"{name!r}: {_run_value(src, proto.kwargs_t[name], k, refs, placeholder)}" for name, k in kw_keys]
    src.emit(f"return ({', '.join(items)}{',' if len(items) == 1 else ''}), {{{', '.join(kw_items)}}}")
    return _define("call", "bound, PH", src, READY=ready_data), internal


def compile_outputs(proto: OpProto):
    """outputs(values, position) -> (return value, weakrefs of new outputs' cells per slot):
    what a deferred op hands out, written out for one position. Written inputs (in-place,
    out=) are returned as themselves; new outputs are deferred wrappers."""
    src = _Source()
    indent = 1
    if proto.info.is_view:
        # As in eager dispatch (_deferred_output), a view of a normal tensor made in
        # inference mode stays a normal tensor: made with inference mode off.
        src.emit("with INFERENCE_OFF(False) if INFERENCE() and HAS_NORMAL(values) else NO_GUARD:")
        indent = 2
    device = src.const(NEURON_DEVICES[proto.device])
    refs = []
    for slot, spec in enumerate(proto.out_specs):
        if spec[0] == "alias":
            src.emit(f"o{slot} = values[{spec[1]}]", indent)
            refs.append("None")
        else:
            size, stride, offset, dtype = (src.const(x) for x in spec[1:5])
            # A deferred wrapper (Note [Deferred values] in dispatch/tensor.py): NeuronTensor's
            # metadata, `_data` None, and the cell the launch fills.
            src.emit(f"o{slot} = MAKE(NT, {size}, strides={stride}, storage_offset={offset}, dtype={dtype}, "
                     f"device={device}, requires_grad=False)", indent)
            src.emit(f"o{slot}._data = None", indent)
            src.emit(f"o{slot}._device_index = {proto.device}", indent)
            src.emit(f"c{slot} = o{slot}._cell = CELL()", indent)
            refs.append(f"REF(c{slot})")
        src.emit(f"o{slot}._producer = (position, {slot})", indent)
    src.emit(f"return {_template_expr(proto.ret_t)}, [{', '.join(refs)}]")
    return _define("outputs", "values, position", src, MAKE=torch.Tensor._make_wrapper_subclass, NT=NeuronTensor,
                   CELL=DeferredCell, REF=weakref.ref, INFERENCE=torch.is_inference_mode_enabled,
                   HAS_NORMAL=has_normal_tensor, INFERENCE_OFF=torch._C._InferenceMode,
                   NO_GUARD=contextlib.nullcontext())


def _template_expr(template) -> str:
    """The expression that rebuilds a return value from o<slot> locals (pending._fill)."""
    if template is None:
        return "None"
    if isinstance(template, int):
        return f"o{template}"
    items = [_template_expr(t) for t in template]
    if isinstance(template, tuple):
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    return "[" + ", ".join(items) + "]"


def _call_env(proto: OpProto) -> dict:
    return dict(READY=ready_data, OP=proto.info.op._op, INFO=proto.info, RUN=run_on_host, FLAT=flat_tensors)


def _emit_call(src: _Source, proto: OpProto, refs: tuple, result: str | None = None) -> None:
    """Lines that call the op on host values and leave its outputs, in slot order, in
    `result` (or return them)."""
    _, arg_keys, kw_keys = proto.signature
    names = []
    for i, (t, k) in enumerate(zip(proto.args_t, arg_keys)):
        src.emit(f"a{i} = {_run_value(src, t, k, refs)}")
        names.append(f"a{i}")
    kw_exprs = []
    for name, k in kw_keys:
        src.emit(f"k_{name} = {_run_value(src, proto.kwargs_t[name], k, refs)}")
        kw_exprs.append((name, f"k_{name}"))
    info = proto.info
    call_args = ", ".join(names)
    call_kwargs = ", ".join(f"{n}={v}" for n, v in kw_exprs)
    if info.is_random:
        # Note [RNG order]: random ops draw from the device generator, as in eager mode.
        src.emit(f"out = RUN(INFO, {proto.device}, ({call_args}{',' if len(names) == 1 else ''}), "
                 f"{{{', '.join(f'{n!r}: {v}' for n, v in kw_exprs)}}})")
    else:
        src.emit(f"out = OP({', '.join(x for x in (call_args, call_kwargs) if x)})")
    lead = "return" if result is None else f"{result} ="
    # The outputs in slot order, flattened as trace.flat_tensors does; spelled out where the
    # structure is fixed by the signature (a foreach op's tensor lists, a tuple of tensors).
    if proto.ret_t is None and info.mutates:
        written = [(names[i], proto.args_t[i]) for i in info.written_args if i < len(names)]
        written += [(f"k_{n}", proto.kwargs_t[n]) for n in info.written_kwargs if n in dict(kw_exprs)]
        if all(_is_tensor_or_tensor_list(t) for _, t in written):
            src.emit(f"{lead} [{', '.join(name if type(t) is Slot else '*' + name for name, t in written)}]")
        else:
            src.emit(f"{lead} FLAT(({', '.join(name for name, _ in written)},))")
    elif isinstance(proto.ret_t, int):
        src.emit(f"{lead} [out]")
    elif all(t is None or isinstance(t, int) for t in proto.ret_t):
        src.emit(f"{lead} [{', '.join(f'out[{i}]' for i, t in enumerate(proto.ret_t) if t is not None)}]")
    else:
        src.emit(f"{lead} FLAT(out)")


def _is_tensor_or_tensor_list(template) -> bool:
    return type(template) is Slot or (type(template) in (list, tuple) and all(type(t) is Slot for t in template))


def _define(name: str, params: str, src: _Source, **env):
    code = f"def {name}({params}):\n" + "\n".join(src.lines) + "\n"
    namespace = dict(env, **src.consts)
    exec(compile(code, f"<adaptive_eager {name}>", "exec"), namespace)  # noqa: S102 - our own code
    fn = namespace[name]
    fn.source = code
    return fn
