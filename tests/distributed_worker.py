"""One rank of tests/integrations/test_distributed.py, started by `torchrun --nproc-per-node=2` (127.0.0.1).

Usage: distributed_worker.py OUT_DIR [--default-init]. Each rank writes OUT_DIR/rank<N>.json
with what it observed; the tests assert on those files. Checks that would stop the run are
recorded as values, not asserted here, so one failure does not hide the others.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import adaptive_eager
from adaptive_eager.mode import SWITCH

DDP_STEPS = 4
LOOP_STEPS = 12


def collectives(rank: int, world: int) -> dict:
    """Every collective the backend offers, on neuron tensors, with their results."""
    out = {}
    x = torch.arange(4, dtype=torch.float32, device="neuron") + rank
    memory_before = adaptive_eager.stats().memory_bytes
    returned = dist.all_reduce(x)
    out["all_reduce_sum"] = x.tolist()
    out["all_reduce_returns_none"] = returned is None
    out["all_reduce_device"] = str(x.device)
    out["memory_unchanged_by_all_reduce"] = adaptive_eager.stats().memory_bytes == memory_before
    m = torch.tensor([float(rank), 10.0 - rank], device="neuron")
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    out["all_reduce_max"] = m.tolist()
    b = torch.full((3,), float(rank + 5), device="neuron")
    dist.broadcast(b, src=1)
    out["broadcast_from_1"] = b.tolist()
    gathered = [torch.empty(2, device="neuron") for _ in range(world)]
    dist.all_gather(gathered, torch.full((2,), float(rank), device="neuron"))
    out["all_gather_list"] = [g.tolist() for g in gathered]
    out["all_gather_list_devices"] = [str(g.device) for g in gathered]
    into = torch.empty(2 * world, device="neuron")
    dist.all_gather_into_tensor(into, torch.full((2,), float(rank + 1), device="neuron"))
    out["all_gather_into_tensor"] = into.tolist()
    scattered = torch.empty(2, device="neuron")
    dist.reduce_scatter_tensor(scattered, torch.arange(2 * world, dtype=torch.float32, device="neuron") * (rank + 1))
    out["reduce_scatter_tensor"] = scattered.tolist()
    a = torch.ones(3, device="neuron") * (rank + 1)
    work = dist.all_reduce(a, async_op=True)
    work.wait()
    out["async_all_reduce"] = a.tolist()
    dist.barrier()
    out["barrier_passed"] = True
    from torch.profiler import ProfilerActivity, profile

    p = torch.ones(2, device="neuron")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dist.all_reduce(p)
    out["profiled_collective_ranges"] = sorted({e.name for e in prof.events() if e.name.startswith("neuron::c10d")})
    c = torch.ones(2) * (rank + 1)
    dist.all_reduce(c)  # CPU tensors on the same group
    out["cpu_all_reduce"] = c.tolist()
    try:  # a CPU tensor in a neuron collective: refused before any rank communicates
        dist.all_gather([torch.empty(2, device="neuron"), torch.empty(2)], torch.ones(2, device="neuron"))
    except RuntimeError as exc:
        out["mixed_device_error"] = str(exc)
    else:
        out["mixed_device_error"] = None
    objects = [None] * world
    dist.all_gather_object(objects, {"rank": rank})  # pickled objects through device tensors
    out["all_gather_object"] = objects
    world_group = dist.group.WORLD
    out["backend_types"] = {d: type(world_group._get_backend(torch.device(d))).__name__ for d in ("neuron", "cpu")}
    return out


def _attempt(fn):
    """fn()'s value, or the error it raised as 'Type: message' (a check that must not stop the run)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 (recorded for the test to show)
        return f"{type(exc).__name__}: {exc}"


