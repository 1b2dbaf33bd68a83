"""NKI kernels on `neuron` tensors: direct calls, `nki_op` custom ops, and their price.

Note [NKI kernels on neuron]: an NKI kernel computes on the device's bytes, which are host
memory, so it runs on host aliases of its neuron arguments (device/nki runs it), and the
HBM tensors it returns are adopted as neuron tensors, zero-copy. Its launch is charged the
kernel's modelled time: the critical path of its instructions on the NeuronCore's engines
(device/nki/timeline.py), plus one launch overhead.

- Called directly (`kernel(x, y)` with neuron tensors), a kernel is not an ATen op, so the
  adaptive engine cannot queue it: the call is a sync point (pending work runs first) and the
  kernel runs now, as one launch. Its results carry no autograd history.
- Registered with `nki_op("ns::name", mutates_args=...)` (TorchNeuron's decorator), the
  function that calls the kernel becomes a torch custom op (dispatch/custom_kernels.py):
  one op of the adaptive engine's traces, one node under torch.compile, differentiable with
  `register_autograd`, and priced by the modelled time of the kernels its body runs.
- Traced with fake or meta tensors (torch.compile, the adaptive engine's shape functions), a
  kernel call runs once on zero-filled host tensors of the same shapes to learn the shapes
  it returns, and returns fake (meta) tensors of those shapes. An op that knows its shapes
  says so with `nki_op(..., fake=shape_function)` and no kernel runs.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from adaptive_eager.device import native
from adaptive_eager.device import nki as device_nki

from .context import CONTEXT
from .custom_kernels import custom_kernel


def run_on_device(kernel, args, kwargs):
    """A kernel called with non-CPU tensors: neuron (run it, Note [NKI kernels on neuron]) or fake."""
    leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    if any(isinstance(x, FakeTensor) or x.device.type == "meta" for x in leaves):
        return _run_on_fakes(kernel, args, kwargs)
    return run_with_timeline(kernel, args, kwargs)[0]


def run_with_timeline(kernel, args, kwargs):
    """Run a kernel on neuron or CPU tensors now; (result, its timeline). On neuron it is one
    launch of the kernel's modelled time."""
    leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    devices = {x.device for x in leaves if x.device.type != "cpu"}
    if any(d.type != "neuron" for d in devices):
        raise TypeError(f"{kernel!r}: NKI kernels run on neuron (or CPU) tensors, got tensors on "
                        f"{', '.join(sorted(map(str, devices)))}")
    if len(devices) > 1:
        raise RuntimeError(f"{kernel!r}: every neuron argument must be on one device, got "
                           f"{', '.join(sorted(map(str, devices)))}")
    if not devices:
        return device_nki.run(kernel, args, kwargs)
    if any(x.device.type == "cpu" and x.dim() > 0 for x in leaves):
        raise TypeError(f"{kernel!r}: called with neuron tensors, it cannot also take CPU tensors; move them with "
                        f".to('neuron') first")
    index = next(iter(devices)).index or 0
    runtime = CONTEXT.runtime
    runtime.synchronize(index)  # a direct call reads the arguments' values now
    aliases = {}

    def to_host(x):
        if isinstance(x, torch.Tensor) and x.device.type == "neuron":
            h = native.host_alias(x)
            aliases[id(h)] = x
            return h
        return x

    host_args, host_kwargs = pytree.tree_map(to_host, (args, kwargs))
    result, timeline = device_nki.run(kernel, host_args, host_kwargs, cores=_cores(kernel))
    for nbytes in timeline.staged:  # the framework's copy of a non-row-major argument, one op each way
        runtime.launch(index, runtime.cost.op_us(0, 2 * nbytes, torch.float32), name="nki staging copy")
    runtime.launch(index, timeline.total_ns / 1000, name=f"nki::{getattr(kernel, '__name__', 'kernel')}")

    def to_device(t):
        if not isinstance(t, torch.Tensor):
            return t
        original = aliases.get(id(t))
        return original if original is not None else native.adopt(t.contiguous(), index)

    return pytree.tree_map(to_device, result), timeline


def _cores(kernel) -> int:
    programs = 1
    for g in kernel.grid:
        programs *= g
    return min(programs, CONTEXT.runtime.config.logical_cores)


def _run_on_fakes(kernel, args, kwargs):
    """The kernel's results as fake tensors: run it on zeros of the arguments' shapes."""
    fakes = {}

    def to_real(x):
        if isinstance(x, torch.Tensor):
            real = torch.zeros(x.shape, dtype=x.dtype)
            fakes[id(real)] = x
            return real
        return x

    with unset_fake_temporarily():
        real_args, real_kwargs = pytree.tree_map(to_real, (args, kwargs))
        result, _ = device_nki.run(kernel, real_args, real_kwargs)
    device = next(x.device for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor))

    def to_fake(t):
        if not isinstance(t, torch.Tensor):
            return t
        original = fakes.get(id(t))
        return original if original is not None else torch.empty(t.shape, dtype=t.dtype, device=device)

    return pytree.tree_map(to_fake, result)


def nki_op(name: str, *, mutates_args: Iterable[str] | str = (), schema: str | None = None, fake=True):
    """Decorator (TorchNeuron's `nki_op`): `fn`, a function whose body calls NKI kernels on its
    tensor arguments, becomes the custom op `name` ("namespace::op"). On neuron it is one op
    of a fused trace, one launch in eager mode, priced by its kernels' modelled time; under
    torch.compile it is one node (its shapes from running the kernels on zeros, `fake=True`,
    or the shape function given as `fake`). The body runs on host tensors: an output it
    allocates on neuron (`torch.empty(..., device="neuron")`, TorchNeuron's pattern) is made on
    the host beside them and adopted. Returns the custom op: `.register_autograd` makes it
    trainable."""
    return custom_kernel(name, mutates_args=mutates_args, schema=schema, fake=fake, neuron_made_on_host=True)


device_nki.set_device_runner(run_on_device)
