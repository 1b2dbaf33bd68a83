"""Activation checkpointing and torch.random.fork_rng on neuron (issue 12): checkpoint saves the
device's RNG state in forward and restores it for the recomputation in backward, so dropout
draws the same mask twice and checkpointed training is bitwise CPU's. It does so only when
`torch.neuron._initialized` says the device is ready (without it: ~0.1 away after 8 steps)."""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import adaptive_eager


def _train(device, use_reentrant, steps=8):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                                torch.nn.Linear(16, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8).to(device).requires_grad_()
    # The dropout masks from here on: CPU's generator and the device's, seeded alike.
    torch.manual_seed(1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = checkpoint(model, x, use_reentrant=use_reentrant).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return [v.item() for v in losses], [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointed_training_with_dropout_is_bitwise_cpus(mode, use_reentrant):
    cpu_losses, cpu_params = _train("cpu", use_reentrant)
    with adaptive_eager.mode(mode):
        losses, params = _train("neuron", use_reentrant)
    assert losses == cpu_losses
    assert all(torch.equal(a, b) for a, b in zip(params, cpu_params))


def test_fork_rng_restores_the_device_generator():
    torch.manual_seed(3)
    with torch.random.fork_rng(device_type="neuron"):
        inside = torch.rand(4, device="neuron").cpu()
    after = torch.rand(4, device="neuron").cpu()
    assert torch.equal(inside, after)  # the draw inside the fork did not advance the device's state
