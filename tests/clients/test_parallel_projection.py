"""Data and tensor parallelism of a Hugging Face Llama under torchrun, with bytes and in
projection (issue 40): tensor parallelism (DTensor's `parallelize_module`) on neuron gives CPU's
bits; a projected DDP, FSDP2 or tensor-parallel step costs what the same step with bytes costs
(launches, ops, modelled time, memory, transfers), collectives included, priced on the link
(Note [Collectives on the link]); tensor parallelism projects over 8 ranks; one process projects
rank 0 of 64 on torch's fake process group.

The ranks are tests/parallel_worker.py; each writes what it measured, the tests compare."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from adaptive_eager.device import PROFILES, DeviceConfig
from adaptive_eager.device.cost import CostModel
from clients import require
from torchrun import finish, torchrun

require("transformers")

WORKER = pathlib.Path(__file__).parent.parent / "parallel_worker.py"
PROJECTION = {"NEURON_PROJECTION": "1"}


def _run(tmp_path, runs: dict[str, tuple[str, str, dict, int]]) -> dict[str, list[dict]]:
    """Start each run (name -> device, kind, env, ranks) at once; each rank's results. A run
    with FAKE_WORLD in its env is one process (rank 0 of that many), without torchrun."""
    jobs = {}
    for name, (device, kind, env, ranks) in runs.items():
        (tmp_path / name).mkdir()
        args = (str(WORKER), str(tmp_path / name), device, kind)
        if "FAKE_WORLD" in env:
            jobs[name] = (subprocess.Popen([sys.executable, *args], env={**os.environ, **env}, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True), 1)
        else:
            jobs[name] = (torchrun(*args, env=env, nproc=ranks), ranks)
    for job, _ in jobs.values():
        finish(job)
    return {name: [json.loads((tmp_path / name / f"rank{r}.json").read_text()) for r in range(ranks)]
            for name, (_, ranks) in jobs.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parallel")
    cpu = {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    return _run(tmp, {"tp-cpu": ("cpu", "tp", cpu, 2), "tp": ("neuron", "tp", {}, 2),
                      "tp-projected": ("neuron", "tp", PROJECTION, 2),
                      "ddp": ("neuron", "ddp", {}, 2), "ddp-projected": ("neuron", "ddp", PROJECTION, 2),
                      "fsdp2": ("neuron", "fsdp2", {}, 2), "fsdp2-projected": ("neuron", "fsdp2", PROJECTION, 2),
                      "tp8-projected": ("neuron", "tp", PROJECTION, 8),
                      "fsdp2-fake2": ("neuron", "fsdp2", {**PROJECTION, "FAKE_WORLD": "2"}, 1),
                      "fsdp2-fake64": ("neuron", "fsdp2", {**PROJECTION, "FAKE_WORLD": "64"}, 1)})


def test_tensor_parallel_llama_on_neuron_trains_to_the_cpu_runs_bits(runs):
    for neuron, cpu in zip(runs["tp"], runs["tp-cpu"]):
        assert neuron["losses"] == cpu["losses"] and len(neuron["losses"]) == 4
        assert neuron["params"] == cpu["params"]
        assert neuron["local_shapes"][1] == [32, 64]  # q_proj's 64 output features split over 2 ranks


@pytest.mark.parametrize("kind", ["tp", "ddp", "fsdp2"])
def test_a_projected_parallel_step_costs_exactly_what_the_step_with_bytes_costs(runs, kind):
    for with_bytes, projected in zip(runs[kind], runs[f"{kind}-projected"]):
        assert "params" not in projected  # nothing to read back: no values
        assert len(projected["steps"]) == 4
        assert projected["steps"] == with_bytes["steps"]  # every figure of every step, exactly
        assert projected["probe"] == {**with_bytes["probe"], "sum": None}


def test_an_all_reduce_is_priced_on_the_ranks_share_of_the_link(runs):
    # 1 MiB over 2 ranks (trn2, LNC=2: 4 ranks share a chip's 1,024 GB/s): 2 hops, 2 x 1/2 MiB
    # on the wire, 1/2 MiB reduced at half the rank's DMA share (Note [Collective figures]).
    cost = CostModel(DeviceConfig.from_env({}))
    figures = cost.collective_costs()
    mib = 2**20
    expected = (cost.launch_overhead_us + 2 * figures["hop_us"] + mib * figures["link_us_per_byte"]
                + mib / 2 * figures["reduce_us_per_byte"])
    assert figures["link_us_per_byte"] == pytest.approx(1e6 / (PROFILES["trn2"].neuronlink_bytes_per_s / 4))
    for rank in runs["tp"]:
        probe = rank["probe"]
        assert probe["launches"] == 1
        assert probe["device_us"] == pytest.approx(expected, rel=1e-12)
        assert probe["sum"] == 4 * 512 * 512  # summed twice over two ranks of ones
        assert probe["future_device"] == "neuron:0"  # the device's tensors, not gloo's host aliases


def test_tensor_parallelism_projects_over_eight_ranks(runs):
    ranks = runs["tp8-projected"]
    assert [r["world"] for r in ranks] == [8] * 8
    assert all(r["local_shapes"][1] == [8, 64] for r in ranks)  # q_proj's 64 features over 8 ranks
    assert all(r["steps"] == ranks[0]["steps"] for r in ranks)  # a symmetric step: every rank alike
    assert ranks[0]["steps"][-1]["memory"] < runs["tp-projected"][0]["steps"][-1]["memory"]  # smaller shards


def test_one_process_projects_rank_zero_of_a_job_on_the_fake_process_group(runs):
    # torch's FakeProcessGroup: rank 0 of 2 alone spends what rank 0 of the two-process job spends.
    alone, in_the_job = runs["fsdp2-fake2"][0], runs["fsdp2-projected"][0]
    assert alone["world"] == 2 and alone["steps"] == in_the_job["steps"]
    # and rank 0 of 64, which no machine here could start 64 processes for: a 64th of each layer
    wide = runs["fsdp2-fake64"][0]
    assert wide["world"] == 64 and len(wide["steps"]) == 4
    assert wide["steps"][-1]["memory"] < alone["steps"][-1]["memory"]
