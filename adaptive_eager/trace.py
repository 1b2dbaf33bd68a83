"""What the engine knows about one op shape (OpProto) and about a cached sequence (Trace).

An OpProto is built once per distinct signature from an op that ran: the argument
template (from dispatch's OpRecord), which inputs the outputs are (in-place, out=), the
metadata of new outputs, and the structure of the return value. A Trace is a list of
protos plus, per tensor input, whether it is produced inside the trace (which op, which
output) or comes from outside.

Output slots: an op's outputs are the tensors of its return value, flattened; an in-place
op that returns nothing (`_foreach_add_`) has its written tensors as outputs instead. The
replay flattens the host results the same way, so slot i means the same thing in both.
"""
from __future__ import annotations

import dataclasses
import itertools

import torch

from dispatch import NeuronTensor, OpInfo

_HOST = torch.device("cpu")


@dataclasses.dataclass(eq=False)
class OpProto:
    info: OpInfo
    signature: tuple
    args_t: tuple  # OpRecord template (Slot placeholders)
    kwargs_t: dict
    # per output slot: ("alias", value index) or ("new", size, stride, offset, dtype)
    out_specs: tuple
    ret_t: object  # return structure: int = output slot, tuple/list of those, or None
    device: int
    barrier: bool  # cannot be deferred: runs eagerly and cuts traces (Note [Sync points])
    name: str = ""
    outputs_fn: object = None  # compile.compile_outputs, generated when first deferred

    def __post_init__(self):
        self.name = self.info.name

    def outputs(self, values, position: int):
        """The deferred op's return value and its new outputs' cell weakrefs (compile_outputs)."""
        fn = self.outputs_fn
        if fn is None:
            from .compile import compile_outputs

            fn = self.outputs_fn = compile_outputs(self)
        return fn(values, position)


def returns_only_views(info: OpInfo) -> bool:
    """Every output of the op is a read-only view of an input: their storage is tracked
    already, so a launch counts no new device memory for them."""
    return all(r.alias_info is not None and not r.alias_info.is_write for r in info.op._schema.returns)


def flat_tensors(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in flat_tensors(o)]
    return []


def written_inputs(info: OpInfo, args, kwargs) -> list:
    found = []
    for i in info.written_args:
        if i < len(args):
            found += flat_tensors(args[i])
    for name in info.written_kwargs:
        if name in kwargs:
            found += flat_tensors(kwargs[name])
    return found


def output_slots(info: OpInfo, result, args, kwargs) -> list:
    """The op's outputs in slot order (see module docstring)."""
    flat = flat_tensors(result)
    if not flat and result is None and info.mutates:
        flat = written_inputs(info, args, kwargs)
    return flat


def return_template(result, counter) -> object:
    if isinstance(result, torch.Tensor):
        return next(counter)
    if isinstance(result, (list, tuple)):
        return type(result)(return_template(r, counter) for r in result)
    return None


def build_proto(info: OpInfo, rec, result, args, kwargs, device: int, barrier: bool) -> OpProto:
    """Describe an op that just ran eagerly: rec is its OpRecord (taken before it ran)."""
    outs = output_slots(info, result, args, kwargs)
    specs = []
    for o in outs:
        index = next((i for i, v in enumerate(rec.values) if v is o), None)
        if index is not None:
            specs.append(("alias", index))
        elif isinstance(o, NeuronTensor):
            specs.append(("new", tuple(o.shape), o.stride(), o.storage_offset(), o.dtype))
        else:  # a host tensor result (a transfer): such ops are barriers anyway
            barrier = True
            specs.append(("host",))
    if not barrier and not _result_is_tensors(result):
        barrier = True  # a Python value (bool, int, float) is needed now
    if not barrier and any(isinstance(v, NeuronTensor) and (v._math_bits or v.dtype.is_complex) for v in rec.values):
        barrier = True  # conj/neg views re-apply flags on unwrap; kept eager (Note [Math bits])
    ret_t = return_template(result, itertools.count()) if not barrier else None
    kwargs_t = dict(rec.kwargs)
    if info.device_arg is not None and isinstance(kwargs_t.get(info.device_arg), torch.device):
        kwargs_t[info.device_arg] = _HOST
    return OpProto(info, rec.signature, rec.args, kwargs_t, tuple(specs), ret_t, device, barrier)


def _result_is_tensors(result) -> bool:
    if result is None or isinstance(result, torch.Tensor):
        return True
    if isinstance(result, (list, tuple)):
        return all(_result_is_tensors(r) for r in result)
    return False


