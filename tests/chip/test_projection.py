"""Projection mode (adaptive_eager.projection): tensors without bytes, costs as with them.

The promise tested here: a program run in projection mode spends on the modelled device what
the same program spends with bytes (launches, ops, device time, transfers, memory and its
peak, an OutOfMemoryError at the same op), in eager and adaptive mode, while its tensors take
no host memory; host reads answer a placeholder, counted; a projected tensor never shows values
it does not have.
"""
from __future__ import annotations

import contextlib
import gc
import resource

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import adaptive_eager
from adaptive_eager.mode import SWITCH
from models import TinyGPT
from subproc import run_json


def _mlp():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).to("neuron")
    x, y = torch.randn(16, 32).to("neuron"), torch.randn(16, 8).to("neuron")
    return model, lambda: F.mse_loss(model(x), y)


def _gpt():
    model = TinyGPT().to("neuron")
    idx = torch.randint(0, 13, (4, 9)).to("neuron")
    return model, lambda: F.cross_entropy(model(idx[:, :-1]).reshape(-1, 13), idx[:, 1:].reshape(-1))


def _cnn():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                          nn.Linear(8 * 7 * 7, 10)).to("neuron")
    x, y = torch.randn(4, 3, 16, 16).to("neuron"), torch.randint(0, 10, (4,)).to("neuron")
    return model, lambda: F.cross_entropy(model(x), y)


def _hf_llama():
    transformers = pytest.importorskip("transformers", reason="the clients extra: pip install -e '.[clients]'")
    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    with torch.device("neuron"):  # built on the device, in bfloat16: as a full-size model is projected
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tokens = torch.randint(0, 128, (2, 32), device="neuron")
    return model, lambda: model(input_ids=tokens, labels=tokens).loss


MODELS = {"mlp-mse": _mlp, "gpt-attention": _gpt, "cnn-batchnorm": _cnn, "hf-llama-bf16": _hf_llama}


def _fresh():
    """Counters zeroed, an engine that has seen nothing, and no garbage of an earlier run left
    for the collector to free in the middle of this one: the two runs start alike."""
    gc.collect()
    torch.manual_seed(0)
    adaptive_eager.reset_stats()
    SWITCH.adaptive.reset()


def _train(make, mode: str, projected: bool, steps: int = 6):
    """The modelled device's figures after each step of AdamW training (memory: what the run
    holds beyond what was allocated before it), and the model."""
    _fresh()
    base = torch.neuron.memory_allocated()
    figures = []
    with adaptive_eager.mode(mode), adaptive_eager.projection() if projected else contextlib.nullcontext():
        model, loss_of = make()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(steps):
            opt.zero_grad()
            loss_of().backward()
            opt.step()
            s = adaptive_eager.stats()
            figures.append(dict(launches=s.launches, ops=s.ops, device_time_us=s.device_time_us,
                                transfers=s.transfers, transfer_bytes=s.transfer_bytes,
                                memory=s.memory_bytes - base, peak=s.peak_memory_bytes - base, fused=s.fused_launches))
    return figures, model


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
@pytest.mark.parametrize("model", list(MODELS))
def test_a_projected_training_step_costs_exactly_what_it_costs_with_bytes(model, mode):
    with_bytes = _train(MODELS[model], mode, projected=False)[0]
    projected, trained = _train(MODELS[model], mode, projected=True)
    assert projected == with_bytes  # every step: launches, ops, device µs, transfers, memory, peak
    assert all(adaptive_eager.is_projected(p) for p in trained.parameters())
    if mode == "adaptive":  # the engine fused the projected steps as it fuses the real ones
        assert projected[-1]["fused"] >= 2 and projected[-1]["launches"] - projected[-2]["launches"] == 1


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_a_second_projected_run_in_the_process_projects_what_its_ops_write_too(mode):
    """The first run's ops teach the eager path their outputs' geometry, and it posts their
    later calls (Note [Eager ops run on the device]): posted, an op wrote shared bytes, and
    the second run's AdamW left its parameters and state with host values, not projected."""
    first, _ = _train(_mlp, mode, projected=True, steps=2)
    second, trained = _train(_mlp, mode, projected=True, steps=2)
    assert second == first
    assert all(adaptive_eager.is_projected(p) for p in trained.parameters())


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_out_of_memory_is_raised_at_the_same_op_as_with_bytes(mode):
    with_bytes = _train(_gpt, mode, projected=False, steps=1)[0]
    limit = with_bytes[0]["peak"] * 3 // 4  # the first step does not fit
    capacity = torch.neuron.get_device_properties(0).total_memory

    def first_oom(projected: bool):
        _fresh()
        torch.neuron.set_per_process_memory_fraction((torch.neuron.memory_allocated() + limit) / capacity)
        try:
            with pytest.raises(torch.OutOfMemoryError) as raised:
                _train(_gpt, mode, projected, steps=1)
        finally:
            torch.neuron.set_per_process_memory_fraction(1.0)
        message, ops = str(raised.value), adaptive_eager.stats().ops
        del raised  # its traceback holds the run's model and optimizer: freed before the next run
        return message, ops

    projected, with_bytes = first_oom(projected=True), first_oom(projected=False)
    assert with_bytes[1] > 100  # mid-step, deep in the backward
    assert projected == with_bytes  # the same message (sizes), the same op


