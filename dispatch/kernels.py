"""Running one ATen op on the emulated device, in terms of the host data.

This is the eager path every executor builds on: unwrap the arguments (checking devices
the way CUDA does), run the op on the host tensors (random ops drawing from the device's
generator), wrap the results (returning the very input objects an in-place or out= op
wrote, as eager PyTorch does), and say what the launch costs.
"""
from __future__ import annotations

import torch
from torch.utils.flop_counter import flop_registry, shape_wrapper

from device import native
from device.profiling import mark_device_time, profile_range, profiler_enabled

from .classify import OpInfo
from .context import CONTEXT
from .tensor import NeuronTensor, fix_wrapper_metadata, host_view, resolve_data, wrap_math_bits_view


def mismatch_error(a: str, b: str, op_name: str) -> RuntimeError:
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, {a} and {b}! "
        f"(when running {op_name}). Move them to one device first, e.g. with .to('{a}').")


def deferred_value_error(t: NeuronTensor, op_name: str) -> Exception:
    """A wrapper whose value never arrived: the launch that computes it failed (its error is
    re-raised, as for every value that depended on the failed op) or was lost."""
    if t._cell is not None and t._cell.error is not None:
        return t._cell.error
    return AssertionError(
        f"internal error: {op_name} read a neuron tensor whose deferred value was never computed "
        f"(Note [Deferred values]); please report it. NEURON_ADAPTIVE_EAGER=0 avoids it.")


def ready_data(t: NeuronTensor, reader: str = "a deferred launch") -> torch.Tensor:
    """t's host data, for `reader` (an op name); the error of the launch that should have
    made it if none arrived."""
    data = resolve_data(t)
    if data is None:
        raise deferred_value_error(t, reader)
    return data


class Unwrapped:
    """Host-side arguments of one op, the device it runs on, and the bytes it reads."""

    __slots__ = ("args", "kwargs", "device", "in_bytes", "dtype", "target")

    def __init__(self):
        self.device = -1
        self.target = None  # the device index a `device=` argument names, if any
        self.in_bytes = 0
        self.dtype = None


def _unwrap(a, u: Unwrapped, info: OpInfo):
    if isinstance(a, NeuronTensor):
        d = a._device_index
        if d != u.device:
            if u.device >= 0:
                raise mismatch_error(f"neuron:{u.device}", f"neuron:{d}", info.name)
            u.device = d
        # A conj/neg flagged wrapper reaches us only for ops that read the flags: Note [Math bits].
        data = host_view(a) if a._math_bits else a._data
        if data is None:
            data = ready_data(a, info.name)
        u.in_bytes += data.nbytes
        if u.dtype is None:
            u.dtype = data.dtype
        return data
    if isinstance(a, torch.Tensor):
        if a.device.type == "neuron":  # made by torch's C++ without us: sparse, quantized
            raise unsupported_layout_error(a)
        # CPU 0-dim tensors are scalars, as on CUDA; CPU index tensors are allowed for indexing.
        if a.dim() != 0 and not info.allows_cpu_indices and a.device.type != "meta":
            raise mismatch_error("neuron:0" if u.device < 0 else f"neuron:{u.device}", str(a.device), info.name)
        return a
    if isinstance(a, (list, tuple)) and a and not isinstance(a[0], (int, float, bool)):
        return type(a)(_unwrap(x, u, info) for x in a)
    return a


_HOST = torch.device("cpu")


def unwrap(info: OpInfo, args, kwargs) -> Unwrapped:
    u = Unwrapped()
    u.args = [_unwrap(a, u, info) for a in args]
    u.kwargs = {k: _unwrap(v, u, info) for k, v in kwargs.items()} if kwargs else {}
    if info.device_arg is not None:
        _take_device_arg(info, u)
    if u.device < 0:
        u.device = CONTEXT.runtime.current_index if u.target is None else u.target
    return u


def _take_device_arg(info: OpInfo, u: Unwrapped) -> None:
    """Ops with a device= argument (new_empty, empty_like, _to_copy) run on the host and
    record which neuron device the result belongs to."""
    dev = u.kwargs.get(info.device_arg)
    if dev is None:
        return
    dev = torch.device(dev)
    if dev.type == "neuron":
        u.target = CONTEXT.runtime.check_index(dev.index)
        u.kwargs[info.device_arg] = _HOST


def run_on_host(info: OpInfo, device_index: int, args, kwargs):
    """Run the op on the host tensors; random ops draw from the device's generator.

    Note [RNG order]: every random op takes its numbers from the generator of the device it
    runs on, in the order the ops run on the device, never from torch's CPU default
    generator. So CPU random calls in between do not change device results, and any
    executor that runs the same ops in the same order gives the same numbers.
    """
    if not info.is_random:
        return info.op(*args, **kwargs)
    gen = CONTEXT.runtime.devices[device_index].generator
    name = info.generator_arg
    if name is not None:
        args = _with_host_generators(args, kwargs, name)
    if name is not None and kwargs.get(name) is None and _generator_is_kwarg(info):
        kwargs[name] = gen
        return info.op(*args, **kwargs)
    # The op uses torch's default CPU generator (native_dropout, ...): lend it our state.
    with DefaultGeneratorLent(gen):
        return info.op(*args, **kwargs)


