"""Shape-generic traces: one cached sequence for a step whose sizes change each repetition.

Note [Shape-generic traces]: decoding with a growing KV cache runs the same ops every token
on sizes that grow by one, so no token's exact signatures (shapes included) repeat and no
exact trace ever matches. Each op also has a size-erased key (every int of its signature
replaced by a marker: tensor sizes, strides and offsets, int arguments; ranks, dtypes,
devices and every other constant kept). A second period detector runs on those keys; when
a period repeats there, two consecutive sightings of it (A and B) are compared int by int:
- an int equal in A and B is a constant of the trace, checked by value;
- one that differs is a size of the step: ints that differ the same way (the same pair
  (a, b)) are one symbol. The first occurrence binds the symbol at match time, each later
  one must equal it: sizes must relate as they did when recorded (the same size flowing from
  the same inputs and producers), not be equal to what they were ("duck sizing", as dynamo
  guards dynamic shapes). Sizes that changed alike in A and B by chance and part later (two
  caches, one of which stops growing) make the trace diverge: Note [Sizes that parted] in
  executor.py has the next two sightings adopted.
A matched op is deferred with a plan from its shape function, at issue (Note [Plans from
shape functions], device/csrc/engine/meta_plan.cpp): its outputs get the geometry this very call
gives them, so correctness never rests on the relations above; they decide which calls are
one program. The launch runs each op's own kernel and is priced, op by op, at the shapes it
ran with, as eager mode prices it.

That geometry must be eager's to the stride, not only the sizes: the launch copies a result
into the layout handed out, and the next kernel reads that layout (group_norm and conv take
their channels-last path for a channels-last input, and round differently). A size-1 dim's
stride is where shape functions disagree. An elementwise op's plan is TensorIterator's,
built over the operands its CPU kernel has: a Python number passed where the schema says
Tensor (`x / 1.0`) is a wrapped CPU scalar on the C++ stack, and the check against the
recorded runs (_checked_pointwise_dtype) must count it too, else it refuses the plan and the
op's Python meta kernel decides (SD3's VAE decoder: channels last's batch stride for batch
1, another group_norm kernel). Any other op's plan is its meta kernel's, unchecked: where
that disagrees with the CPU kernel (flash attention's output for one query position), the
outputs have another layout than eager's.

On the chip (TorchNeuron) a graph is compiled per distinct shape; a serving deployment pads
to a few bucketed lengths so that a handful of programs cover every step. The emulator does
not model compile time: a generic trace is priced as if the program for each shape it meets
were already compiled (one launch overhead per launch), which is what a warmed-up bucketed
deployment spends per step.
"""
from __future__ import annotations

import dataclasses

import torch

from adaptive_eager.device import native
from adaptive_eager.dispatch import OpInfo
from adaptive_eager.engine.record import CPU_SCALAR, Slot, signature_difference

from .matchers import Source, _is_device_key, _is_tensor_key, define, emit_call_checks
from .trace import OpProto, Trace

_INT = object()  # where an int was, in a size-erased key
_EXACT_SIGNATURES_KEPT = 256  # per generic position: the sizes a loop keeps meeting


def _erase_value(template, key, ints: list):
    """(erased key) of one argument; its ints appended to `ints` in matcher order."""
    if type(template) is Slot:
        if _is_tensor_key(key):
            shape, stride, offset, dtype, device = key
            ints.extend(shape)
            ints.extend(stride)
            ints.append(offset)
            return ("tensor", len(shape), dtype, device)
        return key  # a CPU scalar, a lifted float, an opaque object: keyed as before
    if type(template) in (list, tuple):
        return (type(template), tuple(_erase_value(t, k, ints) for t, k in zip(template, key)))
    if type(template) is int:
        ints.append(template)
        return _INT
    return key


