"""Custom device kernels: a user's own op, run by the emulated device as one launch.

A custom kernel is a `torch.library.custom_op` whose implementation computes on host
tensors (the bytes the emulated device holds), plus an optional cost estimate:

    @adaptive_eager.custom_kernel("mylib::scale", cost=lambda x, s: {"flops": x.numel(), "bytes": 2 * x.nbytes})
    def scale(x: torch.Tensor, s: float) -> torch.Tensor:
        return x * s

    scale.register_autograd(lambda ctx, g: (scale(g, ctx.s), None),
                            setup_context=lambda ctx, inputs, output: setattr(ctx, "s", inputs[1]))

Nothing else is needed for it to work on `neuron`: a PrivateUse1 kernel runs the op whole
as one launch in eager mode (Note [Custom kernels run whole]), it is one op of a
trace in adaptive mode (recorded, matched and queued like any ATen op), and its
`register_autograd` backward is whatever ops the user's backward calls (one launch if that
is another custom kernel).

Note [Custom kernel cost]: the device's cost model prices an op from the bytes it reads and
writes and, where torch.utils.flop_counter has a formula, its FLOPs. A custom kernel knows
better (a flash-attention kernel never writes its L x L score matrix), so its `cost` hook
replaces both. The hook is stored on the op's OpInfo (`cost_hook`, looked up once per
OpOverload in classify.py), so other ops pay one attribute test for it.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
import torch.utils._pytree as pytree
from torch._library.custom_ops import OPDEFS
from torch._library.utils import can_generate_trivial_fake_impl

from adaptive_eager.device import native
from adaptive_eager.device.nki import measuring

from .classify import COST_HOOKS, classify, forget
from .context import CONTEXT
from .pricing import priced_us
from .rng import DefaultGeneratorLent

CostFn = Callable[..., dict]


def custom_kernel(name: str, *, mutates_args: Iterable[str] | str = (), cost: CostFn | None = None,
                  schema: str | None = None, fake: Callable | bool = False, random: bool = False,
                  draws: Callable | None = None, neuron_made_on_host: bool = False):
    """Decorator: register `fn` (computing on host tensors) as the custom op `name`
    ("namespace::op") that runs on neuron as one launch, priced by `cost`.

    `cost(*args, **kwargs)` gets the op's host arguments and returns a dict with "flops"
    and/or "bytes" (missing keys: 0 FLOPs, the bytes the op really reads and writes).
    `fake` is the shape function torch.compile traces with (`register_fake`); `fake=True`
    uses `fn` itself, which works when every op it calls has a meta kernel (no `.item()`,
    no numpy). `random=True` marks a kernel that draws from torch's default CPU generator
    (torch.rand, dropout, ...): its draws keep their place among the host's, as ATen's random
    ops' do (Note [Random ops draw from CPU's generator]), so it runs at issue, never deferred,
    unless `draws(*args)` is given: a function that makes, from torch's default generator,
    exactly the draws the body will make, reading only its arguments' shapes, dtypes and
    non-tensor values (their bytes may not exist yet); then the adaptive engine defers it as
    any op, making its draws at issue (Note [Deferred random ops draw at issue]). Returns the
    `torch.library.custom_op` object: `.register_autograd`, `.register_fake` and calling it
    work as for any custom op. `neuron_made_on_host=True` (nki_op's) makes a tensor the body
    creates on neuron on the host instead, beside its arguments (_NeuronMadeOnHost).
    """
    if draws is not None and not random:
        raise TypeError(f"custom kernel {name}: `draws` describes a random kernel's draws; pass random=True with it")
    if draws is not None and not callable(draws):
        raise TypeError(f"custom kernel {name}: `draws` must be a function of the kernel's arguments, "
                        f"got {type(draws).__name__}")
    tags = (torch.Tag.nondeterministic_seeded,) if random else ()

    def register(fn):
        op = torch.library.custom_op(name, fn, mutates_args=mutates_args, schema=schema, tags=tags)
        # "privateuseone", not "neuron": our own kernels are defined before the rename.
        op.register_kernel("privateuseone", _on_host(fn, op._opoverload, neuron_made_on_host))
        if cost is not None:
            set_cost(op, cost)
        if fake:
            op.register_fake(fn if fake is True else fake)
        if draws is not None:
            registered = op._opoverload._schema
            native.set_draw_hook(f"{registered.name}.{registered.overload_name}", draws)
        return op
    return register


def _on_host(fn, overload, neuron_made_on_host: bool = False):
    """Note [Custom kernels run whole]: neuron tensors run every op in C++, where a
    Python kernel's body would be many launches on device tensors. This kernel runs the body
    once, on host aliases of the device's bytes, adopts its results (zero-copy, charged to
    the device) and charges one launch, priced by its cost estimate (dispatch/pricing.py)."""

    def kernel(*args, **kwargs):
        # While adaptive mode is on, the engine may queue the call (Note [Deferred launches]
        # in device/csrc/engine/queue.cpp); its launch runs this kernel again, past the route.
        handled, out = native.offer(overload, args, kwargs)
        if handled:
            return out
        if native.projection_enabled():
            if neuron_made_on_host:  # an nki_op
                return _run_nki_on_placeholder_values(fn, overload, args, kwargs)
            return _run_projected(overload, args, kwargs)
        device, in_bytes = [-1], [0]

        def to_host(x):
            if isinstance(x, torch.Tensor) and x.device.type == "neuron":
                device[0] = x.device.index
                in_bytes[0] += x.nbytes
                return native.host_alias(x)
            return x

        host_args, host_kwargs = pytree.tree_map(to_host, (args, kwargs))
        runtime = CONTEXT.runtime
        index = runtime.current_index if device[0] < 0 else device[0]
        info = classify(overload)
        # (a Python mode costs every torch call of the body: only where asked for)
        with measuring() as kernels, _NeuronMadeOnHost() if neuron_made_on_host else contextlib.nullcontext():
            # A random body draws from torch's default generator: at issue, or, deferred, from
            # the copy it was given at issue (Note [Deferred random ops draw at issue]).
            issued = native.drawing_from() if info.is_random else None
            if issued is not None:
                with DefaultGeneratorLent(issued):
                    out = fn(*host_args, **host_kwargs)
            else:
                out = fn(*host_args, **host_kwargs)
        _launch_ran(overload, info, index, kernels, host_args, host_kwargs, out, in_bytes[0])
        return pytree.tree_map(lambda t: native.adopt(t, index) if isinstance(t, torch.Tensor) else t, out)

    kernel.__name__ = f"neuron_{overload._schema.name.split('::')[-1]}"
    return kernel


def _launch_ran(overload, info, index: int, kernels, args, kwargs, out, in_bytes: int) -> None:
    """One launch for a body that ran on host tensors, `kernels` what measuring() saw it run."""
    if kernels.kernels and info.cost_hook is None:
        # Note [NKI kernels on neuron]: a body that ran NKI kernels costs their modelled time,
        # and the framework's copies of their non-row-major arguments (device/nki/kernel.py)
        runtime = CONTEXT.runtime
        copies_us = sum(runtime.cost.op_us(0, 2 * nbytes, torch.float32) for nbytes in kernels.staged)
        runtime.launch(index, kernels.us + copies_us, name=overload.name())
    else:
        _launch_priced(overload, info, index, args, kwargs, out, in_bytes)


def _launch_priced(overload, info, index: int, args, kwargs, out, in_bytes: int) -> None:
    """One launch on device `index` for a kernel run on these (host or meta) arguments, priced by
    its cost hook or by its bytes and FLOPs (Note [Custom kernel cost])."""
    out_bytes = sum(t.nbytes for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
    dtype = next((t.dtype for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), None)
    CONTEXT.runtime.launch(index, priced_us(info, args, kwargs, out, in_bytes + out_bytes, dtype), name=overload.name())


def _run_projected(overload, args, kwargs):
    """Note [Custom kernels in projection mode]: tensors have no values (adaptive_eager.projection),
    so the kernel's body cannot run: its shape function (`fake=`, or `register_fake`) runs on
    meta tensors of its arguments' geometry instead, its results get projected bytes, and its
    launch is priced by its cost hook (which reads shapes) or by bytes and FLOPs, as with values.
    An NKI kernel's time comes from running it: _run_nki_on_placeholder_values."""
    name = overload._schema.name
    shape_fn = torch._library.simple_registry.singleton.find(name).fake_impl.kernel
    opdef = OPDEFS.get(name)  # a custom_op's fake kernel exists, and raises, where none was given
    if shape_fn is None or (opdef is not None and opdef._abstract_fn is None
                            and not can_generate_trivial_fake_impl(overload)):
        raise NotImplementedError(
            f"custom kernel {name} has no shape function, so projection mode cannot size its outputs without "
            "computing them: give it one (custom_kernel(..., fake=...) or op.register_fake).")
    device, in_bytes = [-1], [0]

    def to_meta(x):
        if isinstance(x, torch.Tensor) and x.device.type == "neuron":
            device[0] = x.device.index
            in_bytes[0] += x.nbytes
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
        return x

    meta_args, meta_kwargs = pytree.tree_map(to_meta, (args, kwargs))
    out = shape_fn(*meta_args, **meta_kwargs)
    index = CONTEXT.runtime.current_index if device[0] < 0 else device[0]
    _launch_priced(overload, classify(overload), index, meta_args, meta_kwargs, out, in_bytes[0])
    return _projected_results(overload, args, kwargs, out, index)