def reduce_ops_as_nccl(rank: int, world: int) -> dict:
    """AVG of integers and PREMUL_SUM, which gloo lacks, on neuron tensors (Note [Reduce ops as
    NCCL computes them] in device/csrc/aten/collectives.cpp), and float AVG, which stays gloo's."""
    def all_reduce(values, dtype, op, async_op=False):
        t = torch.tensor(values, dtype=dtype, device="neuron")
        work = dist.all_reduce(t, op=op, async_op=async_op)
        if async_op:
            work.wait()
        return t.tolist()

    out = {}
    # rank 0: [1, -1, 7], rank 1: [2, -4, 8]; sums [3, -5, 15]; NCCL truncates toward zero
    ints = [[1, -1, 7], [2, -4, 8]][rank]
    for dtype in (torch.int32, torch.int64, torch.uint8):
        values = [abs(v) for v in ints] if dtype == torch.uint8 else ints
        out[f"avg_{dtype}"] = _attempt(lambda: all_reduce(values, dtype, dist.ReduceOp.AVG))
    out["avg_int64_async"] = _attempt(lambda: all_reduce(ints, torch.int64, dist.ReduceOp.AVG, async_op=True))
    out["avg_float32"] = _attempt(lambda: all_reduce([1.0, 4.0], torch.float32, dist.ReduceOp.AVG))
    floats = [[1.0, 2.0, 3.0, 4.0], [3.0, 4.0, 5.0, 6.0]][rank]
    out["premul_sum_scalar"] = _attempt(lambda: all_reduce(floats, torch.float32, dist._make_nccl_premul_sum(2.5)))
    factor = torch.tensor([2.5], device="neuron")
    out["premul_sum_tensor"] = _attempt(lambda: all_reduce(floats, torch.float32, dist._make_nccl_premul_sum(factor)))
    # bfloat16: the factor is rounded to bfloat16 first (0.3 -> 0.30078125), as NCCL does
    out["premul_sum_bf16"] = _attempt(lambda: all_reduce([1.0, 3.0], torch.bfloat16, dist._make_nccl_premul_sum(0.3)))

    def reduce_scatter(op, dtype):
        source = (torch.arange(2 * world, device="neuron") * (rank + 1)).to(dtype)
        before = source.tolist()
        result = torch.empty(2, dtype=dtype, device="neuron")
        dist.reduce_scatter_tensor(result, source, op=op)
        return {"result": result.tolist(), "input_unchanged": source.tolist() == before}

    out["reduce_scatter_premul_sum"] = _attempt(lambda: reduce_scatter(dist._make_nccl_premul_sum(0.5), torch.float32))
    out["reduce_scatter_avg_int"] = _attempt(lambda: reduce_scatter(dist.ReduceOp.AVG, torch.int64))
    return out


def _step(w, collective: bool):
    h = (w @ w).tanh()
    h.mul_(0.5)
    if collective:
        dist.all_reduce(h)
    return h.add(1.0).div(3.0)


def _loop_with_collective(rank: int):
    """A repeating step with a collective in it and no host read: every step's value."""
    torch.manual_seed(0)
    w = torch.randn(8, 8, device="neuron") + rank
    results = []
    for _ in range(LOOP_STEPS):
        w = _step(w, collective=True)
        results.append(w)
    return [r.cpu() for r in results]


def _collective_after_a_trace_prefix(rank: int):
    """Steps without a collective until a trace is cached, then the trace's first ops
    (held back by the engine) and a collective of their result."""
    torch.manual_seed(0)
    w = torch.randn(8, 8, device="neuron") + rank
    for _ in range(LOOP_STEPS):
        w = _step(w, collective=False)
    h = (w @ w).tanh()
    dist.all_reduce(h)
    return [h.cpu(), w.cpu()]


def _loop_with_functional_collective(rank: int):
    """Tensor parallelism's collective (DTensor, parallelize_module): a functional all_reduce
    and its wait, with a host read on rank 0 only, which cuts rank 0's stream where rank 1's
    is not cut (issue 12: fused into a trace, it gave rank 0 another rank's partial sums)."""
    import torch.distributed._functional_collectives as funcol

    torch.manual_seed(0)
    w = torch.randn(8, 8, device="neuron") + rank
    results = []
    for _ in range(LOOP_STEPS):
        h = funcol.all_reduce((w @ w).tanh().mul(0.5), "sum", dist.group.WORLD)
        w = h.add(1.0).div(3.0)
        if rank == 0:
            w.sum().item()
        results.append(w)
    return [r.cpu() for r in results]