def erase(proto) -> tuple[tuple, tuple]:
    """(size-erased signature, its ints) of a recorded op, computed once per proto."""
    found = proto.erased
    if found is None:
        ints: list = []
        func, arg_keys, kw_keys = proto.signature
        erased_args = tuple(_erase_value(t, k, ints) for t, k in zip(proto.args_t, arg_keys))
        erased_kw = tuple((name, k if _is_device_key(k) else _erase_value(proto.kwargs_t[name], k, ints))
                          for name, k in kw_keys)
        found = proto.erased = ((func, erased_args, erased_kw), tuple(ints))
    return found


def erased_signature(entry) -> tuple:
    """The size-erased signature of a history entry's op (a proto, a sync op, a sighting)."""
    return (entry.erased or erase(entry))[0]


def _rebuild(erased, ints):
    """erase()'s inverse for one argument, given its ints (an iterator, in matcher order)."""
    if erased is _INT:
        return next(ints)
    if type(erased) is tuple and erased:
        head = erased[0]
        if head is list or head is tuple:
            return tuple(_rebuild(e, ints) for e in erased[1])
        if len(erased) == 4 and type(head) is str and head == "tensor":
            rank = erased[1]
            shape = torch.Size([next(ints) for _ in range(rank)])
            stride = tuple(next(ints) for _ in range(rank))
            return (shape, stride, next(ints), erased[2], erased[3])
    return erased


def erase_key(key):
    """A sync op's signature with its tensors' sizes erased (it has no template)."""
    if _is_tensor_key(key):
        return ("tensor", len(key[0]), key[3], key[4])
    if type(key) is tuple:
        return tuple(erase_key(k) for k in key)
    return key


@dataclasses.dataclass(eq=False)
class GenericProto:
    """One position of a shape-generic trace (duck-typed like trace.OpProto)."""

    info: OpInfo
    signature: tuple  # ("generic", erased signature, spec): never equal to an exact one
    erased: tuple  # (erased signature, None): what the shape detector sees
    args_t: tuple
    kwargs_t: dict
    # per int of the erased signature, in matcher order: ("const", value), or ("sym", k, first)
    spec: tuple
    device: int
    plan: object
    source: tuple  # the exact signature (of sighting B) it was built from: the arguments' structure
    fixed_plan: bool  # its sizes never change: B's own plan, no shape function at issue
    out_specs: tuple = ()  # _quietest_cut reads producers' outputs; matched ops note none
    barrier: bool = False
    generic: bool = True
    name: str = ""
    matcher: object = None
    interpreted: int = 0  # matches made without it (Note [Matchers compiled once warm] in matchers.py)
    trace: object = None  # the trace it is a position of
    exact_signatures: dict = dataclasses.field(default_factory=dict)  # ints -> GenericSighting.exact_signature

    def __post_init__(self):
        self.name = self.info.name


class GenericSighting:
    """An op a generic position matched, as the history holds it: the position and the ints
    this call had (each a constant, or its symbol's bound size), so that a later, longer
    generic trace can be built over it (Llama's rotary embedding repeats within a token
    before the token does)."""

    __slots__ = ("proto", "ints")
    generic = True
    barrier = False
    out_specs = ()
    ids = None  # the detectors' keys are not kept on it (AdaptiveExecutor._key_ids): it is new per match

    def __init__(self, proto: GenericProto, syms: list):
        self.proto = proto
        self.ints = tuple(s[1] if s[0] == "const" else syms[s[1]] for s in proto.spec)

    def exact_signature(self) -> tuple:
        """The exact signature this call had (OpRecord's), rebuilt from the erased one and
        its ints: an exact trace may then be adopted over ops a generic one matched. Kept
        per position and ints: a decode loop meets the same sizes call after call, and the
        detector keys every op a generic trace matches by it."""
        known = self.proto.exact_signatures
        found = known.get(self.ints)
        if found is None:
            func, erased_args, erased_kw = self.proto.erased[0]
            ints = iter(self.ints)
            found = (func, tuple(_rebuild(a, ints) for a in erased_args),
                     tuple((name, _rebuild(k, ints)) for name, k in erased_kw))
            if len(known) >= _EXACT_SIGNATURES_KEPT:
                known.clear()
            known[self.ints] = found
        return found

    signature = property(lambda self: self.proto.signature)
    erased = property(lambda self: self.proto.erased)
    device = property(lambda self: self.proto.device)
    name = property(lambda self: self.proto.name)


