"""torch.compile on neuron: the `neuron` Dynamo backend.

Each compiled graph (forward, backward) runs as ONE launch on the device: the launches are
observed in the C++ clock's launch log, where a compiled graph is the launch holding
more than one op (in eager mode every other launch holds exactly one). Values are compared
with the same model run without compiling, within torch.compile's usual tolerance.
See Note [Compiled graphs] in dispatch/compile_backend.py.
"""
from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
import torch._inductor.exc
from torch import nn

import adaptive_eager
from adaptive_eager.dispatch.compile_backend import neuron_backend
from adaptive_eager.device import native
from neuron_tensors import is_neuron_tensor
from subproc import SUBPROCESS_TIMEOUT_S


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class LaunchLog:
    """Every launch as (device index, num_ops), while installed: the C++ clock's launch log."""

    def __init__(self):
        native.set_launch_log(True)

    def take(self) -> list[tuple[int, int]]:
        return [tuple(c) for c in native.take_launch_log()]

    def close(self) -> None:
        native.set_launch_log(False)

    def graph_launches(self) -> list[int]:
        """num_ops of the launches since the last take that ran more than one op, then take."""
        return [n for _, n in self.take() if n > 1]


def test_inductor_with_dynamic_shapes_on_neuron_trains_to_eagers_values():
    """dynamic=True: symbolic sizes, and the scheduler's fusions of a reduction (the bias
    gradient) with pointwise ops, which it keeps from CPU kernels only (neuron's are)."""
    torch.manual_seed(0)
    ref = mlp().to("neuron")
    model = copy.deepcopy(ref)
    compiled = torch.compile(model, dynamic=True)
    for batch in (5, 7):
        x = torch.randn(batch, 8, device="neuron")
        compiled(x).sum().backward()
        ref(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad.cpu())


def test_an_inductor_graph_reads_the_values_the_adaptive_engine_still_holds_back():
    """Its generated kernels read data pointers: a compiled call runs the engine's pending
    ops first, and the graph's own ATen calls bypass the engine (Note [Inductor on neuron])."""
    f = torch.compile(lambda h: torch.relu(h) * 3 + 1)  # inductor: one C++ kernel

    def run(mode):
        adaptive_eager.set_mode(mode)
        x = torch.arange(12.0, device="neuron").reshape(3, 4)
        outs = []
        for i in range(8):
            h = torch.tanh(x * (i % 3) - 1)  # matched and deferred once the loop repeats
            outs.append(f(h))
        return torch.stack([o.cpu() for o in outs])

    adaptive = run("adaptive")
    assert adaptive_eager.stats().fused_launches > 0  # h's ops were held back at some calls
    assert torch.equal(adaptive, run("eager"))


@pytest.fixture
def launches():
    log = LaunchLog()
    yield log
    log.close()


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


