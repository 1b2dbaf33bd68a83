"""Crashes, internal asserts and silent wrong answers of issues 12 and 13, seen on the wrapper
tensors: each one's program, pinned in both modes with CPU's values. (Forward-mode AD:
test_forward_ad.py; checkpointing: test_checkpointing.py; collectives: test_distributed.py.)"""
from __future__ import annotations

import pytest
import torch

import adaptive_eager

STEPS = 8  # enough for a trace to be adopted and matched


@pytest.fixture(params=["eager", "adaptive"])
def mode(request):
    with adaptive_eager.mode(request.param):
        yield request.param


def test_ops_that_return_nothing_run_inside_a_repeating_step(mode):
    # cholesky's _linalg_check_errors and _assert_async return nothing: they are part of the
    # stream too (they failed every step in a deferred launch).
    a = (torch.eye(3) * 2 + 0.5).to("neuron")
    for _ in range(STEPS):
        r = torch.linalg.cholesky(a)
        torch._assert_async(r.diagonal().sum() > 0, "cholesky gave a non-positive diagonal")
        y = r * 2
    assert torch.equal(y.cpu(), torch.linalg.cholesky((torch.eye(3) * 2 + 0.5)) * 2)


def test_a_second_to_neuron_of_a_trained_model_keeps_training(mode):
    # What accelerate's prepare() does to a model the Trainer already moved.
    def train(device, second_move):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 1)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(2, 4).to(device)
        for step in range(2 * STEPS):
            if step == STEPS and second_move:
                model.to(device)
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        return [p.detach().cpu() for p in model.parameters()]
    expected = train("cpu", False)
    assert all(torch.equal(a, b) for a, b in zip(train("neuron", True), expected))


def test_backward_on_the_second_device(mode):
    x = torch.randn(3, requires_grad=True, device="neuron:1")
    (x * x).sum().backward()
    assert x.grad.device == torch.device("neuron:1")
    assert torch.equal(x.grad.cpu(), 2 * x.detach().cpu())


def test_a_cpu_leaf_feeding_a_device_model_gets_its_gradient_on_the_cpu(mode):
    leaf = torch.randn(3, requires_grad=True)
    (leaf.to("neuron") * 2).sum().backward()
    assert leaf.grad.device.type == "cpu" and torch.equal(leaf.grad, torch.full((3,), 2.0))


def test_tensor_split_takes_cpu_indices_as_cpu_does(mode):
    x = torch.arange(6.0)
    parts = torch.tensor_split(x.to("neuron"), torch.tensor([2, 4]))
    assert [p.cpu().tolist() for p in parts] == [p.tolist() for p in torch.tensor_split(x, torch.tensor([2, 4]))]


def test_a_scripted_module_moves_to_neuron(mode):
    torch.manual_seed(0)
    cpu = torch.nn.Linear(2, 2)
    scripted = torch.jit.script(torch.nn.Linear(2, 2))
    scripted.load_state_dict(cpu.state_dict())
    scripted.to("neuron")
    x = torch.ones(1, 2)
    assert torch.equal(scripted(x.to("neuron")).detach().cpu(), cpu(x).detach())


@pytest.mark.parametrize("backend", ["neuron", "aot_eager"])
def test_a_compiled_function_that_mutates_a_captured_tensor_with_a_grad_requiring_value(mode, backend):
    # It aborted the process ("terminate called without an active exception").
    torch._dynamo.reset()

    def run(device):
        w = torch.zeros(3, device=device)

        def f(x):
            w.add_(x)
            return w * 2
        x = torch.ones(3, device=device, requires_grad=True)
        out = torch.compile(f, backend=backend)(x)
        out.sum().backward()
        return out.detach().cpu(), x.grad.cpu()
    got, expected = run("neuron"), run("cpu")
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_one_hot_of_a_class_out_of_range_raises_as_on_cpu(mode):
    # Issue 13 item 8: on the wrapper it gave a zero row for the bad class. (CPU says "Class
    # values must be smaller than num_classes"; the device's scatter names the index instead.)
    with pytest.raises(RuntimeError, match="Class values must be smaller than num_classes"):
        torch.nn.functional.one_hot(torch.tensor([1, 12, 3]), 10)
    with pytest.raises(RuntimeError, match="index 12 is out of bounds for dimension 1 with size 10"):
        torch.nn.functional.one_hot(torch.tensor([1, 12, 3]).to("neuron"), 10).cpu()
