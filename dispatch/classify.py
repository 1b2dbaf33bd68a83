"""What kind of op an OpOverload is, read from its schema and tags, computed once per op.

Note [Op classification]: every decision on the per-op hot path (does the op write an
input? is it a view? does it draw random numbers? does its output shape depend on data?)
is made here once per OpOverload and cached on the OpInfo. Names are listed by hand only
where neither the schema nor torch's tags can tell (see HOST_READ_OPS, RESIZING_OPS).
"""
from __future__ import annotations

import dataclasses
import warnings

import torch
from torch.utils.flop_counter import flop_registry

from ..device import native

aten = torch.ops.aten

# Ops whose result is a host value computed from device data: reading them is a sync point.
HOST_READ_OPS = frozenset({
    aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default,
})
# Ops that can give a written argument new storage or new sizes; the schema cannot tell.
RESIZING_OPS = frozenset({
    aten.resize_.default, aten.resize_as_.default, aten.set_.source_Storage,
    aten.set_.source_Storage_storage_offset, aten.set_.source_Tensor, aten.set_.default,
})


def is_distributed_namespace(namespace: str) -> bool:
    """The operator namespaces of torch.distributed, whose ops are collectives, waits or
    redistributions: c10d (allreduce_, ...), _c10d_functional and c10d_functional (all_reduce,
    wait_tensor, ... of functional collectives, tensor parallelism and compiled graphs),
    _c10d_functional_autograd, _dtensor (redistribution) and symm_mem. By namespace, not by
    name, so a collective torch adds later is one too."""
    return "c10d" in namespace or namespace in ("_dtensor", "symm_mem")


# Factories whose length is (end - start) / step of Scalar arguments, floats included.
_SIZED_BY_SCALARS = frozenset({"aten::arange", "aten::range"})


def _is_scalar_type(t) -> bool:
    """A schema's `Scalar` or `Scalar?` (TorchScript's NumberType), not a list of them."""
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch.NumberType)


@dataclasses.dataclass(frozen=True)
class OpInfo:
    op: torch._ops.OpOverload
    name: str
    # indices of the positional arguments that the op writes (in-place self, out=...)
    written_args: tuple[int, ...]
    # names of keyword-only written arguments (out=, out0=...)
    written_kwargs: tuple[str, ...]
    # for each return: ("arg", i) / ("kwarg", name) if it is a written input, else None
    return_aliases: tuple[tuple[str, object] | None, ...]
    is_random: bool
    is_host_read: bool
    has_data_dependent_shape: bool
    may_resize: bool
    device_arg: str | None  # name of a `Device?` argument (factories, _to_copy)
    has_flop_formula: bool  # torch.utils.flop_counter knows this op (matmuls, convolutions)
    # A collective, a wait or a redistribution of torch.distributed (is_distributed_namespace):
    # a sync point, never deferred into a trace, whose timing is the other ranks' (Note [Collectives]).
    is_collective: bool = False
    # A custom kernel's own cost estimate, (args, kwargs, measured_bytes) -> (flops, bytes):
    # Note [Custom kernel cost] in custom_kernels.py. None for every other op.
    cost_hook: object = None
    # Its outputs' sizes come from its Scalar arguments' values (arange(0.0, n / 2, 0.5)):
    # floats are keyed by value for it, not lifted (Note [Lifted scalars] in record.py).
    sized_by_scalars: bool = False
    # Its `Scalar` (or `Scalar?`) arguments: positions and names. A bool there is lifted as a
    # float is (Note [Lifted scalars] in record.py): its value decides no output's geometry.
    scalar_args: frozenset = frozenset()
    scalar_kwargs: frozenset = frozenset()
    # aten.index.Tensor: its output shape depends on the data only for boolean (mask) indices;
    # with integer indices (x[tokens]) it is the indices' shape (static_shape_for below)
    shape_from_index_dtypes: bool = False

    def static_shape_for(self, args) -> bool:
        """A data-dependent-shape op whose output shape, for these arguments, is not: indexing
        with integer index tensors only, on the device (host indices run now, as before: a
        deferred op would read them after the caller may have changed them)."""
        if not self.shape_from_index_dtypes or len(args) < 2:
            return False
        return all(i is None or (isinstance(i, torch.Tensor) and i.dtype not in (torch.bool, torch.uint8)
                                 and i.device.type != "cpu") for i in args[1])

    def resizes_output(self, args, kwargs) -> bool:
        """Whether this call may resize a tensor it writes (Note [An out= op that keeps its
        output's shape]): True for resize_ and set_, for views changed in place, and for an
        out= op unless its output already has the shape the op gives it (found by running it
        on meta tensors)."""
        if not self.may_resize:
            return False
        if not self.written_kwargs or self.op in RESIZING_OPS:
            return True
        try:
            key = (self.op, _geometry(args, self.sized_by_scalars), _geometry(kwargs, self.sized_by_scalars))
            hash(key)
        except TypeError:  # an argument with no geometry to key by: look every time
            return not _keeps_out_shape(self, args, kwargs)
        keeps = _KEEPS_OUT_SHAPE.get(key)
        if keeps is None:
            if len(_KEEPS_OUT_SHAPE) >= _KEEPS_OUT_SHAPE_KEPT:
                _KEEPS_OUT_SHAPE.clear()
            keeps = _KEEPS_OUT_SHAPE[key] = _keeps_out_shape(self, args, kwargs)
        return not keeps

    @property
    def mutates(self) -> bool:
        return bool(self.written_args or self.written_kwargs)


