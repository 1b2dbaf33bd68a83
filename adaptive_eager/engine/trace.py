"""What the engine knows about one op shape (OpProto) and about a cached sequence (Trace).

An OpProto is built once per distinct signature from an op that ran: the argument
template (from record.py's OpRecord), which inputs the outputs are (in-place, out=), the
geometry of new outputs, and the DeferPlan that queues the op in C++ the next time. A
Trace is a list of protos plus, per tensor input, whether an earlier op of the trace wrote
it (which op, which output) or it comes from outside.

Output slots: an op's outputs are the tensors of its return value, flattened; an in-place
op that returns nothing (`_foreach_add_`) has its written tensors as outputs instead.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools

import torch

from adaptive_eager.device import native
from adaptive_eager.dispatch import OpInfo
from adaptive_eager.engine.record import OpRecord


@dataclasses.dataclass(eq=False)
class OpProto:
    info: OpInfo
    signature: tuple
    args_t: tuple  # OpRecord template (Slot placeholders)
    kwargs_t: dict
    # per output slot: ("alias", value index) or ("new", size, stride, offset, dtype, nbytes)
    out_specs: tuple
    device: int
    barrier: bool  # cannot be deferred: runs eagerly and cuts traces (Note [Sync points])
    name: str = ""
    plan: object = None  # native.DeferPlan: the outputs' geometry, to queue it (None: a barrier)
    # Its matcher (compile.py), generated once a trace position holding it is warm (Note
    # [Matchers compiled once warm] in matchers.py), and shared by every such position: a
    # matcher checks the signature alone, and protos are interned by signature. (One per
    # position cost ~10 KB per cached op.)
    matcher: object = None
    interpreted: int = 0  # matches made without it (Note [Matchers compiled once warm] in matchers.py)
    erased: tuple | None = None  # (size-erased signature, its ints): generic.erase, once
    ids: tuple | None = None  # the detectors' keys, with the engine's token (AdaptiveExecutor._key_ids)

    def __post_init__(self):
        self.name = self.info.name


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


_SIZES_KEPT = 8  # a generic trace's last completions' sizes, to tell recurring sizes from growing ones
_UNDEFINED = ("undefined",)  # an output that is None: in the plan, not among the output slots


def build_proto(info, rec: OpRecord, result, args, kwargs) -> OpProto:
    """Describe an op that just ran eagerly, with the DeferPlan that queues it next time; a
    barrier (never deferred) if its results cannot be handed out before it runs."""
    device, barrier = None, False
    storages = set()
    for v in rec.values:
        if isinstance(v, torch.Tensor) and v.device.type == "neuron":
            if device is None:
                device = v.device.index
            storages.add(native.storage_of(v)[0])
        elif isinstance(v, torch.Generator):
            barrier = True  # its state must move at issue, where the user may read it
    if info.is_random and not native.draws_at_issue(info.op._schema.name, info.op._schema.overload_name):
        # Its draws depend on its arguments' values, or on a Python body: they cannot be made
        # at issue without running it (Note [Deferred random ops draw at issue]).
        barrier = True
    if device is None:  # a factory: the device it names
        named = kwargs.get(info.device_arg) if info.device_arg else None
        device = named.index if isinstance(named, torch.device) and named.index is not None \
            else native.current_device()
    written = written_inputs(info, args, kwargs)
    if any(t.device.type != "neuron" for t in written):
        barrier = True  # a host tensor written by a device op: the host must see it now
    schema_returns = info.op._schema.returns
    returns = () if not schema_returns else result if len(schema_returns) > 1 else (result,)
    specs, plan_outputs, list_lengths = [], [], []

    first_index: dict[int, int] = {}  # id(value) -> its first slot: a lookup per output, not a scan
    for i, v in enumerate(rec.values):
        first_index.setdefault(id(v), i)

    def alias_of(t) -> tuple | None:
        index = first_index.get(id(t))  # rec.values holds t alive, so its id is its own
        return None if index is None else ("alias", index)

    def new_output(o) -> tuple | None:
        if o is None:  # an undefined tensor: no output slot, but the plan hands out None there
            plan_outputs.append(None)
            return _UNDEFINED
        if not isinstance(o, torch.Tensor) or o.device.type != "neuron" or o.layout != torch.strided:
            return None
        storage, nbytes = native.storage_of(o)
        if storage in storages:
            return None  # a view of an input, or of another output: aliasing a plan cannot give
        storages.add(storage)
        geometry = (tuple(o.shape), o.stride(), o.storage_offset(), o.dtype, nbytes)
        plan_outputs.append((list(geometry[0]), list(geometry[1]), geometry[2], geometry[3], geometry[4]))
        return ("new",) + geometry

    for alias, r in zip(info.return_aliases, returns):
        if alias is not None:  # an in-place or out= result: must be the written input itself
            found = [alias_of(r) if any(r is t for t in written) else None]
        elif isinstance(r, (list, tuple)):
            list_lengths.append(len(r))
            found = [new_output(o) for o in r]
        else:
            found = [new_output(r)]
        barrier |= None in found
        specs += [f for f in found if f is not _UNDEFINED]
    if not schema_returns:  # in place, returning nothing (_foreach_add_): the written inputs
        specs = [alias_of(t) for t in output_slots(info, result, args, kwargs)]
        barrier |= None in specs
    if barrier:
        specs = [s for s in specs if s is not None]
    plan = None if barrier else native.DeferPlan(device, plan_outputs, list_lengths)
    return OpProto(info, rec.signature, rec.args, dict(rec.kwargs), tuple(specs), device, barrier, plan=plan)


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
        # Note [A trace that keeps diverging retires]: divergences not yet paid back by hits.
        self.strikes = 0
        # Whether its launches may run on the device stream (engine._may_use_stream), once known.
        self.stream_ok: bool | None = None
        # The user's source line of each op, taken the first time the op is matched (one
        # stack walk per position, once): for errors in deferred launches and explain().
        self.sources: list = [None] * len(protos)
        # Note [Shape-generic traces] (generic.py): positions matched by relating sizes, not
        # comparing them; nsyms sizes bound per match (Pending.syms).
        self.generic = False
        self.nsyms = 0
        # The size-erased period it was adopted from (Note [Sizes that parted]).
        self.shape_period = 0
        # Adopted as a segment that recurs apart (Note [Segments that recur apart]).
        self.recurs_apart = False
        # A generic trace's sizes at its last completions, and whether a completion met sizes
        # one of those had: per-head or per-layer sizes that recur each step (Note [An exact
        # proto from a generic position]), not a decode loop's cache that grows every token.
        self.recent_sizes: collections.deque = collections.deque(maxlen=_SIZES_KEPT)
        self.sizes_repeat = False
        # Note [Armed matching] (device/csrc/engine/route.cpp): its positions' C++ guards and
        # plans, built the first time it could be armed; False if some position cannot be.
        self.guard_table = None
        # Note [Detection fed by the route]: its positions' detector keys, with the token of the
        # key tables they index (AdaptiveExecutor._keys_to_push).
        self.pushed_keys: tuple | None = None

    def __len__(self):
        return len(self.protos)

    def note_sizes(self, syms) -> None:
        """A generic trace's completion with these symbol values."""
        sizes = tuple(syms)
        if sizes in self.recent_sizes:
            self.sizes_repeat = True
        self.recent_sizes.append(sizes)

    def describe(self) -> str:
        first, last = self.protos[0].name, self.protos[-1].name
        return f"trace {self.id}: {len(self)} ops, {first} ... {last}, hits {self.hits}"


def build_trace(entries) -> Trace:
    """A trace from consecutive history entries [(global index, proto, input producers)]."""
    start = entries[0][0]
    protos, inputs = [], []
    for _, proto, producers in entries:
        refs = tuple(None if p is None or p[0] < start else (p[0] - start, p[1]) for p in producers)
        protos.append(proto)
        inputs.append(refs)
    return Trace(protos, inputs)
