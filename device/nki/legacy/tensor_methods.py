"""The methods neuronxcc.nki's `nki.tensor` has and nki's NkiTensor does not (Note [Old tensor
methods] in tensor.py): `broadcast_to`, `astype`, `expand_dims`, `assert_shape`, `itemsize`."""
from __future__ import annotations

from .. import language as _nl
from ..errors import NkiValidationError
from ..tensor import _OLD_TENSOR_METHODS


def broadcast_to(t, shape):
    """A tile of `shape` holding t by numpy's broadcast rules (across partitions too)."""
    return _nl.broadcast_to(t, tuple(shape))


def astype(t, dtype):
    """A copy of the tile in another dtype (always a copy, as the old docs say)."""
    return _nl.copy_tile(t, dtype)


def expand_dims(t, axis: int):
    return t.expand_dim(axis)


def assert_shape(t, shape):
    if tuple(t.shape) != tuple(shape):
        raise NkiValidationError(f"assert_shape: tensor {t.name!r} has shape {t.shape}, expected {tuple(shape)}")
    return t


METHODS = {"broadcast_to": broadcast_to, "astype": astype, "expand_dims": expand_dims, "assert_shape": assert_shape}
PROPERTIES = {"itemsize": lambda t: t.dtype.itemsize}

if set(METHODS) | set(PROPERTIES) != _OLD_TENSOR_METHODS:
    raise AssertionError("tensor.py's _OLD_TENSOR_METHODS must name exactly legacy/tensor_methods.py's methods")
