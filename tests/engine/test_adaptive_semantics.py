"""Engine semantics that a training loop does not exercise: deferred errors, blocking
launches, sync points mid-trace, the RNG order, snapshots of host data, threads."""
import threading

import pytest
import torch

import adaptive_eager
from adaptive_eager.engine import executor as engine
from adaptive_eager.mode import SWITCH
from subproc import run_json

STEPS = 6  # enough repetitions for a trace to be adopted and replayed


@pytest.fixture(autouse=True)
def _adaptive_mode():
    previous = adaptive_eager.get_mode()
    adaptive_eager.set_mode("adaptive")
    yield
    adaptive_eager.set_mode(previous)


def _gather_step(x, idx):
    y = x * 2
    z = y.index_select(0, idx)
    w = z + 1
    return y, w.sum(0)


def test_an_error_in_a_deferred_launch_raises_at_the_next_sync_point_with_the_op_name():
    x = torch.arange(12.0).reshape(4, 3).to("neuron")
    good = torch.tensor([0, 3]).to("neuron")
    for _ in range(STEPS):
        _gather_step(x, good)
    assert adaptive_eager.stats().fused_launches > 0
    bad = torch.tensor([0, 7]).to("neuron")  # same shape and dtype: the trace matches
    y, w = _gather_step(x, bad)
    with pytest.raises(IndexError, match=r"index_select.*issued at .*test_adaptive_semantics.py:\d+ in _gather_step"):
        w.cpu()
    # Every op before the failing one ran; the value that depended on it raises the same error.
    assert torch.equal(y.cpu(), torch.arange(12.0).reshape(4, 3) * 2)
    with pytest.raises(IndexError, match="index_select"):
        w.cpu()
    # The device stays usable: the next step gives the right answer.
    y, w = _gather_step(x, good)
    assert torch.equal(w.cpu(), (torch.arange(12.0).reshape(4, 3) * 2)[[0, 3]].add(1).sum(0))


def test_launch_blocking_raises_at_the_call_site():
    out = run_json("""
        import torch, adaptive_eager
        x = torch.arange(12.0).reshape(4, 3).to('neuron')
        for i in range(8):
            idx = torch.tensor([0, 3 if i < 7 else 9]).to('neuron')
            try:
                z = x.index_select(0, idx) * 2
            except IndexError as e:
                emit({'step': i, 'fused': adaptive_eager.stats().fused_launches})
                break
    """, env={"NEURON_LAUNCH_BLOCKING": "1"})
    assert out == {"step": 7, "fused": 0}


def test_a_host_read_mid_trace_launches_the_prefix_and_matching_continues():
    x = torch.ones(8).to("neuron")
    seen = []

    def step(i):
        a = x * 3
        b = a + 1
        if i >= STEPS:
            seen.append(b.cpu().sum().item())  # a read in the middle of the (cached) trace
        c = b * b
        return c.mean()

    for i in range(STEPS):
        step(i)
    adaptive_eager.reset_stats()
    results = [step(STEPS + i) for i in range(3)]
    assert [r.item() for r in results] == [16.0] * 3 and seen == [32.0] * 3
    s = adaptive_eager.stats()
    assert s.divergences == 0 and s.fused_launches >= 3


def test_random_ops_draw_in_stream_order_in_both_modes():
    def run(mode):
        adaptive_eager.set_mode(mode)
        torch.manual_seed(7)
        x = torch.ones(64).to("neuron")
        outs = []
        for i in range(STEPS + 2):
            y = torch.nn.functional.dropout(x, 0.5) + torch.rand_like(x)
            if i == STEPS:
                y = y + torch.randn(64, device="neuron")  # a random factory between deferred ops
            outs.append(y.sum())
        return [o.item() for o in outs], torch.get_rng_state()

    eager, adaptive = run("eager"), run("adaptive")
    assert eager[0] == adaptive[0]
    assert torch.equal(eager[1], adaptive[1])


