"""A library's C++ ops on neuron tensors (Note [Third-party composite ops], csrc/aten/composites.cpp):
registered for the CPU, or as CompositeImplicitAutograd as vLLM's CPU kernels are, they run on
the device's bytes with the CPU's kernel, in eager and adaptive mode, seen and priced as one
launch; Python composites keep their decomposition (and their autograd)."""
from __future__ import annotations

import pytest
import torch

import adaptive_eager
from adaptive_eager.device import native

# Writes out = 2 * x through raw pointers, as vLLM's CPU kernels do: run on a tensor whose bytes
# are not there yet (a deferred value), it would fail or read garbage.
_SOURCE = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
void twice_raw(at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && x.device().is_cpu() && out.device().is_cpu(),
              "twice_raw takes contiguous CPU tensors");
  const float* s = x.data_ptr<float>();
  float* d = out.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) d[i] = 2 * s[i];
}
TORCH_LIBRARY(neuron_test_ext, m) {
  m.def("twice_composite(Tensor(a!) out, Tensor x) -> ()");
  m.def("twice_cpu(Tensor(a!) out, Tensor x) -> ()");
}
TORCH_LIBRARY_IMPL(neuron_test_ext, CompositeImplicitAutograd, m) { m.impl("twice_composite", &twice_raw); }
TORCH_LIBRARY_IMPL(neuron_test_ext, CPU, m) { m.impl("twice_cpu", &twice_raw); }
"""


@pytest.fixture(scope="module")
def ext(tmp_path_factory):
    from torch.utils.cpp_extension import load_inline
    # Loaded after the device registered (at `import torch`): the registration listener finds it.
    load_inline("neuron_test_ext", cpp_sources=[_SOURCE], is_python_module=False,
                build_directory=str(tmp_path_factory.mktemp("ext")))
    return torch.ops.neuron_test_ext


def _program(op, x):
    y = (x + 1) * 3  # deferred in adaptive mode: no bytes until its launch runs
    out = torch.empty_like(y)
    op(out, y)
    return out - 1


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
@pytest.mark.parametrize("name", ["twice_composite", "twice_cpu"])
def test_a_libraries_cpp_op_runs_on_neuron_with_cpus_values(ext, mode, name):
    op = getattr(ext, name)
    x = torch.randn(1000)
    expected = _program(op, x)
    xn = x.to("neuron")
    with adaptive_eager.mode(mode):
        got = [_program(op, xn).cpu() for _ in range(6)]  # adaptive: recorded, then replayed
    for g in got:
        assert torch.equal(g, expected)


def test_a_cpp_composite_is_one_priced_launch_of_the_device(ext):
    assert "neuron_test_ext::twice_composite" in native.covered_third_party_composites()
    x = torch.randn(1000, device="neuron")
    out = torch.empty_like(x)
    with adaptive_eager.mode("eager"):
        torch.neuron.synchronize()
        adaptive_eager.reset_stats()
        ext.twice_composite(out, x)
        s = adaptive_eager.stats()
    assert s.launches == 1 and s.device_time_us > s.launch_overhead_us


def test_a_python_composite_keeps_its_decomposition_and_autograd():
    lib = torch.library.Library("neuron_test_py", "DEF")
    lib.define("scaled(Tensor x) -> Tensor")
    lib.impl("scaled", lambda x: x * 3, "CompositeImplicitAutograd")
    assert "neuron_test_py::scaled" not in native.covered_third_party_composites()
    x = torch.randn(8, device="neuron", requires_grad=True)
    torch.ops.neuron_test_py.scaled(x).sum().backward()
    assert torch.equal(x.grad.cpu(), torch.full((8,), 3.0))
