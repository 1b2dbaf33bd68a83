"""Streams and events on neuron (device/csrc/runtime/streams.cpp, Note [One queue per device]): the
CUDA-style API that FSDP2, DCP and overlap schedules use, on the emulated clock."""
from __future__ import annotations

import threading

import pytest
import torch

import adaptive_eager

NEURON = torch.device("neuron:0")


@pytest.fixture(params=["eager", "adaptive"])
def mode(request):
    previous = adaptive_eager.get_mode()
    adaptive_eager.set_mode(request.param)
    yield request.param
    adaptive_eager.set_mode(previous)


def test_streams_exist_with_a_current_and_a_default_one_per_device():
    # torch.neuron.Stream was missing: FSDP2's first forward failed on it.
    default = torch.neuron.default_stream()
    assert torch.neuron.current_stream() == default and default.stream_id == 0
    s = torch.neuron.Stream()
    assert s.device == NEURON and s != default
    assert torch.Stream(device="neuron") != s  # torch's own constructor gets a new stream too
    assert torch.neuron.Stream("neuron:1").device == torch.device("neuron:1")
    with torch.neuron.stream(s):
        assert torch.neuron.current_stream() == s == torch.accelerator.current_stream()
    assert torch.neuron.current_stream() == default


def test_the_current_stream_is_per_thread_as_on_cuda():
    s = torch.neuron.Stream()
    seen = []
    with torch.neuron.stream(s):
        t = threading.Thread(target=lambda: seen.append(torch.neuron.current_stream()))
        t.start()
        t.join()
        assert torch.neuron.current_stream() == s
    assert seen == [torch.neuron.default_stream()]


def test_a_stream_context_on_another_device_switches_the_device_for_the_block():
    s = torch.neuron.Stream("neuron:1")
    with torch.neuron.stream(s):
        assert torch.neuron.current_device() == 1
        assert torch.ones(1, device="neuron").device == torch.device("neuron:1")
    assert torch.neuron.current_device() == 0


def test_elapsed_time_is_the_modelled_device_time_between_the_records(mode):
    # "Backend doesn't support elapsedTime" before. In adaptive mode the ops held back before
    # the second record are run first, so they count.
    x = torch.randn(64, 64, device="neuron")
    start, end = torch.neuron.Event(enable_timing=True), torch.Event(device="neuron", enable_timing=True)
    start.record()
    before = adaptive_eager.stats().device_time_us
    for _ in range(5):
        x = (x @ x).tanh()
    end.record()
    spent_us = adaptive_eager.stats().device_time_us - before
    assert spent_us > 0
    assert start.elapsed_time(end) == pytest.approx(spent_us / 1000.0, rel=1e-9)
    end.synchronize()  # "Backend doesn't support synchronizing events" before
    assert end.query() and torch.neuron.current_stream().query()


def test_recording_a_timing_event_does_not_wait_for_the_device():
    # As on CUDA: record() enqueues the clock's reading behind the work issued before it and
    # returns; elapsed_time waits for both. It synchronized the device before.
    from adaptive_eager.device import native

    with adaptive_eager.mode("eager"):
        a = torch.randn(1536, 1536, device="neuron")
        (a @ a).sum().cpu()  # learns the ops' plans: later calls are posted
        start, end = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
        before = adaptive_eager.stats().device_time_us
        start.record()
        y = (a @ a) @ a
        end.record()
        assert not native.device_idle()  # the matmuls (tens of ms each on this CPU) still run
        spent_us = adaptive_eager.stats().device_time_us - before
        assert start.elapsed_time(end) == pytest.approx(spent_us / 1000.0, rel=1e-9)
        del y


def test_work_on_another_stream_is_ordered_and_gives_the_same_values(mode):
    x = torch.arange(16.0, device="neuron")
    side = torch.neuron.Stream()
    side.wait_stream(torch.neuron.current_stream())
    with torch.neuron.stream(side):
        y = x * 3
        done = side.record_event()
    torch.neuron.current_stream().wait_event(done)
    z = y + 1
    side.synchronize()
    torch.accelerator.synchronize()
    assert torch.equal(z.cpu(), torch.arange(16.0) * 3 + 1)


def test_torch_accelerator_synchronize_runs_what_the_engine_holds_back():
    adaptive_eager.set_mode("adaptive")
    try:
        x = torch.ones(8, device="neuron")
        for _ in range(6):  # a repeating step: the engine holds the ops of the later ones back
            x = x * 1.5 + 1
        torch.accelerator.synchronize()  # C++: the device guard's synchronizeDevice
        assert adaptive_eager.stats(wait=False).kernel_ops == adaptive_eager.stats(wait=False).ops
    finally:
        adaptive_eager.set_mode("eager")


def test_elapsed_time_needs_two_recorded_timing_events():
    a, b = torch.neuron.Event(), torch.neuron.Event()
    a.record()
    b.record()
    # ValueError, as torch.cuda.Event raises in torch 2.13 (c10/cuda/CUDAEvent.h's elapsed_time
    # checks both with TORCH_CHECK_VALUE; issue 37, item 11 saw an older release's RuntimeError).
    # torch.Event checks timing and records itself (c10::InlineEvent, TORCH_CHECK_VALUE) before
    # the device is asked, and torch.neuron.Event must be a torch.Event: torch.Stream's
    # record_event and elapsed_time accept no subclass, and neuron's streams are torch.Streams.
    with pytest.raises(ValueError, match="enable_timing=True"):  # torch checks this one itself
        a.elapsed_time(b)
    c, d = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    c.record()
    with pytest.raises(ValueError, match="recorded"):
        c.elapsed_time(d)


def test_record_stream_accepts_a_stream_of_the_tensors_device_and_names_a_wrong_one():
    # FSDP1's post-backward calls it on every gradient; the host fallback once ran it on CPU,
    # which has no kernel for it.
    x = torch.ones(4, device="neuron:0")
    x.record_stream(torch.neuron.Stream(device="neuron:0"))
    x.record_stream(torch.neuron.current_stream(0))
    with pytest.raises(RuntimeError, match="record_stream: the stream is on neuron:1 but the tensor is on neuron:0"):
        x.record_stream(torch.neuron.Stream(device="neuron:1"))
