"""torch.profiler with the device's activity shows a neuron device track on the modelled clock.

`profile(activities=[ProfilerActivity.CPU, ProfilerActivity.NEURON])` exports, beside the host's
threads, one track per neuron device (Note [The device timeline], device/csrc/runtime/
device_timeline.cpp): each launch at its modelled time (what the clock charged; not before
the host issued it, not before the launch ahead of it ended), each op of a fused launch a
slice inside it with the user's source line, a flow from the host's `neuron::launch` to the
device slice, and each device op linked to the torch op that issued it. The checks read the
exported chrome trace as Perfetto would: complete slices, flows paired by id, nesting by time.
"""
from __future__ import annotations

import os
from collections import defaultdict

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import adaptive_eager
from chrome_trace import read_events

NEURON = ProfilerActivity.NEURON  # torch's PrivateUse1 activity, named for the backend
# The trace's times are µs with three decimals: a nanosecond of rounding per edge, and a
# double's error on that nanosecond (times are read relative to the trace's first: read_events).
NS = 1e-3 + 1e-9


def _trace(fn, tmp_path, activities=(ProfilerActivity.CPU, NEURON)):
    with profile(activities=list(activities)) as prof:
        fn()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    return prof, read_events(path)


def _device_slices(events, device=0):
    """The device track's complete slices, in time order."""
    return sorted((e for e in events if e.get("ph") == "X" and e.get("pid") == device
                   and e.get("cat") in ("kernel", "gpu_user_annotation", "gpu_memcpy")), key=lambda e: e["ts"])


def _host_launches(events):
    return [e for e in events if e.get("ph") == "X" and e.get("name") in ("neuron::launch", "neuron::transfer")
            and e.get("pid") == os.getpid()]


def _flows(events):
    """ac2g flow events by id: {id: {"s": event, "f": event}}."""
    flows = defaultdict(dict)
    for e in events:
        if e.get("cat") == "ac2g" and e.get("ph") in ("s", "f"):
            assert e["ph"] not in flows[e["id"]], f"flow id {e['id']} used twice"
            flows[e["id"]][e["ph"]] = e
    return flows


def _within(child, parent) -> bool:
    return parent["ts"] - NS <= child["ts"] and child["ts"] + child["dur"] <= parent["ts"] + parent["dur"] + NS


def _mlp_and_adamw():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(4, 8).to("neuron"), torch.randn(4, 1).to("neuron")

    def step():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


# -- eager launches -----------------------------------------------------------------------------

def test_each_eager_launch_is_a_device_slice_of_its_modelled_time_after_its_issue(tmp_path):
    a, w, b = (torch.randn(*s).to("neuron") for s in ((64, 32), (32, 48), (48,)))
    torch.neuron.synchronize()
    before = adaptive_eager.stats()
    with adaptive_eager.mode("eager"):
        _, events = _trace(lambda: torch.addmm(b, a, w).relu_().sum().item(), tmp_path)
    after = adaptive_eager.stats()
    kernels = [e for e in _device_slices(events) if e["cat"] == "kernel"]
    assert [e["name"] for e in kernels] == ["aten::addmm", "aten::relu_", "aten::sum"]
    assert len(kernels) == after.launches - before.launches
    # Each slice lasts what the clock charged, overhead included, and the charges add up.
    assert all(e["dur"] == pytest.approx(e["args"]["device_us"], abs=NS) for e in kernels)
    device = [e for e in _device_slices(events) if e["cat"] in ("kernel", "gpu_memcpy")]
    assert sum(e["args"]["device_us"] for e in device) == pytest.approx(after.device_time_us - before.device_time_us)
    # One queue: no slice starts before the one ahead of it ends, nor before the host issued it.
    for ahead, behind in zip(device, device[1:]):
        assert behind["ts"] >= ahead["ts"] + ahead["dur"] - NS
    flows = _flows(events)
    hosts = {e["ts"]: e for e in _host_launches(events)}
    for k in kernels:
        (flow,) = [f for f in flows.values() if "f" in f and f["f"]["pid"] == 0 and abs(f["f"]["ts"] - k["ts"]) <= NS]
        start = flow["s"]
        assert start["pid"] == os.getpid() and start["ts"] in hosts  # from the host's neuron::launch
        assert k["ts"] >= start["ts"] - NS


