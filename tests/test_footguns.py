"""Known sharp edges of the emulated `neuron` device, each pinned by a test of today's
behaviour. When one gets fixed, its test fails: update the table and the test together.

| # | footgun                                                      | what happens today                              | why                                                                                   | workaround                                              |
|---|--------------------------------------------------------------|-------------------------------------------------|---------------------------------------------------------------------------------------|---------------------------------------------------------|
| 8 | `torch.nested.nested_tensor(parts, device='neuron')` (strided layout) | it is made; its first use (any op, `.cpu()`, printing) raises "dense (strided) only ... use the jagged layout" | torch's factory builds it below the dispatcher, where no kernel of ours is asked (Note [Dense layouts only]); every other constructor refuses at the call | `layout=torch.jagged` |
| 7 | `import device` (or `dispatch`) before anything imports torch | `neuron` is not registered until `import adaptive_eager` | torch's autoload runs while our package is half-imported and leaves registration to it | `import torch` or `import adaptive_eager` first (the usual order) |
"""

import pytest
import torch

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


def test_8_a_strided_nested_tensor_from_the_factory_is_refused_at_its_first_use():
    made = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], device="neuron")
    with pytest.raises(NotImplementedError, match="use the jagged layout|Use the jagged layout"):
        print(made)