def exact_proto(sighting: GenericSighting, signature: tuple) -> OpProto:
    """Note [An exact proto from a generic position]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    An exact trace is built from the protos of ops that ran eagerly; an op a generic trace
    matched has one only if it once ran eagerly with the same sizes. A generic trace that
    matches ops of a longer unit from the start (Qwen3's q/k norm entered at the MLP's
    matmuls; the per-layer backward of a DDP step) then kept the unit from ever being
    adopted. The position describes the op as well: its templates (the arguments' structure,
    checked against the exact signature by the exact matcher) and its plan, fixed where its
    sizes never change (then the exact signature's own) or its shape function's at issue.
    What it does not know is the outputs' geometry (out_specs), which only an eager run shows:
    so it is not interned in the engine's protos (an eager run of the signature describes it
    then), and no cut counts values it produced (_quietest_cut)."""
    proto = sighting.proto
    return OpProto(proto.info, signature, proto.args_t, proto.kwargs_t, (), proto.device, False, plan=proto.plan)


def _described(entry) -> tuple:
    """(proto-like, erased signature, ints) of a history entry's op."""
    if type(entry) is GenericSighting:
        return entry.proto, entry.proto.erased[0], entry.ints
    erased, ints = erase(entry)
    return entry, erased, ints


def build_generic_trace(first, second) -> Trace | None:
    """A trace from two consecutive sightings (history entries) of the same size-erased
    sequence; None where they do not line up or an op cannot be generic."""
    if len(first) != len(second):
        return None
    symbols: dict[tuple, int] = {}
    protos, inputs = [], []
    start = second[0][0]
    for (_, a, _), (_, b, producers) in zip(first, second):
        if a.barrier or b.barrier or type(a) is GenericProto or type(b) is GenericProto:
            return None  # a sync op
        (_, erased_a, ints_a), (b, erased_b, ints_b) = _described(a), _described(b)
        if erased_a != erased_b or len(ints_a) != len(ints_b) or a.device != b.device:
            return None
        spec = []
        for x, y in zip(ints_a, ints_b):
            if x == y:
                spec.append(("const", x))
            elif (x, y) in symbols:
                spec.append(("sym", symbols[(x, y)], False))
            else:
                symbols[(x, y)] = len(symbols)
                spec.append(("sym", symbols[(x, y)], True))
        spec = tuple(spec)
        # Sizes that never change give the outputs B's run gave them: its plan. Only an op
        # with a changing size asks its shape function, at issue (a Python one, as layer
        # norm's, costs milliseconds).
        fixed = not any(x[0] == "sym" for x in spec) and getattr(b, "fixed_plan", True)
        plan = b.plan if fixed else native.DeferPlan.from_meta(b.device, _checked_pointwise_dtype(a, b))
        protos.append(GenericProto(b.info, ("generic", erased_b, spec), (erased_b, None), b.args_t, b.kwargs_t,
                                   spec, b.device, plan, getattr(b, "source", b.signature), fixed))
        inputs.append(tuple(None if p is None or p[0] < start else (p[0] - start, p[1]) for p in producers))
    if not symbols:
        return None  # nothing changes: an exact trace covers it
    trace = Trace(protos, inputs)
    trace.generic = True
    trace.nsyms = len(symbols)
    for proto in protos:
        proto.trace = trace  # a GenericSighting's way to the trace that matched it
    return trace


def generic_covers(trace: Trace, seg) -> bool:
    """Whether shape-generic `trace` is made of the ops of `seg` (history entries: (index,
    proto, producers)) at other sizes: the same size-erased signatures. Not their dataflow:
    the history does not know it for ops a cached trace matched (no producers are noted for
    their outputs). A judgement for detection only (whether an exact trace of seg is worth
    adopting): matching checks everything."""
    return trace.generic and len(trace) == len(seg) and all(
        proto.erased[0] == erased_signature(entry) for proto, (_, entry, _) in zip(trace.protos, seg))


