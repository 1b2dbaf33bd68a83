"""Optimizers on neuron take the path they take on TorchNeuron: `foreach` by default.

On a PrivateUse1 device the parameters are plain tensors, so torch.optim defaults to
foreach, as on CUDA. On CPU the default stays the per-parameter loop.
"""
from __future__ import annotations

import collections

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import _default_to_fused_or_foreach
from torch.utils._python_dispatch import TorchDispatchMode

import adaptive_eager


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops of a region by name."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))

    def foreach_ops(self) -> int:
        return sum(n for name, n in self.counts.items() if name.startswith("_foreach_"))


def _model(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)


def _step_ops(device, **adamw_kwargs):
    """(ops intercepted on neuron, OpCounter) of the third AdamW step, after two warm-up steps."""
    model = _model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **adamw_kwargs)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x, y = torch.randn(5, 8, generator=g).to(device), torch.randn(5, 4, generator=g).to(device)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        if step == 2:
            adaptive_eager.reset_stats()
            with OpCounter() as counter:
                opt.step()
            return adaptive_eager.stats().ops, counter
        opt.step()


def test_neuron_parameters_default_to_foreach_and_cpu_ones_do_not():
    neuron_params = list(_model("neuron").parameters())
    assert _default_to_fused_or_foreach(neuron_params, differentiable=False) == (False, True)
    assert _default_to_fused_or_foreach(list(_model("cpu").parameters()), differentiable=False) == (False, False)


def test_default_adamw_step_has_the_op_count_of_the_foreach_path():
    default_ops, default_counter = _step_ops("neuron")
    foreach_ops, foreach_counter = _step_ops("neuron", foreach=True)
    loop_ops, loop_counter = _step_ops("neuron", foreach=False)
    assert default_ops == foreach_ops
    assert default_counter.counts == foreach_counter.counts
    assert default_counter.foreach_ops() > 0 and loop_counter.foreach_ops() == 0
    assert loop_ops > default_ops  # the per-parameter loop issues more ops


def test_clip_grad_norm_uses_foreach_norm_on_neuron():
    model = _model("neuron")
    model(torch.randn(3, 8).to("neuron")).sum().backward()
    with OpCounter() as counter:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    assert counter.counts["_foreach_norm"] == 1


def _adamw_run(device, **adamw_kwargs):
    model = _model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **adamw_kwargs)
    g = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(4):
        x, y = torch.randn(5, 8, generator=g).to(device), torch.randn(5, 4, generator=g).to(device)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()]


def _assert_same(a, b):
    assert a[0] == b[0]
    assert all(torch.equal(p, q) for p, q in zip(a[1], b[1]))


def test_default_foreach_on_neuron_is_bit_identical_to_both_cpu_paths():
    cpu_loop = _adamw_run("cpu")  # the CPU default: per-parameter loop
    cpu_foreach = _adamw_run("cpu", foreach=True)
    _assert_same(cpu_loop, cpu_foreach)  # the claim in DESIGN.md this compatibility relies on
    _assert_same(cpu_loop, _adamw_run("neuron"))
    _assert_same(cpu_loop, _adamw_run("neuron", foreach=False))
