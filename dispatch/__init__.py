"""adaptive_eager.dispatch (the repository's dispatch/): the device's integrations with PyTorch.

Its job: make each PyTorch subsystem work on `neuron` as it does on CUDA. Registration of the
PrivateUse1 device (`registration.py`, and `refusal.py` for a device a bad setting leaves
unusable), the Executor interface the engine implements (`executor.py`, `context.py`), op
classification and pricing (`classify.py`, `pricing.py`), the device's own kernels
(`attention.py`, `builtin_kernels.py`, `custom_kernels.py`, `nki_kernels.py`: NKI kernels on
torch tensors), what CUDA's kernels compute for dtypes CPU's refuse (`cuda_dtypes.py`: integer
histc), autocast, torch.distributed, torch.compile (`compile_backend.py`,
`inductor.py`, `dynamo_opaque.py`) and the RNG shims (`rng.py`). A new integration is a module
here, installed from registration.py.

The middle layer: it imports adaptive_eager.device, never the engine or the public API above.
"""

if __name__ != "adaptive_eager.dispatch":  # the repository's folder, imported by its own name
    raise ImportError(
        f"the folder dispatch/ of adaptive-eager was imported as {__name__!r}; it is the package "
        f"adaptive_eager.dispatch (pyproject.toml's package-dir): import adaptive_eager.dispatch. "
        f"A second copy under another name would hold a second, unregistered device.")

from .classify import OpInfo, classify
from .context import CONTEXT, install_executor
from .executor import EagerExecutor, Executor
from .registration import register

__all__ = ["CONTEXT", "EagerExecutor", "Executor", "OpInfo", "classify", "install_executor", "register"]