def _meta_inputs(signature) -> list:
    """The tensors of a recorded call as the C++ stack holds them (what pointwise_plan in
    meta_plan.cpp builds its TensorIterator from): meta tensors, CPU scalars as CPU 0-dim ones,
    and a lifted float or complex passed where the schema says Tensor (`x / 1.0`) as the
    wrapped number it is there, a CPU 0-dim tensor too. Leaving that one out changes the
    geometry: with it the operands differ in shape and TensorIterator orders a size-1 dim by
    its stride; without it an input alone is "channels last contiguous" and its output gets
    channels last's strides, which eager's never had (Note [Shape-generic traces])."""
    found = []

    def walk(key, is_tensor: bool):
        if _is_tensor_key(key):
            shape, stride, offset, dtype, _ = key
            span = 1 + offset + sum((n - 1) * s for n, s in zip(shape, stride) if n > 0)
            found.append(torch.empty(span, dtype=dtype, device="meta").as_strided(shape, stride, offset))
        elif isinstance(key, tuple) and len(key) == 2 and key[0] is CPU_SCALAR:
            found.append(torch.zeros((), dtype=key[1]))
        elif is_tensor and key in (float, complex):  # a lifted number, wrapped on the C++ stack
            found.append(torch.zeros((), dtype=torch.float64 if key is float else torch.complex128))
        elif type(key) is tuple:
            for k in key:
                walk(k, False)

    func, arg_keys, kw_keys = signature
    arguments = {a.name: a for a in func._schema.arguments}
    positional = func._schema.arguments
    for i, key in enumerate(arg_keys):
        walk(key, i < len(positional) and isinstance(positional[i].type, torch.TensorType))
    for name, key in kw_keys:
        walk(key, name in arguments and isinstance(arguments[name].type, torch.TensorType))
    return found


def _checked_pointwise_dtype(a, b):
    """The dtype of an elementwise op's one output if TensorIterator's geometry (Note
    [Pointwise shape functions] in meta_plan.cpp) is what both recorded runs made, else None."""
    if torch.Tag.pointwise not in b.info.op.tags or type(a) is not type(b) or not hasattr(a, "out_specs"):
        return None
    if len(a.out_specs) != 1 or len(b.out_specs) != 1 or len(b.info.op._schema.returns) != 1:
        return None
    for run in (a, b):
        spec = run.out_specs[0]
        if spec[0] != "new":
            return None
        try:
            sizes, strides, offset = native.pointwise_geometry(_meta_inputs(run.signature), spec[4])
        except Exception:
            return None
        if (tuple(sizes), tuple(strides), offset) != (tuple(spec[1]), tuple(spec[2]), spec[3]):
            return None  # clone's memory format, masked_fill's contiguous copy: its own shape function
    return b.out_specs[0][4]


# -- the matcher of a generic position ---------------------------------------------------------

def _check_int(src: Source, expr: str, spec_iter) -> None:
    spec = next(spec_iter)
    if spec[0] == "const":
        src.emit(f"if {expr} != {spec[1]!r}: return None")
    elif spec[2]:  # the symbol's first occurrence in the trace: bind it
        src.emit(f"S[{spec[1]}] = {expr}")
    else:
        src.emit(f"if {expr} != S[{spec[1]}]: return None")


