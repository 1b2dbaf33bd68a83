"""The engine's phases (Note [Engine phases], adaptive_eager/engine/phase.py): what each op
sees, and that the phase always says what the engine's state holds."""
import random

import torch

import adaptive_eager
from adaptive_eager.engine.phase import Phase
from adaptive_eager.mode import SWITCH


def _consistent(engine) -> bool:
    """The phase is the one the engine's data implies: a match while MATCHING, ops left to skip
    while BACKING_OFF, neither while RECORDING."""
    if engine.phase is Phase.MATCHING:
        return engine.pending is not None
    if engine.phase is Phase.BACKING_OFF:
        return engine.pending is None and engine._backoff > 0
    return engine.pending is None and engine._backoff == 0


def _step(x, w, seen: list):
    engine = SWITCH.adaptive
    y = torch.tanh(x @ w)
    seen.append(engine.phase)
    z = (y * 2.0).sum(dim=0)
    seen.append(engine.phase)
    w.sub_(z.mean() * 0.001)
    seen.append(engine.phase)
    assert _consistent(engine)


def test_a_fresh_engine_records():
    engine = SWITCH.adaptive
    assert engine.phase is Phase.RECORDING and _consistent(engine)


def test_a_repeating_step_is_matched_once_cached_and_recorded_before():
    x, w = torch.randn(8, 8, device="neuron"), torch.randn(8, 8, device="neuron")
    seen = []
    for _ in range(8):
        _step(x, w, seen)
    first, last = seen[:3], seen[-3:]
    assert first == [Phase.RECORDING] * 3  # nothing cached yet: every op runs and is recorded
    assert last[:2] == [Phase.MATCHING] * 2  # the step's trace is being followed
    assert SWITCH.adaptive.pending is None or SWITCH.adaptive.phase is Phase.MATCHING


def test_a_host_read_inside_a_match_launches_the_prefix_and_matching_goes_on():
    x, w = torch.randn(8, 8, device="neuron"), torch.randn(8, 8, device="neuron")
    for _ in range(8):
        _step(x, w, [])
    engine = SWITCH.adaptive
    y = torch.tanh(x @ w)
    assert engine.phase is Phase.MATCHING
    launches = adaptive_eager.stats().launches
    float(y[0, 0])  # a host read mid-trace: a sync point, not the end of the match
    assert adaptive_eager.stats().launches > launches
    assert engine.phase is Phase.MATCHING and _consistent(engine)


def test_an_explicit_synchronize_ends_the_match():
    x, w = torch.randn(8, 8, device="neuron"), torch.randn(8, 8, device="neuron")
    for _ in range(8):
        _step(x, w, [])
    torch.tanh(x @ w)
    assert SWITCH.adaptive.phase is Phase.MATCHING
    torch.neuron.synchronize()
    assert SWITCH.adaptive.phase is Phase.RECORDING and _consistent(SWITCH.adaptive)


def test_a_diverging_op_ends_the_match():
    x, w = torch.randn(8, 8, device="neuron"), torch.randn(8, 8, device="neuron")
    for _ in range(8):
        _step(x, w, [])
    y = torch.tanh(x @ w)
    assert SWITCH.adaptive.phase is Phase.MATCHING
    torch.exp(y)  # not the trace's next op
    assert SWITCH.adaptive.phase is not Phase.MATCHING and _consistent(SWITCH.adaptive)
    assert SWITCH.adaptive.counters.divergences == 1


def test_a_stream_of_new_shapes_backs_off_and_then_records_again():
    engine = SWITCH.adaptive
    rng = random.Random(0)
    ops = (torch.neg, torch.exp, torch.tanh, torch.sigmoid, torch.relu, torch.abs, torch.sin, torch.cos)
    x = torch.ones(2000, device="neuron")
    phases = set()
    for n in range(1, 1500):  # every op a signature never seen, in no order that repeats
        rng.choice(ops)(x[:n])
        phases.add(engine.phase)
        assert _consistent(engine)
    assert Phase.BACKING_OFF in phases
    # Known ops run out the backoff; the engine records again (and, later, finds their loop,
    # matches it and pauses detection: what the engine shows then is the armed route's).
    while engine._backoff:
        torch.ones(3, device="neuron").neg_()
    assert engine.phase is Phase.RECORDING


def test_explain_names_the_phase():
    x, w = torch.randn(8, 8, device="neuron"), torch.randn(8, 8, device="neuron")
    assert "(engine recording)" in str(adaptive_eager.explain()).splitlines()[0]
    for _ in range(8):
        _step(x, w, [])
    torch.tanh(x @ w)
    assert "(engine matching" in str(adaptive_eager.explain()).splitlines()[0]
