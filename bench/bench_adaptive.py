"""Adaptive against eager on the MLP training loop: CPU eager, neuron eager, neuron adaptive
in one benchmark group, so pytest-benchmark compares them in one run.

Compare ratios, not absolute times (shared, noisy machines). Each neuron benchmark attaches
per step: ops, launches, transfers, emulated device µs, peak device memory, and the
launch-overhead setting. The modelled overhead is not spent in wall-clock time here
(NEURON_SPEND_LAUNCH_OVERHEAD=0, the default).

    python -m pytest bench/bench_adaptive.py -q --benchmark-only
"""
import pytest
import torch
import torch.nn.functional as F

import adaptive_eager

TARGETS = ["cpu", "neuron-eager", "neuron-adaptive"]
WARMUP_STEPS = 40  # past trace adoption and the pause of detection
COUNTED_STEPS = 20


def _mlp_step(device: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 10)).to(device)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, 256, device=device)
    y = torch.randint(0, 10, (64,), device=device)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return step


@pytest.mark.benchmark(group="mlp-train: MLP 3x256, batch 64, AdamW, cross-entropy")
@pytest.mark.parametrize("target", TARGETS)
def test_mlp_train_step(benchmark, target):
    device = "cpu" if target == "cpu" else "neuron"
    mode = "adaptive" if target == "neuron-adaptive" else "eager"
    with adaptive_eager.mode(mode):
        step = _mlp_step(device)
        for _ in range(WARMUP_STEPS):
            step()
        benchmark.pedantic(step, rounds=10, iterations=5, warmup_rounds=1)
        if device == "neuron":
            torch.neuron.synchronize()
            adaptive_eager.reset_stats()
            for _ in range(COUNTED_STEPS):
                step()
            torch.neuron.synchronize()
            s = adaptive_eager.stats()
            benchmark.extra_info.update(
                mode=mode,
                ops_per_step=s.ops / COUNTED_STEPS,
                launches_per_step=s.launches / COUNTED_STEPS,
                transfers_per_step=s.transfers / COUNTED_STEPS,
                device_us_per_step=round(s.device_time_us / COUNTED_STEPS, 3),
                peak_device_memory_bytes=s.peak_memory_bytes,
                launch_overhead_us_setting=torch.neuron.get_device_properties(0).launch_overhead_us,
            )


def _never_repeating_steps(device: str, steps: int):
    """An MLP trained on a batch size that changes every step: no exact trace can match."""
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


@pytest.mark.benchmark(group="never-repeating: 400 steps, batch size changes every step")
@pytest.mark.parametrize("target", TARGETS)
def test_never_repeating_stream(benchmark, target):
    """Adaptive mode must degrade to eager: at most 10% above it (issue 3)."""
    device = "cpu" if target == "cpu" else "neuron"
    mode = "adaptive" if target == "neuron-adaptive" else "eager"
    with adaptive_eager.mode(mode):
        adaptive_eager.reset_stats()
        benchmark.pedantic(_never_repeating_steps(device, 400), rounds=1, iterations=1)
        if device == "neuron":
            s = adaptive_eager.stats()
            benchmark.extra_info.update(mode=mode, ops=s.ops, launches=s.launches,
                                        fused_launches=s.fused_launches)
