"""Armed matching (Note [Armed matching] in device/csrc/engine/route.cpp): once detection has
paused, the route matches a cached trace's next ops in C++ and queues them with no Python
call. The results must stay eager's bit for bit, a divergence must be found at the same op
with the same explanation, and a host read mid-trace must see the ops issued before it."""
import pytest
import torch

import adaptive_eager
from adaptive_eager.device import native
from adaptive_eager.mode import SWITCH

OPS = 32
STEPS = 80  # 2,560 ops: past the 1,024 in completed traces after which detection pauses


@pytest.fixture(autouse=True)
def _adaptive_mode():
    previous = adaptive_eager.get_mode()
    adaptive_eager.set_mode("adaptive")
    yield
    torch.neuron.synchronize()
    adaptive_eager.set_mode(previous)


@pytest.fixture(params=[True, False], ids=["native", "python"])
def native_match(request):
    config = SWITCH.adaptive.config
    previous = config.native_match
    config.native_match = request.param
    yield request.param
    config.native_match = previous


def _chain(device="neuron"):
    """OPS in-place adds on tensors of distinct sizes: one trace of OPS ops per step."""
    xs = [torch.zeros(16 + i, device=device) for i in range(OPS)]
    ones = [torch.ones(16 + i, device=device) for i in range(OPS)]
    return xs, ones


def _step(xs, ones, s):
    for i in range(OPS):
        xs[i].add_(ones[i], alpha=0.5 + 0.01 * s)  # a lifted float, new every step


def test_a_steady_trace_is_matched_in_cpp_with_its_floats_bound_per_call():
    xs, ones = _chain()
    for s in range(STEPS):
        _step(xs, ones, s)
    before, counted = native.armed_matches(), adaptive_eager.stats()
    for s in range(STEPS, STEPS + 10):
        _step(xs, ones, s)
    # Every op, each trace's last and first too: the route completes the trace, submits it to
    # the device stream and goes on into the next step's (Note [Armed rounds]); the engine
    # counts those completions when it next looks (here: stats()).
    assert native.armed_matches() - before == 10 * OPS - 1  # stats() above handed the next op to the engine
    after = adaptive_eager.stats()
    assert after.trace_hits - counted.trace_hits == 10 and after.stream_launches - counted.stream_launches == 10
    assert after.fused_ops - counted.fused_ops == 10 * OPS and after.divergences == counted.divergences
    cpu, cpu_ones = _chain("cpu")
    for s in range(STEPS + 10):
        _step(cpu, cpu_ones, s)
    assert all(torch.equal(x.cpu(), c) for x, c in zip(xs, cpu))


def _chain_until_armed():
    """The chain's steps, op by op while detection finds the step's unit, up to the first step
    the route matched in C++ (Note [Armed matching while detecting]): its tensors, and the
    next step's number."""
    xs, ones = _chain()
    s, first = 0, native.armed_matches()
    while native.armed_matches() == first:
        _step(xs, ones, s)
        s += 1
        assert s < 20, "the 32-op step was never matched in C++"
    return xs, ones, s


def test_before_detection_pauses_a_matched_trace_is_matched_in_cpp_and_detection_sees_every_op():
    """Note [Armed matching while detecting]: before detection pauses, a trace's ops after the
    first are matched in C++ (warm-up pays no Python per op), and detection's history still
    gets every one of them, in order, at the engine's next entry."""
    engine = SWITCH.adaptive
    xs, ones, s = _chain_until_armed()
    assert adaptive_eager.stats().trace_hits >= 1 and not engine.detection_paused
    before, position = native.armed_matches(), engine.position
    for _ in range(2):
        _step(xs, ones, s)
        s += 1
    engine.catch_up()
    assert not engine.detection_paused  # still before the first pause
    # Each step's first op starts the match in the engine, its last completes it there.
    assert native.armed_matches() - before == 2 * (OPS - 2)
    assert engine.position - position == 2 * OPS
    assert [e[0] for e in list(engine.history)[-2 * OPS:]] == list(range(position, position + 2 * OPS))
    cpu, cpu_ones = _chain("cpu")
    for c in range(s):
        _step(cpu, cpu_ones, c)
    assert all(torch.equal(x.cpu(), c) for x, c in zip(xs, cpu))


