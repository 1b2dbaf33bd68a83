"""Known sharp edges of the emulated `neuron` device, each pinned by a test of today's
behaviour. When one gets fixed, its test fails: update the table and the test together.

| # | footgun                                                      | what happens today                              | why                                                                                   | workaround                                              |
|---|--------------------------------------------------------------|-------------------------------------------------|---------------------------------------------------------------------------------------|---------------------------------------------------------|
| 5 | a bad `NEURON_*` value                                        | `import torch` itself fails (cause names the variable) | torch's backend autoload re-raises any entry-point error (test_device_api.py pins the message) | fix the variable, or `TORCH_DEVICE_BACKEND_AUTOLOAD=0`    |
| 7 | `import device` (or `dispatch`) before anything imports torch | `neuron` is not registered until `import adaptive_eager` | torch's autoload runs while our package is half-imported and leaves registration to it | `import torch` or `import adaptive_eager` first (the usual order) |
"""

from subproc import run_json



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
