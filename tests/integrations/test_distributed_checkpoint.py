"""torch.distributed.checkpoint (DCP) with neuron loaded: it asks the accelerator for its
current stream (`torch.neuron.current_stream`), which was missing, so even a CPU state dict
failed to save, with a BaseException that `except Exception` misses."""
from __future__ import annotations

import warnings

import torch
import torch.distributed.checkpoint as dcp


def test_dcp_saves_and_loads_cpu_and_neuron_tensors_in_place(tmp_path):
    state = {"cpu": torch.arange(4.0), "neuron": torch.arange(3.0, device="neuron") * 2}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group is initialized
        dcp.save(state, checkpoint_id=str(tmp_path))
        loaded = {"cpu": torch.zeros(4), "neuron": torch.zeros(3, device="neuron")}
        dcp.load(loaded, checkpoint_id=str(tmp_path))
    assert torch.equal(loaded["cpu"], torch.arange(4.0))
    assert loaded["neuron"].device == torch.device("neuron:0")
    assert torch.equal(loaded["neuron"].cpu(), torch.arange(3.0) * 2)
