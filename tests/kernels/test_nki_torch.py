"""NKI kernels in PyTorch programs on `neuron` (dispatch/nki_kernels.py): called directly, as
`nki_op` custom ops in eager and adaptive mode, under torch.compile, trained through
register_autograd, and stopped in with pdb."""
from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

import adaptive_eager
import adaptive_eager.nki as nki
import adaptive_eager.nki.isa as nisa
import adaptive_eager.nki.language as nl
from models import neuron_steps_matching_cpu, regression_batches, train_regression
from subproc import SUBPROCESS_TIMEOUT_S


@nki.jit
def silu_kernel(x, out):
    """out = silu(x), 128 rows at a time (the last tile may be short)."""
    rows, cols = x.shape
    for r in range((rows + 127) // 128):
        n = min(128, rows - r * 128)
        tile = nl.ndarray((n, cols), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x[r * 128:r * 128 + n, :])
        y = nl.ndarray((n, cols), dtype=x.dtype, buffer=nl.sbuf)
        nisa.activation(dst=y, op=nl.silu, data=tile)
        nisa.dma_copy(dst=out[r * 128:r * 128 + n, :], src=y)
    return out


@nki.jit
def silu_backward_kernel(x, grad):
    """grad * silu'(x), as a new tensor the kernel allocates."""
    rows, cols = x.shape
    out = nl.ndarray((rows, cols), dtype=x.dtype, buffer=nl.shared_hbm)
    for r in range((rows + 127) // 128):
        n = min(128, rows - r * 128)
        xt, gt = nl.load(x[r * 128:r * 128 + n, :]), nl.load(grad[r * 128:r * 128 + n, :])
        d = nl.ndarray((n, cols), dtype=x.dtype, buffer=nl.sbuf)
        nisa.activation(dst=d, op=nl.silu_dx, data=xt)
        nisa.tensor_tensor(dst=d, data1=d, data2=gt, op=nl.multiply)
        nl.store(out[r * 128:r * 128 + n, :], d)
    return out


@adaptive_eager.nki_op("nki_test::silu", mutates_args=())
def nki_silu(x: Tensor) -> Tensor:
    out = torch.empty_like(x)  # the TorchNeuron pattern: the kernel writes a preallocated output
    silu_kernel(x, out)
    return out


@adaptive_eager.nki_op("nki_test::silu_backward", mutates_args=())
def nki_silu_backward(x: Tensor, grad: Tensor) -> Tensor:
    return silu_backward_kernel(x, grad)


nki_silu.register_autograd(lambda ctx, grad: nki_silu_backward(ctx.saved_tensors[0], grad),
                           setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]))


@adaptive_eager.nki_op("nki_test::scale_into", mutates_args=("out",))
def nki_scale_into(x: Tensor, out: Tensor) -> None:
    _scale_kernel(x, out)


@nki.jit
def _scale_kernel(x, out):
    t = nl.load(x)
    nl.store(out, nl.multiply(t, 3.0))


def _launches() -> int:
    return adaptive_eager.stats().launches


@pytest.fixture
def eager():
    with adaptive_eager.mode("eager"):
        yield


def test_a_kernel_called_with_neuron_tensors_returns_neuron_tensors_with_cpus_bits(eager):
    x = torch.randn(200, 64)
    expect = silu_backward_kernel(x, torch.ones(200, 64))
    xn, gn = x.to("neuron"), torch.ones(200, 64, device="neuron")
    adaptive_eager.reset_stats()
    got = silu_backward_kernel(xn, gn)
    stats = adaptive_eager.stats()
    assert got.device.type == "neuron" and torch.equal(got.cpu(), expect)
    modelled = nki.profile(silu_backward_kernel, x, torch.ones(200, 64)).total_us
    assert stats.launches == 1
    assert stats.device_time_us == pytest.approx(stats.launch_overhead_us + modelled)


def test_a_direct_call_writes_its_neuron_output_argument_and_returns_it(eager):
    x = torch.randn(128, 32, device="neuron")
    out = torch.zeros(128, 32, device="neuron")
    assert silu_kernel(x, out) is out
    assert torch.equal(out.cpu(), torch.nn.functional.silu(x.cpu()))


