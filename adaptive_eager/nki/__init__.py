"""NKI on the emulated chip: write Trainium kernels in NKI and run them on any CPU.

    import adaptive_eager.nki as nki
    import adaptive_eager.nki.language as nl
    import adaptive_eager.nki.isa as nisa

    @nki.jit
    def add_kernel(a, b):
        ...                       # the kernel as written for the chip

    c = add_kernel(x, y)          # x, y: torch tensors (CPU or neuron) or numpy arrays
    print(nki.profile(add_kernel, x, y))   # modelled time per engine

`nki.install()` (or ADAPTIVE_EAGER_NKI=1 before `import torch`) also makes these modules
importable as `nki`, `nki.language` and `nki.isa`, for kernels written for the real
package, unchanged; it refuses where a real `nki` package is installed. Kernels run
eagerly, instruction by instruction, so a breakpoint inside one shows real tile values.
See the README's "NKI kernels" section and device/nki for the emulation itself.
"""
from __future__ import annotations

import importlib.util
import sys
import types

from adaptive_eager.device.nki import KernelProfile, NkiValidationError, isa, jit, language, simulate
from adaptive_eager.device.nki import collectives
from adaptive_eager.device.nki import ranks as _ranks
from adaptive_eager.device.nki import constants as _constants
from adaptive_eager.device.nki import nki_typing as typing
from adaptive_eager.device.nki.dtypes import NkiDType as dtype
from adaptive_eager.device.nki.kernel import Kernel
from adaptive_eager.dispatch.nki_kernels import nki_op, run_with_timeline

# the NKI simulator's own name for simulate (the NKI library's harness calls it)
cpu_simulate = simulate

# One module object per name, whichever way it is imported (adaptive_eager.nki.language,
# nki.language after install()).
_SUBMODULES = {"language": language, "isa": isa, "isa.constants": _constants, "typing": typing,
               "collectives": collectives}
for _name, _module in _SUBMODULES.items():
    sys.modules[f"{__name__}.{_name}"] = _module
isa.constants = _constants


def profile(kernel, *args, **kwargs) -> KernelProfile:
    """Run `kernel(*args, **kwargs)` once and return its modelled profile: total time, busy
    time and utilisation per engine, the instructions, `.result` (what the kernel returned)
    and `.export_chrome_trace(path)` (one track per engine, for Perfetto or chrome://tracing)."""
    if not isinstance(kernel, Kernel):
        raise TypeError(f"profile() takes an @nki.jit kernel, got {type(kernel).__name__}")
    result, timeline = run_with_timeline(kernel, args, kwargs)
    report = timeline.report()
    report.result = result
    return report


def run_ranks(kernel, collective_ranks: int, inputs) -> list:
    """Run `kernel` on `collective_ranks` ranks, one per logical NeuronCore, as the Neuron
    runtime launches a kernel that calls nki.collectives; returns each rank's result.
    `inputs`: the kernel's keyword arguments, the same for every rank (each gets its own copy),
    or a function rank -> keyword arguments (device/nki/ranks.py, Note [Rank launches])."""
    return _ranks.run_ranks(kernel, collective_ranks, inputs)[0]


def profile_ranks(kernel, collective_ranks: int, inputs) -> list[KernelProfile]:
    """run_ranks, returning each rank's modelled profile (with `.result`)."""
    results, timelines = _ranks.run_ranks(kernel, collective_ranks, inputs)
    reports = []
    for result, timeline in zip(results, timelines):
        report = timeline.report()
        report.result = result
        reports.append(report)
    return reports


def install() -> None:
    """Make `import nki`, `import nki.language as nl`, `import nki.isa as nisa` give these
    modules, so kernels written for AWS's package run unchanged. Refuses to shadow a real one."""
    _install_as("nki", sys.modules[__name__], _SUBMODULES, "install()")


def install_neuronxcc() -> None:
    """Make `from neuronxcc import nki`, `import neuronxcc.nki.language as nl` (and `.isa`,
    `.typing`) give the old dialect's modules (adaptive_eager.nki.neuronxcc), for kernels
    written against neuronxcc.nki. Refuses to shadow a real neuronxcc."""
    from . import neuronxcc
    if sys.modules.get("neuronxcc.nki") is neuronxcc:
        return
    _refuse_a_real("neuronxcc", "install_neuronxcc()", "import adaptive_eager.nki.neuronxcc as nki")
    package = types.ModuleType("neuronxcc", "The emulator's stand-in for neuronxcc: only its nki dialect.")
    package.__path__ = []  # a package, so `import neuronxcc.nki` looks its submodules up in sys.modules
    package.nki = neuronxcc
    sys.modules["neuronxcc"] = package
    _install_as("neuronxcc.nki", neuronxcc, neuronxcc.SUBMODULES, "install_neuronxcc()")


def _install_as(name: str, module, submodules: dict, how: str) -> None:
    if sys.modules.get(name) is module:
        return
    _refuse_a_real(name, how, "import adaptive_eager.nki as nki")
    sys.modules[name] = module
    for sub, value in submodules.items():
        sys.modules[f"{name}.{sub}"] = value


def _refuse_a_real(name: str, how: str, instead: str) -> None:
    existing = sys.modules.get(name)
    try:
        spec = importlib.util.find_spec(name) if existing is None else None
    except ModuleNotFoundError:  # a dotted name whose parent is not there
        spec = None
    if existing is not None or spec is not None:
        where = getattr(existing, "__file__", None) if existing is not None else spec.origin
        raise RuntimeError(
            f"a real {name!r} package is installed ({where}); adaptive_eager.nki.{how} never shadows it. "
            f"Import the emulator's modules by their own names instead: {instead}, and its language and isa "
            f"submodules.")


def uninstall() -> None:
    """Undo install() and install_neuronxcc(): `import nki` and `import neuronxcc` no longer
    find the emulator."""
    mine = sys.modules[__name__]
    if sys.modules.get("nki") is mine:
        for name in ["nki"] + [f"nki.{n}" for n in _SUBMODULES]:
            sys.modules.pop(name, None)
    legacy = sys.modules.get(f"{__name__}.neuronxcc")
    if legacy is not None and sys.modules.get("neuronxcc.nki") is legacy:
        for name in ["neuronxcc", "neuronxcc.nki"] + [f"neuronxcc.nki.{n}" for n in legacy.SUBMODULES]:
            sys.modules.pop(name, None)


__all__ = ["Kernel", "KernelProfile", "NkiValidationError", "cpu_simulate", "dtype", "install", "install_neuronxcc",
           "isa", "jit", "language", "nki_op", "profile", "simulate", "typing", "uninstall"]