def test_an_eager_device_op_is_linked_to_the_torch_op_that_issued_it(tmp_path):
    a, w = torch.randn(16, 16).to("neuron"), torch.randn(16, 16).to("neuron")
    with adaptive_eager.mode("eager"):
        prof, events = _trace(lambda: torch.mm(a, w).cpu(), tmp_path)
    (mm,) = [e for e in _device_slices(events) if e["name"] == "aten::mm"]
    host_ops = [e for e in events if e.get("cat") == "cpu_op" and e["name"] == "aten::mm"]
    assert [e["args"]["External id"] for e in host_ops] == [mm["args"]["External id"]]
    # so the profiler's own table gives the op its modelled device time (the device's own row
    # beside it, as CUDA's kernels have theirs)
    rows = {r.device_type.name: r for r in prof.key_averages() if r.key == "aten::mm"}
    assert rows["CPU"].device_time_total == pytest.approx(mm["dur"], abs=0.01)
    assert rows["NEURON"].self_device_time_total == pytest.approx(mm["dur"], abs=0.01)


def test_an_eager_op_carries_the_users_source_line(tmp_path):
    x = torch.randn(8).to("neuron")
    with adaptive_eager.mode("eager"):
        _, events = _trace(lambda: torch.tanh(x).cpu(), tmp_path)  # this line
    (tanh,) = [e for e in _device_slices(events) if e["name"] == "aten::tanh"]
    assert tanh["args"]["source"].startswith(f"{__file__}:")
    assert "in <lambda>" in tanh["args"]["source"]


def test_transfers_are_memcpy_slices_carrying_their_bytes(tmp_path):
    host = torch.randn(256)
    _, events = _trace(lambda: host.to("neuron").cpu(), tmp_path)
    copies = [e for e in _device_slices(events) if e["cat"] == "gpu_memcpy"]
    assert [e["args"]["bytes"] for e in copies] == [1024, 1024]
    assert all(e["dur"] > 0 for e in copies)


# -- fused launches -----------------------------------------------------------------------------

def test_each_op_of_a_fused_launch_is_a_slice_inside_it_with_its_source_line(tmp_path):
    step = _mlp_and_adamw()
    for _ in range(6):  # the step is detected and cached as a trace
        step()
    torch.neuron.synchronize()  # every launch of the trace below is issued while it records

    def run():
        for _ in range(2):
            loss = step()
        loss.item()

    before = adaptive_eager.stats()
    _, events = _trace(run, tmp_path)
    after = adaptive_eager.stats()
    slices = _device_slices(events)
    launches = [e for e in slices if e["cat"] == "gpu_user_annotation"]
    assert launches and all(e["name"].startswith("neuron::fused[trace ") for e in launches)
    assert len(launches) == after.fused_launches - before.fused_launches
    kernels = [e for e in slices if e["cat"] == "kernel"]
    ops = [e for e in kernels if e["name"] != "launch overhead"]
    assert len(ops) == after.ops - before.ops  # every op the launches ran, none twice
    for launch in launches:
        overhead, *inside = [e for e in kernels if _within(e, launch)]
        assert len(inside) == launch["args"]["ops"]
        # the launch is its overhead, then its ops back to back: its kernels add up to it
        assert overhead["name"] == "launch overhead" and overhead["ts"] == pytest.approx(launch["ts"], abs=NS)
        assert overhead["args"]["device_us"] == launch["args"]["overhead_us"]
        assert sum(e["args"]["device_us"] for e in [overhead, *inside]) == pytest.approx(launch["args"]["device_us"])
        for a, b in zip([overhead, *inside], inside):
            assert b["ts"] == pytest.approx(a["ts"] + a["dur"], abs=NS)
    # and so the device's kernels add up to the clock's time
    assert sum(e["args"]["device_us"] for e in kernels) == pytest.approx(
        after.device_time_us - before.device_time_us - sum(e["args"]["device_us"] for e in slices if e["cat"] == "gpu_memcpy"))
    # Forward and optimizer ops were issued from this file (nn and optim are torch's: the
    # innermost frame that is the user's); backward ops by autograd's thread, with no Python caller.
    sources = [e["args"].get("source") for e in ops]
    here = [s for s in sources if s is not None]
    assert here and all(s.startswith(f"{__file__}:") for s in here)
    assert {s.split(" in ")[1] for s in here} == {"step"}
    lines = {int(s.split(":")[-1].split(" ")[0]) for s in here}
    assert len(lines) >= 3  # zero_grad, the forward, opt.step: each op its own line


