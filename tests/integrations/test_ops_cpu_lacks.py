"""Ops with no CPU kernel that real code calls on an accelerator (issue 37, item 7): neuron
gives each a kernel (dispatch/linear_backward.py, dispatch/sync_batch_norm.py). Before, each
raised "has no CPU kernel"."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import adaptive_eager

MODES = ["eager", "adaptive"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(6, 4), (2, 3, 4)])
def test_linear_backward_gives_cpu_autograds_bits_for_each_asked_gradient(shape, mode):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, requires_grad=True)
    w = torch.randn(5, 4, generator=g, requires_grad=True)
    b = torch.randn(5, generator=g, requires_grad=True)
    gy = torch.randn(*shape[:-1], 5, generator=g)
    F.linear(x, w, b).backward(gy)
    with adaptive_eager.mode(mode):
        for _ in range(4):  # adaptive: replayed in a trace too
            got = torch.ops.aten.linear_backward(x.detach().to("neuron"), gy.to("neuron"), w.detach().to("neuron"),
                                                 [True, True, True])
            assert [torch.equal(a.cpu(), e) for a, e in zip(got, (x.grad, w.grad, b.grad))] == [True] * 3
        only_weight = torch.ops.aten.linear_backward(x.detach().to("neuron"), gy.to("neuron"),
                                                     w.detach().to("neuron"), [False, True, False])
    assert [t is None for t in only_weight] == [True, False, True]


@pytest.mark.parametrize("mode", MODES)
def test_sync_batch_norms_kernels_over_two_shards_give_one_batch_norm_over_the_whole_batch(mode):
    """SyncBatchNorm's flow (torch/nn/modules/_functions.py) on two shards in one process, the
    collectives done by hand: the same values as F.batch_norm over the whole batch on CPU, to
    float32 rounding, and the running statistics too."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(6, 3, 4, 4, generator=g), torch.randn(3, generator=g), torch.randn(3, generator=g)
    gy = torch.randn(6, 3, 4, 4, generator=g)
    eps, momentum = 1e-5, 0.1
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    running = torch.zeros(3), torch.ones(3)
    F.batch_norm(xr, *running, wr, br, training=True, momentum=momentum, eps=eps).backward(gy)
    with adaptive_eager.mode(mode):
        shards, grads = [x[:2].to("neuron"), x[2:].to("neuron")], [gy[:2].to("neuron"), gy[2:].to("neuron")]
        wn, bn = w.to("neuron"), b.to("neuron")
        rm, rv = torch.zeros(3, device="neuron"), torch.ones(3, device="neuron")
        stats = [torch.batch_norm_stats(s, eps) for s in shards]
        counts = torch.tensor([2 * 16.0, 4 * 16.0], device="neuron")
        mean, invstd = torch.batch_norm_gather_stats_with_counts(
            shards[0], torch.stack([m for m, _ in stats]), torch.stack([i for _, i in stats]), rm, rv, momentum, eps,
            counts)
        out = torch.cat([torch.batch_norm_elemt(s, wn, bn, mean, invstd, eps) for s in shards])
        reduced = [torch.batch_norm_backward_reduce(gs, s, mean, invstd, wn, True, True, True)
                   for gs, s in zip(grads, shards)]
        sum_dy, sum_dy_xmu = sum(r[0] for r in reduced), sum(r[1] for r in reduced)
        count = torch.tensor([32, 64], dtype=torch.int32, device="neuron")
        grad_input = torch.cat([torch.batch_norm_backward_elemt(gs, s, mean, invstd, wn, sum_dy, sum_dy_xmu, count)
                                for gs, s in zip(grads, shards)])
        grad_weight, grad_bias = sum(r[2] for r in reduced), sum(r[3] for r in reduced)
    expected = F.batch_norm(x, torch.zeros(3), torch.ones(3), w, b, training=True, momentum=momentum, eps=eps)
    for got, want in ((out, expected), (grad_input, xr.grad), (grad_weight, wr.grad), (grad_bias, br.grad),
                      (rm, running[0]), (rv, running[1])):
        assert got.device.type == "neuron"
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