# Whether an out= call keeps its output's shape, by the call's geometry: the meta run it takes
# to know costs ~80 us, and a training step makes the same calls every step (DDP: 11).
_KEEPS_OUT_SHAPE: dict = {}
_KEEPS_OUT_SHAPE_KEPT = 4096


def _geometry(x, floats_by_value: bool):
    """What decides an op's output shapes in an argument: a tensor's geometry, dtype and device
    type; a float's type only (its value decides none, but for arange and range); any other
    value itself."""
    if isinstance(x, torch.Tensor):
        return (x.shape, x.stride(), x.dtype, x.device.type)
    if isinstance(x, (list, tuple)):
        return tuple(_geometry(v, floats_by_value) for v in x)
    if isinstance(x, dict):
        return tuple((k, _geometry(v, floats_by_value)) for k, v in x.items())
    if type(x) is float and not floats_by_value:
        return float
    return x


def _keeps_out_shape(info: OpInfo, args, kwargs) -> bool:
    """Note [An out= op that keeps its output's shape]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    An out= op resizes its output when the result's shape differs, which changes the host's
    tensor when the op runs: the adaptive engine runs such ops at once, as sync points. Most
    calls write an output of the very shape already (SDPA's math path ends in `_safe_softmax`,
    whose `where(..., out=)` writes the softmax's own result: 4 sync points a step of T5, 9
    launches where 1 would do). Run on meta tensors, the call shows whether it would resize;
    where it would not, it is an op like any other (written in place, as `add_` is). A call
    whose meta run fails is taken as resizing (the old way: at once, its error at the call)."""
    def to_meta(x):
        if isinstance(x, torch.Tensor) and not (x.device.type == "cpu" and x.dim() == 0):
            return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="meta")
        return x

    meta_args = [to_meta(a) for a in args]
    meta_kwargs = {k: to_meta(v) for k, v in kwargs.items()}
    outs = [(kwargs.get(name), meta_kwargs.get(name)) for name in info.written_kwargs]
    if any(not isinstance(real, torch.Tensor) for real, _ in outs):
        return False  # an output left out, or a list of them: keep the old way
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "An output with one or more elements was resized"
            info.op(*meta_args, **meta_kwargs)
    except Exception:
        return False
    return all(meta.shape == real.shape and meta.stride() == real.stride() for real, meta in outs)


_cache: dict[torch._ops.OpOverload, OpInfo] = {}
# Cost hooks of custom kernels, filled by custom_kernels.set_cost before the op is classified.
COST_HOOKS: dict[torch._ops.OpOverload, object] = {}


def forget(op: torch._ops.OpOverload) -> None:
    """Drop op's cached OpInfo: it is classified afresh at its next call."""
    _cache.pop(op, None)
    if getattr(op, "_neuron_info", None) is not None:
        op._neuron_info = None


def classify(op: torch._ops.OpOverload) -> OpInfo:
    # Kept on the OpOverload itself: a dict keyed by OpOverload pays its Python __hash__
    # (~0.35 us) on every lookup, and this one runs once per op.
    info = getattr(op, "_neuron_info", None)
    if info is None:
        info = _cache[op] = _classify(op)
        op._neuron_info = info
    return info


def _classify(op) -> OpInfo:
    # The schema's argument list and each type's string are read once: each read of
    # `schema.arguments` builds a new list of bound Argument objects, and `str(a.type)` a new
    # string, and a classification read them five times over: 30-250 us an op, ~40 ops in a
    # training step's first sight (issue 35's warm-up).
    schema = op._schema
    arguments = schema.arguments
    type_names = [str(a.type) for a in arguments]
    written_args, written_kwargs, alias_of = [], [], {}
    for i, a in enumerate(arguments):
        ai = a.alias_info
        if ai is not None and ai.is_write:
            if a.kwarg_only:
                written_kwargs.append(a.name)
                ref = ("kwarg", a.name)
            else:
                written_args.append(i)
                ref = ("arg", i)
            for s in ai.before_set:
                alias_of[s] = ref
    return_aliases = []
    for r in schema.returns:
        ai = r.alias_info
        ref = None
        if ai is not None:
            sets = list(ai.before_set)
            if ai.is_write and sets and sets[0] in alias_of:
                ref = alias_of[sets[0]]
        return_aliases.append(ref)
    tags = set(op.tags)
    random = native.draws_random_numbers(schema.name, torch.Tag.nondeterministic_seeded in tags,
                                         any("Generator" in name for name in type_names))
    dev = next((a.name for a, name in zip(arguments, type_names) if "Device" in name), None)
    is_out = bool(written_kwargs)
    scalars = [(i, a.name) for i, a in enumerate(arguments) if _is_scalar_type(a.type)]
    return OpInfo(
        op=op, name=str(op), written_args=tuple(written_args),
        written_kwargs=tuple(written_kwargs), return_aliases=tuple(return_aliases),
        is_random=random,
        is_host_read=op in HOST_READ_OPS,
        has_data_dependent_shape=(torch.Tag.dynamic_output_shape in tags
                                  or torch.Tag.data_dependent_output in tags),
        # inplace_view ops (t_, unsqueeze_, as_strided_) change the written tensor's
        # sizes/strides, as resize_ does.
        may_resize=is_out or op in RESIZING_OPS or torch.Tag.inplace_view in tags,
        device_arg=dev,
        has_flop_formula=op._overloadpacket in flop_registry,
        is_collective=is_distributed_namespace(op.namespace),
        cost_hook=COST_HOOKS.get(op),
        sized_by_scalars=schema.name in _SIZED_BY_SCALARS,
        scalar_args=frozenset(i for i, _ in scalars),
        scalar_kwargs=frozenset(name for _, name in scalars),
        shape_from_index_dtypes=op is aten.index.Tensor,
    )
