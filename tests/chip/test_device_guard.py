"""The device guard and hooks in C++ (device/csrc/runtime/guard.cpp, Note [C++ device guard]).

C++ autograd calls the guard on its worker threads and in destructors that run while an
exception unwinds. With torch's Python guard, an exception in a backward hook (or a Ctrl-C
landing in a guard call) aborted the process, and backward on neuron:1 and above hit an
autograd INTERNAL ASSERT. The abort cases run in a child process: an abort there is a
failed test, not a dead test run.
"""
import threading

import pytest
import torch

import adaptive_eager
from adaptive_eager.device import native
from adaptive_eager.device.errors import NeuronDeviceError
from subproc import run_json

MODES = ["eager", "adaptive"]


@pytest.mark.parametrize("mode", MODES)
def test_an_exception_in_a_backward_hook_reaches_the_caller_as_on_cpu(mode):
    out = run_json(f"""
        import torch, adaptive_eager
        adaptive_eager.set_mode({mode!r})
        def failing(kind):
            def hook(*args):
                raise ValueError(kind)
            return hook
        def run(device):
            caught = []
            for _ in range(3):  # adaptive mode: the engine sees the same step repeat
                x = torch.ones(3, device=device, requires_grad=True)
                y = x * 2
                y.register_hook(failing("tensor hook"))
                try:
                    y.sum().backward()
                except ValueError as e:
                    caught.append(str(e))
                p = torch.nn.Parameter(torch.ones(3, device=device))
                p.register_post_accumulate_grad_hook(failing("post-accumulate hook"))
                try:
                    (p * p).sum().backward()
                except ValueError as e:
                    caught.append(str(e))
                m = torch.nn.Linear(3, 2).to(device)
                m.register_full_backward_hook(failing("module hook"))
                try:
                    m(torch.ones(4, 3, device=device, requires_grad=True)).sum().backward()
                except ValueError as e:
                    caught.append(str(e))
            ok = torch.ones(3, device=device, requires_grad=True)
            (ok * ok).sum().backward()  # autograd still works afterwards
            return caught, ok.grad.tolist()
        emit({{"neuron": run("neuron"), "cpu": run("cpu")}})
    """)
    assert out["neuron"] == out["cpu"]
    assert out["neuron"][0] == ["tensor hook", "post-accumulate hook", "module hook"] * 3


@pytest.mark.parametrize("mode", MODES)
def test_backward_on_every_device_puts_cpus_gradients_there(mode):
    adaptive_eager.set_mode(mode)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    x = torch.randn(4, 5)
    ref(x).square().sum().backward()
    for index in range(torch.neuron.device_count()):
        device = torch.device("neuron", index)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
        model.load_state_dict(ref.state_dict())
        model.to(device)
        model(x.to(device)).square().sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert p.grad.device == device
            assert torch.equal(p.grad.cpu(), q.grad)


def test_the_guard_counts_the_runtimes_devices():
    assert native._C.device_count() == torch.neuron.device_count() >= 2
    with pytest.raises(NeuronDeviceError, match=r"Invalid device: neuron:99.*out of range"):
        torch.neuron.set_device(99)


def test_the_current_device_is_per_thread_as_on_cuda():
    previous = torch.neuron.current_device()
    try:
        torch.neuron.set_device(1)
        seen = []
        worker = threading.Thread(target=lambda: seen.append(torch.neuron.current_device()))
        worker.start()
        worker.join()
        assert torch.neuron.current_device() == 1 and seen == [0]
        assert torch.ones(1, device="neuron").device == torch.device("neuron:1")
    finally:
        torch.neuron.set_device(previous)


def test_accelerator_device_index_context_switches_the_neuron_device():
    previous = torch.neuron.current_device()
    with torch.accelerator.device_index(1):
        assert torch.neuron.current_device() == torch.accelerator.current_device_index() == 1
        assert torch.ones(1, device="neuron").device == torch.device("neuron:1")
    assert torch.neuron.current_device() == previous


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_ctrl_c_during_training_is_a_keyboard_interrupt_never_an_abort(mode):
    # Interrupts land anywhere in the step, guard calls included; the loop catches them and
    # goes on, as a notebook does. The process must finish on its own. The handler raises only
    # inside the step and disarms itself as it raises: an interrupt landing in the loop's own
    # bookkeeping (the `while` test, the `except` clause) would escape any handler, on CPU too.
    out = run_json(f"""
        import os, signal, threading, time, torch, adaptive_eager
        adaptive_eager.set_mode({mode!r})
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to("neuron")
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(8, 16).to("neuron")
        armed = [False]
        def on_sigint(signum, frame):
            if armed[0]:
                armed[0] = False
                raise KeyboardInterrupt
        signal.signal(signal.SIGINT, on_sigint)
        stop = threading.Event()
        def interrupter():
            while not stop.wait(0.003):
                os.kill(os.getpid(), signal.SIGINT)
        caught = steps = 0
        threading.Thread(target=interrupter, daemon=True).start()
        end = time.monotonic() + 4
        while time.monotonic() < end:
            try:
                armed[0] = True
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
                armed[0] = False
                steps += 1
            except KeyboardInterrupt:
                caught += 1
        stop.set()
        emit({{"caught": caught, "steps": steps}})
    """)
    assert out["caught"] > 10, out  # the interrupts did land


def test_a_program_that_exits_right_after_a_backward_never_aborts():
    # Note [Autograd's device threads at exit] (dispatch/registration.py): the device thread
    # dropped its graph task, a Python decref, while the interpreter finalized, and the
    # process aborted after its last line ("terminate called without an active exception").
    # Without the exit hook, 32 of 120 such children aborted here, two running at a time.
    from subproc import start_json, communicate

    code = """
        import torch
        x = torch.ones(2, device="neuron", requires_grad=True)
        emit("started")
        (x * 3).sum().backward()  # and exit at once: the race is widest
    """
    outcomes = []
    for _ in range(12):
        pair = [start_json(code), start_json(code)]
        outcomes += [(p, communicate(p)) for p in pair]
    aborted = [err for p, (_, err) in outcomes if p.returncode != 0]
    assert not aborted, f"{len(aborted)} of {len(outcomes)} children failed, first: {aborted[0][-500:]}"
    assert all('"started"' in out for _, (out, _) in outcomes)
