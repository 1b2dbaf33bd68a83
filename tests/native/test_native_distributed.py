"""torch.distributed on native tensors: c10d's collectives run by the eager path on the
device's bytes (gloo in place), so FSDP2 trains as it does on CPU."""
from __future__ import annotations

import json
import pathlib


from torchrun import finish, torchrun

WORKER = pathlib.Path(__file__).with_name("fsdp2_worker.py")



def test_fsdp2_trains_a_neuron_model_to_the_cpu_models_bits(tmp_path):
    # On the wrapper, FSDP2 stops at storage resize_ (no storage) and, before streams, at
    # torch.neuron.Stream; on native tensors its collectives first met gloo's device check.
    out = {dev: tmp_path / dev for dev in ("neuron", "cpu")}
    for d in out.values():
        d.mkdir()
    jobs = [torchrun(str(WORKER), str(out["neuron"]), "neuron"),
            torchrun(str(WORKER), str(out["cpu"]), "cpu", env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})]
    for job in jobs:
        finish(job)
    ranks = {dev: [json.loads((d / f"rank{r}.json").read_text()) for r in range(2)] for dev, d in out.items()}
    for neuron, cpu in zip(ranks["neuron"], ranks["cpu"]):
        assert neuron["device"].startswith("neuron") and cpu["device"] == "cpu"
        assert neuron["losses"] == cpu["losses"]
        assert neuron["params"] == cpu["params"]
