"""The period detector's cost per op against the length of the repeating step.

Issue 15: the detector must cost the same per op whatever the step's length. Each benchmark
pushes three steps' worth of keys of a synthetic training step (an embedding, L identical
layers of 40 ops, a head, an optimizer) into a fresh detector and reports µs per op; the
groups' ratios, not absolute times, are what to compare (noisy, shared machines).

    python -m pytest bench/bench_detector.py -q --benchmark-only
"""
import pytest

from adaptive_eager.engine.config import EngineConfig
from adaptive_eager.engine.detector import PeriodDetector

LAYER_OPS = 40


def _step_keys(ops: int) -> list[int]:
    """About `ops` keys shaped as a deep model's step: unique ops around identical layers."""
    layers = max(1, (ops - 60) // LAYER_OPS)
    head = list(range(10_000, 10_020))
    layer = [i % 25 for i in range(LAYER_OPS)]  # few distinct keys, each many times a step
    tail = list(range(20_000, 20_040))
    return head + layer * layers + tail


@pytest.mark.parametrize("step_ops", [500, 5_000, 20_000])
def test_detector_cost_per_op(benchmark, step_ops):
    cfg = EngineConfig()
    keys = _step_keys(step_ops) * 3
    fired = []

    def run():
        detector = PeriodDetector(cfg.min_trace_len_between_syncs, cfg.max_period, cfg.repeats,
                                  unit_min=cfg.min_trace_len)
        fired.clear()
        for k in keys:
            p = detector.push(k)
            if p is not None:
                fired.append(p)

    benchmark.group = "detector: cost per op by step length"
    benchmark.pedantic(run, rounds=3, iterations=1)
    period = len(keys) // 3
    assert period in fired, f"the step ({period} ops) never fired: {sorted(set(fired))[-5:]}"
    benchmark.extra_info.update(step_ops=period, us_per_op=benchmark.stats.stats.min * 1e6 / len(keys))
