"""Fused launches on the device stream: the launch runs on a worker thread beside the host,
and nothing the user can see differs from a launch on the issuing thread: values, errors,
memory, the RNG, exit and fork (Note [The device stream] in device/csrc/engine/queue.cpp)."""
import gc

import pytest
import torch
import torch.nn.functional as F

import adaptive_eager
from adaptive_eager.device import native, stream
from subproc import run_json
from test_adaptive_semantics import _gather_step

STEPS = 8


@pytest.fixture(autouse=True)
def _adaptive_with_stream():
    previous = adaptive_eager.get_mode()
    adaptive_eager.set_mode("adaptive")
    yield
    stream.set_enabled(True)
    adaptive_eager.set_mode(previous)


def _mlp_loop(mode, use_stream=True, steps=STEPS, threads=None):
    """MLP + AdamW; returns losses, parameters, peak and current device memory, stats."""
    previous_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        stream.set_enabled(use_stream)
        adaptive_eager.set_mode(mode)
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).to("neuron")
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(16, 32, generator=g).to("neuron"), torch.randint(0, 10, (16,), generator=g).to("neuron")
        adaptive_eager.reset_stats()
        losses = []
        for _ in range(steps):
            loss = F.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        params = [p.detach().cpu() for p in net.parameters()]
        result = dict(losses=[l.cpu() for l in losses], params=params, peak=torch.neuron.max_memory_allocated(),
                      allocated=torch.neuron.memory_allocated(), stats=adaptive_eager.stats())
        del net, opt, losses
        return result
    finally:
        torch.set_num_threads(previous_threads)
        stream.set_enabled(True)


def _same(a, b):
    return (all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"]))
            and all(torch.equal(x, y) for x, y in zip(a["params"], b["params"])))


def test_steady_state_launches_run_on_the_stream_with_the_bits_of_the_issuing_thread():
    eager = _mlp_loop("eager")
    on_stream = _mlp_loop("adaptive")
    on_host = _mlp_loop("adaptive", use_stream=False)
    assert on_stream["stats"].stream_launches >= STEPS - 4  # every complete launch after warm-up
    assert on_host["stats"].stream_launches == 0
    assert _same(eager, on_stream) and _same(on_host, on_stream)


def test_memory_accounting_of_stream_launches_equals_the_issuing_threads():
    on_stream, on_host = _mlp_loop("adaptive"), _mlp_loop("adaptive", use_stream=False)
    assert on_stream["stats"].stream_launches > 0
    assert on_stream["peak"] == on_host["peak"]
    assert on_stream["allocated"] == on_host["allocated"]


@pytest.mark.parametrize("threads", [1, 2])
def test_a_stream_launch_splits_work_over_the_issuing_threads_intra_op_threads(threads):
    # A long sum's bits depend on how many threads share it (checked first: else the test
    # could not fail), so the worker must use the issuing thread's count.
    x = torch.randn(1_000_003, generator=torch.Generator().manual_seed(2))
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = x.sum()
        torch.set_num_threads(2)
        two = x.sum()
    finally:
        torch.set_num_threads(previous)
    assert not torch.equal(one, two)

    def run(mode):
        adaptive_eager.set_mode(mode)
        torch.set_num_threads(threads)
        try:
            d = x.to("neuron")
            sums = [(d * (1.0 + i / 8)).sum() for i in range(STEPS)]
            return torch.stack([s.cpu() for s in sums])
        finally:
            torch.set_num_threads(previous)

    before = adaptive_eager.stats().stream_launches
    adaptive, eager = run("adaptive"), run("eager")
    assert adaptive_eager.stats().stream_launches > before
    assert torch.equal(adaptive, eager)


def test_a_deferred_value_read_while_its_launch_runs_waits_for_it():
    # h is carried from step to step: each trace reads the previous launch's output, and
    # the last one is read on the host while its launch may still run.
    def run(mode):
        adaptive_eager.set_mode(mode)
        w = torch.full((64, 64), 0.01).to("neuron")
        h = torch.ones(8, 64).to("neuron")
        history = []
        for _ in range(3 * STEPS):
            h = torch.tanh(h @ w + 0.5)
            history.append(h)
        return torch.stack([t.cpu() for t in history])

    adaptive = run("adaptive")
    stats = adaptive_eager.stats()
    # Each step is matched while the launch that makes its input runs (the matcher takes a
    # value the stream will bring), and the host reads at the end wait for it.
    assert stats.stream_launches > 0 and stats.divergences == 0
    assert torch.equal(adaptive, run("eager"))


