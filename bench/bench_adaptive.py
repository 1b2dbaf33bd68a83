"""Adaptive mode on a stream that never repeats (issue 3: it must degrade to eager, at
most 10% above it), and on one whose sizes change every step (issue 15: one shape-generic
trace fuses it): CPU eager, neuron eager, neuron adaptive in one benchmark group each.
The training-loop comparisons are in bench_workloads.py.

Compare ratios, not absolute times (shared, noisy machines).

    python -m pytest bench/bench_adaptive.py -q --benchmark-only
"""
import random

import pytest
import torch
import torch.nn.functional as F

import adaptive_eager

TARGETS = ["cpu", "neuron-eager", "neuron-adaptive"]


def _never_repeating_steps(device: str, steps: int):
    """Each step runs a few ops drawn at random on a batch size drawn at random: neither the
    ops' order nor their sizes repeat, so no trace, exact or shape-generic, can match."""
    rng = random.Random(0)
    plan = [(rng.randint(4, 64), [rng.randrange(5) for _ in range(rng.randint(3, 9))]) for _ in range(steps)]
    w = torch.randn(32, 32, generator=torch.Generator().manual_seed(0)).to(device)
    table = [lambda x: x @ w, torch.relu, lambda x: x * 0.5, torch.tanh, lambda x: x + 1]

    def run():
        for n, ops in plan:
            x = torch.ones(n, 32, device=device)
            for k in ops:
                x = table[k](x)
        if device == "neuron":
            torch.neuron.synchronize()
    return run


def _changing_batch_steps(device: str, steps: int):
    """An MLP trained on a batch size that changes every step: no exact trace can match, one
    shape-generic trace serves every step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).to(device)
    opt = torch.optim.AdamW(model.parameters())
    data = [(torch.randn(8 + i, 32, device=device), torch.randint(0, 10, (8 + i,), device=device))
            for i in range(steps)]

    def run():
        for x, y in data:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        if device == "neuron":
            torch.neuron.synchronize()
    return run


def _run_once(benchmark, target: str, build) -> None:
    device = "cpu" if target == "cpu" else "neuron"
    mode = "adaptive" if target == "neuron-adaptive" else "eager"
    with adaptive_eager.mode(mode):
        adaptive_eager.reset_stats()
        benchmark.pedantic(build(device, 400), rounds=1, iterations=1)
        if device == "neuron":
            s = adaptive_eager.stats()
            benchmark.extra_info.update(mode=mode, ops=s.ops, launches=s.launches,
                                        fused_launches=s.fused_launches)


@pytest.mark.benchmark(group="never-repeating: 400 steps of random ops on random batch sizes")
@pytest.mark.parametrize("target", TARGETS)
def test_never_repeating_stream(benchmark, target):
    """Adaptive mode must degrade to eager: at most 10% above it (issue 3)."""
    _run_once(benchmark, target, _never_repeating_steps)


@pytest.mark.benchmark(group="changing shapes: 400 steps, batch size changes every step")
@pytest.mark.parametrize("target", TARGETS)
def test_batch_size_changing_every_step(benchmark, target):
    """One shape-generic trace fuses every step (issue 15)."""
    _run_once(benchmark, target, _changing_batch_steps)


SMALL_OPS_PER_STEP = 32


@pytest.mark.benchmark(group=f"per op: a step of {SMALL_OPS_PER_STEP} x.add_(i) on 16 elements")
@pytest.mark.parametrize("target", TARGETS)
def test_per_op_cost_of_a_repeating_step_of_small_ops(benchmark, target):
    """What each path costs per op when the kernels cost nothing: CPU eager, the C++ eager
    path, and adaptive mode in its steady state (each op matched and queued, one launch per
    step: the ops differ by their integer constant, so the step is the unit that repeats).
    Divide the median by SMALL_OPS_PER_STEP."""
    device = "cpu" if target == "cpu" else "neuron"
    mode = "adaptive" if target == "neuron-adaptive" else "eager"
    x = torch.zeros(16, device=device)

    def step():
        for i in range(SMALL_OPS_PER_STEP):
            x.add_(i)

    with adaptive_eager.mode(mode):
        for _ in range(8):  # adaptive: the trace is adopted and matched by now
            step()
        adaptive_eager.reset_stats()
        benchmark.pedantic(step, rounds=20, iterations=50, warmup_rounds=2)
        if device == "neuron":
            torch.neuron.synchronize()
            s = adaptive_eager.stats()
            steps = (20 + 2) * 50  # warm-up rounds run their iterations too
            benchmark.extra_info.update(mode=mode, launches_per_step=s.launches / steps,
                                        fused_launches_per_step=s.fused_launches / steps)