# Note [Deferred random ops draw at issue]: neuron's random ops draw from torch's default CPU
# generator, as TorchNeuron's do, so the host's own draws between them must keep their place.
def _dropout_step_with_host_draws(device: str, steps: int = STEPS + 3):
    torch.manual_seed(11)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(32, 4)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    launches, host_draws = [], []
    for _ in range(steps):
        before = adaptive_eager.stats().launches
        x = torch.randn(8, 16).to(device)  # a host draw before the step's device draws
        h = model(x)
        y = torch.randn(8, 4)  # a host draw after dropout's mask was issued, before it runs
        noise = torch.rand(8, 4, device=device).bernoulli_(0.5)
        loss = ((h + noise + y.to(device)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        host_draws.append(y)
        if device != "cpu":
            torch.neuron.synchronize()
            launches.append(adaptive_eager.stats().launches - before)
    return [p.detach().cpu() for p in model.parameters()], host_draws, torch.get_rng_state(), launches


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_a_dropout_model_trains_as_on_cpu_with_host_draws_between_its_device_draws(mode):
    adaptive_eager.set_mode(mode)
    cpu = _dropout_step_with_host_draws("cpu")
    neuron = _dropout_step_with_host_draws("neuron")
    assert all(torch.equal(a, b) for a, b in zip(cpu[0], neuron[0])), "parameters differ from CPU's"
    assert all(torch.equal(a, b) for a, b in zip(cpu[1], neuron[1])), "a host draw got other numbers"
    assert torch.equal(cpu[2], neuron[2]), "the CPU generator ended elsewhere"
    if mode == "adaptive":  # its random ops were deferred, not run at issue: one launch a step
        assert neuron[3][-3:] == [1, 1, 1]


def test_a_random_op_whose_draws_depend_on_values_runs_at_issue_in_order():
    # multinomial's CPU kernel draws as its probabilities say: it cannot draw ahead on scratch
    # tensors, so the engine runs it at issue (a barrier), keeping its place among host draws.
    def run(device):
        torch.manual_seed(5)
        w = torch.rand(4, 6).to(device)
        outs = []
        for _ in range(STEPS + 2):
            p = (w * 2).softmax(-1)
            picked = torch.multinomial(p, 3)
            host = torch.rand(2)
            noise = torch.empty_like(w).uniform_()
            outs.append((picked.cpu(), host, noise.cpu()))
        return outs, torch.get_rng_state()

    cpu, neuron = run("cpu"), run("neuron")
    assert all(torch.equal(a, b) for x, y in zip(cpu[0], neuron[0]) for a, b in zip(x, y))
    assert torch.equal(cpu[1], neuron[1])


def test_host_to_device_copy_snapshots_the_host_data_when_issued():
    host = torch.zeros(4)
    outs = []
    for i in range(STEPS + 2):
        host.fill_(i)
        d = host.to("neuron") * 2 + 1
        host.fill_(-100)  # after the copy was issued: must not leak into the deferred ops
        outs.append(d)
    assert [o.cpu()[0].item() for o in outs] == [2.0 * i + 1 for i in range(STEPS + 2)]


def test_ops_from_two_threads_are_correct():
    errors = []

    def work(seed):
        try:
            x = torch.full((16,), float(seed)).to("neuron")
            for _ in range(20):
                x = x * 1.0 + 1.0
            assert x.cpu().eq(seed + 20).all()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in (1, 100)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_explain_names_where_a_trace_starts_and_where_a_divergence_happened():
    x = torch.ones(8).to("neuron")
    for i in range(STEPS + 1):
        y = x * 2
        y = y + 1 if i < STEPS else y - 1  # the last step diverges here
        y = y.sigmoid()
        y = y.exp()
    torch.neuron.synchronize()
    report = adaptive_eager.explain()
    ours = [t for t in report.traces if t.starts_at and "test_adaptive_semantics.py" in t.starts_at]
    assert ours and "test_explain_names_where" in ours[-1].starts_at
    assert "test_adaptive_semantics.py" in report.recent_divergences[-1]
    assert "expected aten.add.Tensor, got aten.sub.Tensor" in report.recent_divergences[-1]


def test_explain_names_the_argument_that_differed_when_the_op_is_the_same():
    # It said "expected aten.sum.dim_IntList, got aten.sum.dim_IntList": the op, never what differed.
    x = torch.ones(4, 4).to("neuron")
    for i in range(STEPS + 1):
        y = x * 2
        y = y.sum(0 if i < STEPS else 1)
        y = y.sigmoid()
        y = y.exp()
    torch.neuron.synchronize()
    last = adaptive_eager.explain().recent_divergences[-1]
    assert "aten.sum.dim_IntList with argument 1: expected [0], got [1] at " in last, last


def test_signature_difference_names_the_first_argument_or_keyword_that_differs():
    from adaptive_eager.engine.record import OpRecord, signature_difference
    a = torch.ones(2, 3).to("neuron")

    def sig(*args, **kwargs):
        return OpRecord.from_call(torch.ops.aten.sum.dim_IntList, args, kwargs).signature
    assert signature_difference(sig(a, [0]), sig(a, [0])) == ""
    assert signature_difference(sig(a, [0]), sig(a, [1])) == "argument 1: expected [0], got [1]"
    assert signature_difference(sig(a, [0]), sig(a, [0], True)) == "expected 2 arguments, got 3"
    assert signature_difference(sig(a, [0]), sig(a, [0], dtype=torch.float64)) == \
        "expected dtype=(not given), got dtype=torch.float64"
    assert signature_difference(sig(a, [0]), sig(a.t(), [0])) == \
        "argument 0: expected f32[2, 3] neuron:0, got f32[3, 2]{stride=(1, 3)} neuron:0"


def test_a_repeating_phase_after_ops_that_never_repeat_is_fused():
    w = torch.ones(4).to("neuron")

    def step(n):
        x = torch.ones(n, 4, device="neuron")
        y = (x * w + 1).relu().sum(0) * 0.5
        return y.tanh()

    def novel(n):  # lists of n tensors: every op is new even with its sizes erased
        ys = torch._foreach_mul([w] * n, 2.0)
        return torch._foreach_add(ys, 1.0)

    for n in range(1, 400):  # the engine backs off from recording (each time longer)
        novel(n)
    assert SWITCH.adaptive._backoff_len > engine._NOVELTY_WINDOW
    for _ in range(1200):  # ~6000 ops at one shape: fused again within the longest backoff
        step(3)
    adaptive_eager.reset_stats()
    for _ in range(5):
        step(3)
    torch.neuron.synchronize()
    s = adaptive_eager.stats()
    assert s.fused_ops >= 5 * 5 and s.divergences == 0


def test_factories_inside_a_step_join_its_trace_and_draw_random_numbers_in_order():
    def run(mode):
        adaptive_eager.set_mode(mode)
        torch.manual_seed(3)
        x = torch.randn(4, 8).to("neuron")
        launches, outs = [], []
        for _ in range(STEPS + 3):
            before = adaptive_eager.stats().launches
            m = torch.ones(8, 8, device="neuron").triu(1)
            pos = torch.arange(8, device="neuron")
            noise = torch.randn(4, 8, device="neuron")
            outs.append(((x @ m + pos) * noise).relu().sum(0))
            launches.append(adaptive_eager.stats().launches - before)
        return [o.tolist() for o in outs], launches

    eager, adaptive = run("eager"), run("adaptive")
    assert eager[0] == adaptive[0]
    assert adaptive[1][-3:] == [1, 1, 1] and eager[1][-1] > 5


def test_a_chain_of_identical_ops_fuses_as_one_launch_per_chain():
    # Signatures alone make `c = mm(c, b)` x4 look 1-periodic; its unit is the chain.
    a, b = torch.randn(8, 8).to("neuron"), torch.randn(8, 8).to("neuron")
    chains = []
    for _ in range(STEPS + 4):
        c = a
        for _ in range(4):
            c = torch.mm(c, b)
        chains.append(c)
    adaptive_eager.reset_stats()
    for _ in range(4):
        c = a
        for _ in range(4):
            c = torch.mm(c, b)
    torch.neuron.synchronize()
    s = adaptive_eager.stats()
    assert (s.launches, s.fused_ops, s.divergences) == (4, 16, 0)
    expected = a.cpu()
    for _ in range(4):
        expected = expected @ b.cpu()
    assert torch.equal(c.cpu(), expected) and torch.equal(chains[-1].cpu(), expected)


def test_a_loop_body_shorter_than_a_trace_fuses_several_iterations_per_launch():
    x = torch.ones(8).to("neuron")
    for _ in range(20):
        x = (x * 2).add_(1)
    adaptive_eager.reset_stats()
    for _ in range(8):
        x = (x * 2).add_(1)
    torch.neuron.synchronize()
    s = adaptive_eager.stats()
    assert s.fused_ops == 16 and s.launches <= 4


def _copying_loop(mode, steps=STEPS):
    """Host data copied in every step (`.to('neuron')`, `torch.tensor(..., device=)`), and a
    copy into a tensor that held-back ops read."""
    adaptive_eager.set_mode(mode)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to("neuron")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    seen = torch.zeros(4).to("neuron")
    losses, reads, launches = [], [], []
    for i in range(steps):
        before = adaptive_eager.stats(wait=False).launches
        x = torch.randn(8, 16, generator=g).to("neuron")
        y = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3], device="neuron")
        loss = torch.nn.functional.cross_entropy(net(x), y)
        reads.append(torch.tanh(seen * 2 + 1).sum())  # held back, reads `seen` ...
        seen.copy_(torch.full((4,), float(i)))  # ... which this copy then overwrites
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        launches.append(adaptive_eager.stats(wait=False).launches - before)
    return [t.cpu() for t in losses + reads], launches