def test_an_error_in_a_stream_launch_raises_at_the_next_sync_point_and_later_ops_do_not_run():
    x = torch.arange(12.0).reshape(4, 3).to("neuron")
    good = torch.tensor([0, 3]).to("neuron")
    for _ in range(STEPS):
        _gather_step(x, good)
    before = adaptive_eager.stats(wait=False).stream_launches
    assert before > 0
    bad = torch.tensor([0, 7]).to("neuron")  # same shape and dtype: the trace matches
    y, w = _gather_step(x, bad)
    assert adaptive_eager.stats(wait=False).stream_launches == before + 1  # the failing launch ran there
    with pytest.raises(IndexError, match=r"index_select.*op 2 of 4.*issued at .*test_adaptive_semantics.py:\d+ in _gather_step"):
        w.cpu()
    assert torch.equal(y.cpu(), torch.arange(12.0).reshape(4, 3) * 2)  # the op before it ran
    with pytest.raises(IndexError, match="index_select"):
        w.cpu()  # the value that depended on it carries the same error
    y, w = _gather_step(x, good)  # the device stays usable
    assert torch.equal(w.cpu(), (torch.arange(12.0).reshape(4, 3) * 2)[[0, 3]].add(1).sum(0))


def test_traces_that_draw_random_numbers_stay_on_the_issuing_thread():
    def run(mode):
        adaptive_eager.set_mode(mode)
        torch.manual_seed(3)
        x = torch.ones(64, 64).to("neuron")
        outs = [torch.tanh(F.dropout(x * (1.0 + i), 0.5) + 1).sum() for i in range(STEPS)]
        return torch.stack([o.cpu() for o in outs])

    adaptive = run("adaptive")
    stats = adaptive_eager.stats()
    assert stats.fused_launches > 0 and stats.stream_launches == 0
    assert torch.equal(adaptive, run("eager"))


def test_exit_and_fork_with_a_launch_in_flight_are_clean():
    out = run_json("""
        import os, torch, adaptive_eager
        x = torch.ones(256, 256).to('neuron')
        for i in range(12):
            x = torch.tanh(x @ x * 0.001 + 0.1)
        assert adaptive_eager.stats(wait=False).stream_launches > 0
        pid = os.fork()  # the parent's launch finishes before the fork; the child gets its own worker
        if pid == 0:
            # One intra-op thread, as in a DataLoader worker: with libgomp, a child's first
            # parallel region after the parent ran one hangs (plain CPU torch too).
            torch.set_num_threads(1)
            for i in range(12):
                x = torch.tanh(x @ x * 0.001 + 0.1)
            os._exit(0 if adaptive_eager.stats().stream_launches > 0 and torch.isfinite(x.cpu()).all() else 1)
        _, status = os.waitpid(pid, 0)
        for i in range(12):
            x = torch.tanh(x @ x * 0.001 + 0.1)
        emit({'child': os.waitstatus_to_exitcode(status)})
        # the process exits with this last launch still running on the stream
    """, env={"NEURON_ASYNC_LAUNCH": "1"})
    assert out == {"child": 0}


def test_a_stream_launch_runs_to_the_end_while_the_host_holds_the_gil():
    # With a switch interval of minutes, this thread never hands the GIL over while it polls:
    # a launch that needed the GIL (a tensor with a Python object freed on the worker, say)
    # could not finish.
    import sys
    import time

    from adaptive_eager.mode import SWITCH

    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to("neuron")
    opt = torch.optim.AdamW(net.parameters())
    x = torch.randn(32, 64).to("neuron")
    for _ in range(STEPS):
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
    assert SWITCH.adaptive.inflight  # the last step's launch, submitted just now
    previous = sys.getswitchinterval()
    sys.setswitchinterval(600.0)
    try:
        end = time.monotonic() + 30
        while not native.launch_finished() and time.monotonic() < end:
            pass
        finished = native.launch_finished()
    finally:
        sys.setswitchinterval(previous)
    assert finished


def test_a_step_that_reads_the_last_launchs_output_is_matched_without_waiting_for_it():
    # Token-by-token decoding: each step reads what the previous launch computes. The stream
    # runs launches in order, so queueing the next step's ops need not wait for it (Note [A
    # read of the launch in flight]). The launch is long (a 1024^3 matmul: tens of ms on any
    # CPU) and the host queues one op after submitting it: the launch has not finished then,
    # unless the host waited for it, as it did before.
    def run(mode, probe=None):
        adaptive_eager.set_mode(mode)
        w = torch.full((1024, 1024), 1e-3).to("neuron")
        h = torch.ones(1024, 1024).to("neuron")
        for i in range(2 * STEPS):
            y = h @ w  # reads the output of the launch that may still be running
            if probe is not None and i == 2 * STEPS - 1:
                probe.append((native.launch_in_flight(), native.launch_finished()))
            h = torch.tanh(y + 0.5) * 0.9
        return h.cpu()

    seen = []
    adaptive = run("adaptive", probe=seen)
    in_flight, finished = seen[0]
    assert in_flight and not finished  # the step's first op was queued while its input was being made
    assert adaptive_eager.stats().divergences == 0
    assert torch.equal(adaptive, run("eager"))


