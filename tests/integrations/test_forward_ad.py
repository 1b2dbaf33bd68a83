"""Forward-mode AD and torch.func on neuron give CPU's values, in both modes (issue 12: they
segfaulted or raised "data is not allocated yet" on the wrapper; on native tensors a known-zero
tangent, a ZeroTensor with no bytes, read as a failed deferred value)."""
from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import hessian, jacfwd, jacrev, jvp

import adaptive_eager


@pytest.fixture(params=["eager", "adaptive"])
def mode(request):
    with adaptive_eager.mode(request.param):
        yield request.param


def _inputs(device):
    g = torch.Generator().manual_seed(0)
    w, x, t = torch.randn(4, 3, generator=g), torch.randn(3, generator=g), torch.randn(3, generator=g)
    return w.to(device), x.to(device), t.to(device)


def test_a_dual_tensors_tangent_goes_through_ops_as_on_cpu(mode):
    def tangent(device):
        w, x, t = _inputs(device)
        with fwAD.dual_level():
            y = torch.tanh(w @ (fwAD.make_dual(x, t) * 2)).sum()
            return fwAD.unpack_dual(y).tangent.cpu()
    assert torch.equal(tangent("neuron"), tangent("cpu"))


@pytest.mark.parametrize("transform", ["jvp", "jacfwd", "jacrev", "hessian"])
def test_torch_func_transforms_give_cpus_values(mode, transform):
    def run(device):
        w, x, t = _inputs(device)
        f = lambda v: torch.tanh(w @ v)  # noqa: E731
        if transform == "jvp":
            out = jvp(f, (x,), (t,))[1]
        elif transform == "jacfwd":
            out = jacfwd(f)(x)
        elif transform == "jacrev":
            out = jacrev(f)(x)
        else:
            out = hessian(lambda v: torch.tanh(w @ v).sum())(x)
        return out.cpu()
    assert torch.equal(run("neuron"), run("cpu"))


def test_a_known_zero_tangent_is_a_zero_tensor_on_the_device():
    z = torch._efficientzerotensor(3, device="neuron")
    assert z.device == torch.device("neuron:0") and z._is_zerotensor()
    assert torch.equal((torch.ones(3, device="neuron") + z).cpu(), torch.ones(3))