def test_before_detection_pauses_a_trace_is_matched_in_cpp_from_its_second_match():
    """Note [Detection fed by the route]: the route pushes each op it matches to the period
    detectors itself, so it is armed as soon as a trace is known (its first match, in Python,
    takes each position's source line), not only once detection has found nothing new for a
    few trace lengths: the step after the one that completed the trace first has all its ops
    but the first (which starts the match) and the last (which completes it) matched in C++,
    and the history still holds every position once, in order."""
    engine = SWITCH.adaptive
    engine.reset()
    xs, ones = _chain()
    start = engine.position
    s = 0
    while engine.counters.trace_hits == 0:
        _step(xs, ones, s)
        engine.catch_up()
        s += 1
        assert s < 8, "the 32-op step was never cached"
    hits, before = engine.counters.trace_hits, native.armed_matches()
    _step(xs, ones, s)
    engine.catch_up()
    assert engine.counters.trace_hits - hits == 1 and not engine.detection_paused
    assert native.armed_matches() - before == OPS - 2
    positions = [e[0] for e in engine.history if e[0] >= start]
    assert positions == list(range(start, engine.position))
    cpu, cpu_ones = _chain("cpu")
    for c in range(s + 1):
        _step(cpu, cpu_ones, c)
    assert all(torch.equal(x.cpu(), c) for x, c in zip(xs, cpu))


def test_a_quiet_pause_that_begins_at_an_op_the_route_matched_leaves_detection_as_matching_op_by_op_does():
    """Note [Detection fed by the route]: where the engine's count of ops with nothing new
    reaches its limit at an op the route matched, the route stops after it, so detection pauses
    there (Note [Detection that finds nothing pauses]) and no later op reaches the detectors,
    exactly as when the engine matches each op itself."""
    def pause_mid_step(native):
        engine = SWITCH.adaptive
        engine.config.native_match = native
        try:
            engine.reset()
            xs, ones = _chain()
            for s in range(4):  # the step's trace is cached and matched (in C++ with native)
                _step(xs, ones, s)
            engine.catch_up()
            assert engine.counters.trace_hits >= 1 and not engine.detection_paused
            # Ten more ops with nothing found pause it: at the step's 10th op (its first starts the match).
            engine._max_pause_after = engine._fruitless_limit
            engine._fruitless = engine._fruitless_limit - 10
            _step(xs, ones, 4)
            engine.catch_up()
            return (engine.counters.quiet_pauses, engine._quiet_until, engine.position, engine.detector.kept_keys(),
                    engine.shape_detector.kept_keys(), engine.shape_detector.live_runs(), len(engine.history))
        finally:
            engine.config.native_match = True
            engine.reset()

    native, python = pause_mid_step(True), pause_mid_step(False)
    assert native[0] == 1
    assert native == python


def _two_kinds_of_layers(device):
    """Three 6-op tanh layers, then three 5-op sigmoid layers: each kind's trace is found inside
    the first step, the whole step's while the route matches layers in C++."""
    torch.manual_seed(0)
    ws = [torch.randn(16, 16).to(device) for _ in range(6)]
    x = torch.randn(8, 16).to(device)

    def step():
        h = x
        for i, w in enumerate(ws):
            h = torch.tanh(h @ w) * 0.5 + 0.1 if i < 3 else torch.sigmoid(h @ w) - 0.5
            h = h * h - 0.2
        return h
    return step


def test_a_unit_found_while_the_route_matches_is_adopted_where_matching_op_by_op_adopts_it(native_match):
    """Note [Detection fed by the route]: a period that fires on keys the route pushed stops
    it after that op, so the engine adopts the longer unit and enters it at the same op as
    when it matches each op itself: the same launches, step by step (here the step's period
    fires at a layer's op the route matched: taking no notice of it left 11 launches a step),
    and eager's bits."""
    def launches_per_step():
        step, outs, launches = _two_kinds_of_layers("neuron"), [], []
        SWITCH.adaptive.reset()
        for _ in range(12):
            before = adaptive_eager.stats(wait=False).launches  # no sync: the stream runs on
            outs.append(step())
            launches.append(adaptive_eager.stats(wait=False).launches - before)
        return [o.cpu() for o in outs], launches

    outs, launches = launches_per_step()
    assert launches[-4:] == [1] * 4  # the whole step: one launch
    config = SWITCH.adaptive.config
    config.native_match = not native_match
    try:
        _, other = launches_per_step()
    finally:
        config.native_match = native_match
    assert launches == other
    cpu_step = _two_kinds_of_layers("cpu")
    assert all(torch.equal(o, cpu_step()) for o in outs)