def _projected_results(overload, args, kwargs, out, index: int):
    """A projected kernel's results, as projected neuron tensors of `out`'s geometry (meta or
    host tensors); what it writes has no known values any more."""
    for i, argument in enumerate(overload._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            for t in pytree.tree_leaves(value):
                if isinstance(t, torch.Tensor) and t.device.type == "neuron":
                    native.forget_values(t)

    def adopt(t):
        if not isinstance(t, torch.Tensor):
            return t
        if t.device.type != "meta":
            t = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        return native.adopt_meta(t, index)
    return pytree.tree_map(adopt, out)


# Note [NKI kernels in projection mode]: an NKI kernel's time comes from running it in the NKI
# simulator (Note [NKI kernels on neuron]), which reads values. Its instructions, their shapes and
# so its modelled time depend on its arguments' geometry, not their values, unless its control
# flow reads values (a kernel that branches on data: its time is what zeros give). So in
# projection mode it runs, as value-dependent ops do (Note [Value-dependent ops on placeholder
# values]), on host zeros of its arguments' geometry, up to PLACEHOLDER_RUN_BYTES of them; its
# results take projected bytes and its launch costs the simulated time, as with values.
PLACEHOLDER_RUN_BYTES = 256 * 2**20


def _run_nki_on_placeholder_values(fn, overload, args, kwargs):
    name = overload._schema.name
    device, in_bytes = [-1], [0]

    def to_zeros(x):
        if isinstance(x, torch.Tensor) and x.device.type == "neuron":
            device[0] = x.device.index
            in_bytes[0] += x.nbytes
            return torch.zeros_like(x, device="cpu")  # zeros_like keeps a dense tensor's strides
        return x

    sizes = [x.nbytes for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and x.device.type == "neuron"]
    if sum(sizes) > PLACEHOLDER_RUN_BYTES:
        raise NotImplementedError(
            f"NKI kernel {name} in projection mode: its modelled time comes from running it in the NKI simulator, "
            f"here on placeholder zeros of its arguments' geometry, up to {PLACEHOLDER_RUN_BYTES >> 20} MiB of them; "
            f"its arguments hold {sum(sizes) / 2**20:,.0f} MiB. Project it on smaller shapes, or run it outside "
            "adaptive_eager.projection().")
    host_args, host_kwargs = pytree.tree_map(to_zeros, (args, kwargs))
    index = CONTEXT.runtime.current_index if device[0] < 0 else device[0]
    with measuring() as kernels, _NeuronMadeOnHost():
        out = fn(*host_args, **host_kwargs)
    _launch_ran(overload, classify(overload), index, kernels, host_args, host_kwargs, out, in_bytes[0])
    return _projected_results(overload, args, kwargs, out, index)


class _NeuronMadeOnHost(torch.overrides.TorchFunctionMode):
    """While a body runs on host tensors, a tensor it makes on neuron (`torch.empty(...,
    device="neuron")`, `x.to("neuron")`: TorchNeuron's nki_op pattern for an output) is made on
    the host beside them, and adopted with the body's other results."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(_names_neuron(a) for a in args) or any(_names_neuron(v) for v in kwargs.values()):
            args = tuple("cpu" if _names_neuron(a) else a for a in args)
            kwargs = {k: "cpu" if _names_neuron(v) else v for k, v in kwargs.items()}
        return func(*args, **kwargs)


def _names_neuron(value) -> bool:
    if isinstance(value, torch.device):
        return value.type == "neuron"
    return isinstance(value, str) and (value == "neuron" or value.startswith("neuron:"))


def set_cost(op, cost: CostFn) -> None:
    """Give an existing custom op (or any OpOverload) its own cost estimate on neuron."""
    overload = getattr(op, "_opoverload", op)
    if not isinstance(overload, torch._ops.OpOverload):
        raise TypeError(
            f"set_cost needs a torch.library.custom_op or an OpOverload (torch.ops.ns.op.default), "
            f"got {type(op).__name__}.")
    if not callable(cost):
        raise TypeError(f"cost must be a function of the op's arguments returning "
                        f"{{'flops': ..., 'bytes': ...}}, got {type(cost).__name__}.")
    COST_HOOKS[overload] = _CostHook(str(overload), cost)
    forget(overload)  # an OpInfo classified before this call must not keep the old cost


class _CostHook:
    """Calls the user's cost function; returns (flops, bytes). Called with the host
    arguments and the bytes measured for the op (the default when the hook gives none)."""

    __slots__ = ("fn", "name")

    def __init__(self, name: str, fn: CostFn):
        self.name = name
        self.fn = fn

    def __call__(self, args, kwargs, measured_bytes: int) -> tuple[float, int]:
        est = self.fn(*args, **kwargs)
        if not isinstance(est, dict) or not set(est) <= {"flops", "bytes"}:
            raise TypeError(
                f"the cost function of custom kernel {self.name} returned {est!r}; it must return a dict "
                f"with the keys 'flops' and/or 'bytes', e.g. {{'flops': x.numel(), 'bytes': 2 * x.nbytes}}.")
        return float(est.get("flops", 0)), int(est.get("bytes", measured_bytes))
