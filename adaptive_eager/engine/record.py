"""OpRecord: one ATen op as the engine sees it, and a recorder to print any code's op stream.

An OpRecord holds the op overload, an argument template (the args/kwargs structure with
tensors and lifted scalars replaced by `Slot` placeholders), the values bound to those
slots for this call, and a metadata signature: two calls with equal signatures are the
same op on tensors of the same layout, whatever the data and the lifted scalars are.

Note [Lifted scalars]: Python floats (and complex numbers) are never part of the key,
wherever they appear: in `Scalar` arguments, in lists (`_foreach_*.ScalarList`), and where
the schema says Tensor but a float was passed (AdamW's `div.Tensor(x, 0.0547)`). Only
their type is keyed; the value is bound per call. Otherwise an optimizer whose step size
or bias correction changes every step would never repeat. Not for the ops whose output
sizes those values decide, `arange` and `range` (OpInfo.sized_by_scalars): keyed by value
there, or a trace would promise mvlgamma's backward an `arange` of another length. A bool
passed as a `Scalar` argument is lifted too (its type keyed, its value bound): there it is
a value like a float, which decides no output's geometry, and generate()'s stopping
criteria fill their done flag with `cur_len >= max_length` (`fill_(t, False)` every token
but the last): keyed by value, the token's trace diverged at the last token of every call,
and the ops after it ran one by one, recorded in Python (issue 35). Ints, other bools,
strings, dtypes, layouts, memory formats and devices are structural (they change shapes or
kernels) and are keyed by value; bools are keyed apart from ints because `True == 1`.

Note [CPU scalar tensors]: a CPU 0-dim tensor passed to an op (and not written by it) is
a scalar, as on CUDA: its value is read when the op is issued (the bound value is a
snapshot, so a later `step_t += 1` cannot leak into a deferred launch) and only its dtype
is keyed. A written CPU 0-dim tensor (an optimizer's step counter in `add_`) stays a
tensor argument, bound to the object itself.

The signature does not hold dataflow (which earlier op produced an input): that depends
on the trace the op sits in, and the engine adds it.
"""
from __future__ import annotations

import os
import sys
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from adaptive_eager.dispatch.classify import classify

__all__ = ["OpRecord", "OpRecorder", "Slot", "record_ops"]


