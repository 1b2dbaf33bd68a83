"""Straight-line Python for each op of a trace: a matcher and a runner.

The steady-state cost of the engine is paid per op, so each trace position gets code of
its own, generated once when the trace is cached:

- the matcher checks an incoming call against that position without describing it first
  (no OpRecord, no key tuples): internal inputs by producer identity only (their metadata
  was fixed by the trace), outside inputs by metadata, constants by value, lifted floats
  by type. It returns the call's slot values, or None (a divergence).
- the runner calls the op on host data with the arguments wired in: internal inputs from
  the launch's results, outside inputs from their wrappers, scalars as bound.

Both must agree exactly with `dispatch.record.OpRecord` (the slow path that builds the
trace): the same slot numbering, the same keys. tests/test_adaptive*.py run every loop in
both modes and compare bit for bit.
"""
from __future__ import annotations

import torch

from dispatch import NeuronTensor
from dispatch.kernels import run_on_host
from dispatch.record import CPU_SCALAR, Slot
from dispatch.tensor import resolve_data

from .trace import OpProto, flat_tensors

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


def _match_value(src: _Source, expr: str, template, key, refs) -> None:
    """Emit checks that the value at `expr` fits (template, key); store slot values."""
    if type(template) is Slot:
        s = template.index
        if _is_tensor_key(key):
            ref = refs[s]
            if ref is not None:
                want = src.const(ref)
                # Produced by op ref[0] of this trace: its metadata is the trace's by construction.
                src.emit(f"v = {expr}")
                src.emit(f"if v.__class__ is not NT or v._producer != (p.positions[{want}[0]], {want}[1]): return None")
            else:
                shape, stride, offset, dtype, device = (src.const(x) for x in key)
                src.emit(f"v = {expr}")
                src.emit(f"if not isinstance(v, TENSOR) or v.shape != {shape} or v.stride() != {stride} "
                         f"or v.storage_offset() != {offset} or v.dtype != {dtype} or v.device != {device}: return None")
                src.emit("if v.__class__ is NT:")
                src.emit("pr = v._producer", 2)
                src.emit("if pr is not None and pr[0] >= p.base or v._data is None and RESOLVE(v) is None: return None", 2)
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
            _match_value(src, f"{name}[{i}]", t, k, refs)
    else:  # a structural constant: keyed by value (bools apart from ints)
        c = src.const(template)
        cls = src.const(type(template))
        src.emit(f"v = {expr}")
        src.emit(f"if v.__class__ is not {cls} or v != {c}: return None")


def compile_matcher(proto: OpProto, refs: tuple, n_values: int):
    """match(args, kwargs, pending) -> list of slot values, or None."""
    src = _Source()
    _, arg_keys, kw_keys = proto.signature
    src.emit(f"if len(args) != {len(arg_keys)} or len(kwargs) != {len(kw_keys)}: return None")
    src.emit(f"vals = [None] * {n_values}")
    for i, (t, k) in enumerate(zip(proto.args_t, arg_keys)):
        _match_value(src, f"args[{i}]", t, k, refs)
    for name, k in kw_keys:
        t = proto.kwargs_t[name] if not _is_device_key(k) else k
        src.emit(f"if {name!r} not in kwargs: return None")
        _match_value(src, f"kwargs[{name!r}]", t, k, refs)
    src.emit("return vals")
    return _define("match", "args, kwargs, p", src, NT=NeuronTensor, TENSOR=torch.Tensor, RESOLVE=resolve_data)


def _is_device_key(key) -> bool:
    return isinstance(key, torch.device)


def _run_value(src: _Source, template, key, refs) -> str:
    """An expression for the host value of one argument at launch time."""
    if type(template) is Slot:
        s = template.index
        if _is_tensor_key(key):
            ref = refs[s]
            if ref is not None:
                return f"results[{ref[0]}][{ref[1]}]"
            if key[4].type == "neuron":
                return f"RESOLVE(bound[{s}])"
        return f"bound[{s}]"
    if type(template) in (list, tuple):
        items = [_run_value(src, t, k, refs) for t, k in zip(template, key)]
        inner = ", ".join(items) + ("," if type(template) is tuple and len(items) == 1 else "")
        return f"[{inner}]" if type(template) is list else f"({inner})"
    return src.const(template)


def compile_runner(proto: OpProto, refs: tuple):
    """run(bound, results) -> the op's host outputs in slot order (see trace.py)."""
    src = _Source()
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
    if proto.ret_t is None and info.mutates:
        written = [names[i] for i in info.written_args if i < len(names)]
        written += [f"k_{n}" for n in info.written_kwargs if n in dict(kw_exprs)]
        src.emit(f"return FLAT(({', '.join(written)},))")
    elif isinstance(proto.ret_t, int):
        src.emit("return [out]")
    else:
        src.emit("return FLAT(out)")
    return _define("run", "bound, results", src, RESOLVE=resolve_data, OP=info.op._op, INFO=info,
                   RUN=run_on_host, FLAT=flat_tensors)


def _define(name: str, params: str, src: _Source, **env):
    code = f"def {name}({params}):\n" + "\n".join(src.lines) + "\n"
    namespace = dict(env, **src.consts)
    exec(compile(code, f"<adaptive_eager {name}>", "exec"), namespace)  # noqa: S102 - our own code
    fn = namespace[name]
    fn.source = code
    return fn
