"""torch.distributed on neuron: the "neuron" process-group backend, its collectives, DDP.

The multi-process tests start `torchrun --nproc-per-node=2` on 127.0.0.1, as a user would:
tests/distributed_worker.py runs every scenario once per rank and writes what it saw to a
JSON file per rank; the tests below assert on those files. The three torchrun jobs (the
worker with backend="neuron", the worker with no backend, the README's DDP demo) start
together in one module fixture, so the file costs about one job's wall time.
"""
from __future__ import annotations

import importlib
import json
import pathlib
import re

import pytest
import torch
import torch.distributed as dist

from adaptive_eager.dispatch.classify import classify
from torchrun import finish as _finish
from torchrun import torchrun as _torchrun

WORKER = pathlib.Path(__file__).parent.parent / "distributed_worker.py"
REPO = WORKER.parent.parent
DEMO_STEPS = 6


def _ranks(out_dir: pathlib.Path) -> list[dict]:
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{'neuron': [rank0, rank1], 'default': [...], 'demo': stdout}, from three concurrent jobs."""
    neuron_dir, default_dir = tmp_path_factory.mktemp("neuron"), tmp_path_factory.mktemp("default")
    jobs = {
        "neuron": _torchrun(str(WORKER), str(neuron_dir)),
        "default": _torchrun(str(WORKER), str(default_dir), "--default-init"),
        "demo": _torchrun("-m", "adaptive_eager.cli.ddp_demo", "--steps", str(DEMO_STEPS)),
    }
    outputs = {name: _finish(proc) for name, proc in jobs.items()}
    return {"neuron": _ranks(neuron_dir), "default": _ranks(default_dir), "demo": outputs["demo"]}


@pytest.fixture(params=["neuron", "default"])
def ranks(request, runs):
    """Both ways of creating the group: backend="neuron", and no backend at all."""
    return runs[request.param]


# -- the backend -----------------------------------------------------------------------------------
def test_neuron_backend_is_registered_for_neuron_and_cpu_tensors():
    assert "NEURON" in dist.Backend._plugins
    assert dist.Backend.default_device_backend_map["neuron"] == "neuron"
    assert sorted(dist.Backend.backend_capability["neuron"]) == ["cpu", "neuron"]
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"  # CPU's own default untouched


def test_init_process_group_with_backend_neuron_names_the_group_neuron(runs):
    assert [r["backend"] for r in runs["neuron"]] == ["neuron", "neuron"]


def test_both_init_styles_give_one_gloo_backend_for_neuron_and_cpu(ranks):
    for r in ranks:
        assert r["world"] == 2
        assert r["backend_types"] == {"neuron": "ProcessGroupGloo", "cpu": "ProcessGroupGloo"}


# -- collectives -----------------------------------------------------------------------------------
def test_all_reduce_sums_and_maxes_neuron_tensors_in_place(ranks):
    for r in ranks:
        assert r["all_reduce_sum"] == [1.0, 3.0, 5.0, 7.0]  # [0,1,2,3] + [1,2,3,4]
        assert r["all_reduce_returns_none"] and r["all_reduce_device"] == "neuron:0"
        assert r["all_reduce_max"] == [1.0, 10.0]


def test_all_reduce_does_not_charge_device_memory_again(ranks):
    # the op writes its inputs in place: no new device memory
    assert all(r["memory_unchanged_by_all_reduce"] for r in ranks)


def test_broadcast_copies_the_source_ranks_tensor(ranks):
    assert [r["broadcast_from_1"] for r in ranks] == [[6.0] * 3, [6.0] * 3]


def test_all_gather_fills_a_list_and_a_tensor(ranks):
    for r in ranks:
        assert r["all_gather_list"] == [[0.0, 0.0], [1.0, 1.0]]
        assert r["all_gather_list_devices"] == ["neuron:0", "neuron:0"]
        assert r["all_gather_into_tensor"] == [1.0, 1.0, 2.0, 2.0]


def test_all_gather_object_collects_every_ranks_object(ranks):
    assert [r["all_gather_object"] for r in ranks] == [[{"rank": 0}, {"rank": 1}]] * 2


def test_reduce_scatter_tensor_gives_each_rank_its_reduced_chunk(ranks):
    # input on rank k is [0,1,2,3] * (k+1); the sum is [0,3,6,9]; rank k keeps chunk k
    assert [r["reduce_scatter_tensor"] for r in ranks] == [[0.0, 3.0], [6.0, 9.0]]


def test_async_all_reduce_is_complete_after_wait_and_barrier_returns(ranks):
    for r in ranks:
        assert r["async_all_reduce"] == [3.0, 3.0, 3.0]
        assert r["barrier_passed"] is True


def test_a_collective_is_a_named_profiler_range(ranks):
    assert [r["profiled_collective_ranges"] for r in ranks] == [["neuron::c10d::allreduce_"]] * 2


def test_the_group_serves_cpu_tensors_too(ranks):
    assert [r["cpu_all_reduce"] for r in ranks] == [[3.0, 3.0], [3.0, 3.0]]


def test_a_cpu_tensor_in_a_neuron_collective_is_refused_with_the_device_error(ranks):
    for r in ranks:
        assert r["mixed_device_error"] is not None, "all_gather mixed cpu and neuron tensors silently"
        assert "Expected all tensors to be on the same device" in r["mixed_device_error"]
        assert "c10d::allgather_" in r["mixed_device_error"], r["mixed_device_error"]  # the op, named


# -- reduce ops gloo lacks: Note [Reduce ops as NCCL computes them] (device/csrc/aten/collectives.cpp) --
def test_all_reduce_avg_of_integers_sums_then_truncates_toward_zero_as_nccl(ranks):
    # gloo raised "result type Float can't be cast to the desired output type Long".
    for r in ranks:
        for dtype in ("torch.int32", "torch.int64"):
            assert r[f"avg_{dtype}"] == [1, -2, 7], r[f"avg_{dtype}"]  # [3, -5, 15] / 2, toward zero
        assert r["avg_torch.uint8"] == [1, 2, 7]  # [3, 5, 15] / 2
        assert r["avg_int64_async"] == [1, -2, 7]
        assert r["avg_float32"] == [1.0, 4.0]  # floating AVG: gloo's own, unchanged


def test_premul_sum_scales_each_ranks_input_then_sums_as_nccl(ranks):
    # gloo raised "Cannot use ReduceOp.PREMUL_SUM with Gloo".
    for r in ranks:
        assert r["premul_sum_scalar"] == [10.0, 15.0, 20.0, 25.0], r["premul_sum_scalar"]
        assert r["premul_sum_tensor"] == [10.0, 15.0, 20.0, 25.0], r["premul_sum_tensor"]
        factor = torch.tensor(0.3, dtype=torch.bfloat16)
        per_rank = [torch.tensor([1.0, 3.0], dtype=torch.bfloat16) * factor] * 2
        assert r["premul_sum_bf16"] == (per_rank[0] + per_rank[1]).tolist()


def test_reduce_scatter_premul_sum_and_integer_avg_leave_the_input_as_it_was(ranks):
    # input on rank k is [0,1,2,3] * (k+1): premul 0.5 then sum gives [0,1.5,3,4.5]; AVG of the
    # integers [0,3,6,9] / 2 toward zero gives [0,1,3,4]
    assert [r["reduce_scatter_premul_sum"] for r in ranks] == [
        {"result": [0.0, 1.5], "input_unchanged": True}, {"result": [3.0, 4.5], "input_unchanged": True}]
    assert [r["reduce_scatter_avg_int"] for r in ranks] == [
        {"result": [0, 1], "input_unchanged": True}, {"result": [3, 4], "input_unchanged": True}]


# -- the adaptive engine ---------------------------------------------------------------------------
def test_collectives_waits_and_redistributions_are_classified_as_collectives():
    for module in ("torch.distributed._functional_collectives", "torch.distributed.tensor"):
        importlib.import_module(module)  # registers _c10d_functional, _dtensor

    for op in (torch.ops.c10d.allreduce_.default, torch.ops.c10d.broadcast_.default,
               torch.ops.c10d._allgather_base_.default, torch.ops.c10d._reduce_scatter_base_.default,
               # functional collectives (tensor parallelism, compiled graphs) and their wait
               torch.ops._c10d_functional.all_reduce.default, torch.ops._c10d_functional.wait_tensor.default,
               torch.ops._c10d_functional.all_gather_into_tensor.default,
               torch.ops._c10d_functional_autograd.all_to_all_single.default,
               torch.ops._dtensor.shard_dim_alltoall.default):
        assert classify(op).is_collective, op
    assert not classify(torch.ops.aten.add.Tensor).is_collective


def test_a_step_with_a_collective_fuses_around_it_and_matches_eager(runs):
    for r in runs["neuron"]:
        assert r["mode"] == "adaptive"
        assert r["loop_identical_to_eager"]
        assert r["loop_traces"] >= 1 and r["loop_fused_launches"] > 0
        assert r["loop_collectives_in_traces"] == 0  # a collective is never deferred


def test_a_functional_collective_with_a_host_read_on_one_rank_matches_eager(runs):
    for r in runs["neuron"]:
        assert r["functional_identical_to_eager"]
        assert r["functional_distributed_ops_in_traces"] == []  # never deferred into a trace
        assert r["functional_fused_launches"] > 0  # the ops around it still fuse


def test_a_collective_first_runs_the_held_back_ops_it_reads(runs):
    for r in runs["neuron"]:
        assert r["prefix_identical_to_eager"]
        assert r["prefix_flushes"].get("sync: c10d.allreduce_.default") == 1


# -- DDP -------------------------------------------------------------------------------------------
def test_ddp_on_neuron_trains_bit_identically_to_cpu_ddp_with_gloo(runs):
    for r in runs["neuron"]:
        assert r["ddp_params_changed"], "training did not change the parameters: nothing was compared"
        assert r["ddp_losses_identical_to_cpu"]
        assert r["ddp_params_identical_to_cpu"]
        assert r["ddp_params_equal_across_ranks"]


def test_ddp_loop_settles_without_divergences_and_fuses_between_collectives(runs):
    """Backward segments between collectives often start with the same op; the engine must
    hand those matches to the right trace rather than diverge every step (it did: 2 per step)."""
    warmup = 5
    for r in runs["neuron"]:
        launches, divergences = r["ddp_steady_launches"], r["ddp_steady_divergences"]
        assert divergences[warmup:] == [0] * (len(divergences) - warmup), divergences
        assert len(set(launches[warmup:])) == 1, launches
        assert launches[-1] < launches[0] / 3, launches  # fused: far fewer than one per op


def test_ddp_options_needing_pinned_memory_train_a_neuron_model_as_on_cpu(runs):
    # Refused at construction before the C++ host allocator: DDP's reducer keeps its
    # used-parameter map in pinned memory for both options.
    for r in runs["neuron"]:
        for option, params in r["ddp_options_needing_pinned_memory"].items():
            assert params["neuron"] == params["cpu"], option
    assert runs["neuron"][0]["ddp_options_needing_pinned_memory"] == runs["neuron"][1]["ddp_options_needing_pinned_memory"]


# -- the README's demo -----------------------------------------------------------------------------
def test_ddp_demo_prints_each_ranks_loss_and_launches_per_step(runs):
    out = runs["demo"]
    steps = re.findall(r"rank (\d) step +(\d+) +loss ([0-9.]+) +launches (\d+)", out)
    assert len(steps) == 2 * DEMO_STEPS, out
    for rank in ("0", "1"):
        launches = [int(n) for rk, _, _, n in steps if rk == rank]
        assert launches[-1] < launches[0], f"rank {rank}: no fewer launches once the step repeats: {launches}"
    assert "backend 'neuron'" in out
    assert out.count("parameters identical to rank 0's: True") == 2, out


# -- SyncBatchNorm (its CUDA-only kernels: dispatch/sync_batch_norm.py) ------------------------------
@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_sync_batch_norm_trains_across_ranks_as_one_batch_norm_over_the_whole_batch(runs, mode):
    """Each rank normalizes its shard with the statistics of every rank's: outputs, gradients and
    running statistics are those of one BatchNorm2d over the whole batch (to float32 rounding:
    SyncBatchNorm merges per-rank statistics, as on CUDA, where BatchNorm reduces at once). It
    raised 'aten::batch_norm_stats has no CPU kernel' before."""
    for r in runs["neuron"]:
        diffs = r[f"sync_bn_{mode}"]
        assert isinstance(diffs, dict), diffs
        assert diffs.pop("device") == "neuron:0"
        assert all(v < 2e-5 for v in diffs.values()), diffs
