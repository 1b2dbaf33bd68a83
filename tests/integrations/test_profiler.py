"""Neuron launches, transfers and sync points show up as named torch.profiler ranges.

Each test profiles real work, exports the chrome trace and checks its `neuron::` ranges
against the counters of the same run: one range per launch (eager: per op; adaptive: per
fused trace), one per transfer, and each launch or transfer carrying its emulated device
time in a nested `neuron::device_time` range (Note [Profiler ranges] in device/profiling.py).
"""
from __future__ import annotations

import re
import threading

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import adaptive_eager
from adaptive_eager.device import profiling
from chrome_trace import read_events

FUSED = re.compile(r"neuron::fused\[trace (\d+), (\d+) ops(?:: (.+) -> (.+))?\]$")


def _profile(fn, tmp_path, **options):
    """Run fn under a CPU profiler; returns (profiler, the neuron:: events of its chrome trace)."""
    options.setdefault("record_shapes", True)  # range arguments are exported only with it
    with profile(activities=[ProfilerActivity.CPU], **options) as prof:
        fn()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = read_events(path)
    return prof, [e for e in events if e.get("ph") == "X" and e.get("name", "").startswith("neuron::")]


def _named(events, prefix):
    return [e for e in events if e["name"].startswith(prefix)]


def _inside(child, parent) -> bool:
    # chrome trace times are µs with 3 decimals: allow the rounding
    return (child["tid"] == parent["tid"] and child["ts"] >= parent["ts"] - 0.01
            and child["ts"] + child["dur"] <= parent["ts"] + parent["dur"] + 0.01)


def _device_times(events, parent):
    """device_us of the device_time ranges nested in parent."""
    return [e["args"]["device_us"] for e in _named(events, profiling.DEVICE_TIME) if _inside(e, parent)]


def _mlp_and_adamw():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(4, 8).to("neuron"), torch.randn(4, 1).to("neuron")

    def step(after_forward=None):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        if after_forward is not None:
            after_forward(loss)
        loss.backward()
        opt.step()
        return loss

    return step


# -- the hot path -------------------------------------------------------------------------------

def test_no_range_is_created_while_no_profiler_runs(monkeypatch):
    made = []
    real = profiling._RecordFunctionFast
    monkeypatch.setattr(profiling, "_RecordFunctionFast", lambda *a: made.append(a[0]) or real(*a))
    step = _mlp_and_adamw()
    for _ in range(6):
        loss = step()
    loss.item()
    with adaptive_eager.mode("eager"):
        step().item()
    assert adaptive_eager.stats().fused_launches > 0  # both kinds of launch did run
    assert made == []


# -- eager launches -----------------------------------------------------------------------------

def test_eager_mode_shows_one_range_per_launch_named_by_op(tmp_path):
    a = torch.randn(4, 8).to("neuron")
    w = torch.randn(8, 3).to("neuron")
    b = torch.randn(3).to("neuron")
    adaptive_eager.reset_stats()
    with adaptive_eager.mode("eager"):
        _, events = _profile(lambda: torch.addmm(b, a, w).relu_(), tmp_path)
    names = [e["name"] for e in events if e["name"].startswith("neuron::aten::")]
    assert names == ["neuron::aten::addmm", "neuron::aten::relu_"]
    assert len(names) == adaptive_eager.stats().launches


def test_every_launch_and_transfer_carries_its_device_time(tmp_path):
    step = _mlp_and_adamw()

    def run():
        for _ in range(6):
            loss = step()
        loss.item()

    adaptive_eager.reset_stats()
    _, events = _profile(run, tmp_path)
    s = adaptive_eager.stats()
    launches = _named(events, "neuron::aten::") + _named(events, "neuron::fused[")
    transfers = _named(events, "neuron::transfer[")
    assert (len(launches), len(transfers)) == (s.launches, s.transfers)
    for r in launches + transfers:
        times = _device_times(events, r)
        assert len(times) == 1 and times[0] > 0, (r["name"], times)
    assert _named(events, "neuron::fused[") and _named(events, "neuron::sync[")
    marks = _named(events, profiling.DEVICE_TIME)
    assert len(marks) == s.launches + s.transfers
    assert sum(m["args"]["device_us"] for m in marks) == pytest.approx(s.device_time_us)