class WithGraphBreak(nn.Module):
    """Two compiled graphs with a host read (`.item()`, a graph break) in between."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        scale = h.mean().item()  # a sync point, run eagerly between the two graphs
        return self.b(h) * (1.0 + scale)


def test_neuron_backend_is_found_by_name_without_importing_dynamo_at_import_time():
    assert torch._dynamo.lookup_backend("neuron") is neuron_backend
    code = ("import sys, torch, adaptive_eager\n"
            "assert 'torch._dynamo' not in sys.modules, 'import torch/adaptive_eager imported torch._dynamo'\n"
            "assert 'adaptive_eager.dispatch.compile_backend' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stderr


def test_mlp_forward_and_backward_each_run_as_one_launch_with_eager_values(launches):
    torch.manual_seed(0)
    ref = mlp().to("neuron")
    model = copy.deepcopy(ref)
    compiled = torch.compile(model, backend="neuron")
    x = torch.randn(5, 8, device="neuron")
    with adaptive_eager.mode("eager"):  # eager: every launch outside a graph holds one op
        for _ in range(2):  # the first call compiles, the second reuses
            launches.take()
            out = compiled(x)
            fw = launches.graph_launches()
            out.sum().backward()
            bw = launches.graph_launches()
            assert len(fw) == 1 and fw[0] >= 3, f"forward launches holding >1 op: {fw}"
            assert len(bw) == 1 and bw[0] >= 3, f"backward launches holding >1 op: {bw}"
        for _ in range(2):  # gradients accumulate over both calls, as in the compiled loop
            expected = ref(x)
            expected.sum().backward()
    assert is_neuron_tensor(out)
    torch.testing.assert_close(out.cpu(), expected.cpu())
    for p, q in zip(model.parameters(), ref.parameters()):
        assert is_neuron_tensor(p.grad)
        torch.testing.assert_close(p.grad.cpu(), q.grad.cpu())


def test_compiled_launch_is_counted_by_stats_with_the_graph_ops():
    torch.manual_seed(0)
    model = mlp().to("neuron")
    compiled = torch.compile(model, backend="neuron")
    x = torch.randn(5, 8, device="neuron")
    with torch.no_grad():
        compiled(x)  # compile (an inference graph)
        adaptive_eager.reset_stats()
        compiled(x)
    s = adaptive_eager.stats()
    assert s.launches == 1
    assert s.kernel_ops >= 3  # addmm, relu, addmm (plus views): one launch holds them all
    assert s.device_time_us > s.launch_overhead_us  # the graph's roofline cost was charged


def test_tracing_launches_nothing(launches):
    """Compiling traces the model on fake tensors: no op of that may reach the device."""
    torch.manual_seed(0)
    model = mlp().to("neuron")
    x = torch.randn(5, 8, device="neuron")
    compiled = torch.compile(model, backend="eager")  # runs Dynamo's graph op by op on neuron
    with adaptive_eager.mode("eager"):
        launches.take()
        compiled(x)  # traces, compiles, runs
        first = launches.take()
        compiled(x)  # runs
        second = launches.take()
    assert len(first) == len(second) > 0


def test_graph_break_runs_eagerly_between_two_compiled_graphs(launches):
    torch.manual_seed(0)
    ref = WithGraphBreak().to("neuron")
    model = copy.deepcopy(ref)
    counter = torch._dynamo.testing.CompileCounterWithBackend("neuron")
    compiled = torch.compile(model, backend=counter)
    x = torch.randn(5, 8, device="neuron")
    with adaptive_eager.mode("eager"):
        compiled(x)
        launches.take()
        out = compiled(x)
        fw = launches.graph_launches()
        out.sum().backward()
        bw = launches.graph_launches()
    assert counter.frame_count == 2  # the graph before the break and the one after
    assert len(fw) == 2, f"forward: one launch per compiled graph, got {fw}"
    assert len(bw) == 2, f"backward: one launch per compiled graph, got {bw}"
    expected = ref(x)
    expected.sum().backward()
    torch.testing.assert_close(out.cpu(), expected.cpu())
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad.cpu())


def _train(model, steps: int):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(6, 8, generator=gen).to("neuron")
        y = torch.randn(6, 4, generator=gen).to("neuron")
        out = model(x)
        loss = ((out - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return [float(v) for v in losses]


@pytest.mark.parametrize("cls", [mlp, WithGraphBreak], ids=["mlp", "graph_break"])
def test_adamw_training_in_adaptive_mode_matches_uncompiled(cls):
    torch.manual_seed(0)
    ref = cls().to("neuron")
    model = copy.deepcopy(ref)
    compiled = torch.compile(model, backend="neuron")
    assert adaptive_eager.get_mode() == "adaptive"
    got = _train(compiled, 6)
    want = _train(ref, 6)
    torch.testing.assert_close(got, want)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach().cpu())
    assert got[-1] < got[0]  # it trained


def _still_held_back(t) -> bool:
    """t is the output of an op the adaptive engine has not launched yet."""
    from adaptive_eager.device import native

    return not native.has_bytes(t)  # a deferred output's bytes are made when its launch runs


@pytest.mark.parametrize("streamed", [False, True], ids=["submitted_whole", "streamed"])
def test_compiled_call_sees_values_the_adaptive_engine_still_holds_back(streamed):
    """A compiled call is a sync point: inputs produced, or written in place, by ops of a
    pending fused launch have their current values (Note [Compiled graphs]). The loop is
    fused first; the compiled call then comes in the middle of a matched trace. A streamed
    launch (Note [Streamed launches]) runs its ops while they are issued, so its values may
    have their bytes already: the held-back case is checked with launches submitted whole."""
    from adaptive_eager.device import native

    native.set_streamed_launches(streamed)
    try:
        _compiled_call_in_a_matched_trace(check_held_back=not streamed)
    finally:
        native.set_streamed_launches(True)


def _compiled_call_in_a_matched_trace(check_held_back):
    f = torch.compile(lambda a, b: a * 3 + b, backend="neuron")
    x = torch.ones(4, device="neuron")
    p = torch.zeros(4, device="neuron")
    outs = []
    for i in range(1, 12):
        t = (x + 1) * 2 - 3
        t.mul_(2)
        u = t.exp()
        p.add_(1)  # an in-place write to a tensor whose `_data` exists: may still be pending
        if i == 11:
            if check_held_back:
                assert _still_held_back(u), "u was computed already: the test exercises nothing"
            out = f(u, p)
        else:
            out = u * 3 + p
        outs.append(out * 2 - 1)
    for i, got in enumerate(outs, start=1):
        expected = (torch.full((4,), 2.0).exp() * 3 + i) * 2 - 1
        torch.testing.assert_close(got.cpu(), expected)
    assert adaptive_eager.stats().fused_launches > 0


def test_compiled_call_sees_in_place_writes_the_adaptive_engine_still_holds_back():
    """An input whose `_data` exists but that a pending op writes in place: the call must
    first run that op (a sync), not just read `_data`."""
    g = torch.compile(lambda a: a * 3, backend="neuron")
    p = torch.zeros(4, device="neuron")
    outs = []
    for _ in range(10):
        p.add_(1)
        p.mul_(1)
        outs.append(g(p) + 0)  # an op after the call: the loop is one repeating unit
    for i, got in enumerate(outs, start=1):
        torch.testing.assert_close(got.cpu(), torch.full((4,), 3.0 * i))
    assert adaptive_eager.stats().fused_launches > 0


def test_dynamic_shapes_recompile_once_and_charge_each_shape_its_cost(launches):
    torch._dynamo.reset()  # earlier tests' calls must not have marked the batch dynamic already
    torch.manual_seed(0)
    model = mlp().to("neuron")
    counter = torch._dynamo.testing.CompileCounterWithBackend("neuron")
    compiled = torch.compile(model, backend=counter)
    times = {}
    with torch.no_grad():
        for batch in (3, 5, 7, 9, 5):
            x = torch.randn(batch, 8, device="neuron")
            adaptive_eager.reset_stats()
            launches.take()
            out = compiled(x)
            assert out.shape == (batch, 4)
            assert len(launches.graph_launches()) == 1
            times[batch] = adaptive_eager.stats().device_time_us
            # (After the count: adaptive mode fuses this eager reference across batch sizes too.)
            torch.testing.assert_close(out.cpu(), model(x).cpu())
            launches.take()
    # 3 compiles static; 5 recompiles with a dynamic batch that serves every later size
    assert counter.frame_count == 2
    assert times[3] < times[5] < times[7] < times[9]


def test_dropout_in_a_compiled_graph_draws_cpus_numbers_from_cpus_generator():
    y = torch.ones(1000, device="neuron")
    drop = nn.Dropout(0.5)
    torch.manual_seed(0)
    expected = drop(y.cpu())
    after = torch.get_rng_state()
    compiled = torch.compile(drop, backend="neuron")
    torch.manual_seed(0)
    compiled(y)  # compile
    torch.manual_seed(0)
    got = compiled(y).cpu()
    assert torch.equal(got, expected)  # CPU's numbers, as TorchNeuron's CPU fallback draws them
    assert torch.equal(torch.get_rng_state(), after)  # and CPU's generator moved as CPU's dropout moves it


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_inductor_on_neuron_inputs_returns_neuron_tensors_with_eagers_values(mode):
    """torch.compile's default backend: CPU code generated for 'neuron' runs on the device
    tensors' bytes (Note [Inductor on neuron] in dispatch/inductor.py)."""
    adaptive_eager.set_mode(mode)
    torch.manual_seed(0)
    ref = mlp().to("neuron")
    model = copy.deepcopy(ref)
    compiled = torch.compile(model)  # the default backend: inductor
    x = torch.randn(5, 8, device="neuron")
    out = compiled(x)
    assert is_neuron_tensor(out)
    out.sum().backward()
    expected = ref(x)
    expected.sum().backward()
    torch.testing.assert_close(out.cpu(), expected.cpu())
    for p, q in zip(model.parameters(), ref.parameters()):
        assert is_neuron_tensor(p.grad)
        torch.testing.assert_close(p.grad.cpu(), q.grad.cpu())