def test_host_reads_in_projection_answer_a_placeholder_counted_and_warned_once():
    # In a process of its own: the warning is once per process.
    result = run_json("""
        import warnings
        import torch, adaptive_eager
        with warnings.catch_warnings(record=True) as caught, adaptive_eager.projection():
            warnings.simplefilter("always")
            x = torch.randn(3, 4, device="neuron")
            loss = (x * 2).sum()
            values = [loss.item(), float(loss), (x > 0).any().item(), x.cpu().tolist()]
        emit(dict(values=values, reads=adaptive_eager.stats().placeholder_reads,
                  warned=[str(w.message) for w in caught if "projection mode" in str(w.message)]))
    """)
    assert result["values"] == [0.0, 0.0, False, [[0.0] * 4] * 3]
    assert result["reads"] == 4
    assert len(result["warned"]) == 1 and "placeholder" in result["warned"][0]


def test_a_projected_tensor_has_no_values_to_read_or_compute_with_outside_projection():
    with adaptive_eager.projection():
        x = torch.randn(3, 4, device="neuron")
    assert adaptive_eager.is_projected(x)
    with pytest.raises(RuntimeError, match="made in projection mode"):
        x.sum().item()
    with pytest.raises(RuntimeError, match="made in projection mode"):
        x.cpu()
    with pytest.raises(RuntimeError, match="made in projection mode"):
        (x + 1).cpu()  # the op itself is refused (at the latest at this sync)
        torch.neuron.synchronize()


def test_a_tensor_written_in_projection_forgets_the_values_it_had():
    x = torch.arange(6.0, device="neuron")
    memory = torch.neuron.memory_allocated()
    with adaptive_eager.projection():
        x.mul_(2)
        assert torch.neuron.memory_allocated() == memory  # same bytes charged, no values behind them
    assert adaptive_eager.is_projected(x)
    with pytest.raises(RuntimeError, match="made in projection mode"):
        x.tolist()  # not the stale [0, 1, 2, ...]
    assert not adaptive_eager.is_projected(torch.arange(6.0, device="neuron"))  # outside: bytes again


