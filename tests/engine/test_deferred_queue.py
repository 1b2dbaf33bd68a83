"""Adaptive mode on native neuron tensors: the engine defers ops into the C++ queue
(Note [Deferred launches], device/csrc/engine/queue.cpp). These pin what the queue itself must get
right; test_adaptive*.py and test_training.py run whole loops in this process too (among them
the transformer step that fuses only because queued arguments count no references: Note
[Queued arguments count no references])."""
from __future__ import annotations

import pytest
import torch

import adaptive_eager

NEURON = torch.device("neuron")



@pytest.fixture(autouse=True)
def _restore_mode():
    previous = adaptive_eager.get_mode()
    yield
    adaptive_eager.set_mode(previous)


def test_a_deferred_in_place_op_writes_the_storage_it_was_issued_on_not_a_later_data():
    # A launched kernel holds its arguments' memory: `p.data = other` after the issue must not
    # redirect an update still queued (the queue captures the storage, not the Python tensor).
    def run(mode):
        adaptive_eager.set_mode(mode)
        p = torch.zeros(4, device=NEURON)
        q = torch.zeros(4, device=NEURON)
        swapped = []
        for i in range(10):
            p.add_(1.0)
            p.mul_(2.0)
            p.sub_(0.5)
            p.div_(1.5)
            held, p.data = p.data, q.data if i == 8 else p.data  # swap once, with ops queued
            swapped.append(held)
        return p.cpu(), q.cpu(), swapped[-1].cpu()

    assert all(torch.equal(a, b) for a, b in zip(run("eager"), run("adaptive")))


def test_an_intermediate_nobody_holds_is_freed_once_its_readers_ran():
    # Deferred outputs get bytes when their op runs and lose them when the last holder (a user
    # tensor or a queued reader) lets go: after a fused step, only what the user keeps is held.
    x = torch.randn(256, 256, device=NEURON)

    def step():
        y = x.exp().mul(2).tanh().add(1)  # three intermediates, only y kept
        return y.sum()

    adaptive_eager.set_mode("adaptive")
    for _ in range(12):
        step()
    torch.neuron.synchronize()
    held = torch.neuron.memory_allocated()
    s = step()
    torch.neuron.synchronize()
    assert torch.neuron.memory_allocated() == held + s.untyped_storage().nbytes()


def test_a_value_read_on_the_host_before_its_launch_waits_for_it():
    adaptive_eager.set_mode("adaptive")
    x = torch.arange(8.0, device=NEURON)
    for _ in range(12):
        y = (x * 3).add(1).neg().abs()
    y = (x * 3).add(1).neg().abs()  # deferred: its bytes do not exist yet
    assert torch.equal(y.cpu(), torch.arange(8.0) * 3 + 1)
    assert y.data_ptr() != 0


def test_a_host_copy_into_bytes_a_queued_op_reads_waits_for_that_op():
    # The queue's capture of `a` is not a reference to a's storage object (Note [Queued arguments
    # count no references]): the copy must still see that a queued op reads a's bytes.
    def run(mode):
        adaptive_eager.set_mode(mode)
        a = torch.ones(4, device=NEURON)
        for _ in range(12):
            (a * 2).add(1).mul(3).sub(1)
        b = a * 2  # the cached trace's first op: queued
        a.copy_(torch.full((4,), 7.0))  # a host write in the middle of the trace
        return b.cpu(), a.cpu()

    eager, adaptive = run("eager"), run("adaptive")
    assert torch.equal(eager[0], torch.full((4,), 2.0)) and all(torch.equal(x, y) for x, y in zip(eager, adaptive))


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_python_numbers_passed_as_tensors_keep_their_value_and_type_when_ops_share_them(mode):
    # Note [Wrapped numbers are shared]: one queued tensor per (dtype, value) of a Python
    # number. 2 and 2.0 differ by type (an int tensor + 2 stays int, + 2.0 becomes float),
    # 0.0 and -0.0 by their bits, and a number seen again after many others (the table
    # refills) is still itself.
    def program(device):
        i = torch.arange(6, device=device)
        f = torch.linspace(-1, 1, 6, device=device)
        out = []
        for step in range(14):
            out += [i + 2, i + 2.0, i * 3, f * -0.0, f * 0.0, f + 0.1, f.mul(2)]
            for k in range(160):  # more distinct numbers than the table holds across the steps
                f = f + (k * 1e-3 + step)
            f = f / 1000
            out.append(i.remainder(4))
        return [t.cpu() for t in out]

    adaptive_eager.set_mode(mode)
    cpu, neuron = program("cpu"), program(NEURON)
    assert all(a.dtype == b.dtype and torch.equal(a, b) and torch.equal(a.signbit(), b.signbit())
               for a, b in zip(cpu, neuron))
    assert neuron[0].dtype == torch.int64 and neuron[1].dtype == torch.float32


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_python_numbers_beside_tensors_of_each_dtype_give_cpus_bits(mode):
    # Note [Wrapped numbers are shared]: a number converted by the kernel to the op's dtype as
    # CPU converts it: ints float32 rounds, bools, floats float32 rounds, float64, half and
    # bfloat16 (whose kernels read the number at opmath precision), a mask beside it, int ops,
    # step after step (adaptive: in fused launches).
    def program(device):
        f = torch.linspace(-3, 3, 7, device=device)
        d = f.double()
        h, b = f.half(), f.bfloat16()
        i = torch.arange(7, device=device)
        out = []
        for step in range(6):
            out += [f + (2**40 + 1), f * True, f - 0.1, f / 3, f.remainder(7), f < 2**24 + 1, f.abs().pow(2.5), f ** 2,
                    d + 0.1, d * (2**60 + 1), h + 0.1, b * 1.1, i + 3, i * 2.5, torch.where(f > 0, f, 0.5)]
            f = f.add(0.3)
            f.mul_(0.999)
        return [t.cpu() for t in out]

    adaptive_eager.set_mode(mode)
    cpu, neuron = program("cpu"), program(NEURON)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(cpu, neuron))