def _pointwise(x):
    return (x.sin() * 2).cos() + x


def test_inductors_generated_kernels_are_launches_priced_by_the_buffers_they_move():
    """Note [Inductor kernels on the clock]: the graph is one fused kernel (no ATen call),
    which reads x and writes the result: one launch, priced by those bytes."""
    from adaptive_eager.dispatch.context import CONTEXT

    x = torch.randn(512, 512, device="neuron")
    compiled = torch.compile(_pointwise)
    compiled(x)  # compiles
    adaptive_eager.reset_stats()
    out = compiled(x)
    s = adaptive_eager.stats()
    torch.testing.assert_close(out.cpu(), _pointwise(x).cpu())
    assert s.launches == 1
    moved_us = CONTEXT.runtime.cost.op_us(0, 2 * x.nbytes, torch.float32)
    assert s.device_time_us - s.launch_overhead_us == pytest.approx(moved_us, rel=1e-9)


def _embed_and_normalize(ids, positions, tokens, places):
    """GPT-2's first lines: two embedding lookups added, then a layer norm. Inductor fuses the
    indexed loads into the norm's reduction (the kernel that failed on neuron before Note
    [Inductor's backend for neuron])."""
    x = nn.functional.embedding(ids, tokens) + nn.functional.embedding(positions, places)
    return nn.functional.layer_norm(x, (x.shape[-1],))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inductor_fuses_indexed_loads_into_a_reduction_on_neuron(dtype):
    """Values within torch.compile's tolerance of the CPU's compiled ones, not its bits: some
    of inductor's lowerings choose by device (a small variance is two passes on the CPU,
    Welford's on any other device)."""
    torch.manual_seed(0)
    args = (torch.randint(0, 64, (2, 1)), torch.tensor([[5]]), torch.randn(64, 32, dtype=dtype),
            torch.randn(64, 32, dtype=dtype))
    on_cpu = torch.compile(_embed_and_normalize)(*args)
    torch._dynamo.reset()
    on_neuron = torch.compile(_embed_and_normalize)(*(a.to("neuron") for a in args))
    assert is_neuron_tensor(on_neuron)
    torch.testing.assert_close(on_neuron.cpu(), on_cpu)


