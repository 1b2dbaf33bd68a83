"""adaptive-eager: an emulated AWS Trainium device (`neuron`) for PyTorch.

`import adaptive_eager` (or just `import torch`, through torch's backend autoload) makes
`.to('neuron')` work.
"""
import torch  # noqa: F401  (first: torch's backend autoload then finds us mid-import)

from dispatch import register as _register

_register()

from .stats import Stats, reset_stats, stats  # noqa: E402

__version__ = "0.1.0"


__all__ = ["Stats", "reset_stats", "stats", "__version__"]