def test_projection_holds_a_model_larger_than_this_machine_without_its_bytes():
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    allocated = torch.neuron.memory_allocated()
    free = torch.neuron.get_device_properties(0).total_memory - allocated  # 24 GiB on trn2, less what tests hold
    n = free // 4 // 3 * 2  # float32 elements: two thirds of what is free (16 GiB)
    with adaptive_eager.projection():
        weight = torch.empty(n, device="neuron")
        weight.zero_()
        half = weight[: n // 2] * 2  # the last third
        assert torch.neuron.memory_allocated() - allocated == (n + n // 2) * 4
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
            weight[: n // 2] + 1  # past the device's capacity, as on the chip
        del weight, half
    assert torch.neuron.memory_allocated() == allocated
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 512 << 10  # < 512 MiB of host memory


def test_an_op_without_a_shape_function_is_refused_by_name():
    with adaptive_eager.projection():
        x = torch.randn(8, device="neuron")
        # No Meta kernel, and a CPU kernel that writes into its arguments: it cannot run on zeros instead.
        with pytest.raises(NotImplementedError, match="aten::_cummax_helper has no shape function"):
            torch.cummax(x, 0)
            torch.neuron.synchronize()


def test_custom_kernels_run_their_shape_function_and_cost_hook_in_projection():
    @adaptive_eager.custom_kernel("projection_test::scale", fake=True,
                                  cost=lambda x, s: {"flops": 1000 * x.numel(), "bytes": 2 * x.nbytes})
    def scale(x: torch.Tensor, s: float) -> torch.Tensor:
        return x * s

    @adaptive_eager.custom_kernel("projection_test::no_shape")
    def no_shape(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    def run(projected: bool):
        _fresh()
        with adaptive_eager.mode("eager"), adaptive_eager.projection() if projected else contextlib.nullcontext():
            y = scale(torch.ones(64, 64, device="neuron"), 3.0)
            s = adaptive_eager.stats()
            return y.shape, adaptive_eager.is_projected(y), s.launches, s.device_time_us, s.memory_bytes

    with_bytes, projected = run(False), run(True)
    assert projected[1] and not with_bytes[1]
    assert projected[:1] + projected[2:] == with_bytes[:1] + with_bytes[2:]
    with adaptive_eager.projection():
        with pytest.raises(NotImplementedError, match="projection_test::no_shape has no shape function"):
            no_shape(torch.ones(4, device="neuron"))


def test_NEURON_PROJECTION_projects_the_whole_process():
    result = run_json("""
        import torch, adaptive_eager
        x = torch.ones(1024, 1024, device="neuron")
        y = x @ x
        emit(dict(projected=adaptive_eager.is_projected(y), value=y[0, 0].item(),
                  memory=torch.neuron.memory_allocated()))
    """, env={"NEURON_PROJECTION": "1"})
    assert result == dict(projected=True, value=0.0, memory=2 * 4 << 20)


def test_ops_whose_sizes_are_data_run_on_placeholder_zeros_counted():
    with adaptive_eager.projection():
        x = torch.randn(3, 4, device="neuron")
        before = adaptive_eager.stats().placeholder_reads
        assert x[x > 0].shape == (0,)  # a boolean mask of zeros selects nothing
        assert torch.unique(x).shape == (1,)
        assert torch.nonzero(x).shape == (0, 2)
        assert adaptive_eager.stats().placeholder_reads - before == 3
        assert repr(x).startswith("tensor([[0., 0., 0., 0.],")  # print works, showing the placeholder


def test_compiled_graphs_project_with_the_neuron_backend_and_inductor_is_refused():
    import torch._dynamo

    torch._dynamo.reset()
    try:
        with adaptive_eager.projection():
            x = torch.randn(3, 4, device="neuron")
            assert adaptive_eager.is_projected(torch.compile(lambda a: a.sin() * 2, backend="neuron")(x))
            # Its generated kernels would read the bytes projected tensors do not have.
            with pytest.raises(NotImplementedError, match="inductor"):
                torch.compile(lambda a: a.cos() * 2)(x)
    finally:
        torch._dynamo.reset()


def test_a_copy_to_the_host_of_a_result_still_queued_is_a_counted_placeholder():
    with adaptive_eager.mode("eager"), adaptive_eager.projection():
        x = torch.ones(64, 64, device="neuron")
        for _ in range(3):
            x @ x  # the same key thrice: its plan is learnt, later calls are posted (still queued when read)
        before = adaptive_eager.stats(wait=False).placeholder_reads
        assert torch.equal((x @ x).cpu(), torch.zeros(64, 64))
        assert adaptive_eager.stats().placeholder_reads - before == 1
