"""The C++ core of the emulated device (device/csrc), compiled at install time.

Everything else about the distribution is in pyproject.toml. Note [C++ device guard]: the
guard and hooks must exist before the first `neuron` tensor, so they are a regular
extension module, built by `pip install` with torch's own build rules (torch is a build
requirement, pinned as at run time so the headers match the library).
"""
import glob
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(
    # -g0: Python's own CFLAGS ask for debug info (-g), which for translation units that
    # include torch's headers doubled the compile time (the eager path, then one file of
    # csrc/aten: 47 s with, 24 s without, on a 2-core machine) and made objects twenty times
    # larger; symbol names for backtraces stay. The last -O wins over CFLAGS' -O3.
    # device/csrc is grouped by job (runtime/, aten/, cost/, engine/: device/csrc/README.md);
    # its files include the shared headers by their path from csrc/.
    ext_modules=[CppExtension("adaptive_eager.device._C", sorted(glob.glob("device/csrc/**/*.cpp", recursive=True)),
                              depends=sorted(glob.glob("device/csrc/**/*.h", recursive=True)),
                              # kineto's headers (the profiler's device track, runtime/device_timeline.cpp)
                              # are included by their bare names, as torch's own headers include them
                              include_dirs=[os.path.abspath("device/csrc"),
                                            os.path.join(os.path.dirname(torch.__file__), "include", "kineto")],
                              extra_compile_args=["-O2", "-g0"])],
    cmdclass={"build_ext": BuildExtension},
)
