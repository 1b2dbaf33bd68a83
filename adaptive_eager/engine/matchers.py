"""Straight-line Python for each position of a trace: its matcher.

The steady-state cost of the engine is paid per op, so each trace position gets a matcher
of its own, generated once the position is warm (Note [Matchers compiled once warm]): it
checks an incoming call against that position without describing it first (no OpRecord, no
key tuples): tensors by metadata (the signature fixes every output's geometry, and the C++ queue holds the
arguments themselves, so dataflow is not checked), constants by value, lifted floats by
type. It returns True, or None (a divergence).

It must agree exactly with `adaptive_eager.engine.record.OpRecord` (the slow path that builds the
trace): the same slot numbering, the same keys. tests/test_adaptive*.py run every loop in
both modes and compare bit for bit.
"""
from __future__ import annotations

import torch

from adaptive_eager.engine.record import CPU_SCALAR, Slot

from .trace import OpProto


class Source:
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


def _is_device_key(key) -> bool:
    return isinstance(key, torch.device)


def _exact_tensor(src: Source, expr: str, key) -> None:
    """A tensor argument checked against its signature's key: every size, stride and more."""
    # Any tensor class (nn.Parameter too); the device by index (`v.device` builds a
    # torch.device on every read): get_device() is -1 on the CPU.
    shape, stride, offset, dtype = (src.const(x) for x in key[:4])
    index = key[4].index if key[4].type == "neuron" else -1
    src.emit(f"v = {expr}")
    src.emit(f"if not isinstance(v, TENSOR) or v.get_device() != {index} or v.shape != {shape} "
             f"or v.stride() != {stride} or v.storage_offset() != {offset} or v.dtype != {dtype}: return None")


def _match_value(src: Source, expr: str, template, key, on_tensor=_exact_tensor, on_int=None) -> None:
    """Emit checks that the value at `expr` fits (template, key). on_tensor(src, expr, key)
    checks a tensor argument; on_int(src, expr), when given, an int constant (a shape-generic
    matcher's, generic.py, checks them as sizes, not values)."""
    if type(template) is Slot:
        if _is_tensor_key(key):
            on_tensor(src, expr, key)
        elif isinstance(key, tuple) and len(key) == 2 and key[0] is CPU_SCALAR:
            dtype = src.const(key[1])
            src.emit(f"v = {expr}")
            src.emit(f"if not isinstance(v, TENSOR) or not v.is_cpu or v.dim() != 0 or v.dtype != {dtype}: return None")
        else:  # a lifted float/complex, or an unhashable object: keyed by type
            cls = src.const(key if isinstance(key, type) else type(None))
            src.emit(f"v = {expr}")
            src.emit(f"if v.__class__ is not {cls}: return None")
    elif type(template) in (list, tuple):
        cls = "list" if type(template) is list else "tuple"
        src.emit(f"v = {expr}")
        src.emit(f"if v.__class__ is not {cls} or len(v) != {len(template)}: return None")
        name = f"l{len(src.lines)}"
        src.emit(f"{name} = v")
        for i, (t, k) in enumerate(zip(template, key)):
            _match_value(src, f"{name}[{i}]", t, k, on_tensor, on_int)
    elif on_int is not None and type(template) is int:
        src.emit(f"v = {expr}")
        src.emit("if v.__class__ is not int: return None")
        on_int(src, "v")
    else:  # a structural constant: keyed by value (bools apart from ints)
        c = src.const(template)
        cls = src.const(type(template))
        src.emit(f"v = {expr}")
        src.emit(f"if v.__class__ is not {cls} or v != {c}: return None")


def emit_call_checks(src: Source, signature: tuple, args_t: tuple, kwargs_t: dict, on_tensor=_exact_tensor,
                     on_int=None) -> None:
    """Checks of a whole call (args, kwargs) against a signature and its argument template."""
    _, arg_keys, kw_keys = signature
    src.emit(f"if len(args) != {len(arg_keys)} or len(kwargs) != {len(kw_keys)}: return None")
    for i, (t, k) in enumerate(zip(args_t, arg_keys)):
        _match_value(src, f"args[{i}]", t, k, on_tensor, on_int)
    for name, k in kw_keys:
        t = kwargs_t[name] if not _is_device_key(k) else k
        src.emit(f"if {name!r} not in kwargs: return None")
        _match_value(src, f"kwargs[{name!r}]", t, k, on_tensor, on_int)


# Note [Matchers compiled once warm]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Compiling a matcher (Python's compile() of its source: 200-600 us) costs what ~65 matches
# save with it (an addmm's: 1.7 us, where describing the call and comparing signatures takes
# 4.7), and most positions are matched in Python a few times only: once detection pauses or
# goes quiet, the C++ route matches a trace's positions after its first (Note [Armed
# matching]). A small MLP's first 30 steps compiled 19 matchers: 60 of the 113 million
# instructions its thread spent in them, where eager mode's spent 47 (callgrind). So a
# position's first INTERPRETED_MATCHES matches describe the call (OpRecord.from_call) and
# compare: its signature for an exact position (what the slow path compares, and what the
# matcher checks), its size-erased structure and ints for a generic one (generic.fits_generic,
# the same checks in the same order as compile_generic_matcher's). A position matched more
# often gets its matcher.
INTERPRETED_MATCHES = 64


def compile_matcher(proto: OpProto):
    """match(args, kwargs, pending) -> True, or None."""
    src = Source()
    emit_call_checks(src, proto.signature, proto.args_t, proto.kwargs_t)
    src.emit("return True")
    return define("match", "args, kwargs, p", src, TENSOR=torch.Tensor)


# Compiled matcher sources. A matcher's constants are names (C0, C1, ...) bound in its
# namespace, so positions of the same structure (every `mm(a, b)` of a step, every foreach op of
# one parameter list) share one source: compiling it is most of what a new matcher costs (about
# 200 µs; 22 of them were a fifth of a small MLP's warm-up excess over eager mode), binding its
# constants a few µs. Cleared when full: bounded memory for streams of ever new structures.
_COMPILED: dict[str, object] = {}
_COMPILED_KEPT = 4096


def define(name: str, params: str, src: Source, **env):
    code = f"def {name}({params}):\n" + "\n".join(src.lines) + "\n"
    compiled = _COMPILED.get(code)
    if compiled is None:
        if len(_COMPILED) >= _COMPILED_KEPT:
            _COMPILED.clear()
        compiled = _COMPILED[code] = compile(code, f"<adaptive_eager {name}>", "exec")
    namespace = dict(env, **src.consts)
    exec(compiled, namespace)  # noqa: S102 - our own code
    fn = namespace[name]
    fn.source = code
    return fn