class Slot:
    """Placeholder in an argument template for the value bound at position `index`."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __repr__(self):
        return f"Slot({self.index})"


# Slots are interned per index: a template costs no allocation per placeholder.
_SLOTS = [Slot(i) for i in range(64)]


def _slot(i: int) -> Slot:
    if i < 64:
        return _SLOTS[i]
    while i >= len(_SLOTS):
        _SLOTS.append(Slot(len(_SLOTS)))
    return _SLOTS[i]


class _CpuScalar:
    """Key marker of a CPU 0-dim tensor read as a scalar (see Note [CPU scalar tensors])."""

    __slots__ = ()

    def __repr__(self):
        return "cpu-scalar"


CPU_SCALAR = _CpuScalar()
_CPU = torch.device("cpu")

# Keyed by value; the key is the value itself.
_BY_VALUE = frozenset({int, str, type(None), torch.dtype, torch.layout, torch.memory_format, torch.device})
_LIFTED = frozenset({float, complex})


def _describe(a, values: list, scalar_ok: bool, lift: bool = True):
    """(key, template) of one argument; appends the values bound to new slots. lift=False:
    floats are keyed by value (an op sized by its scalars, OpInfo.sized_by_scalars)."""
    if isinstance(a, torch.Tensor):
        if scalar_ok and a.is_cpu and a.dim() == 0:
            # Note [CPU scalar tensors]: a snapshot, read now.
            values.append(a.detach().clone())
            return (CPU_SCALAR, a.dtype), _slot(len(values) - 1)
        values.append(a)
        return (a.shape, a.stride(), a.storage_offset(), a.dtype, a.device), _slot(len(values) - 1)
    cls = type(a)
    if cls in _BY_VALUE:
        return a, a
    if cls in _LIFTED and lift:  # Note [Lifted scalars]
        values.append(a)
        return cls, _slot(len(values) - 1)
    if cls is bool:
        return (bool, a), a
    if cls is list or cls is tuple:
        keys, template = [], []
        for x in a:
            k, t = _describe(x, values, scalar_ok, lift)
            keys.append(k)
            template.append(t)
        return tuple(keys), cls(template)
    if cls is torch.ScriptObject:
        # An opaque handle (c10d's ProcessGroup, ReduceOp): a new wrapper object per call, so
        # keyed by its class, as a value bound per call. Keyed by identity, every collective
        # had a new signature and the stream around it never repeated (Note [Collectives]).
        values.append(a)
        return (cls, a._type().qualified_name()), _slot(len(values) - 1)
    try:
        hash(a)
    except TypeError:  # not a structural value (a Generator is hashable; this is rarer)
        values.append(a)
        return cls, _slot(len(values) - 1)
    return (cls, a), a


def _rebind(t, values):
    cls = type(t)
    if cls is Slot:
        return values[t.index]
    if cls is list or cls is tuple:
        return cls(_rebind(x, values) for x in t)
    return t


class OpRecord:
    """One issued ATen op: overload, argument template, bound values, metadata signature."""

    __slots__ = ("func", "args", "kwargs", "values", "signature", "results", "_where")

    def __init__(self, func, args: tuple, kwargs: dict, values: tuple, signature: tuple, where=None):
        self.func = func
        self.args = args  # template: Slot placeholders where tensors and lifted scalars were
        self.kwargs = kwargs
        self.values = values  # what the slots are bound to in this call
        self.signature = signature  # hashable: (func, arg keys, kwarg keys)
        self.results = None  # output keys, filled in by recorders that ran the op
        self._where = where  # (code, lineno) of the user's frame, if captured

    @classmethod
    def from_call(cls, func, args, kwargs, *, source: bool = False) -> "OpRecord":
        """Describe the call func(*args, **kwargs) before it runs.

        source=True also captures where in the user's code the op was issued (one short
        stack walk); leave it off on hot paths.
        """
        info = classify(func)
        written = info.written_args
        lift = not info.sized_by_scalars
        values: list = []
        arg_keys, arg_tmpl = [], []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and not a.is_cpu:  # fast path: a device tensor
                values.append(a)
                arg_keys.append((a.shape, a.stride(), a.storage_offset(), a.dtype, a.device))
                arg_tmpl.append(_slot(len(values) - 1))
                continue
            if a.__class__ is bool and lift and i in info.scalar_args:  # Note [Lifted scalars]
                values.append(a)
                arg_keys.append(bool)
                arg_tmpl.append(_slot(len(values) - 1))
                continue
            k, t = _describe(a, values, i not in written, lift)
            arg_keys.append(k)
            arg_tmpl.append(t)
        kw_keys, kw_tmpl = [], {}
        if kwargs:
            for name, a in kwargs.items():
                if a.__class__ is bool and lift and name in info.scalar_kwargs:  # Note [Lifted scalars]
                    values.append(a)
                    kw_keys.append((name, bool))
                    kw_tmpl[name] = _slot(len(values) - 1)
                    continue
                k, t = _describe(a, values, name not in info.written_kwargs, lift)
                kw_keys.append((name, k))
                kw_tmpl[name] = t
        signature = (func, tuple(arg_keys), tuple(kw_keys))
        where = _user_frame(sys._getframe(1)) if source else None
        return cls(func, tuple(arg_tmpl), kw_tmpl, tuple(values), signature, where)

    def bind(self, values=None) -> tuple[tuple, dict]:
        """(args, kwargs) with the slots filled from values (default: this call's values)."""
        values = self.values if values is None else values
        return (tuple(_rebind(t, values) for t in self.args),
                {k: _rebind(t, values) for k, t in self.kwargs.items()})

    @property
    def name(self) -> str:
        """'aten.addmm.default', as the op prints in PyTorch's own traces."""
        return _op_name(self.func)

    @property
    def source(self) -> str | None:
        """'file:line in function' of the user's code that issued the op (formatted on
        request), or None when not captured or when no user frame exists (ops that
        autograd's engine issues during backward have only C++ callers)."""
        if self._where is None:
            return None
        code, line = self._where
        return f"{_short_path(code.co_filename)}:{line} in {code.co_name}"

    def describe_args(self) -> str:
        parts = [_fmt(t, k, self.values) for t, k in zip(self.args, self.signature[1])]
        parts += [f"{name}={_fmt(self.kwargs[name], k, self.values)}" for name, k in self.signature[2]]
        return ", ".join(parts)

    def __repr__(self):
        text = f"{self.name}({self.describe_args()})"
        if self.results:
            text += " -> " + ", ".join(_fmt_key(k, None) for k in self.results)
        return text


# -- formatting -----------------------------------------------------------------------------

_DTYPE_SHORT = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "b8", torch.complex64: "c64", torch.complex128: "c128",
}


def _op_name(func) -> str:
    return str(func)


def _dtype(d) -> str:
    return _DTYPE_SHORT.get(d) or str(d).replace("torch.", "")