def _distributed_ops_in(traces) -> list[str]:
    return [p.name for t in traces for p in t.protos if "c10d" in p.info.op.namespace]


def _eager_then_adaptive(fn, rank: int):
    with adaptive_eager.mode("eager"):
        eager = fn(rank)
    SWITCH.adaptive.reset()  # an engine that has seen nothing (as tests/conftest.py does)
    adaptive_eager.reset_stats()
    adaptive = fn(rank)
    identical = all(torch.equal(a, b) for a, b in zip(eager, adaptive))
    traces = list(SWITCH.adaptive.cache.values())
    return identical, adaptive_eager.stats(), traces


def collectives_in_the_adaptive_engine(rank: int) -> dict:
    """Default (adaptive) mode: results equal eager's; a collective is a sync point."""
    out = {"mode": adaptive_eager.get_mode()}
    identical, stats, traces = _eager_then_adaptive(_loop_with_collective, rank)
    out["loop_identical_to_eager"] = identical
    out["loop_fused_launches"] = stats.fused_launches
    out["loop_traces"] = len(traces)
    out["loop_collectives_in_traces"] = sum(p.info.is_collective for t in traces for p in t.protos)
    identical, stats, _ = _eager_then_adaptive(_collective_after_a_trace_prefix, rank)
    out["prefix_identical_to_eager"] = identical
    out["prefix_flushes"] = stats.flushes
    identical, stats, traces = _eager_then_adaptive(_loop_with_functional_collective, rank)
    out["functional_identical_to_eager"] = identical
    out["functional_fused_launches"] = stats.fused_launches
    out["functional_distributed_ops_in_traces"] = _distributed_ops_in(traces)
    return out


