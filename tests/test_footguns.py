"""Known sharp edges of the emulated `neuron` device, each pinned by a test of today's
behaviour. When one gets fixed, its test fails: update the table and the test together.

| # | footgun                                                      | what happens today                              | why                                                                                   | workaround                                              |
|---|--------------------------------------------------------------|-------------------------------------------------|---------------------------------------------------------------------------------------|---------------------------------------------------------|
| 1 | `torch.empty(n, pin_memory=True)` (any factory with pin_memory) | NotImplementedError naming getPinnedMemoryAllocator | the CPU factory asks the accelerator's hooks for a pinned allocator; a Python backend cannot provide one (needs C++) | `torch.empty(n).pin_memory()`, or leave pin_memory off    |
| 2 | `t.pin_memory().is_pinned()`                                  | False (pin_memory() returns a plain copy)       | host memory is pageable; the emulated device copies from it (dispatch/host_compat.py) | none needed: transfers behave the same                   |
| 3 | `torch.load(cpu_checkpoint, map_location='neuron')`           | the CPU tensors stay CPU tensors                | moving a storage to 'neuron' would segfault (no allocator), so host_compat keeps it on the host; only NeuronTensor checkpoints rebuild on the device | `model.load_state_dict(...)` on a neuron model, or `.to('neuron')` |
| 5 | a bad `NEURON_*` value                                        | `import torch` itself fails (cause names the variable) | torch's backend autoload re-raises any entry-point error (test_device_api.py pins the message) | fix the variable, or `TORCH_DEVICE_BACKEND_AUTOLOAD=0`    |
| 7 | `import device` (or `dispatch`) before anything imports torch | `neuron` is not registered until `import adaptive_eager` | torch's autoload runs while our package is half-imported and leaves registration to it | `import torch` or `import adaptive_eager` first (the usual order) |
| 9 | `DDP(neuron_model, static_graph=True)` or `find_unused_parameters=True` | NotImplementedError at construction, naming the option (pinned by test_distributed.py) | DDP's reducer then needs pinned host memory, which needs C++ | leave the option off (CPU models keep both) |
"""
import io

import pytest
import torch

from subproc import run_json

from dispatch import NeuronTensor


def test_1_factories_with_pin_memory_true_need_a_cpp_pinned_allocator():
    with pytest.raises(NotImplementedError, match="getPinnedMemoryAllocator"):
        torch.empty(2, pin_memory=True)
    with pytest.raises(NotImplementedError, match="getPinnedMemoryAllocator"):
        torch.zeros(2, pin_memory=True)
    # the workaround works
    assert torch.equal(torch.zeros(2).pin_memory(), torch.zeros(2))


def test_2_pin_memory_copies_but_never_reports_pinned():
    x = torch.ones(3)
    pinned = x.pin_memory()
    assert pinned is not x and torch.equal(pinned, x)
    assert pinned.is_pinned() is False


def test_3_map_location_neuron_leaves_a_cpu_checkpoint_on_the_cpu():
    buf = io.BytesIO()
    torch.save({"w": torch.arange(3.0)}, buf)
    buf.seek(0)
    w = torch.load(buf, map_location="neuron", weights_only=True)["w"]
    assert type(w) is torch.Tensor and w.device.type == "cpu"
    # the workaround
    model = torch.nn.Linear(3, 1, bias=False).to("neuron")
    model.load_state_dict({"weight": w.view(1, 3)})
    assert isinstance(model.weight, NeuronTensor) and model.weight.tolist() == [[0.0, 1.0, 2.0]]


def test_7_importing_device_first_leaves_neuron_unregistered_until_adaptive_eager():
    out = run_json("""
        import device
        import torch
        try:
            torch.ones(1, device='neuron')
            before = 'registered'
        except RuntimeError:
            before = 'unregistered'
        import adaptive_eager
        emit([before, str(torch.ones(1, device='neuron').device)])
    """)
    assert out == ["unregistered", "neuron:0"]