def _attention_with_dropout(x, proj, dropout_p=0.25):
    """GPT-2's attention in training: heads split by a view and a transpose (non-contiguous
    queries), dropout inside SDPA."""
    q, k, v = (x @ proj).view(2, 7, 3, 2, 16).permute(2, 0, 3, 1, 4)  # [3, batch, heads, tokens, 16]
    return nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


def test_attention_with_dropout_compiles_for_training_and_draws_eagers_mask():
    """neuron::attention_dropout's fake kernels (builtin_kernels.py): the generator state it
    returns made from the inputs (fake mode refuses one made from the real state), and its
    gradients laid out as the math path's backward lays them, which the graph asserts."""
    x = torch.randn(2, 7, 32, device="neuron")
    grads = []
    for run in (_attention_with_dropout, torch.compile(_attention_with_dropout)):
        proj = torch.randn(32, 96, generator=torch.Generator().manual_seed(1)).to("neuron").requires_grad_()
        torch.manual_seed(3)  # the device generator: the same dropout mask in both runs
        out = run(x, proj)
        out.sum().backward()
        grads.append((out.detach().cpu(), proj.grad.cpu()))
    (eager_out, eager_grad), (compiled_out, compiled_grad) = grads
    with torch.no_grad():
        undropped = _attention_with_dropout(x, proj, dropout_p=0.0).cpu()
    assert not torch.allclose(eager_out, undropped), "dropout dropped nothing: the mask is not compared"
    torch.testing.assert_close(compiled_out, eager_out)
    torch.testing.assert_close(compiled_grad, eager_grad)