def _train(device: str, group, rank: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(device)
    ddp = DDP(model, process_group=group)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    losses = []
    for _ in range(DDP_STEPS):
        x, y = torch.randn(8, 16, generator=data), torch.randint(0, 4, (8,), generator=data)
        loss = F.cross_entropy(ddp(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return [p.detach().cpu() for p in model.parameters()], [float(v) for v in losses]


def ddp(rank: int, world: int) -> dict:
    """DDP on neuron (the "neuron" group) against the same loop on CPU (a gloo group)."""
    cpu_params, cpu_losses = _train("cpu", dist.new_group(backend="gloo"), rank)
    neuron_params, neuron_losses = _train("neuron", None, rank)
    # DDP keeps the ranks' parameters equal: compare this rank's with rank 0's.
    flat = torch.cat([p.flatten() for p in neuron_params])
    rank0 = flat.clone()
    dist.broadcast(rank0, src=0)
    return {"ddp_params_identical_to_cpu": all(torch.equal(a, b) for a, b in zip(cpu_params, neuron_params)),
            "ddp_losses_identical_to_cpu": cpu_losses == neuron_losses,
            "ddp_params_changed": not torch.equal(flat, torch.cat([p.flatten() for p in _initial_params()])),
            "ddp_params_equal_across_ranks": torch.equal(flat, rank0)}


def ddp_steady_state(rank: int) -> dict:
    """A DDP loop in adaptive mode with a loss read every step: launches and divergences
    per step, to show the engine settles (collectives and reads cut every step the same way)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).to("neuron")
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank)).to("neuron")
    y = torch.arange(8).remainder(4).to("neuron")
    launches, divergences = [], []
    for _ in range(LOOP_STEPS):
        before = adaptive_eager.stats()
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss.item()
        after = adaptive_eager.stats()
        launches.append(after.launches - before.launches)
        divergences.append(after.divergences - before.divergences)
    return {"ddp_steady_launches": launches, "ddp_steady_divergences": divergences}


def _initial_params():
    torch.manual_seed(0)
    return list(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).parameters())


class _PartlyUsed(nn.Module):
    """`unused` never takes part in the loss: find_unused_parameters must mark it ready."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def ddp_options_needing_pinned_memory(rank: int) -> dict:
    """DDP's reducer keeps its used-parameter map in pinned host memory for these options
    (the device's host allocator: device/csrc/runtime/pinned_memory.cpp). Parameters after a few
    steps, on neuron and on CPU (gloo), for each option."""
    cpu_group = dist.new_group(backend="gloo")
    out = {}
    for option in ("static_graph", "find_unused_parameters"):
        params = {}
        for device in ("cpu", "neuron"):
            torch.manual_seed(0)
            model = _PartlyUsed().to(device)
            group = cpu_group if device == "cpu" else None
            ddp_model = DDP(model, process_group=group, **{option: True})
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            gen = torch.Generator().manual_seed(rank)
            for _ in range(3):
                opt.zero_grad()
                ddp_model(torch.randn(2, 4, generator=gen).to(device)).square().sum().backward()
                opt.step()
            params[device] = [p.detach().cpu().tolist() for p in model.parameters()]
        out[option] = params
    return out


def sync_batch_norm(rank: int, world: int) -> dict:
    """nn.SyncBatchNorm training on neuron, each rank a quarter-batch shard, against one CPU
    BatchNorm2d on the whole batch: outputs, input and parameter gradients, running stats (max
    absolute differences), in each mode. Its five CUDA-only kernels: dispatch/sync_batch_norm.py."""
    out = {}
    g = torch.Generator().manual_seed(0)
    x, gy = torch.randn(4 * world, 3, 5, 5, generator=g), torch.randn(4 * world, 3, 5, 5, generator=g)
    mine = slice(4 * rank, 4 * (rank + 1))
    ref = nn.BatchNorm2d(3)
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    yr.backward(gy)
    for mode in ("eager", "adaptive"):
        def step():
            bn = nn.SyncBatchNorm(3).to("neuron")
            xs = x[mine].to("neuron").requires_grad_()
            y = bn(xs)
            y.backward(gy[mine].to("neuron"))
            return bn, xs, y

        with adaptive_eager.mode(mode):
            result = _attempt(step)
            if isinstance(result, str):  # it raised: "Type: message"
                out[f"sync_bn_{mode}"] = result
                continue
            bn, xs, y = result
            grads = torch.cat([bn.weight.grad, bn.bias.grad])
            dist.all_reduce(grads)  # each rank's parameter gradient is its shard's (DDP sums them)
            diffs = {
                "forward": (y.cpu() - yr[mine].detach()).abs().max().item(),
                "input_grad": (xs.grad.cpu() - xr.grad[mine]).abs().max().item(),
                "param_grad": (grads.cpu() - torch.cat([ref.weight.grad, ref.bias.grad])).abs().max().item(),
                "running_mean": (bn.running_mean.cpu() - ref.running_mean).abs().max().item(),
                "running_var": (bn.running_var.cpu() - ref.running_var).abs().max().item(),
                "device": str(y.device),
            }
            out[f"sync_bn_{mode}"] = diffs
    return out


def main() -> None:
    out_dir = sys.argv[1]
    if "--default-init" in sys.argv:
        dist.init_process_group()  # no backend: the accelerator's default
    else:
        dist.init_process_group(backend="neuron")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"rank": rank, "world": world, "backend": dist.get_backend()}
    result.update(collectives(rank, world))
    result.update(reduce_ops_as_nccl(rank, world))
    if "--default-init" not in sys.argv:
        result.update(collectives_in_the_adaptive_engine(rank))
        result.update(ddp(rank, world))
        result.update(ddp_steady_state(rank))
        result.update(sync_batch_norm(rank, world))
        result["ddp_options_needing_pinned_memory"] = ddp_options_needing_pinned_memory(rank)
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    # Leave without interpreter finalization: gloo's worker threads may still be dropping a
    # finished Work whose tensors hold Python objects, and CPython kills a thread that asks
    # for the GIL during finalization, aborting the rank after its results are written
    # ("terminate called without an active exception"; pytorch/pytorch#190489, reproduced on
    # CPU with this package not loaded). Everything this rank reports is written and flushed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