def test_host_data_copied_in_each_step_cuts_no_trace_and_a_copy_into_a_used_tensor_waits():
    eager, _ = _copying_loop("eager", steps=2 * STEPS)
    adaptive_eager.reset_stats()
    adaptive, launches = _copying_loop("adaptive", steps=2 * STEPS)
    assert len(eager) == len(adaptive) and all(torch.equal(a, b) for a, b in zip(eager, adaptive))
    # The copies into fresh tensors run at once and cut no trace: one launch per step (the
    # trace ends at the copy into `seen`, which waits for the launch that reads it).
    assert launches[-4:] == [1, 1, 1, 1]
    assert adaptive_eager.stats().divergences == 0


# -- interrupts: Note [Interrupted issue] in adaptive_eager/engine/executor.py ------------------------------
def _interrupted_loop(steps=16):
    """Steps of a loop that catches KeyboardInterrupt and goes on, as a notebook does; the
    completed steps' outputs, and how many steps were interrupted."""
    x = torch.arange(12.0).reshape(4, 3).to("neuron")
    outs, interrupted = [], 0
    for i in range(steps):
        try:
            outs.append(torch.tanh(x * (1.0 + i % 2) + 1).sum(0))
        except KeyboardInterrupt:
            interrupted += 1
    return [o.cpu() for o in outs], interrupted