def test_eager_training_loop_shows_per_op_ranges_transfers_and_no_fused_launch(tmp_path):
    step = _mlp_and_adamw()

    def run():
        for _ in range(3):
            loss = step()
        loss.item()

    with adaptive_eager.mode("eager"):
        before = adaptive_eager.stats()
        prof, events = _profile(run, tmp_path)
        after = adaptive_eager.stats()
    ops = _named(events, "neuron::aten::")
    assert len(ops) == after.launches - before.launches > 3 * 20
    names = {e["name"] for e in ops}
    assert {"neuron::aten::addmm", "neuron::aten::mse_loss_backward", "neuron::aten::_foreach_sqrt"} <= names
    assert _named(events, "neuron::fused[") == [] and _named(events, "neuron::sync[") == []
    assert [e["name"] for e in _named(events, "neuron::transfer[")] == ["neuron::transfer[device->host]"]
    table = prof.key_averages().table(row_limit=-1)
    assert "neuron::aten::addmm" in table and "neuron::transfer[device->host]" in table


def test_factory_launches_in_eager_mode_are_ranges_too(tmp_path):
    with adaptive_eager.mode("eager"):
        _, events = _profile(lambda: torch.ones(3, device="neuron"), tmp_path)
    # torch's own composite (empty + fill_): fill_ is the launch.
    (r,) = _named(events, "neuron::aten::fill_")
    assert len(_device_times(events, r)) == 1


# -- fused launches -----------------------------------------------------------------------------

def test_training_loop_trace_shows_fused_launches_with_op_counts(tmp_path):
    step = _mlp_and_adamw()
    for _ in range(6):  # warm up: the step is detected and cached as a trace
        step()

    def run():
        for _ in range(3):
            loss = step()
        loss.item()

    # No reset_stats() here: it synchronizes, which would end the match mid-step.
    before = adaptive_eager.stats()
    prof, events = _profile(run, tmp_path)
    after = adaptive_eager.stats()
    fused = _named(events, "neuron::fused[")
    assert len(fused) == after.fused_launches - before.fused_launches >= 3
    counts = [int(FUSED.match(e["name"]).group(2)) for e in fused]
    assert sum(counts) == after.fused_ops - before.fused_ops
    assert all(e["args"]["ops"] == n for e, n in zip(fused, counts))
    assert _named(events, "neuron::aten::") == []  # everything ran fused
    table = prof.key_averages().table(row_limit=-1)
    assert fused[0]["name"][:40] in table  # the table truncates long names


def test_the_fused_op_count_matches_the_cached_trace(tmp_path):
    step = _mlp_and_adamw()
    for _ in range(6):
        step()
    (trace,) = _engine().cache.values()
    _, events = _profile(step, tmp_path)
    full = [FUSED.match(e["name"]).groups()[:2] for e in _named(events, "neuron::fused[")]
    assert (str(trace.id), str(len(trace))) in full


def _engine():
    from adaptive_eager.mode import SWITCH
    return SWITCH.adaptive


def test_fused_range_names_carry_first_and_last_source_lines_when_asked(tmp_path):
    step = _mlp_and_adamw()
    for _ in range(6):
        step()
    previous = profiling.set_profiler_sources(True)
    try:
        _, events = _profile(step, tmp_path)
    finally:
        profiling.set_profiler_sources(previous)
    (trace,) = _engine().cache.values()
    names = [FUSED.match(e["name"]) for e in _named(events, "neuron::fused[")]
    full = [m for m in names if m.group(2) == str(len(trace))]
    assert full, [m.group(0) for m in names]
    first, last = full[0].group(3), full[0].group(4)
    assert (first, last) == (trace.sources[0], trace.sources[-1])
    # The last op is the step's, or a backward op (a trace cut elsewhere), which the autograd
    # engine issued, with no Python caller.
    assert "test_profiler.py" in first and ("test_profiler.py" in last or last == "(autograd engine)")


def test_with_stack_puts_source_lines_in_fused_range_names(tmp_path):
    step = _mlp_and_adamw()
    for _ in range(6):
        step()
    _, plain = _profile(step, tmp_path)
    _, stacked = _profile(step, tmp_path, with_stack=True)
    assert all(FUSED.match(e["name"]).group(3) is None for e in _named(plain, "neuron::fused["))
    sourced = [FUSED.match(e["name"]).group(3) for e in _named(stacked, "neuron::fused[")]
    assert sourced and all("test_profiler.py:" in s for s in sourced)


def _gather_step(x, idx):
    y = x * 2
    z = y.index_select(0, idx)
    w = z + 1
    return y, w.sum(0)


