"""The eager path's FLOP count (dispatch.kernels.op_cost_us) agrees with torch's flop_counter.

kernels.py calls torch's formulas on shapes it computes itself (flop_registry's wrapper
costs ~35 us per op); these tests pin that the counts stay torch's.
"""
import pytest
import torch
from torch.utils.flop_counter import flop_registry

from dispatch.kernels import _shape_flop_formula, _shape_of

aten = torch.ops.aten

CASES = {
    "mm": (aten.mm.default, lambda: (torch.randn(4, 8), torch.randn(8, 5))),
    "addmm": (aten.addmm.default, lambda: (torch.randn(5), torch.randn(4, 8), torch.randn(8, 5))),
    "bmm": (aten.bmm.default, lambda: (torch.randn(3, 4, 8), torch.randn(3, 8, 5))),
    "baddbmm": (aten.baddbmm.default,
                lambda: (torch.randn(3, 4, 5), torch.randn(3, 4, 8), torch.randn(3, 8, 5))),
    "convolution": (aten.convolution.default,
                    lambda: (torch.randn(2, 3, 9, 9), torch.randn(6, 3, 3, 3), None,
                             [1, 1], [0, 0], [1, 1], False, [0, 0], 1)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_flop_count_matches_torch_flop_counter(name):
    op, make = CASES[name]
    args = make()
    out = op(*args)
    expected = flop_registry[op._overloadpacket](*args, out_val=out)
    fn, on_shapes = _shape_flop_formula(op)
    assert on_shapes
    assert fn(*[_shape_of(a) for a in args], out_shape=_shape_of(out)) == expected > 0


def test_ops_without_a_formula_have_none():
    assert _shape_flop_formula(aten.add.Tensor) is None


def test_addmm_on_neuron_charges_the_cost_model_its_flops(monkeypatch):
    from dispatch import CONTEXT

    cost = CONTEXT.runtime.cost
    seen = []
    real = cost.op_us
    monkeypatch.setattr(cost, "op_us", lambda flops, nbytes, dtype: seen.append(flops) or real(flops, nbytes, dtype))
    bias, a, b = (torch.randn(5, device="neuron"), torch.randn(4, 8, device="neuron"),
                  torch.randn(8, 5, device="neuron"))
    seen.clear()
    torch.addmm(bias, a, b)
    assert seen == [2 * 4 * 5 * 8]