def _expected(n_interrupted_at=()):
    with adaptive_eager.mode("eager"):
        x = torch.arange(12.0).reshape(4, 3)
        return [torch.tanh(x * (1.0 + i % 2) + 1).sum(0) for i in range(16) if i not in n_interrupted_at]


def _raise_once_at(call: int):
    calls = [0]

    def maybe_raise():
        calls[0] += 1
        if calls[0] == call:
            raise KeyboardInterrupt
    return maybe_raise


def test_an_interrupt_as_a_trace_completes_leaves_the_engine_consistent(monkeypatch):
    engine = SWITCH.adaptive
    real = engine._complete
    interrupt = _raise_once_at(6)  # the sixth completion: matched traces by then

    def complete(p):
        interrupt()
        real(p)
    monkeypatch.setattr(engine, "_complete", complete)
    outs, interrupted = _interrupted_loop()
    # The interrupt came from the step's last op, which was queued: the step's value never
    # reached the loop, and the engine's next op found the match ended, not an IndexError.
    assert interrupted == 1
    assert len(outs) == 15
    expected = _expected()
    skipped = next(i for i in range(16) if i == len(outs) or not torch.equal(outs[i], expected[i]))
    assert all(torch.equal(a, b) for a, b in zip(outs, expected[:skipped] + expected[skipped + 1:]))
    assert engine.counters.fused_launches > 6  # and it fused again afterwards


def test_an_interrupt_after_an_op_is_counted_but_before_it_is_queued_leaves_the_engine_consistent(monkeypatch):
    from adaptive_eager.engine.pending import Pending

    interrupt = _raise_once_at(30)  # inside a matched trace, right after `p.pos += 1`
    real = Pending.complete

    def complete(self):
        interrupt()
        return real.fget(self)
    monkeypatch.setattr(Pending, "complete", property(complete))
    outs, interrupted = _interrupted_loop()
    assert interrupted == 1 and len(outs) == 15
    expected = _expected()
    skipped = next(i for i in range(16) if i == len(outs) or not torch.equal(outs[i], expected[i]))
    assert all(torch.equal(a, b) for a, b in zip(outs, expected[:skipped] + expected[skipped + 1:]))


