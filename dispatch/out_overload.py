"""The `.out` overload of an op whose functional kernel is ours: the same values, written into
the caller's tensors as torch's out= ops write them."""
from __future__ import annotations

from collections.abc import Callable

from torch._prims_common.wrappers import _maybe_resize_out


def out_overload(functional: Callable, out_names: tuple[str, ...]) -> Callable:
    """A kernel for `name.out`: runs `functional` on the other arguments, then resizes each out
    tensor as torch's resize_output does (a warning where a non-empty one has another shape) and
    copies the result in. A result the functional kernel leaves out (None) leaves its tensor as
    it was."""
    def kernel(*args, **kwargs):
        outs = [kwargs.pop(name) for name in out_names]
        results = functional(*args, **kwargs)
        if len(out_names) == 1:
            results = (results,)
        for out, result in zip(outs, results):
            if result is not None:
                _maybe_resize_out(out, result.shape)
                out.copy_(result)
        return outs[0] if len(outs) == 1 else tuple(outs)

    return kernel
