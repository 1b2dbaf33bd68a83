"""Known sharp edges of the emulated `neuron` device, each pinned by a test of today's
behaviour. When one gets fixed, its test fails: update the table and the test together.

| # | footgun                                                      | what happens today                              | why                                                                                   | workaround                                              |
|---|--------------------------------------------------------------|-------------------------------------------------|---------------------------------------------------------------------------------------|---------------------------------------------------------|
| 8 | `torch.nested.nested_tensor(parts, device='neuron')` (strided layout) | it is made; its first use (any op, `.cpu()`, printing) raises "dense (strided) only ... use the jagged layout" | torch's factory builds it below the dispatcher, where no kernel of ours is asked (Note [Dense layouts only]); every other constructor refuses at the call | `layout=torch.jagged` |
| 9 | training in a `fork`ed child after a backward in the parent | the child's backward raises torch's "Unable to handle autograd's threading in combination with fork-based multiprocessing" | as on CUDA: autograd runs a device's backward on a thread of its own, which fork does not copy | start children with `spawn` or `forkserver` (`torch.multiprocessing.spawn`, `mp.get_context("spawn")`): they train as the parent does |
| 10 | `safetensors.torch.load_file(path, device='neuron')` | safetensors raises its own `SafetensorError: device neuron is invalid` | safetensors checks the device name against a list of its own (cpu, cuda, mps, npu, xpu, ...), before torch sees it | load on the host, then move: `model.load_state_dict(load_file(path))` into a neuron model, or `{k: v.to('neuron') for k, v in load_file(path).items()}` |
| 11 | an `nki.isa` instruction called outside any kernel after `NEURON_PLATFORM_TARGET_OVERRIDE` changed | it runs for the target the thread had at its first instruction outside a kernel (a trn3-only one raises "NeuronCore-v4" under override trn3) | outside a kernel each thread gets one interactive program, made on first use with the target of that moment (device/nki/program.py); kernels resolve the target per launch | call the instructions inside an `@nki.jit` kernel, or set the override before the thread's first one |
"""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from subproc import _PRELUDE, RESULT_MARKER, run_json



def test_8_a_strided_nested_tensor_from_the_factory_is_refused_at_its_first_use():
    made = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], device="neuron")
    with pytest.raises(NotImplementedError, match="use the jagged layout|Use the jagged layout"):
        print(made)


_FORK_AND_SPAWN = """
    import multiprocessing as mp
    import torch

    def train(queue):
        torch.set_num_threads(1)  # libgomp in a forked child (the README's other fork note)
        try:
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 2).to("neuron")
            model(torch.ones(3, 4, device="neuron")).sum().backward()
            queue.put(model.weight.grad.cpu().tolist())
        except RuntimeError as exc:
            queue.put(str(exc))

    if __name__ == "__main__":
        x = torch.ones(2, device="neuron", requires_grad=True)
        (x * 2).sum().backward()  # the parent's backward starts the device's autograd thread
        out = {}
        for method in ("fork", "spawn"):
            context = mp.get_context(method)
            queue = context.Queue()
            child = context.Process(target=train, args=(queue,))
            child.start()
            out[method] = queue.get(timeout=600)
            child.join()
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        model(torch.ones(3, 4)).sum().backward()
        out["cpu"] = model.weight.grad.tolist()
        emit(out)
"""


def test_9_training_in_a_forked_child_raises_as_on_cuda_and_spawn_trains(tmp_path):
    script = tmp_path / "fork_and_spawn.py"  # spawn re-imports __main__: a file, not -c
    script.write_text(_PRELUDE + textwrap.dedent(_FORK_AND_SPAWN))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900)
    assert RESULT_MARKER in proc.stdout, proc.stderr
    out = json.loads(proc.stdout.split(RESULT_MARKER)[-1])
    assert "Unable to handle autograd's threading in combination with fork-based multiprocessing" in out["fork"]
    assert out["spawn"] == out["cpu"]


def test_10_safetensors_refuses_to_load_onto_neuron_itself_and_host_then_move_works(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    path = str(tmp_path / "t.safetensors")
    safetensors_torch.save_file({"w": torch.arange(4.0, device="neuron")}, path)
    with pytest.raises(Exception, match="device neuron is invalid"):  # safetensors' own check
        safetensors_torch.load_file(path, device="neuron")
    moved = {k: v.to("neuron") for k, v in safetensors_torch.load_file(path).items()}
    assert moved["w"].device == torch.device("neuron:0") and torch.equal(moved["w"].cpu(), torch.arange(4.0))


def test_11_the_interactive_nki_program_keeps_the_target_it_was_made_with(monkeypatch):
    import threading

    import adaptive_eager.nki as nki
    import adaptive_eager.nki.isa as nisa
    import adaptive_eager.nki.language as nl

    def exponential():
        src = nl.ndarray((4, 8), nl.float32, nl.sbuf)
        nisa.memset(dst=src, value=0.0)
        nisa.exponential(dst=nl.ndarray((4, 8), nl.float32, nl.sbuf), src=src)  # NeuronCore-v4 only

    outcome = []

    def fresh_thread():  # a thread of its own: a fresh interactive program, whatever ran before
        nl.ndarray((1, 1), nl.float32, nl.sbuf)  # made under the profile's target (trn2)
        monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
        try:
            exponential()
            outcome.append("ran")
        except nisa.NkiValidationError as exc:
            outcome.append(str(exc))

    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE", raising=False)
    monkeypatch.setenv("NEURON_PROFILE", "trn2")
    worker = threading.Thread(target=fresh_thread)
    worker.start()
    worker.join()
    assert "NeuronCore-v4" in outcome[0]
    nki.jit(lambda x: exponential())(torch.zeros(1))  # a kernel reads the override at its launch