class TraceKey:
    """A trace's identity in the cache (its signatures and dataflow) with its hash computed
    once: the LRU touches the key on every trace start, and hashing the nested tuple of a
    long trace each time cost more than the rest of the start."""

    __slots__ = ("parts", "_hash")

    def __init__(self, parts: tuple):
        self.parts = parts
        self._hash = hash(parts)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return self is other or (isinstance(other, TraceKey) and self._hash == other._hash
                                 and self.parts == other.parts)


class Trace:
    """A cached sequence of ops, replayed as one launch."""

    _ids = itertools.count(1)

    def __init__(self, protos: list[OpProto], inputs: list[tuple]):
        self.id = next(Trace._ids)
        self.protos = protos
        # per op, per value slot: (op index, output slot) if produced inside the trace, else None
        self.inputs = inputs
        self.key = TraceKey(tuple((p.signature, i) for p, i in zip(protos, inputs)))
        self.device = protos[0].device
        self.hits = 0  # completed matches
        self.divergences = 0
        self.last_use = _last_uses(inputs, len(protos))
        # per op: value slots bound by position (not held while pending)
        self.internal_slots = [[s for s, ref in enumerate(refs) if ref is not None] for refs in inputs]
        # Generated code per position (compile.py), made on first use: a trace adopted but
        # never entered (a run of the same program twice looks like one long period) costs
        # nothing to generate.
        self.matchers = _LazyCode(self, "matcher")
        self.runners = _LazyCode(self, "runner")
        self.replays = _LazyCode(self, "replay")
        # native_engine.py's matchers (metadata only), made on first use per position
        self.native_matchers: list = [None] * len(protos)
        self.op_costs: list = [None] * len(protos)  # emulated µs per op, fixed by the signature
        # stream_launch.StreamProgram once built; False if launches stay on the issuing thread
        self.stream_program = None
        # native_engine.py: whether its launches may run on the device stream, once known
        self.native_stream_ok: bool | None = None
        # The user's source line of each op, taken the first time the op is matched (one
        # stack walk per position, once): for errors in deferred launches and explain().
        self.sources: list = [None] * len(protos)
        used = {ref for refs in inputs for ref in refs if ref is not None}
        self.consumed = [any((k, slot) in used for slot in range(len(p.out_specs)))
                         for k, p in enumerate(protos)]  # some output read by a later op
        # per op: output slots no later op of the trace reads (freed as soon as it ran)
        self.unread_slots = [[slot for slot in range(len(p.out_specs)) if (k, slot) not in used]
                             for k, p in enumerate(protos)]

    def __len__(self):
        return len(self.protos)

    def describe(self) -> str:
        first, last = self.protos[0].name, self.protos[-1].name
        return f"trace {self.id}: {len(self)} ops, {first} ... {last}, hits {self.hits}"


class _LazyCode:
    """trace.matchers[k] / runners[k] / replays[k]: generated on first access, then kept."""

    __slots__ = ("trace", "kind", "code")

    def __init__(self, trace: "Trace", kind: str):
        self.trace, self.kind = trace, kind
        self.code: list = [None] * len(trace.protos)

    def __getitem__(self, k: int):
        fn = self.code[k]
        if fn is None:
            from .compile import compile_matcher, compile_replay, compile_runner

            proto, refs = self.trace.protos[k], self.trace.inputs[k]
            if self.kind == "matcher":
                fn = compile_matcher(proto, refs, len(refs))
            elif self.kind == "runner":
                fn = compile_runner(proto, refs)
            else:
                fn = compile_replay(self.trace, k)
            self.code[k] = fn
        return fn


def _last_uses(inputs, n: int) -> list[list[tuple[int, int]]]:
    """frees[k] = the (op, output slot) values last read inside the trace by op k."""
    last: dict[tuple[int, int], int] = {}
    for k, refs in enumerate(inputs):
        for ref in refs:
            if ref is not None:
                last[ref] = k
    frees = [[] for _ in range(n)]
    for value, k in last.items():
        frees[k].append(value)
    return frees


def build_trace(entries) -> Trace:
    """A trace from consecutive history entries [(global index, proto, input producers)]."""
    start = entries[0][0]
    protos, inputs = [], []
    for _, proto, producers in entries:
        refs = tuple(None if p is None or p[0] < start else (p[0] - start, p[1]) for p in producers)
        protos.append(proto)
        inputs.append(refs)
    return Trace(protos, inputs)