def _attention_with_learned_bias(q, bias):
    """T5's attention: the mask is a position bias that is trained, so it needs a gradient."""
    return nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=bias, scale=1.0)


def test_attention_whose_mask_needs_a_gradient_compiles_on_neuron():
    """SDPA's C++ body asks the device's kernel choice of the fake tensors tracing makes: the
    choice reads their metadata only (it aliased their bytes, which fakes do not have)."""
    q = torch.randn(2, 4, 7, 8, generator=torch.Generator().manual_seed(0)).to("neuron")
    results = []
    for run in (_attention_with_learned_bias, torch.compile(_attention_with_learned_bias)):
        bias = torch.randn(1, 4, 7, 7, generator=torch.Generator().manual_seed(1)).to("neuron").requires_grad_()
        out = run(q, bias)
        out.square().sum().backward()
        results.append((out.detach().cpu(), bias.grad.cpu()))
    (eager_out, eager_grad), (compiled_out, compiled_grad) = results
    torch.testing.assert_close(compiled_out, eager_out)
    torch.testing.assert_close(compiled_grad, eager_grad)


def _causal_attention(q, k, v):
    return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("dynamic", [None, True])
def test_compiled_attention_runs_at_every_sequence_length_with_cpus_values(dynamic):
    """The kernel choice of fake tensors with symbolic sizes (a new sequence length makes Dynamo
    compile with dynamic shapes; dynamic=True does from the start): the host shadows needed
    numbers, and compiling raised 'SymIntArrayRef expected to contain only concrete integers'."""
    torch._dynamo.reset()
    compiled = torch.compile(_causal_attention, dynamic=dynamic)
    make = torch.Generator().manual_seed(0)
    for length in (16, 24, 32):
        q, k, v = (torch.randn(1, 2, length, 8, generator=make) for _ in range(3))
        out = compiled(q.to("neuron"), k.to("neuron"), v.to("neuron"))
        assert torch.equal(out.cpu(), _causal_attention(q, k, v))


@pytest.fixture
def structured_trace_on():
    """What pytest 9.2's logging plugin does to every non-propagating logger: a handler on
    torch's structured-trace logger `torch.__trace`. torch.compile then writes its structured
    logs (torch._logging.trace_structured checks for handlers, not levels), and AOTAutograd's
    log of the forward's metadata calls repr() on the traced neuron tensors."""
    logger = logging.getLogger("torch.__trace")
    handler = logging.NullHandler()
    logger.addHandler(handler)
    torch._dynamo.reset()  # compile afresh, so the logs are written
    yield
    logger.removeHandler(handler)
    torch._dynamo.reset()


