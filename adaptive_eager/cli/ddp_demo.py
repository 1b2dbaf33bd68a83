"""DistributedDataParallel on the emulated neuron device: the demo MLP trained on every rank.

    torchrun --nproc-per-node=2 -m adaptive_eager.cli.ddp_demo [--steps N]

Each rank draws its own batches, DDP all-reduces the gradients through the "neuron"
process-group backend (gloo on the host data, Note [Collectives] in dispatch/distributed.py),
and each rank prints its loss and the device launches of every step. In the default adaptive
mode the launches per step fall once the step has repeated: a collective is a sync point,
so a step runs as a few fused launches plus one launch per gradient bucket's all-reduce.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import adaptive_eager

from .main import _build, _positive_int


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node=2 -m adaptive_eager.cli.ddp_demo", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=_positive_int, default=10, help="training steps (default 10)")
    parser.add_argument("--width", type=_positive_int, default=64, help="hidden width (default 64)")
    parser.add_argument("--layers", type=_positive_int, default=3, help="linear layers (default 3)")
    parser.add_argument("--batch", type=_positive_int, default=32, help="batch size per rank (default 32)")
    return parser.parse_args(argv)


def train(args, rank: int) -> torch.nn.Module:
    """Train under DDP; print this rank's loss and launches per step. Returns the model."""
    torch.manual_seed(0)  # every rank builds the same model (DDP also broadcasts rank 0's)
    model, opt, _, _ = _build(args.width, args.layers, 10, args.batch, data_on_device=False)
    ddp = DDP(model)
    data = torch.Generator().manual_seed(1 + rank)  # each rank its own batches
    x = torch.randn(args.batch, args.width, generator=data).to("neuron")
    y = torch.randint(0, 10, (args.batch,), generator=data).to("neuron")
    losses = []
    for step in range(args.steps):
        before = adaptive_eager.stats().launches
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())  # a host read: it ends the step's pending work
        launches = adaptive_eager.stats().launches - before
        print(f"rank {rank} step {step:3d}  loss {losses[-1]:.6f}  launches {launches}", flush=True)
    return model


def parameters_agree(model_params) -> bool:
    """True if every rank holds rank 0's parameters (what DDP promises)."""
    flat = torch.cat([p.detach().flatten() for p in model_params])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    return bool(torch.equal(flat, reference))


def main(argv=None) -> int:
    args = parse_args(argv)
    dist.init_process_group(backend="neuron")
    try:
        rank = dist.get_rank()
        if rank == 0:
            print(f"ddp_demo: {dist.get_world_size()} ranks, backend {dist.get_backend()!r}, "
                  f"mode {adaptive_eager.get_mode()}, MLP {args.layers}x{args.width}, batch {args.batch}/rank",
                  flush=True)
        adaptive_eager.reset_stats()
        model = train(args, rank)
        stats = adaptive_eager.stats()
        print(f"rank {rank} done: {stats.launches} launches ({stats.fused_launches} fused), "
              f"flushes {dict(stats.flushes)}", flush=True)
        agree = parameters_agree(model.parameters())
        print(f"rank {rank} parameters identical to rank 0's: {agree}", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
