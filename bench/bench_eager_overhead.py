"""Eager overhead of the emulated `neuron` device against native CPU eager.

One benchmark group per workload, CPU and neuron side by side: compare the ratio, not the
absolute times (the machines are shared and noisy). Each neuron benchmark attaches, per
step (one call of the workload), what the emulated device did: intercepted ops, kernel
launches, transfers, emulated device µs, peak device memory, and the launch-overhead
setting the device time was computed with.

    python -m pytest bench -q --benchmark-only
"""
import pytest
import torch
import torch.nn.functional as F

import adaptive_eager

DEVICES = ["cpu", "neuron"]
COUNTED_STEPS = 10  # steps run once more, untimed, to read the per-step counters


@pytest.fixture(autouse=True)
def _eager_mode():
    """This file measures the eager path: op by op, whatever the default mode is."""
    with adaptive_eager.mode("eager"):
        yield


def _attach_counters(benchmark, device: str, step) -> None:
    """Run `step` COUNTED_STEPS times from zeroed counters and attach the per-step figures."""
    torch.neuron.synchronize()
    adaptive_eager.reset_stats()
    for _ in range(COUNTED_STEPS):
        step()
    torch.neuron.synchronize()
    s = adaptive_eager.stats()
    benchmark.extra_info.update(
        device=device,
        ops_per_step=s.ops / COUNTED_STEPS,
        launches_per_step=s.launches / COUNTED_STEPS,
        transfers_per_step=s.transfers / COUNTED_STEPS,
        device_us_per_step=round(s.device_time_us / COUNTED_STEPS, 3),
        peak_device_memory_bytes=s.peak_memory_bytes,
        launch_overhead_us_setting=torch.neuron.get_device_properties(0).launch_overhead_us,
    )


def _run(benchmark, device, step, *, rounds, iterations):
    benchmark.pedantic(step, rounds=rounds, iterations=iterations, warmup_rounds=2)
    _attach_counters(benchmark, device, step)


# -- small ops: the per-op cost of the eager path -------------------------------------------------

@pytest.mark.benchmark(group="small: x.add_(1), 16 elements")
@pytest.mark.parametrize("device", DEVICES)
def test_add_inplace_16(benchmark, device):
    x = torch.zeros(16, device=device)
    _run(benchmark, device, lambda: x.add_(1), rounds=20, iterations=200)


@pytest.mark.benchmark(group="small: x + 1, 16 elements")
@pytest.mark.parametrize("device", DEVICES)
def test_add_out_of_place_16(benchmark, device):
    x = torch.zeros(16, device=device)
    _run(benchmark, device, lambda: x + 1, rounds=20, iterations=200)


@pytest.mark.benchmark(group="small: torch.mm 16x16")
@pytest.mark.parametrize("device", DEVICES)
def test_mm_16x16(benchmark, device):
    a = torch.randn(16, 16, device=device)
    b = torch.randn(16, 16, device=device)
    _run(benchmark, device, lambda: torch.mm(a, b), rounds=20, iterations=200)


# -- a training step ---------------------------------------------------------------------------------

def _mlp_step(device: str):
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


@pytest.mark.benchmark(group="MLP 3x256, batch 64, AdamW, cross-entropy: training step")
@pytest.mark.parametrize("device", DEVICES)
def test_mlp_training_step(benchmark, device):
    step = _mlp_step(device)
    step()  # create the optimizer state outside the timing
    _run(benchmark, device, step, rounds=10, iterations=5)
