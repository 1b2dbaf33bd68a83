"""torch.distributed on neuron tensors: c10d's collectives run by the eager path on the
device's bytes (gloo in place), so FSDP2 and FSDP1 train as they do on CPU."""
from __future__ import annotations

import json
import pathlib

import pytest

from torchrun import finish, torchrun

WORKER = pathlib.Path(__file__).with_name("fsdp_worker.py")


@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1"])
def test_fsdp_trains_a_neuron_model_to_the_cpu_models_bits(tmp_path, kind):
    # On the wrapper, FSDP2 stopped at storage resize_ (no storage) and, before streams, at
    # torch.neuron.Stream; FSDP1 at resize_ too, then (native tensors) at record_stream, which
    # the host fallback ran on CPU, which has no kernel for it.
    out = {dev: tmp_path / dev for dev in ("neuron", "cpu")}
    for d in out.values():
        d.mkdir()
    # The CPU reference is FSDP2 in both cases: FSDP1 refuses the CPU ("needs a non-CPU
    # accelerator"), and both shard the same way and average the same way (the gradient
    # divided by the world size before the reduce-scatter), so CPU's bits are FSDP2's.
    jobs = [torchrun(str(WORKER), str(out["neuron"]), "neuron", kind),
            torchrun(str(WORKER), str(out["cpu"]), "cpu", "fsdp2", env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})]
    for job in jobs:
        finish(job)
    ranks = {dev: [json.loads((d / f"rank{r}.json").read_text()) for r in range(2)] for dev, d in out.items()}
    for neuron, cpu in zip(ranks["neuron"], ranks["cpu"]):
        assert neuron["device"].startswith("neuron") and cpu["device"] == "cpu"
        assert neuron["losses"] == cpu["losses"]
        assert neuron["params"] == cpu["params"]
