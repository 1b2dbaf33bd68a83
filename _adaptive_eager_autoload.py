"""The `torch.backends` entry point of adaptive-eager: `import torch` calls `load()` last.

It lives outside our three packages on purpose: importing a submodule of a package runs
the package's __init__, and when the user's own `import adaptive_eager` (or `dispatch`,
`device`) is what pulled torch in, that package is half-initialized right now. In that
case we return and let that import finish the registration itself.

Note [A bad setting fails at first use]: a `NEURON_*` variable we cannot use must not make
`import torch` fail in a program that never touches neuron (torch re-raises any error of an
entry point). So the autoload keeps the error and makes `neuron` a device that raises it,
with its message, at the first use: an op on a neuron tensor or a factory on the device
(a PrivateUse1 fallback), `torch.neuron.<anything>`, and `import adaptive_eager` itself
(which reads the setting again). As torch.cuda does when its driver is broken, the probes
that libraries call to choose a device answer without raising: `torch.neuron.is_available()`
(and so `torch.accelerator.is_available()`) is False, with a warning that gives the message,
`device_count()` is 0, and `hasattr(torch.neuron, ...)` is False (the error is an
AttributeError too).
"""
import sys

_refusal = []  # the libraries of the kernels that raise, while the device is refused


def _initializing(name: str) -> bool:
    spec = getattr(sys.modules.get(name), "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def load() -> None:
    if any(_initializing(n) for n in ("adaptive_eager", "dispatch", "device")):
        return
    from device.errors import NeuronConfigError  # importing device reads no setting

    try:
        import adaptive_eager  # noqa: F401  (registers the device and installs the engine)
    except NeuronConfigError as error:
        _refuse_the_device(error)


def _refuse_the_device(error) -> None:
    import types
    import warnings

    import torch

    from device.errors import NeuronConfigError

    message = str(error)

    class NeuronUnusable(NeuronConfigError, AttributeError):
        """The configuration error, raised where the device is used."""

    def refuse(*args, **kwargs):
        raise NeuronConfigError(message)

    def attribute(name: str):
        if name.startswith("__"):  # the import system's and inspection's probes
            raise AttributeError(name)
        raise NeuronUnusable(message)

    from device import native

    torch.utils.rename_privateuse1_backend("neuron")  # so that 'neuron' parses as a device
    # `device='neuron'` asks the guard for the current device before any kernel runs.
    native.install_refusing_guard(message)
    lib = torch.library.Library("_", "IMPL")
    lib.fallback(refuse, "PrivateUse1")
    _refusal.append(lib)
    # Composite kernels apply to PrivateUse1 and run before a fallback: `.to('neuron')` is the
    # composite _to_copy, which would fail on the missing device guard ("PyTorch is not linked
    # with support for neuron devices"). Only in this broken configuration, so cost is no matter.
    aten = torch.library.Library("aten", "IMPL")
    for name in torch._C._dispatch_get_all_op_names():
        if (name.startswith("aten::")
                and not torch._C._dispatch_has_kernel_for_dispatch_key(name, "PrivateUse1")
                and torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd")):
            aten.impl(name[len("aten::"):], refuse, "PrivateUse1")
    _refusal.append(aten)

    def is_available() -> bool:
        warnings.warn(f"neuron is unavailable: {message}", RuntimeWarning, stacklevel=2)
        return False

    module = types.ModuleType("torch.neuron", "The neuron device, unusable: " + message)
    module.__getattr__ = attribute
    module.is_available = is_available
    module.device_count = lambda: 0
    torch._register_device_module("neuron", module)


def withdraw_refusal() -> None:
    """Undo _refuse_the_device (the setting was fixed in this process): registration follows."""
    if not _refusal:
        return
    import torch

    while _refusal:
        _refusal.pop()._destroy()
    sys.modules.pop("torch.neuron", None)
    if hasattr(torch, "neuron"):
        delattr(torch, "neuron")