def _contiguous_strides(shape) -> tuple:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def _fmt_key(key, value) -> str:
    """A slot's key (and value, for scalars) as text: 'f32[64, 256] neuron:0'."""
    if key is float or key is complex or key is bool:  # lifted: Note [Lifted scalars]
        return key.__name__ if value is None else repr(value)
    if isinstance(key, tuple) and len(key) == 2 and key[0] is CPU_SCALAR:
        shown = "" if not isinstance(value, torch.Tensor) else f"={value.item()!r}"
        return f"cpu-scalar {_dtype(key[1])}{shown}"
    if isinstance(key, tuple) and len(key) == 5:
        shape, stride, offset, dtype, device = key
        text = f"{_dtype(dtype)}[{', '.join(map(str, shape))}]"
        if tuple(stride) != _contiguous_strides(shape):
            text += f"{{stride={tuple(stride)}}}"
        if offset:
            text += f"{{offset={offset}}}"
        return f"{text} {device}"
    return f"<{key.__name__ if isinstance(key, type) else key}>"


def _fmt_any_key(key) -> str:
    """Any argument's key as text: a tensor's metadata, a list's keys, a value as Python shows it."""
    if isinstance(key, tuple) and len(key) == 5 and isinstance(key[0], torch.Size):
        return _fmt_key(key, None)
    if isinstance(key, tuple) and len(key) == 2 and (key[0] is CPU_SCALAR or key[0] is bool):
        return _fmt_key(key, None) if key[0] is CPU_SCALAR else repr(key[1])
    if isinstance(key, tuple):
        return "[" + ", ".join(_fmt_any_key(k) for k in key) + "]"
    if isinstance(key, type):
        return _fmt_key(key, None)
    return repr(key)


def signature_difference(expected: tuple, got: tuple) -> str:
    """What tells two signatures apart, as text: 'argument 1: expected f32[8, 64] neuron:0, got
    f32[9, 64] neuron:0'; the ops, when they differ; '' when they are equal."""
    if expected[0] != got[0]:
        return f"expected {_op_name(expected[0])}, got {_op_name(got[0])}"
    args_e, args_g = expected[1], got[1]
    for i, (a, b) in enumerate(zip(args_e, args_g)):
        if a != b:
            return f"argument {i}: expected {_fmt_any_key(a)}, got {_fmt_any_key(b)}"
    if len(args_e) != len(args_g):
        return f"expected {len(args_e)} arguments, got {len(args_g)}"
    kw_e, kw_g = dict(expected[2]), dict(got[2])
    for name in sorted(kw_e.keys() | kw_g.keys()):
        if kw_e.get(name) != kw_g.get(name):
            shown = [_fmt_any_key(kw[name]) if name in kw else "(not given)" for kw in (kw_e, kw_g)]
            return f"expected {name}={shown[0]}, got {name}={shown[1]}"
    return ""


def _fmt(template, key, values) -> str:
    cls = type(template)
    if cls is Slot:
        value = values[template.index] if values is not None else None
        if isinstance(value, torch.Tensor) and key[0] is not CPU_SCALAR:
            value = None  # tensors print as their metadata; only scalar values are shown
        return _fmt_key(key, value)
    if cls is list or cls is tuple:
        return "[" + ", ".join(_fmt(t, k, values) for t, k in zip(template, key)) + "]"
    return repr(template)


# -- the user's source line -----------------------------------------------------------------

def _package_dirs() -> tuple[str, ...]:
    # The folders of our three layers: adaptive_eager.device and .dispatch live beside
    # adaptive_eager/, not in it (pyproject.toml's package-dir).
    import adaptive_eager.device as device_layer  # `as`: found in sys.modules mid-import too
    import adaptive_eager.dispatch as dispatch_layer

    packages = (sys.modules["adaptive_eager"], device_layer, dispatch_layer)
    ours = [os.path.join(os.path.abspath(p), "") for m in packages for p in m.__path__]
    return (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, *ours)


_INTERNAL_DIRS = _package_dirs()
_internal_cache: dict[str, bool] = {}


def _is_internal(filename: str) -> bool:
    hit = _internal_cache.get(filename)
    if hit is None:
        hit = _internal_cache[filename] = os.path.abspath(filename).startswith(_INTERNAL_DIRS)
    return hit


def _user_frame(frame):
    """(code, lineno) of the first frame outside torch/ and our packages, or None."""
    while frame is not None:
        code = frame.f_code
        if not _is_internal(code.co_filename):
            # Keep the code object and line, never the frame: a frame keeps its locals
            # (tensors) alive, and extra references change autograd's op stream.
            return code, frame.f_lineno
        frame = frame.f_back
    return None


