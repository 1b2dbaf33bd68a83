"""Long runs hold steady (issue 13's holding cases): many adaptive steps leave host and device
memory flat and the parameters bit for bit eager's; a batch size that never settles keeps
the trace cache at its cap. CI runs a short form; the long one by hand:

    NEURON_SOAK_STEPS=20000 python -m pytest -q tests/engine/test_soak.py
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

import adaptive_eager
from subproc import run_json

STEPS = int(os.environ.get("NEURON_SOAK_STEPS", "1500"))
MiB = 1 << 20


# The child imports this module, and it imports the helpers of tests/ (subproc).
_TEST_PATH = os.pathsep.join([os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__))])


def _rss() -> int:
    with open("/proc/self/statm") as f:  # resident pages now (ru_maxrss never goes down)
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _train(mode: str, steps: int, batch_of=lambda step: 16, on_step=None):
    with adaptive_eager.mode(mode):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).to("neuron")
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(300, 32, generator=g), torch.randint(0, 10, (300,), generator=g)) for _ in range(8)]
        losses = []
        for step in range(steps):
            x, y = data[step % len(data)]
            n = batch_of(step)
            loss = F.cross_entropy(net(x[:n].to("neuron")), y[:n].to("neuron"))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 10 == 0:
                losses.append(loss.item())
            if on_step is not None:
                on_step(step)
        torch.neuron.synchronize()
        return losses, [p.detach().cpu() for p in net.parameters()]


def test_a_long_adaptive_run_keeps_memory_flat_and_eagers_bits():
    marks = {}

    def measure(step):
        if step in (STEPS // 5, STEPS - 1):
            torch.neuron.synchronize()
            marks[step] = (_rss(), torch.neuron.memory_allocated())

    adaptive = _train("adaptive", STEPS, on_step=measure)
    eager = _train("eager", STEPS)
    assert adaptive[0] == eager[0]
    assert all(torch.equal(a, b) for a, b in zip(adaptive[1], eager[1]))
    (rss_early, dev_early), (rss_late, dev_late) = marks[STEPS // 5], marks[STEPS - 1]
    assert dev_late == dev_early  # every step frees what it made
    assert rss_late - rss_early < 32 * MiB, f"host memory grew {(rss_late - rss_early) / MiB:.1f} MiB"
    assert adaptive_eager.stats().fused_launches > 0


def test_a_batch_size_that_never_settles_keeps_the_trace_cache_at_its_cap():
    # 300 batch sizes, each for six steps (long enough to be cached as a trace): more exact
    # traces than a cache of 64 holds, so it must evict, stay at its cap, and keep eager's
    # bits. (Shape-generic traces off: one of them would serve every batch size.)
    out = run_json("""
        import torch, test_soak
        from adaptive_eager.mode import SWITCH
        batch_of = lambda step: 1 + (step // 6) % 300
        adaptive = test_soak._train("adaptive", 1800, batch_of)
        cached = len(SWITCH.adaptive.cache)
        eager = test_soak._train("eager", 1800, batch_of)
        emit({"cached": cached, "cap": SWITCH.adaptive.cache.maxsize, "losses": adaptive[0] == eager[0],
              "params": all(torch.equal(a, b) for a, b in zip(adaptive[1], eager[1]))})
    """, env={"NEURON_TRACE_CACHE_SIZE": "64", "NEURON_GENERIC_TRACES": "0", "PYTHONPATH": _TEST_PATH})
    assert out == {"cached": 64, "cap": 64, "losses": True, "params": True}