def test_compile_with_structured_trace_logging_on_runs_the_graphs_as_launches(structured_trace_on, launches):
    torch.manual_seed(0)
    ref = mlp().to("neuron")
    model = copy.deepcopy(ref)
    compiled = torch.compile(model, backend="neuron")
    x = torch.randn(5, 8, device="neuron")
    with adaptive_eager.mode("eager"):
        launches.take()
        out = compiled(x)
        fw = launches.graph_launches()
        out.sum().backward()
        bw = launches.graph_launches()
        expected = ref(x)
        expected.sum().backward()
    assert len(fw) == 1 and len(bw) == 1, (fw, bw)  # compiled: no silent fall back to eager
    torch.testing.assert_close(out.cpu(), expected.cpu())
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad.cpu())


def _our_files() -> tuple[str, ...]:
    import adaptive_eager.device as device
    import adaptive_eager.dispatch as dispatch

    return tuple(os.path.join(os.path.dirname(os.path.realpath(m.__file__)), "")
                 for m in (adaptive_eager, dispatch, device))


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_dynamo_never_compiles_a_frame_of_our_own_code(mode):
    """Note [Opaque to Dynamo]: the eager parts of a compiled call (here a graph break at
    `.item()`) reach our dispatch, engine and kernels from C++; Dynamo must leave them alone."""
    from torch._dynamo.convert_frame import input_codes

    torch._dynamo.reset()
    input_codes.clear()
    torch.manual_seed(0)
    model = WithGraphBreak().to("neuron")
    compiled = torch.compile(model, backend="neuron")
    x = torch.randn(5, 8, device="neuron")
    with adaptive_eager.mode(mode):
        for _ in range(3):
            compiled(x).sum().backward()
            print(compiled(x).sum())  # a host read, outside a graph
    offered = [ref() for ref in input_codes.seen]
    ours = [f"{c.co_name} ({c.co_filename}:{c.co_firstlineno})" for c in offered
            if c is not None and os.path.realpath(c.co_filename).startswith(_our_files())]
    assert any(c is not None and c.co_name == "forward" for c in offered)  # the probe works
    assert ours == [], f"Dynamo tried to compile our code: {ours}"


def test_host_copies_and_device_factories_inside_a_graph(launches):
    to_host = torch.compile(lambda a: (a * 2).cpu() + 1, backend="neuron")
    r = to_host(torch.ones(2, device="neuron"))
    assert type(r) is torch.Tensor and r.device.type == "cpu"  # .cpu() in a graph gives a host tensor
    assert torch.equal(r, torch.full((2,), 3.0))
    factory = torch.compile(lambda a: a + torch.ones(2, device=a.device), backend="neuron")
    with adaptive_eager.mode("eager"):
        a = torch.ones(2, device="neuron")
        launches.take()
        r = factory(a)
        # ones and add: one launch
        assert launches.graph_launches() == [2]
    assert is_neuron_tensor(r)
    assert torch.equal(r.cpu(), torch.full((2,), 2.0))
    made = torch.compile(lambda a: (a * 2, torch.zeros(3, device=a.device)), backend="neuron")
    doubled, zeros = made(torch.ones(2, device="neuron"))  # a factory the graph returns
    assert is_neuron_tensor(zeros)
    assert torch.equal(zeros.cpu(), torch.zeros(3)) and torch.equal(doubled.cpu(), torch.full((2,), 2.0))


def test_a_graph_with_inputs_on_two_devices_is_a_clear_error():
    if torch.neuron.device_count() < 2:
        pytest.skip("needs two neuron devices (NEURON_NUM_DEVICES=2)")
    f = torch.compile(lambda a, b: a + b.to(a.device), backend="neuron")
    with pytest.raises(Exception, match=r"inputs are on neuron:0, neuron:1. Move them to one device"):
        f(torch.ones(2, device="neuron:0"), torch.ones(2, device="neuron:1"))