# -- memory near capacity: Note [Deferred outputs are charged at issue] in device/csrc/runtime/memory.cpp --
_NEAR_CAPACITY = """
    import traceback
    import torch, adaptive_eager
    hold_bytes = HOLD_BYTES
    out = {}
    for mode in ("eager", "adaptive"):
        adaptive_eager.set_mode(mode)
        torch.neuron.reset_peak_memory_stats()
        torch.manual_seed(0)
        w = torch.randn(256, 256).to("neuron")  # 256 KiB
        base = torch.ones(1, 256, 256).to("neuron")
        reads, ooms, memory, hold = [], [], [], None
        for step in range(30):
            try:
                if step in (7, 8, 19):  # more held: these steps may not fit, in either mode
                    hold = torch.empty(hold_bytes, dtype=torch.uint8, device="neuron")
                elif step in (9, 20):
                    hold = None
                x = base.repeat(8, 1, 1)  # 2 MiB, allocated at issue, while the last step may be held back
                y = (x @ w).relu().sum(0)  # two 2 MiB temporaries
                w.add_(y * 1e-6)
                if step % 4 == 3:
                    reads.append((step, w.sum().item()))
            except torch.OutOfMemoryError as e:
                # where it was raised (the source line), and what it says of the memory then
                ooms.append((step, traceback.extract_tb(e.__traceback__)[-1].lineno, str(e).split(".")[1]))
                x = y = None
            # The books with no sync point: what the device holds at this point of the program.
            memory.append((torch.neuron.memory_allocated(), torch.neuron.max_memory_allocated()))
        torch.neuron.synchronize()
        out[mode] = {"ooms": ooms, "reads": reads, "final": w.sum().item(), "memory": memory}
        del w, base, x, y, hold
    emit(out)
"""


def test_a_loop_near_capacity_runs_out_of_memory_where_eager_does_and_retries_as_eager():
    # The repeat's bytes were taken before the held-back ops of the previous step made theirs:
    # adaptive ran out of memory every fourth step where eager never did, one OOM surfaced
    # only at the final synchronize, and the loop's reads then differed from eager's.
    out = run_json(_NEAR_CAPACITY.replace("HOLD_BYTES", str(6 << 20)), env={"NEURON_DEVICE_MEMORY": "8MiB"})
    assert [oom[0] for oom in out["eager"]["ooms"]] == [7, 8, 19]  # each at the step's repeat or its hold
    assert out["adaptive"] == out["eager"]


@pytest.mark.parametrize("hold_kib", [1536, 2560, 3584, 6656])
def test_out_of_memory_comes_at_eagers_op_with_eagers_books_whatever_is_held(hold_kib):
    # Deferred outputs are charged when they are handed out, and released when their holders
    # drop them, though a queued op still reads them: at 3.5 MiB held, eager ran out at relu
    # in step 8 while adaptive mode, whose relu ran later in a fused launch after the host had
    # dropped `hold`, did not (and applied step 8's update); at 6.5 MiB eager's peak was 7.0
    # MiB and adaptive's 6.75; captured arguments kept the bytes a loop had dropped charged
    # until their launch ran, and an allocation failed that fit in eager mode.
    out = run_json(_NEAR_CAPACITY.replace("HOLD_BYTES", str(hold_kib << 10)), env={"NEURON_DEVICE_MEMORY": "8MiB"})
    eager, adaptive = out["eager"], out["adaptive"]
    assert eager["ooms"], "the held bytes must make some step run out of memory, or this test proves nothing"
    assert adaptive["ooms"] == eager["ooms"]  # the same steps, source lines and memory in the message
    assert adaptive["memory"] == eager["memory"]  # allocated and peak after every step, no sync
    assert adaptive["reads"] == eager["reads"] and adaptive["final"] == eager["final"]


def test_an_arange_whose_float_end_changes_gets_its_own_length():
    # arange's length is (end - start) / step of its Scalar arguments: floats are keyed by
    # value for it (elsewhere they are lifted), or its trace would promise the old length.
    def run(mode):
        with adaptive_eager.mode(mode):
            outs = []
            for end in [1.5] * 4 + [3.5] * 3:
                w = torch.ones(1, device="neuron")
                outs.append((torch.arange(0.0, end, 0.5, device="neuron") * w + 1).exp().cpu())
            return outs

    eager, adaptive = run("eager"), run("adaptive")
    assert [o.shape[0] for o in adaptive] == [3] * 4 + [7] * 3
    assert all(torch.equal(a, b) for a, b in zip(adaptive, eager))