def user_source_line(frame=None) -> str | None:
    """'file:line in function' of the user's code calling into torch right now, or None
    (no Python caller: an op autograd's engine issues). One short stack walk."""
    where = _user_frame(frame or sys._getframe(1))
    if where is None:
        return None
    code, line = where
    return f"{_short_path(code.co_filename)}:{line} in {code.co_name}"


_short_paths: dict[tuple[str, str], str] = {}


def _short_path(filename: str) -> str:
    # Asked once per trace position as the engine first matches it (the trace's sources), and
    # at every divergence: os.path.relpath cost 6-12 us a call (an abspath of each side), 0.5
    # of the 1.2 ms the engine spent matching the small MLP's first matched step. Relative to
    # the working directory, which may change: part of the key (getcwd is one system call).
    try:
        key = (filename, os.getcwd())
    except OSError:  # the working directory was removed: no shorter name to give
        return filename
    short = _short_paths.get(key)
    if short is None:
        try:
            rel = os.path.relpath(filename)
        except ValueError:  # another drive on Windows
            rel = ".."
        short = filename if rel.startswith("..") else rel
        if len(_short_paths) >= 4096:  # files x directories: a bound, never reached in practice
            _short_paths.clear()
        _short_paths[key] = short
    return short


# -- the recorder -----------------------------------------------------------------------------

class OpRecorder(TorchDispatchMode):
    """A dispatch mode that records every ATen op issued while it is active.

    It sees factories too, on every device, and (being a dispatch mode, whose stack torch
    propagates) ops that autograd runs on its backward thread. Tensors are not kept alive:
    a record keeps only metadata and the scalar values.
    """

    def __init__(self, devices=None, source: bool = True):
        super().__init__()
        self.records: list[OpRecord] = []
        self.source = source
        self._devices = _device_filter(devices)
        self._lock = threading.Lock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = OpRecord.from_call(func, args, kwargs, source=False)
        if self.source:
            rec._where = _user_frame(sys._getframe(1))
        out = func(*args, **kwargs)
        rec.results = tuple(_result_keys(out))
        if self._devices is None or _touches(rec, kwargs, self._devices):
            # Drop references to tensors: keep scalars and scalar snapshots for printing.
            rec.values = tuple(v if not isinstance(v, torch.Tensor) or v.dim() == 0 and v.device == _CPU
                               else None for v in rec.values)
            with self._lock:
                self.records.append(rec)
        return out

    # -- reading the stream ----------------------------------------------------------------
    def names(self) -> list[str]:
        """Op names in issue order, e.g. ['aten.addmm.default', ...]."""
        return [r.name for r in self.records]

    def __len__(self):
        return len(self.records)

    def __iter__(self):
        return iter(self.records)

    def __getitem__(self, i):
        return self.records[i]

    def __str__(self):
        width = len(str(len(self.records)))
        lines = [f"{len(self.records)} ops"]
        for i, r in enumerate(self.records):
            where = r.source or ("-" if not self.source else "(no Python caller: autograd engine)")
            lines.append(f"{i:>{width}}  {r!r}    # {where}")
        return "\n".join(lines)


def record_ops(devices=None, *, source: bool = True) -> OpRecorder:
    """Record the op stream of a block: `with record_ops() as rec: ...; print(rec)`.

    devices: None records every op; otherwise a device or device type ('neuron',
    'neuron:1', 'cpu') or a list of them, and only ops with a tensor (argument or result)
    or a device= argument there are kept. source=False skips the user-source lookup.
    """
    return OpRecorder(devices, source)


def _device_filter(devices):
    if devices is None:
        return None
    if isinstance(devices, (str, torch.device)):
        devices = [devices]
    return tuple(torch.device(d) for d in devices)


def _matches(device, wanted) -> bool:
    for w in wanted:
        if device.type == w.type and (w.index is None or device.index == w.index):
            return True
    return False


def _result_keys(out):
    if isinstance(out, torch.Tensor):
        yield (out.shape, out.stride(), out.storage_offset(), out.dtype, out.device)
    elif isinstance(out, (list, tuple)):
        for o in out:
            yield from _result_keys(o)


def _tensor_keys(key):
    if isinstance(key, tuple):
        if len(key) == 5 and isinstance(key[4], torch.device):
            yield key
        else:
            for k in key:
                yield from _tensor_keys(k)


def _touches(rec: OpRecord, kwargs, wanted) -> bool:
    for key in (*_tensor_keys(rec.signature[1:]), *rec.results):
        if _matches(key[4], wanted):
            return True
    dev = kwargs.get("device")
    return dev is not None and _matches(torch.device(dev), wanted)
