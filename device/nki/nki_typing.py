"""nki.typing: the annotations kernels put on their parameters (nt.tensor, nt.mutable_tensor)."""
from __future__ import annotations

from .tensor import NkiTensor

tensor = NkiTensor  # a kernel argument the kernel reads
mutable_tensor = NkiTensor  # one it writes too
scalar = float

__all__ = ["mutable_tensor", "scalar", "tensor"]