class DefaultGeneratorLent:
    """Inside the block, torch's default CPU generator draws from `generator`'s state; on
    exit the state it reached goes back to `generator` and the default gets its own back.
    For host code that can only use the default generator (Note [RNG order])."""

    __slots__ = ("generator", "saved")

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def __enter__(self):
        default = torch.default_generator
        self.saved = default.get_state()
        default.set_state(self.generator.get_state())

    def __exit__(self, *exc):
        default = torch.default_generator
        self.generator.set_state(default.get_state())
        default.set_state(self.saved)


_MATH_BIT_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.Conjugate) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.Negative)


def run_on_host_with_math_bits(info: OpInfo, device_index: int, args, kwargs):
    """run_on_host with the Conjugate and Negative keys enabled again (Note [Math bits]).

    `__torch_dispatch__` runs with them excluded, so a host kernel that builds a conj view
    internally and computes with it (linalg_pinv, lstsq: `A.mH @ ...`) would silently drop the
    conjugation. Re-enabling them costs ~2.5 us, so callers do it only for complex data.
    """
    exclude = torch._C._dispatch_tls_local_exclude_set()
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude - _MATH_BIT_KEYS):
        return run_on_host(info, device_index, args, kwargs)


def _with_host_generators(args, kwargs: dict, name: str):
    """A torch.Generator(device='neuron') argument becomes the CPU generator it holds (host
    kernels take only CPU generators: device/csrc/generator.cpp); returns the arguments."""
    given = kwargs.get(name)
    if isinstance(given, torch.Generator) and given.device.type == "neuron":
        kwargs[name] = native.host_generator(given)
    if any(isinstance(a, torch.Generator) and a.device.type == "neuron" for a in args):
        args = [native.host_generator(a) if isinstance(a, torch.Generator) else a for a in args]
    return args


def _generator_is_kwarg(info: OpInfo) -> bool:
    return any(a.name == info.generator_arg and a.kwarg_only for a in info.op._schema.arguments)


def wrap_new(data: torch.Tensor, device_index: int) -> NeuronTensor:
    """Wrap a host tensor produced by a kernel; its storage now counts against the device."""
    try:
        storage = data.untyped_storage()
    except NotImplementedError:  # sparse/quantized results: no storage (a try costs nothing here)
        raise unsupported_layout_error(data) from None
    CONTEXT.runtime.devices[device_index].memory.track(storage)
    return NeuronTensor(data, device_index)


def unsupported_layout_error(data: torch.Tensor) -> NotImplementedError:
    return NotImplementedError(
        f"neuron tensors are dense (strided) only, but this op produced a {data.layout} tensor. "
        f"Keep sparse tensors on the CPU (x.cpu().to_sparse()), or use a dense equivalent "
        f"(to_dense(), torch.mm on dense tensors) on neuron.")


def wrap_result(out, info: OpInfo, args, kwargs, device_index: int):
    """Map the host result back: written inputs are returned as themselves."""
    if isinstance(out, torch.Tensor):
        return _wrap_one(out, info.return_aliases[0] if info.return_aliases else None, info, args, kwargs, device_index)
    if isinstance(out, (tuple, list)):
        aliases = info.return_aliases
        if info.returns_tensor_list and len(aliases) == 1:
            return type(out)(_wrap_one(o, None, info, args, kwargs, device_index) for o in out)
        return type(out)(
            _wrap_one(o, aliases[i] if i < len(aliases) else None, info, args, kwargs, device_index)
            for i, o in enumerate(out))
    return out


def _wrap_one(o, alias, info: OpInfo, args, kwargs, device_index: int):
    if not isinstance(o, torch.Tensor):
        if isinstance(o, list):
            return [_wrap_one(x, None, info, args, kwargs, device_index) for x in o]
        return o
    if alias is not None:
        written = args[alias[1]] if alias[0] == "arg" else kwargs[alias[1]]
        if info.may_resize and isinstance(written, NeuronTensor):
            CONTEXT.runtime.devices[device_index].memory.track(written._data.untyped_storage())
            fix_wrapper_metadata(written)
        return written
    if info.is_view:
        if torch.is_inference_mode_enabled() and has_normal_tensor(args):
            # A view of a normal tensor is a normal tensor, even in inference mode (as on
            # CPU); a wrapper made here would be an inference tensor, and torch then
            # refuses to share the base's version counter with it.
            with torch.inference_mode(False):
                return _wrap_view(o, device_index)
        return _wrap_view(o, device_index)
    return wrap_new(o, device_index)


def _wrap_view(o: torch.Tensor, device_index: int) -> NeuronTensor:
    if o.is_conj() or o.is_neg():  # Note [Math bits]
        return wrap_math_bits_view(o, device_index)
    return wrap_new(o, device_index)