def test_the_fused_launches_host_side_is_linked_to_the_engines_range(tmp_path):
    step = _mlp_and_adamw()
    for _ in range(6):
        step()
    torch.neuron.synchronize()  # every launch of the trace below is issued while it records
    _, events = _trace(lambda: step().item(), tmp_path)
    launches = [e for e in _device_slices(events) if e["cat"] == "gpu_user_annotation"]
    assert launches
    flows = _flows(events)
    ranges = {e["args"]["External id"]: e for e in events
              if e.get("ph") == "X" and e.get("name", "").startswith("neuron::fused[") and e.get("pid") == os.getpid()}
    for launch in launches:
        (flow,) = [f for f in flows.values() if "f" in f and f["f"]["pid"] == 0 and abs(f["f"]["ts"] - launch["ts"]) <= NS]
        (host,) = [e for e in _host_launches(events) if e["ts"] == flow["s"]["ts"] and e["tid"] == flow["s"]["tid"]]
        fused_range = ranges[host["args"]["External id"]]
        assert fused_range["name"] == launch["name"]
        assert _within(host, fused_range)


# -- what the trace holds ---------------------------------------------------------------------

def test_a_cpu_only_profile_has_no_device_track(tmp_path):
    x = torch.randn(8).to("neuron")
    with adaptive_eager.mode("eager"):
        _, events = _trace(lambda: torch.tanh(x).cpu(), tmp_path, activities=(ProfilerActivity.CPU,))
    assert _device_slices(events) == [] and _host_launches(events) == []


def test_the_trace_is_well_formed_for_perfetto(tmp_path):
    """What Perfetto's JSON importer needs: every complete slice has a start and a duration,
    every flow has its start and its end, in order, each bound to a slice on its track, and the
    device's process and track are named."""
    step = _mlp_and_adamw()
    for _ in range(3):
        step()
    with adaptive_eager.mode("eager"):
        _mlp_and_adamw()()
    _, events = _trace(lambda: step().item(), tmp_path)
    complete = [e for e in events if e.get("ph") == "X"]
    assert all(isinstance(e["ts"], (int, float)) and e["dur"] >= 0 for e in complete)
    by_track = defaultdict(list)
    for e in complete:
        by_track[(e["pid"], e["tid"])].append(e)
    flows = _flows(events)
    assert flows
    for flow in flows.values():
        assert set(flow) == {"s", "f"} and flow["s"]["ts"] <= flow["f"]["ts"] + NS
        for end in flow.values():
            assert any(s["ts"] - NS <= end["ts"] <= s["ts"] + s["dur"] + NS for s in by_track[(end["pid"], end["tid"])])
    names = {(e["pid"], e["name"]): e["args"] for e in events if e.get("ph") == "M"}
    assert names[(0, "process_name")]["name"] == "neuron:0"
    assert "neuron:0 queue" in names[(0, "thread_name")]["name"]
    # slices on the device track nest or follow one another, never overlap partly
    track = sorted(by_track[(0, 0)], key=lambda e: (e["ts"], -e["dur"]))
    for a, b in zip(track, track[1:]):
        assert b["ts"] >= a["ts"] + a["dur"] - NS or _within(b, a)
