"""adaptive-eager: an emulated AWS Trainium device (`neuron`) for PyTorch.

`import adaptive_eager` (or just `import torch`, through torch's backend autoload) makes
`.to('neuron')` work.
"""
import os as _os

import torch  # noqa: F401  (first: torch's backend autoload then finds us mid-import)

from dispatch import register as _register

from .mode import SWITCH as _SWITCH, get_mode, mode, set_mode  # noqa: E402

# Every setting is read before the device registers: a bad one leaves nothing half-done, and
# the autoload can make the device refuse instead (Note [A bad setting fails at first use]).
_default_mode = _SWITCH.default_from_env()
_register()

from .stats import Stats, reset_stats, stats  # noqa: E402
from .explain import Explanation, explain  # noqa: E402
from dispatch.custom_kernels import custom_kernel, set_cost  # noqa: E402
from dispatch.nki_kernels import nki_op  # noqa: E402

_SWITCH.set(_default_mode)

if _os.environ.get("ADAPTIVE_EAGER_NKI", "").strip().lower() in ("1", "true", "yes"):
    from . import nki as _nki  # `import nki` gives the emulator's NKI (adaptive_eager.nki.install)

    _nki.install()

# Last, once the engine's modules are loaded: Note [Opaque to Dynamo]. Modules imported later
# (the command line, dispatch.compile_backend) mark themselves or never run under Dynamo.
from dispatch.dynamo_opaque import hide_packages as _hide_packages  # noqa: E402

_hide_packages(("adaptive_eager", "dispatch", "device"), extra_modules=("_adaptive_eager_autoload",))

__version__ = "0.1.0"


__all__ = ["Explanation", "Stats", "custom_kernel", "explain", "get_mode", "mode", "nki_op", "reset_stats", "set_cost", "set_mode", "stats", "__version__"]