def has_normal_tensor(args) -> bool:
    return any(isinstance(a, NeuronTensor) and not a.is_inference() for a in args)


def op_cost_us(info: OpInfo, u: Unwrapped, out) -> float:
    """Roofline time of the op: bytes read and written, FLOPs where torch has a formula."""
    nbytes = u.in_bytes
    if isinstance(out, torch.Tensor):
        nbytes += out.nbytes
    elif isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                nbytes += o.nbytes
    return priced_us(info, u.args, u.kwargs, out, nbytes, u.dtype)


def priced_us(info: OpInfo, args, kwargs, out, nbytes: int, dtype) -> float:
    """Roofline µs of one op on these host arguments moving nbytes: a custom kernel's own
    estimate (Note [Custom kernel cost]), else FLOPs where torch has a formula."""
    if info.cost_hook is not None:
        flops, nbytes = info.cost_hook(args, kwargs, nbytes)
    else:
        flops = op_flops(info, args, kwargs, out) if info.has_flop_formula else 0
    return CONTEXT.runtime.cost.op_us(flops, nbytes, dtype or torch.float32)


def op_flops(info: OpInfo, args, kwargs, out) -> float:
    """FLOPs of the op on these host arguments, where torch has a formula; else 0."""
    formula = _flop_formulas.get(info.op, _UNSEEN)
    if formula is _UNSEEN:
        formula = _flop_formulas[info.op] = _shape_flop_formula(info.op)
    if formula is None:
        return 0
    fn, on_shapes = formula
    try:
        if on_shapes:
            return fn(*[_shape_of(a) for a in args], out_shape=_shape_of(out),
                      **{k: _shape_of(v) for k, v in kwargs.items()})
        return fn(*args, **kwargs, out_val=out)
    except Exception:  # a formula that cannot read these arguments: count bytes only
        return 0


# torch's FLOP formulas, per OpOverload, called on shapes. flop_registry holds them wrapped in
# flop_counter.shape_wrapper, whose pytree tree_map over every argument cost ~35 us per mm
# (more than the whole rest of the eager path); we map tensors to shapes ourselves instead.
_flop_formulas: dict = {}
_UNSEEN = object()
_SHAPE_WRAPPER_CODE = shape_wrapper(lambda: None).__code__


def _mm_flops(a, b, out_shape=None, **_):
    m, k = a
    n = b[-1]
    return m * n * 2 * k


def _bmm_flops(a, b, out_shape=None, **_):
    batch, m, k = a
    n = b[-1]
    return batch * m * n * 2 * k


# The matmul family, as flop_counter's formulas compute it: its addmm/baddbmm formulas call the
# *wrapped* mm/bmm formulas, so unwrapping them alone would still pay a tree_map per op.
_MATMUL_FLOPS = {
    torch.ops.aten.mm: _mm_flops,
    torch.ops.aten.addmm: lambda c, a, b, out_shape=None, **_: _mm_flops(a, b),
    torch.ops.aten.bmm: _bmm_flops,
    torch.ops.aten.baddbmm: lambda c, a, b, out_shape=None, **_: _bmm_flops(a, b),
}


def _shape_flop_formula(op):
    """(formula, takes_shapes) for the op, or None: the formula unwrapped when it is
    shape_wrapper's, else as registered (get_raw=True formulas take the values)."""
    formula = flop_registry.get(op._overloadpacket)
    if formula is None:
        return None
    if op._overloadpacket in _MATMUL_FLOPS:
        return _MATMUL_FLOPS[op._overloadpacket], True
    inner = getattr(formula, "__wrapped__", None)
    if inner is not None and getattr(formula, "__code__", None) is _SHAPE_WRAPPER_CODE:
        return inner, True
    return formula, False


def _shape_of(a):
    """flop_counter.get_shape, mapped through lists and tuples as its tree_map does."""
    if isinstance(a, torch.Tensor):
        return a.shape
    if isinstance(a, (list, tuple)):
        return type(a)(_shape_of(x) for x in a)
    return a


def run_kernel(info: OpInfo, args, kwargs, *, _in_range: bool = False):
    """Run one op now, as one launch on its device (the eager path)."""
    if not _in_range and profiler_enabled():  # the one check per op: Note [Profiler ranges]
        with profile_range("neuron::" + info.op._schema.name):
            return run_kernel(info, args, kwargs, _in_range=True)
    u = unwrap(info, args, kwargs)
    CONTEXT.ops[u.device] += 1
    if u.dtype is not None and u.dtype.is_complex:  # only complex data carries math bits
        out = run_on_host_with_math_bits(info, u.device, u.args, u.kwargs)
    else:
        out = run_on_host(info, u.device, u.args, u.kwargs)
    result = wrap_result(out, info, args, kwargs, u.device if u.target is None else u.target)
    device_us = CONTEXT.runtime.launch(u.device, op_cost_us(info, u, out))
    if _in_range:  # a local test, not a second profiler check on the hot path
        mark_device_time(device_us, ops=1, device=u.device)
    return result
