"""torch.distributed on neuron tensors: c10d's collectives run by the eager path on the
device's bytes (gloo in place), so FSDP2, FSDP1 and distributed checkpointing train and resume
as they do on CPU."""
from __future__ import annotations

import json
import pathlib

import pytest

from torchrun import finish, torchrun

WORKER = pathlib.Path(__file__).parent.parent / "fsdp_worker.py"
MODES = {"eager": "0", "adaptive": "1"}


def _run(tmp_path, runs: dict[str, tuple[str, str, str, dict]]) -> dict[str, list[dict]]:
    """Start each run (name -> device, fsdp kind, model, env) at once; each rank's results."""
    jobs = {}
    for name, (device, kind, arch, env) in runs.items():
        (tmp_path / name).mkdir()
        jobs[name] = torchrun(str(WORKER), str(tmp_path / name), device, kind, arch, env=env)
    for job in jobs.values():
        finish(job)
    return {name: [json.loads((tmp_path / name / f"rank{r}.json").read_text()) for r in range(2)] for name in jobs}


@pytest.mark.parametrize("kind, arch, mode", [("fsdp2", "mlp", "adaptive"), ("fsdp2", "transformer", "eager"),
                                              ("fsdp2", "transformer", "adaptive"), ("fsdp1", "mlp", "adaptive")])
def test_fsdp_trains_and_resumes_a_neuron_model_to_the_cpu_models_bits(tmp_path, kind, arch, mode):
    # On the wrapper, FSDP2 stopped at storage resize_ (no storage) and, before streams, at
    # torch.neuron.Stream; FSDP1 at resize_ too, then (native tensors) at record_stream, which
    # the host fallback ran on CPU, which has no kernel for it.
    # The CPU reference is FSDP2 in both cases: FSDP1 refuses the CPU ("needs a non-CPU
    # accelerator"), and both shard the same way and average the same way (the gradient
    # divided by the world size before the reduce-scatter), so CPU's bits are FSDP2's.
    ranks = _run(tmp_path, {"neuron": ("neuron", kind, arch, {"NEURON_ADAPTIVE_EAGER": MODES[mode]}),
                            "cpu": ("cpu", "fsdp2", arch, {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})})
    for neuron, cpu in zip(ranks["neuron"], ranks["cpu"]):
        assert neuron["device"].startswith("neuron") and cpu["device"] == "cpu"
        assert neuron["losses"] == cpu["losses"] and len(set(cpu["losses"])) > 1
        assert neuron["params"] == cpu["params"]
        if kind == "fsdp2":
            # Resumed from the sharded DCP checkpoint taken after step 3: steps 4 and 5 again,
            # the same bits as the run that went on, on neuron as on CPU.
            assert neuron["resumed_losses"] == neuron["losses"][3:] == cpu["resumed_losses"]
            assert neuron["resumed_params"] == neuron["params"]
