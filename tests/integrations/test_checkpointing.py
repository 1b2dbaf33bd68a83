"""Activation checkpointing and torch.random.fork_rng on neuron (issue 12): checkpoint saves the
RNG states in forward (CPU's, which neuron's random ops draw from, and the device's) and
restores them for the recomputation in backward, so dropout draws the same mask twice and
checkpointed training is bitwise CPU's. It does so only when
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
    # The dropout masks from here on: CPU's generator, which neuron's dropout draws from too.
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


class _AttentionBlock(torch.nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads, self.qkv, self.out = heads, torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.norm, self.mlp = torch.nn.LayerNorm(dim), torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm(x))


def _train_checkpointed_attention(device, steps=6):
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(_AttentionBlock() for _ in range(3)).to(device)
    opt = torch.optim.SGD(blocks.parameters(), lr=0.1)
    x = torch.randn(2, 5, 16).to(device)
    torch.manual_seed(1)
    losses = []
    for _ in range(steps):
        h = x
        for block in blocks:
            h = checkpoint(block, h, use_reentrant=False)
        loss = h.square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in blocks.parameters()]


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_checkpointed_attention_with_dropout_is_bitwise_cpus(mode):
    cpu_losses, cpu_params = _train_checkpointed_attention("cpu")
    with adaptive_eager.mode(mode):
        losses, params = _train_checkpointed_attention("neuron")
    assert losses == cpu_losses
    assert all(torch.equal(a, b) for a, b in zip(params, cpu_params))


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_attention_backward_under_saved_tensor_hooks_calls_them_as_cpu_does(dropout_p):
    # The device's attention backward recomputes its forward under host autograd. Its graph
    # must keep its own saved tensors: a fused launch runs it under the state of whichever op
    # flushed it, and inside checkpoint's recomputation the hooks took them as the region's
    # (HF GPT-2 with gradient checkpointing and dropout: "Recomputed values ... different
    # metadata", from the third step in adaptive mode).
    def packed_in_backward(device):
        q, k, v = (torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(i)).to(device).requires_grad_()
                   for i in range(3))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda x: packed.append(x) or x, lambda x: x):
            out.sum().backward()
        return len(packed)

    assert packed_in_backward("neuron") == packed_in_backward("cpu") == 0


def test_fork_rng_restores_the_device_generator():
    torch.manual_seed(3)
    with torch.random.fork_rng(device_type="neuron"):
        inside = torch.rand(4, device="neuron").cpu()
    after = torch.rand(4, device="neuron").cpu()
    assert torch.equal(inside, after)  # the draw inside the fork did not advance the device's state
