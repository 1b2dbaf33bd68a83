"""`neuronxcc.nki` on the emulated chip: the old NKI dialect, for kernels written against it.

    import adaptive_eager.nki.neuronxcc as nki      # or nki.install_neuronxcc(), then
    import adaptive_eager.nki.neuronxcc.language as nl    # `from neuronxcc import nki` as on the SDK

    @nki.jit
    def add(a_input, b_input):
        out = nl.ndarray(a_input.shape, dtype=a_input.dtype, buffer=nl.shared_hbm)
        i_p, i_f = nl.mgrid[0:128, 0:512]
        nl.store(out[i_p, i_f], nl.load(a_input[i_p, i_f]) + nl.load(b_input[i_p, i_f]))
        return out

The emulation is device/nki/legacy; `install_neuronxcc()` (adaptive_eager.nki) makes
`import neuronxcc.nki` give this module, and refuses where a real neuronxcc is installed.
"""
from __future__ import annotations

import sys

from adaptive_eager.device.nki import constants as _constants
from adaptive_eager.device.nki import nki_typing as typing
from adaptive_eager.device.nki.legacy import (BenchmarkKernel, baremetal, benchmark, isa, jit, language,
                                              simulate_kernel, tensor)

SUBMODULES = {"language": language, "isa": isa, "isa.constants": _constants, "typing": typing}
for _name, _module in SUBMODULES.items():
    sys.modules[f"{__name__}.{_name}"] = _module


def __getattr__(name):
    raise AttributeError(f"module 'neuronxcc.nki' has no attribute {name!r} in the emulator (it has jit, baremetal, "
                         f"benchmark, simulate_kernel, tensor, language, isa and typing; for a profile use "
                         f"adaptive_eager.nki.profile(kernel, *args))")


__all__ = ["BenchmarkKernel", "baremetal", "benchmark", "isa", "jit", "language", "simulate_kernel", "tensor", "typing"]