def test_an_interrupt_while_detection_is_given_the_armed_ops_feeds_none_twice(monkeypatch):
    """Note [Armed matching while detecting], Note [Interrupted issue]: a KeyboardInterrupt
    right after one op went into the history, before the feed moved on, is raised by the op
    that made the engine catch up (it never runs, as an interrupted op in eager mode); the
    next entry feeds the rest, and the history holds each position once."""
    engine = SWITCH.adaptive
    xs, ones, s = _chain_until_armed()
    real, calls = engine._advance, [0]

    def advance(proto, producers, pushed=None):
        position = real(proto, producers, pushed)
        calls[0] += 1
        if calls[0] == 5:  # inside the feed: the route matched this step's ops 1-30 in C++
            raise KeyboardInterrupt
        return position
    monkeypatch.setattr(engine, "_advance", advance)
    with pytest.raises(KeyboardInterrupt):
        _step(xs, ones, s)
    monkeypatch.setattr(engine, "_advance", real)
    skipped = (s, OPS - 1)  # the step's last op raised: it never ran
    for s in range(s + 1, s + 4):
        _step(xs, ones, s)
    engine.catch_up()
    positions = [e[0] for e in engine.history]
    assert positions == sorted(set(positions))
    cpu, cpu_ones = _chain("cpu")
    for c in range(s + 1):
        for i in range(OPS):
            if (c, i) != skipped:
                cpu[i].add_(cpu_ones[i], alpha=0.5 + 0.01 * c)
    assert all(torch.equal(x.cpu(), c) for x, c in zip(xs, cpu))


def test_a_divergence_while_armed_is_found_at_the_same_op_and_explained_the_same(native_match):
    xs, ones = _chain()
    for s in range(STEPS):
        _step(xs, ones, s)
    for i in range(OPS):
        if i == 17:
            xs[i].mul_(ones[i])  # the op that differs
        else:
            xs[i].add_(ones[i], alpha=0.5)
    torch.neuron.synchronize()
    last = adaptive_eager.explain().recent_divergences[-1]
    assert "expected aten.add_.Tensor, got aten.mul_.Tensor" in last
    assert "test_native_matching.py" in last


def test_a_host_read_mid_trace_sees_the_ops_issued_before_it(native_match):
    xs, ones = _chain()
    cpu, cpu_ones = _chain("cpu")
    for s in range(STEPS):
        _step(xs, ones, s)
        _step(cpu, cpu_ones, s)
    for i in range(OPS):
        xs[i].add_(ones[i], alpha=0.25)
        cpu[i].add_(cpu_ones[i], alpha=0.25)
        if i == 12:
            assert xs[5].sum().item() == cpu[5].sum().item()
    assert all(torch.equal(x.cpu(), c) for x, c in zip(xs, cpu))


def test_a_training_loop_with_backward_on_autograds_thread_keeps_eagers_bits(native_match):
    def train(mode):
        with adaptive_eager.mode(mode):
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to("neuron")
            opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
            x, y = torch.randn(8, 16).to("neuron"), torch.randint(0, 4, (8,)).to("neuron")
            before = native.armed_matches()
            for _ in range(90):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(net(x), y).backward()
                opt.step()
            return [p.detach().cpu() for p in net.parameters()], native.armed_matches() - before

    eager, _ = train("eager")
    adaptive, armed = train("adaptive")
    assert (armed > 0) is native_match
    assert all(torch.equal(a, e) for a, e in zip(adaptive, eager))