def compile_generic_matcher(proto: GenericProto):
    """match(args, kwargs, pending) -> True, or None; binds and checks the trace's symbols in
    pending.syms. The same checks as an exact matcher's (compile.py), but for the ints: each
    a constant, or a size bound at its symbol's first occurrence (_check_int)."""
    src = Source()
    spec_iter = iter(proto.spec)

    def on_tensor(src: Source, expr: str, key) -> None:
        shape, _, _, dtype, device = key
        index = device.index if device.type == "neuron" else -1
        d = src.const(dtype)
        src.emit(f"v = {expr}")
        src.emit(f"if not isinstance(v, TENSOR) or v.get_device() != {index} or v.dtype != {d} "
                 f"or v.dim() != {len(shape)}: return None")
        src.emit("sh = v.shape")
        src.emit("st = v.stride()")
        for i in range(len(shape)):
            _check_int(src, f"sh[{i}]", spec_iter)
        for i in range(len(shape)):
            _check_int(src, f"st[{i}]", spec_iter)
        _check_int(src, "v.storage_offset()", spec_iter)

    src.emit("S = p.syms")
    emit_call_checks(src, proto.source, proto.args_t, proto.kwargs_t, on_tensor,
                     lambda src, expr: _check_int(src, expr, spec_iter))
    assert next(spec_iter, None) is None, "the matcher and the erasure walk the ints apart"
    src.emit("return True")
    return define("match", "args, kwargs, p", src, TENSOR=torch.Tensor)


def fits_generic(proto: GenericProto, rec, syms: list) -> bool:
    """compile_generic_matcher's checks, interpreted (Note [Matchers compiled once warm]): the
    call's structure against the position's, then each int in matcher order, a constant by
    value, a symbol bound at its first occurrence and checked where it recurs."""
    erased, ints = erase(_Call(rec))
    if erased != proto.erased[0]:
        return False
    for spec, value in zip(proto.spec, ints):
        if spec[0] == "const":
            if value != spec[1]:
                return False
        elif spec[2]:
            syms[spec[1]] = value
        elif value != syms[spec[1]]:
            return False
    return True


# -- explain(): why a call did not fit ---------------------------------------------------------

def _labels(template, key, label: str, out: list) -> None:
    """Names of the ints erase() takes from one argument, in the same order."""
    if type(template) is Slot:
        if _is_tensor_key(key):
            rank = len(key[0])
            out.extend(f"{label} size[{d}]" for d in range(rank))
            out.extend(f"{label} stride[{d}]" for d in range(rank))
            out.append(f"{label} storage offset")
    elif type(template) in (list, tuple):
        for i, (t, k) in enumerate(zip(template, key)):
            _labels(t, k, f"{label}[{i}]", out)
    elif type(template) is int:
        out.append(label)


class _Call:
    """An OpRecord as erase() reads a proto."""

    __slots__ = ("signature", "args_t", "kwargs_t", "erased")

    def __init__(self, rec):
        self.signature, self.args_t, self.kwargs_t, self.erased = rec.signature, rec.args, rec.kwargs, None


def differs_in_sizes_only(expected: GenericProto, rec) -> bool:
    """Whether a call that did not fit a generic position is its op with arguments of the same
    structure: only its sizes broke the constants and relations recorded."""
    return expected.info.op is rec.func and erase(_Call(rec))[0] == expected.erased[0]


def generic_difference(expected: GenericProto, rec, syms: list) -> str:
    """What kept a call from a generic trace's position, as text for explain()."""
    if expected.info.op is not rec.func:
        return f"expected {expected.name}, got {rec.name}"
    erased, ints = erase(_Call(rec))
    if erased != expected.erased[0]:
        return signature_difference(expected.source, rec.signature) or "its arguments' structure differed"
    labels: list = []
    _, arg_keys, kw_keys = expected.source
    for i, (t, k) in enumerate(zip(expected.args_t, arg_keys)):
        _labels(t, k, f"argument {i}", labels)
    for name, k in kw_keys:
        if not _is_device_key(k):
            _labels(expected.kwargs_t[name], k, name, labels)
    for label, spec, value in zip(labels, expected.spec, ints):
        if spec[0] == "const" and value != spec[1]:
            return f"{label}: expected {spec[1]} (the same in both repetitions recorded), got {value}"
        if spec[0] == "sym" and not spec[2] and syms[spec[1]] is not None and value != syms[spec[1]]:
            return (f"{label}: got {value}, but it was the same size as an earlier one in the repetitions "
                    f"recorded, which is {syms[spec[1]]} in this one")
    return ""
