"""Known sharp edges of the emulated `neuron` device, each pinned by a test of today's
behaviour. When one gets fixed, its test fails: update the table and the test together.

| # | footgun                                                      | what happens today                              | why                                                                                   | workaround                                              |
|---|--------------------------------------------------------------|-------------------------------------------------|---------------------------------------------------------------------------------------|---------------------------------------------------------|
| 3 | `torch.load(cpu_checkpoint, map_location='neuron')`           | the CPU tensors stay CPU tensors                | moving a storage to 'neuron' would make a real PrivateUse1 storage, which NeuronTensor wrappers cannot use, so host_compat keeps it on the host; only NeuronTensor checkpoints rebuild on the device (NEURON_TENSORS=native loads onto the device) | `model.load_state_dict(...)` on a neuron model, or `.to('neuron')` |
| 5 | a bad `NEURON_*` value                                        | `import torch` itself fails (cause names the variable) | torch's backend autoload re-raises any entry-point error (test_device_api.py pins the message) | fix the variable, or `TORCH_DEVICE_BACKEND_AUTOLOAD=0`    |
| 7 | `import device` (or `dispatch`) before anything imports torch | `neuron` is not registered until `import adaptive_eager` | torch's autoload runs while our package is half-imported and leaves registration to it | `import torch` or `import adaptive_eager` first (the usual order) |
"""
import io

import torch

from subproc import run_json

from neuron_tensors import NATIVE, is_neuron_tensor


def test_3_map_location_neuron_leaves_a_cpu_checkpoint_on_the_cpu():
    buf = io.BytesIO()
    torch.save({"w": torch.arange(3.0)}, buf)
    buf.seek(0)
    w = torch.load(buf, map_location="neuron", weights_only=True)["w"]
    if NATIVE:  # no footgun there: a real storage moves to the device, as with 'cuda'
        assert is_neuron_tensor(w) and w.tolist() == [0.0, 1.0, 2.0]
        return
    assert type(w) is torch.Tensor and w.device.type == "cpu"
    # the workaround
    model = torch.nn.Linear(3, 1, bias=False).to("neuron")
    model.load_state_dict({"weight": w.view(1, 3)})
    assert is_neuron_tensor(model.weight) and model.weight.tolist() == [[0.0, 1.0, 2.0]]


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