def test_a_bool_passed_as_a_scalar_is_lifted_and_a_trace_replays_with_either_value():
    # Note [Lifted scalars]: generate()'s done flag, `torch.full((1,), cur_len >= max_len)`, is
    # a fill with a Python bool. Keyed by value, a step whose flag had changed ran op by op (9
    # launches) until the other value had a trace of its own. Lifted, one trace replays with
    # either value, which the launch reads.
    flags = ([False] * 5 + [True]) * 3

    def run(mode):
        with adaptive_eager.mode(mode):
            x = torch.arange(4.0, device="neuron")
            outs, launches = [], []
            for flag in flags:
                before = adaptive_eager.stats().launches
                done = torch.full((4,), flag, dtype=torch.bool, device="neuron")
                y = (x * 2).masked_fill(done, -1.0) + x
                x = y.tanh() + done.to(torch.float32)
                outs.append(x.sum().cpu())  # a host read each step, as generate()'s
                launches.append(adaptive_eager.stats().launches - before)
            return outs, launches

    (eager, _), (adaptive, launches) = run("eager"), run("adaptive")
    assert all(torch.equal(a, b) for a, b in zip(adaptive, eager))
    assert launches[2:] == [1] * (len(flags) - 2), launches  # was 9 at the 6th and 12th steps


def _gather_steps(index_dtype, steps=8):
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0)).to("neuron")
    g = torch.Generator().manual_seed(1)
    if index_dtype is torch.bool:
        indices = [(torch.rand(64, generator=g) > 0.5).to("neuron") for _ in range(steps)]
    else:
        indices = [torch.randint(0, 64, (32,), generator=g).to("neuron") for _ in range(steps)]
    outs, per_step = [], []
    for idx in indices:
        before = adaptive_eager.stats().launches
        outs.append((x[idx] * 2 + 1).tanh().sum(0))
        per_step.append(adaptive_eager.stats().launches - before)
    return [o.cpu() for o in outs], per_step


def test_indexing_with_integer_tensors_is_deferred_into_traces():
    """x[idx] with integer indices has the indices' shape: a data-dependent-shape op only for
    boolean masks, so MoE routing (x[tokens]) fuses with the rest of its step."""
    with adaptive_eager.mode("eager"):
        expected, _ = _gather_steps(torch.int64)
    with adaptive_eager.mode("adaptive"):
        got, per_step = _gather_steps(torch.int64)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert per_step[-1] == 1  # the gather fused with the rest of the step: one launch


def test_indexing_with_a_boolean_mask_stays_a_sync_point():
    with adaptive_eager.mode("eager"):
        expected, _ = _gather_steps(torch.bool)
    with adaptive_eager.mode("adaptive"):
        got, per_step = _gather_steps(torch.bool)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert per_step[-1] >= 2  # the mask's nonzero count is read before the op can run: its own launch


@pytest.mark.parametrize("where", ["cpu", "neuron"])
def test_an_index_tensor_changed_after_the_gather_was_issued_does_not_change_its_result(where):
    """Device indices are deferred with the op (the op reads them in stream order); host
    indices make the gather run now (a deferred op would read them after they changed)."""
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0)).to("neuron")

    def run(mode):
        idx, outs = torch.arange(32).to(where), []
        with adaptive_eager.mode(mode):
            for _ in range(STEPS + 2):
                outs.append((x[idx] * 2).sum(0))
                idx.add_(1)
            return [o.cpu() for o in outs]

    assert all(torch.equal(a, b) for a, b in zip(run("adaptive"), run("eager")))


RUN_WHOLE = {  # functional ops whose CPU kernel computes through their out= variant (registration.cpp's kRunWhole)
    "abs": lambda x: x.abs(),
    "logical_and": lambda x: torch.logical_and(x > 0, x < 0.5).float(),
    "logical_not": lambda x: torch.logical_not(x > 0).float(),
    "nan_to_num": lambda x: torch.nan_to_num(x.log()),
    "logsumexp": lambda x: torch.logsumexp(x, dim=1, keepdim=True).expand_as(x),
    "deg2rad": lambda x: torch.deg2rad(x),
}