def test_a_failed_fused_launch_is_a_range_charging_the_ops_before_the_failure(tmp_path):
    x = torch.arange(12.0).reshape(4, 3).to("neuron")
    good, bad = torch.tensor([0, 3]).to("neuron"), torch.tensor([0, 7]).to("neuron")
    for _ in range(6):
        _gather_step(x, good)

    def run():
        y, w = _gather_step(x, bad)  # the trace matches; index_select fails in the launch
        with pytest.raises(IndexError, match="index_select"):
            w.cpu()

    _, events = _profile(run, tmp_path)
    (launch,) = _named(events, "neuron::fused[")
    assert FUSED.match(launch["name"]).group(2) == "4"  # mul, index_select, add, sum were pending
    (mark,) = [e for e in _named(events, profiling.DEVICE_TIME) if _inside(e, launch)]
    assert mark["args"]["ops"] == 1 and mark["args"]["device_us"] > 0  # only mul ran


# -- transfers and sync points ------------------------------------------------------------------

def test_transfers_are_ranges_named_by_direction(tmp_path):
    def run():
        x = torch.arange(6.0).to("neuron")
        x.to("neuron:1")
        x.cpu()
        x.sum().item()

    _, events = _profile(run, tmp_path)
    names = [e["name"] for e in _named(events, "neuron::transfer[")]
    assert names == ["neuron::transfer[host->device]", "neuron::transfer[device->device]",
                     "neuron::transfer[device->host]", "neuron::transfer[device->host]"]
    assert [e["args"]["bytes"] for e in _named(events, profiling.DEVICE_TIME)
            if any(_inside(e, t) for t in _named(events, "neuron::transfer["))] == [24, 24, 24, 4]


def test_sync_points_are_ranges_with_their_reason_and_the_launch_they_forced(tmp_path):
    step = _mlp_and_adamw()
    for _ in range(6):
        step()
    trace_len = len(next(iter(_engine().cache.values())))

    def run():  # a sync after the forward, in the middle of the cached trace
        step(lambda loss: loss.item())
        step(lambda loss: torch.neuron.synchronize())

    _, events = _profile(run, tmp_path)
    syncs = {e["name"]: e for e in _named(events, "neuron::sync[")}
    assert sorted(syncs) == ["neuron::sync[aten._local_scalar_dense.default]", "neuron::sync[synchronize]"]
    for sync in syncs.values():
        # Each sync finds the trace's ops issued so far pending, and launches them inside its
        # own range.
        pending = sync["args"]["pending_ops"]
        assert 0 < pending < trace_len
        launched = [e for e in _named(events, "neuron::fused[") if _inside(e, sync)]
        assert [int(FUSED.match(e["name"]).group(2)) for e in launched] == [pending]


def test_a_sync_in_the_middle_of_a_trace_launches_the_prefix_inside_its_range(tmp_path):
    x = torch.zeros(16, device="neuron")

    def body():
        for _ in range(20):
            x.add_(1)
            x.mul_(0.5)
            x.sub_(0.25)

    for _ in range(4):
        body()

    def run():
        x.add_(1)
        x.mul_(0.5)
        print_value = repr(x)  # a host read mid-trace
        return print_value

    _, events = _profile(run, tmp_path)
    # repr's first device op (its abs) is not the trace's next op: the divergence is the sync
    # point, and the two ops matched so far launch inside its range.
    sync = _named(events, "neuron::sync[")[0]
    assert sync["name"] == "neuron::sync[divergence]"
    assert sync["args"]["pending_ops"] == 2
    (prefix,) = [e for e in _named(events, "neuron::fused[") if _inside(e, sync)]
    assert FUSED.match(prefix["name"]).group(2) == "2"


# -- threads ------------------------------------------------------------------------------------

def test_ranges_appear_on_autograd_backward_thread_in_eager_mode(tmp_path):
    model = nn.Linear(8, 4).to("neuron")
    x = torch.randn(2, 8).to("neuron")
    main = threading.get_native_id()

    def run():
        model(x).sum().backward()

    with adaptive_eager.mode("eager"):
        _, events = _profile(run, tmp_path)
    backward_tids = {e["tid"] for e in _named(events, "neuron::aten::")} - {main}
    assert backward_tids, "no neuron range on a thread other than the caller's"
    on_backward = [e for e in _named(events, "neuron::aten::") if e["tid"] in backward_tids]
    assert any(e["name"] == "neuron::aten::mm" for e in on_backward)
    for r in on_backward:
        assert len(_device_times(events, r)) == 1
