"""adaptive-eager: an emulated AWS Trainium device (`neuron`) for PyTorch.

`import adaptive_eager` (or just `import torch`, through torch's backend autoload) makes
`.to('neuron')` work.

One namespace, one folder of the repository per layer; an import goes down this list, never up:
- `adaptive_eager` (adaptive_eager/): the public API (this module, `mode`, `stats`,
  `explain`) and, a subpackage each, the adaptive engine (`engine/`: recording, detection,
  traces, matching), the command line (`cli/`), NKI for users (`nki/`: the `nki` module and
  the kernel library), vLLM's platform plugin (`vllm_platform/`) and PyTorch Lightning's
  accelerator (`lightning_plugin/`);
- `adaptive_eager.dispatch` (dispatch/): the device's integrations with PyTorch's subsystems
  (registration, the executor interface, op classification and pricing, autocast, attention,
  distributed, torch.compile and inductor, custom and NKI kernels on torch tensors);
- `adaptive_eager.device` (device/): the emulated chip (settings, profiles, memory, clock and
  cost model, streams, `torch.neuron`, the NeuronCore's NKI simulator) and its C++ core
  (device/csrc: runtime/, aten/ for op kernels, cost/, engine/ for the queue of deferred ops).
"""
import torch  # noqa: F401  (first: torch's backend autoload then finds us mid-import)

import os as _os

from .device import native as _native, settings as _settings
from .dispatch import register as _register

# Every setting is read before anything registers: a bad one leaves nothing half-done, and
# the autoload makes the device refuse instead (Note [A bad setting fails at first use]).
_settings.check_all()

from .mode import SWITCH as _SWITCH, get_mode, mode, set_mode  # noqa: E402

_default_mode = _SWITCH.default_from_env()
_register()
# A posted op's error names the user's line, not this package's: Note [Where an op was issued].
_native.add_internal_source_dir(_os.path.dirname(_os.path.abspath(__file__)) + _os.sep)

from .stats import Stats, reset_stats, stats  # noqa: E402
from .projection import is_projected, projection  # noqa: E402
from .explain import Explanation, explain  # noqa: E402
from .dispatch.custom_kernels import custom_kernel, set_cost  # noqa: E402
from .dispatch.nki_kernels import nki_op  # noqa: E402

_SWITCH.set(_default_mode)
if _settings.read("NEURON_PROJECTION"):
    _native.set_projection(True)  # the whole process: Note [Projected bytes]

if _settings.read("ADAPTIVE_EAGER_NKI"):
    from . import nki as _nki  # `import nki` gives the emulator's NKI (adaptive_eager.nki.install)

    _nki.install()

# `Trainer(accelerator="neuron")` once Lightning is imported: Note [Lightning's neuron accelerator].
from .lightning_plugin import install as _install_lightning  # noqa: E402

_install_lightning()

# Last, once the engine's modules are loaded: Note [Opaque to Dynamo]. Modules imported later
# (the command line, dispatch.compile_backend) mark themselves or never run under Dynamo.
from .dispatch.dynamo_opaque import hide_packages as _hide_packages  # noqa: E402

_hide_packages(("adaptive_eager",), extra_modules=("_adaptive_eager_autoload",))

__version__ = "0.1.0"


__all__ = ["Explanation", "Stats", "custom_kernel", "explain", "get_mode", "is_projected", "mode", "nki_op", "projection",
           "reset_stats", "set_cost", "set_mode", "stats", "__version__"]