@pytest.mark.parametrize("name", sorted(RUN_WHOLE))
def test_ops_whose_cpu_kernel_goes_through_out_variants_stay_inside_traces(name):
    fn = RUN_WHOLE[name]
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0)).to("neuron")

    def run(mode):
        outs, per_step = [], []
        with adaptive_eager.mode(mode):
            y = x
            for _ in range(STEPS + 2):
                before = adaptive_eager.stats().launches
                y = (fn(y) * 0.5 + x).tanh()
                outs.append(y)
                per_step.append(adaptive_eager.stats().launches - before)
            return [o.cpu() for o in outs], per_step

    expected, _ = run("eager")
    got, per_step = run("adaptive")
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    flushes = adaptive_eager.stats().flushes
    assert per_step[-1] <= 1, per_step
    assert not [r for r in flushes if r.endswith(".out")], flushes  # no out= op cut a trace


def _out_steps(mode, make_out, steps=STEPS + 2):
    """Steps that write through out= arguments: the out of add is made by make_out(step); the
    where writes into its own input (torch 2.13's _safe_softmax does, in SDPA's math path)."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(8, 16, generator=g).to("neuron") for _ in range(2))
    outs = []
    with adaptive_eager.mode(mode):
        for step in range(steps):
            o = make_out(step)
            torch.add(a, b, out=o)
            torch.where(o > 0, o, b, out=o)
            outs.append((o * 2).tanh())
            a = a + 0.25
        return [t.cpu() for t in outs]


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")  # torch's, as on CPU
@pytest.mark.parametrize("start", ["empty", "wrong_sizes", "transposed", "right_sizes"])
def test_out_ops_give_eagers_values_and_sizes_whether_they_resize_their_outs_or_not(start):
    """An out= op may give its out new geometry, which what follows must see (a sync point
    today): eager's values and sizes every step, for outs it resizes, restrides or keeps."""
    make = {"empty": lambda step: torch.empty(0, device="neuron"),
            "wrong_sizes": lambda step: torch.empty(4, 16, device="neuron"),
            "transposed": lambda step: torch.empty(16, 8, device="neuron").t(),
            "right_sizes": lambda step: torch.empty(8, 16, device="neuron")}[start]
    expected = _out_steps("eager", make)
    got = _out_steps("adaptive", make)
    assert [x.shape for x in got] == [torch.Size([8, 16])] * len(got)
    assert all(torch.equal(x, y) for x, y in zip(got, expected))


def _out_ops_step(out, grow: bool):
    x = torch.arange(12.0, device="neuron").reshape(3, 4)
    cond = x > 5
    y = torch.where(cond, x, -x, out=out if not grow else torch.empty(0, device="neuron"))
    return (y * 2).sum(0)


def test_an_out_op_that_keeps_its_outputs_shape_is_no_sync_point_and_one_that_resizes_still_is():
    """Note [An out= op that keeps its output's shape] (dispatch/classify.py): an out= op whose
    output has the result's shape already is deferred into the step's trace like an in-place
    op; one that resizes its output runs at once, as before (its host tensor changes)."""
    out = torch.empty(3, 4, device="neuron")
    expected = [_out_ops_step(out, grow).cpu() for grow in (False, True)]
    for grow in (False, True):
        adaptive_eager.reset_stats()
        got = [_out_ops_step(out, grow) for _ in range(STEPS)]
        assert all(torch.equal(g.cpu(), expected[grow]) for g in got)
        flushes = adaptive_eager.stats().flushes
        assert (sum(flushes.values()) > 0) == grow, (grow, flushes)


def test_whether_an_out_op_resizes_is_answered_per_geometry_of_its_call():
    """Note [An out= op that keeps its output's shape]: the answer is kept by the call's
    geometry (its meta run costs ~80 us); a call whose output has another shape, or whose
    inputs broadcast to another, gets its own answer."""
    from adaptive_eager.dispatch import classify

    info = classify(torch.ops.aten.mul.out)
    x = torch.randn(3, 4).to("neuron")
    fits, empty = torch.empty(3, 4).to("neuron"), torch.empty(0).to("neuron")
    assert not info.resizes_output((x, 2.0), {"out": fits})
    assert info.resizes_output((x, 2.0), {"out": empty})
    assert not info.resizes_output((x, 3.0), {"out": fits})  # another float: the same shapes
    assert info.resizes_output((x, torch.randn(2, 3, 4).to("neuron")), {"out": fits})  # broadcasts wider
    assert not info.resizes_output((x, 2.0), {"out": fits})