def test_a_launch_that_fails_between_armed_rounds_raises_at_the_host_read_after_it(native_match):
    """Note [Armed syncs]: a host read between two rounds is taken by the route unless a
    launch failed; then the engine takes it and raises the error naming the trace's op."""
    def step(h, idx):
        return torch.tanh(h.index_select(0, idx) * 0.5 + 0.1)

    good = torch.tensor([0, 1, 2, 3]).to("neuron")
    h = torch.ones(4, 3).to("neuron")
    expected = torch.ones(4, 3)
    before = native.armed_matches()
    for _ in range(300):  # 4 ops a step and a host read: detection pauses after 1,024 ops
        h = step(h, good)
        expected = torch.tanh(expected * 0.5 + 0.1)
        assert h[1, 1].item() == expected[1, 1].item()
    assert (native.armed_matches() - before > 0) is native_match
    h = step(h, torch.tensor([0, 1, 2, 7]).to("neuron"))
    with pytest.raises(IndexError, match=r"index_select.*failed in a deferred launch.*index out of range"):
        h[1, 1].item()
    h = torch.ones(4, 3).to("neuron")  # the device stays usable
    assert torch.equal(step(h, good).cpu(), torch.tanh(torch.ones(4, 3) * 0.5 + 0.1))


# -- shape-generic traces (Note [Generic guards] in device/csrc/engine/guards.cpp) -----------------
def _growing_cache_loop(device, tokens, on_token=lambda t: None, other_dim_at=None, read_each_token=False):
    """A KV cache grown by torch.cat a row per token, read by a matmul: a shape-generic trace
    per token. From token `other_dim_at` on, softmax takes another dimension (an int that was
    constant in the repetitions recorded). read_each_token: the host reads a value of each
    token's (as generate() reads its stopping criteria); the values read are returned too."""
    torch.manual_seed(0)
    w = torch.randn(8, 8).to(device)
    cache = torch.zeros(1, 8, device=device)
    out, reads = [], []
    for t in range(tokens):
        q = torch.full((1, 8), 0.01 * (t % 7), device=device)
        row = (q @ w).tanh()
        cache = torch.cat([cache, row])
        dim = 1 if other_dim_at is not None and t >= other_dim_at else 0
        out.append((cache @ q.T).softmax(dim).sum(0))
        if read_each_token:
            reads.append(row[0, 3].item())
        on_token(t)
    return (torch.cat(out).cpu(), reads) if read_each_token else torch.cat(out).cpu()


def _steadiest_generic_trace():
    traces = [t for starts in SWITCH.adaptive.cache.by_first_op.values() for t in starts if t.generic]
    return max(traces, key=lambda t: t.hits)


@pytest.mark.parametrize("read_each_token", [False, True], ids=["no-read", "host-read-per-token"])
def test_a_steady_shape_generic_trace_is_matched_in_cpp_with_its_sizes_bound_per_token(native_match, read_each_token):
    armed = {}
    adaptive = _growing_cache_loop("neuron", 300, lambda t: armed.setdefault(t, native.armed_matches()),
                                   read_each_token=read_each_token)
    trace = _steadiest_generic_trace()
    cpu = _growing_cache_loop("cpu", 300, read_each_token=read_each_token)
    if read_each_token:
        assert adaptive[1] == cpu[1]
        adaptive, cpu = adaptive[0], cpu[0]
    assert torch.equal(adaptive, cpu)
    per_token = [armed[t + 1] - armed[t] for t in range(250, 299)]
    # Once detection pauses, every op of every token is matched in C++, its first and last
    # too (Note [Armed rounds]), and the host read between two tokens is taken there as well
    # (Note [Armed syncs]): the engine is not called at all.
    assert per_token == ([len(trace)] * len(per_token) if native_match else [0] * len(per_token))
    # The sizes of the rounds completed in C++ are noted as the engine's completions note
    # them (Trace.note_sizes): a cache that grows every token never repeats its sizes, so no
    # exact trace is made from the generic one (Note [An exact proto from a generic position]).
    assert not trace.sizes_repeat
    assert len(set(trace.recent_sizes)) == len(trace.recent_sizes) == trace.recent_sizes.maxlen


def test_a_generic_divergence_while_armed_is_found_at_the_same_op_and_explained_the_same(native_match):
    adaptive = _growing_cache_loop("neuron", 300, other_dim_at=290)
    assert torch.equal(adaptive, _growing_cache_loop("cpu", 300, other_dim_at=290))
    divergences = "\n".join(adaptive_eager.explain().recent_divergences)
    assert ("aten._softmax.default with argument 1: expected 0 (the same in both repetitions recorded), got 1 "
            "at tests/engine/test_native_matching.py") in divergences, divergences