def test_a_failed_launchs_error_reaches_the_steps_that_read_its_values():
    def step(h, idx):
        return torch.tanh(h.index_select(0, idx) * 0.5 + 0.1)

    good = torch.tensor([0, 1, 2, 3]).to("neuron")
    h = torch.ones(4, 3).to("neuron")
    for _ in range(STEPS):
        h = step(h, good)
    h = step(h, torch.tensor([0, 1, 2, 7]).to("neuron"))  # fails on the stream
    h = step(h, good)  # matched while that launch runs: it reads a value that never arrives
    # The same error, not a confusing one about a missing input (the launch reading the
    # value fails at its first op, with the first failure as the cause).
    with pytest.raises(IndexError, match=r"index_select.*failed in a deferred launch.*index out of range"):
        h.cpu()
    h = torch.ones(4, 3).to("neuron")  # the device stays usable
    for _ in range(3):
        h = step(h, good)
    expected = torch.ones(4, 3)
    for _ in range(3):
        expected = torch.tanh(expected * 0.5 + 0.1)
    assert torch.equal(h.cpu(), expected)


def test_stats_without_waiting_count_the_launch_on_the_device_stream_as_issued():
    """stats(wait=False) leaves a launch in flight running; it has been issued all the same,
    so its launch and its ops count as they do once it has finished (its device time and
    memory are charged when it ends)."""
    x = torch.ones(256, 256).to("neuron")
    in_flight = 0
    for _ in range(12):
        x = torch.tanh(x @ x * 0.001 + 0.1)
        in_flight += native.launch_in_flight()
        issued = adaptive_eager.stats(wait=False)
        done = adaptive_eager.stats()
        assert (issued.launches, issued.ops) == (done.launches, done.ops)
    assert done.stream_launches > 0
    assert in_flight > 0  # the counts above were read with a launch running


# -- Note [Streamed launches] (device/csrc/engine/queue.cpp): a launch on the stream from its
# first op, running while its trace is still being issued.

def _streamed_loop(streamed, mid_step=None, steps=20):
    """An MLP training loop in adaptive mode, its launches streamed or submitted whole;
    mid_step(i) runs in the middle of each step (between forward and backward)."""
    from adaptive_eager.mode import SWITCH

    SWITCH.adaptive.reset()  # an engine that has seen nothing: each run detects its own traces
    native.set_streamed_launches(streamed)
    gc.collect()  # what earlier tests left must not be freed during the run
    torch.neuron.synchronize()
    torch.neuron.reset_peak_memory_stats()
    base = torch.neuron.memory_allocated()
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10)).to("neuron")
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(16, 32, generator=g).to("neuron"), torch.randint(0, 10, (16,), generator=g).to("neuron")
        adaptive_eager.reset_stats()
        opened, forced = native.streamed_launches(), native.forced_seals()
        losses, per_step, seen_open = [], [], 0
        for i in range(steps):
            # Each step begins with the device idle, so its launch finds room on the stream
            # and streams (Note [Streamed launches]): a device still busy with earlier work (a
            # loaded machine's, or the warm-up's posted ops) has the launch submitted whole,
            # and a run would stream too few to test anything. Not a host sync to the engine.
            native.wait_for_device()
            before = adaptive_eager.stats(wait=False).launches
            loss = F.cross_entropy(net(x), y)
            if mid_step is not None:
                seen_open += native.queue_streamed()
                mid_step(i)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            per_step.append(adaptive_eager.stats(wait=False).launches - before)
        params = [p.detach().cpu() for p in net.parameters()]
        stats = adaptive_eager.stats()
        return dict(losses=[l.cpu() for l in losses], params=params, stats=stats, per_step=per_step,
                    opened=native.streamed_launches() - opened, forced=native.forced_seals() - forced,
                    seen_open=seen_open, peak=torch.neuron.max_memory_allocated() - base)
    finally:
        native.set_streamed_launches(True)


