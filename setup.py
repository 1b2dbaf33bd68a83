"""The C++ core of the emulated device (device/csrc), compiled at install time.

Everything else about the distribution is in pyproject.toml. Note [C++ device guard]: the
guard and hooks must exist before the first `neuron` tensor, so they are a regular
extension module, built by `pip install` with torch's own build rules (torch is a build
requirement, pinned as at run time so the headers match the library).
"""
import glob

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(
    ext_modules=[CppExtension("device._C", sorted(glob.glob("device/csrc/*.cpp")),
                              depends=sorted(glob.glob("device/csrc/*.h")), extra_compile_args=["-O2"])],
    cmdclass={"build_ext": BuildExtension},
)