def test_a_deferred_outputs_data_ptr_mid_step_is_its_own_and_the_step_keeps_eagers_values():
    # Note [A deferred output's bytes exist at issue]: in a matched trace the outputs are
    # deferred; each has its own address from issue, which asking for launches nothing.
    from adaptive_eager.device import native

    adaptive_eager.set_mode("adaptive")
    native.set_streamed_launches(False)  # submitted whole: c cannot have run when it is looked at
    try:
        x = torch.arange(6.0, device=NEURON)
        for i in range(10):
            a = x + i
            b = a * 2
            c = b - 3
            if i == 9:
                assert not native.has_bytes(c)  # matched: deferred, not made
                addresses = {a.data_ptr(), b.data_ptr(), c.data_ptr()}
                assert 0 not in addresses and len(addresses) == 3
                assert not native.has_bytes(c)  # no sync point: still queued
            d = c / 4
    finally:
        native.set_streamed_launches(True)
    assert torch.equal(d.cpu(), ((torch.arange(6.0) + 9) * 2 - 3) / 4)
    assert torch.equal(c.cpu(), (torch.arange(6.0) + 9) * 2 - 3)
    assert adaptive_eager.stats().fused_launches > 0


def test_an_op_the_engine_records_is_posted_as_eager_mode_posts_it_not_waited_for():
    # Note [Recorded ops are posted]: recording, the engine ran each op while the host waited.
    from adaptive_eager.device import native

    adaptive_eager.set_mode("adaptive")
    x = torch.arange(6.0, device=NEURON)
    x.mul(3).add(1).neg()  # their first calls run while the host waits: they teach the plans
    torch.neuron.synchronize()
    native.sleep_on_device(0.3)
    posted, _ = native.eager_issue_counts()
    y = x.mul(3).add(1).neg()
    assert not native.device_idle()  # none waited for the device
    assert native.eager_issue_counts()[0] == posted + 3
    assert torch.equal(y.cpu(), -(torch.arange(6.0) * 3 + 1))


def test_an_op_recorded_while_a_launch_is_on_the_stream_does_not_wait_for_the_launch():
    # The engine drained the stream before it recorded an op, from when recorded ops ran while
    # the host waited; posted now (Note [Recorded ops are posted]), they queue behind it, as
    # eager mode's ops do, and the host goes on.
    from adaptive_eager.device import native

    adaptive_eager.set_mode("adaptive")
    x = torch.arange(6.0, device=NEURON)
    x.sub(5)  # its first call runs while the host waits: it teaches the plan
    for _ in range(30):  # two units are cached as one trace, replayed as one launch on the stream
        y = x.mul(3).add(1).neg()
    torch.neuron.synchronize()
    native.sleep_on_device(0.3)
    for _ in range(2):
        y = x.mul(3).add(1).neg()
    assert native.launches_in_flight() == 1  # on the stream, behind the sleep
    z = x.sub(5)  # in no trace: recorded
    assert native.launches_in_flight() == 1 and not native.device_idle()  # nothing waited for the launch
    assert torch.equal(z.cpu(), torch.arange(6.0) - 5)
    assert torch.equal(y.cpu(), -(torch.arange(6.0) * 3 + 1))


def test_a_recorded_ops_error_raises_at_the_next_sync_naming_the_op():
    adaptive_eager.set_mode("adaptive")
    table = torch.arange(12.0, device=NEURON).reshape(4, 3)
    torch.index_select(table, 0, torch.tensor([0, 3], device=NEURON))  # learns its plan: the next call is posted
    torch.neuron.synchronize()
    out = torch.index_select(table, 0, torch.tensor([0, 7], device=NEURON))  # no error at the call
    with pytest.raises(IndexError, match=r"index out of range[\s\S]*aten::index_select"):
        torch.neuron.synchronize()
    with pytest.raises(IndexError, match=r"index out of range"):
        out.cpu()  # its output was never made
    torch.neuron.synchronize()  # raised once: the next sync is clean