def test_a_direct_call_in_adaptive_mode_reads_values_still_pending():
    with adaptive_eager.mode("adaptive"):
        x = torch.randn(128, 16, device="neuron")
        results = []
        for i in range(6):  # a repeating step: its ops are deferred once a trace forms
            y = (x * (i + 1)).tanh()
            results.append(silu_backward_kernel(y, torch.ones_like(y)).cpu())
    for i, r in enumerate(results):
        y = (x.cpu() * (i + 1)).tanh()
        assert torch.equal(r, silu_backward_kernel(y, torch.ones_like(y)))


def test_a_kernel_rejects_neuron_and_cpu_tensors_mixed():
    with pytest.raises(TypeError, match="cannot also take CPU tensors"):
        silu_kernel(torch.randn(4, 4, device="neuron"), torch.zeros(4, 4))


def test_an_nki_op_is_one_launch_priced_by_its_kernels_modelled_time(eager):
    x = torch.randn(256, 128)
    xn = x.to("neuron")
    adaptive_eager.reset_stats()
    y = nki_silu(xn)
    stats = adaptive_eager.stats()
    assert torch.equal(y.cpu(), torch.nn.functional.silu(x))
    modelled = nki.profile(silu_kernel, x, torch.empty_like(x)).total_us
    assert stats.launches == 1 and stats.ops == 1
    assert stats.device_time_us == pytest.approx(stats.launch_overhead_us + modelled)


def test_a_mutating_nki_op_writes_its_argument_in_eager_and_adaptive_mode():
    for mode in ("eager", "adaptive"):
        with adaptive_eager.mode(mode):
            x = torch.arange(32.0).reshape(4, 8).to("neuron")
            out = torch.zeros(4, 8, device="neuron")
            for _ in range(5):
                nki_scale_into(x, out)
                x = out + 1
            assert torch.equal(out.cpu(), _scale_reference()), mode


def _scale_reference():
    x = torch.arange(32.0).reshape(4, 8)
    for _ in range(5):
        out = x * 3
        x = out + 1
    return out


class NkiMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 8)

    def forward(self, x):
        return self.fc2(nki_silu(self.fc1(x)))


def _train(device, mode, steps=8):
    return train_regression(NkiMlp, device, mode, regression_batches((16, 32), (16, 8), steps), steps)


def test_training_through_an_nki_op_matches_cpu_and_fuses_into_one_launch_per_step():
    per_step = neuron_steps_matching_cpu(_train)
    assert per_step[-1] == 1, per_step  # the whole step, forward and backward kernels included


def test_an_nki_op_is_one_node_under_torch_compile_and_runs_on_neuron(eager):
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(x):
        return nki_silu(x * 2) + 1

    x = torch.randn(130, 16)
    expect = f(x)
    torch._dynamo.reset()
    try:
        assert torch.equal(torch.compile(f, backend=capture)(x.to("neuron")).cpu(), expect)
        ops = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
        assert ops.count(torch.ops.nki_test.silu.default) == 1
        torch._dynamo.reset()
        adaptive_eager.reset_stats()
        got = torch.compile(f, backend="neuron")(x.to("neuron"))
        assert torch.equal(got.cpu(), expect)
        assert adaptive_eager.stats().launches >= 1
    finally:
        torch._dynamo.reset()


@adaptive_eager.nki_op("nki_test::silu_alloc_on_neuron", mutates_args=())
def nki_silu_alloc_on_neuron(x: Tensor) -> Tensor:
    # TorchNeuron's documented pattern: the output allocated on the device by name
    out = torch.empty(x.shape, dtype=x.dtype, device="neuron")
    silu_kernel(x, out)
    return out


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_an_nki_op_that_allocates_its_output_on_neuron_runs_as_one_launch(mode):
    """issue 38, item 7: the body runs on host tensors, so its `device="neuron"` output was a
    device tensor beside host ones, and the kernel refused the mix."""
    x = torch.randn(130, 16)
    expect = torch.nn.functional.silu(x)
    with adaptive_eager.mode(mode):
        xn = x.to("neuron")
        per_call = []
        for _ in range(6):
            before = adaptive_eager.stats().launches
            got = nki_silu_alloc_on_neuron(xn) * 2
            torch.neuron.synchronize()
            per_call.append(adaptive_eager.stats().launches - before)
    assert got.device.type == "neuron"
    assert torch.allclose(got.cpu(), expect * 2, rtol=1e-6, atol=1e-6)
    assert torch.equal(got.cpu(), (nki_silu(xn) * 2).cpu())  # the empty_like pattern's bits
    assert per_call[-1] == (1 if mode == "adaptive" else 2), per_call