def test_a_streamed_launch_has_the_bits_memory_and_modelled_time_of_one_submitted_whole():
    streamed, whole = _streamed_loop(True), _streamed_loop(False)
    assert streamed["opened"] >= 6 and whole["opened"] == 0  # else the test could not fail
    eager = _mlp_like_eager()
    assert _same(streamed, whole) and _same(streamed, eager)
    # One launch on the clock, priced from its whole on-chip plan either way.
    s, w = streamed["stats"], whole["stats"]
    assert (s.launches, s.ops, s.fused_launches) == (w.launches, w.ops, w.fused_launches)
    assert s.device_time_us == w.device_time_us
    assert streamed["peak"] == whole["peak"] == eager["peak"]
    assert streamed["forced"] == 0


def _mlp_like_eager():
    previous = adaptive_eager.get_mode()
    adaptive_eager.set_mode("eager")
    try:
        return _streamed_loop(True)
    finally:
        adaptive_eager.set_mode(previous)


def test_work_in_the_middle_of_a_streamed_step_neither_waits_for_it_nor_splits_it():
    """A tensor made from host data in the middle of a step (HF code does it for masks and
    ids) is a transfer into bytes only it holds: it runs between the streamed launch's ops.
    Reading the device's counters (stats(), which waits for launches already issued) waits
    for what is ahead of it and launches nothing held back. Either one waiting for the open
    launch would never return; sealing it would split the step."""
    made = []

    def mid_step(i):
        made.append(torch.tensor([float(i), 2.0], device="neuron"))
        adaptive_eager.stats()

    streamed = _streamed_loop(True, mid_step)
    whole = _streamed_loop(False, mid_step)
    assert streamed["seen_open"] >= 6  # the step's launch was open at that point
    assert streamed["per_step"][-4:] == whole["per_step"][-4:] == [1] * 4
    assert streamed["forced"] == 0
    assert _same(streamed, whole)
    assert [t.cpu().tolist() for t in made[:3]] == [[0.0, 2.0], [1.0, 2.0], [2.0, 2.0]]


def test_a_fork_in_the_middle_of_a_streamed_step_launches_it_first_and_the_child_computes():
    out = run_json("""
        import os, torch, adaptive_eager
        from adaptive_eager.device import native
        x = torch.ones(64, 64).to('neuron')
        def step(x):
            return torch.tanh(x @ x * 0.001 + 0.1)
        for i in range(12):
            x = step(x)
            x.sum().item()
        y = x @ x  # the next step's first op: a streamed launch opens
        was_open = native.queue_streamed()
        pid = os.fork()  # launches it first: the child has no executor running it
        if pid == 0:
            torch.set_num_threads(1)
            z = torch.tanh(y * 0.001 + 0.1)
            os._exit(0 if torch.isfinite(z.cpu()).all() else 1)
        _, status = os.waitpid(pid, 0)
        emit({'was_open': was_open, 'child': os.waitstatus_to_exitcode(status),
              'y': torch.equal(y.cpu(), x.cpu() @ x.cpu()), 'forced': native.forced_seals()})
    """, env={"NEURON_ASYNC_LAUNCH": "1"})
    assert out == {"was_open": True, "child": 0, "y": True, "forced": 0}


def test_the_seal_of_a_streamed_launch_waits_for_the_op_running_not_for_the_device_to_catch_up():
    """The host plans a streamed launch at its seal while none of its entries runs (Note
    [Streamed launches]): it waits for the entry running then, and the executor takes no further
    entry until the plan is made. When the executor took its `running` lock again entry after
    entry, the host waited for every published entry (with one intra-op thread, as here: checked
    on the old engine, where each step's launch had finished when its last op returned). Each
    step is 6 matmuls of a few ms and 6 different activations: one launch, the step; after its
    last op returns, the launch is still running."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(512, 512, generator=g) * 0.04).to("neuron")
    x0 = torch.randn(512, 512, generator=g).to("neuron")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        adaptive_eager.reset_stats()
        forced = native.forced_seals()
        still_running = []
        for _ in range(10):
            torch.neuron.synchronize()  # the step's launch finds the stream empty
            x = x0
            for f in (torch.tanh, torch.sigmoid, F.relu, F.gelu, F.silu, F.elu):
                x = f(x @ w)
            still_running.append(not native.launch_finished())
        torch.neuron.synchronize()
        s = adaptive_eager.stats()
    finally:
        torch.set_num_threads(previous_threads)
    assert s.stream_launches >= 6  # the steps were streamed (else the test could not fail)
    assert sum(still_running[-5:]) >= 4, still_running
    assert native.forced_seals() == forced