def test_an_nki_op_that_allocates_its_output_on_neuron_compiles(eager):
    x = torch.randn(130, 16)
    torch._dynamo.reset()
    try:
        got = torch.compile(lambda t: nki_silu_alloc_on_neuron(t) + 1, backend="neuron")(x.to("neuron"))
        assert torch.equal(got.cpu(), (nki_silu(x.to("neuron")) + 1).cpu())
    finally:
        torch._dynamo.reset()


PDB_SCRIPT = textwrap.dedent('''
    import torch
    import adaptive_eager.nki as nki
    import adaptive_eager.nki.isa as nisa
    import adaptive_eager.nki.language as nl

    @nki.jit
    def double(x):
        tile = nl.load(x)
        doubled = nl.add(tile, tile)
        breakpoint()
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        nl.store(out, doubled)
        return out

    x = torch.arange(12.0).reshape(3, 4).to("neuron")
    print("RESULT", double(x).cpu().tolist())
''')


def test_a_breakpoint_inside_a_kernel_shows_real_tile_values():
    commands = "p doubled.values().tolist()\np tile.shape, tile.buffer\nc\n"
    proc = subprocess.run([sys.executable, "-c", PDB_SCRIPT], input=commands, capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    expect = [[2.0 * (4 * r + c) for c in range(4)] for r in range(3)]
    assert repr(expect) in proc.stdout
    assert "((3, 4), nl.sbuf)" in proc.stdout
    assert f"RESULT {expect}" in proc.stdout


def test_the_readmes_nki_example_runs(tmp_path):
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme[readme.index("## NKI kernels on the emulated chip"):]
    example = section[section.index("```python\n") + len("```python\n"):section.index("```\n", section.index("```python"))]
    example += "\nassert torch.equal(z, x + y) and torch.equal(zn.cpu(), x + y)\nprint('EXAMPLE OK')\n"
    proc = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, cwd=tmp_path,
                          timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    assert "EXAMPLE OK" in proc.stdout and "us modelled" in proc.stdout
    assert (tmp_path / "kernel.json").is_file()


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_nki_kernels_in_projection_cost_what_they_cost_with_values(mode):
    """Note [NKI kernels in projection mode]: before, refused ("needs its arguments' values")."""
    def step(projected: bool):
        with adaptive_eager.mode(mode), adaptive_eager.projection() if projected else contextlib.nullcontext():
            x = torch.ones(200, 64, device="neuron").requires_grad_()
            a, out = torch.ones(128, 64, device="neuron"), torch.empty(128, 64, device="neuron")
            torch.neuron.synchronize()
            adaptive_eager.reset_stats()
            y = nki_silu(x)  # a result, then its NKI backward
            y.backward(torch.ones_like(y))
            nki_scale_into(a, out)  # and a kernel that writes an argument
            s = adaptive_eager.stats()
            return ((y.shape, x.grad.shape), (s.launches, s.device_time_us, s.memory_bytes),
                    [adaptive_eager.is_projected(t) for t in (y, x.grad, out)])

    with_bytes, projected = step(False), step(True)
    assert projected[:2] == with_bytes[:2] and with_bytes[1][1] > 0
    assert projected[2] == [True] * 3 and with_bytes[2] == [False] * 3


def test_an_nki_kernel_too_large_to_run_on_placeholder_values_is_refused_by_name():
    with adaptive_eager.projection():
        x = torch.empty(2**20, 80, device="neuron")  # 320 MiB
        with pytest.raises(NotImplementedError, match="NKI kernel nki_test::silu in projection mode.*320 MiB"):
            nki_silu(x)
            torch.neuron.synchronize()
