"""One rank of an FSDP run, started by torchrun (tests/native/test_native_distributed.py).

Usage: fsdp_worker.py OUT_DIR DEVICE [fsdp2|fsdp1]. DEVICE 'neuron' runs with neuron
tensors and the "neuron" backend; 'cpu' is the reference (gloo; the test turns neuron's
autoload off, or FSDP would place the mesh on the accelerator). fsdp1 is
FullyShardedDataParallel with FULL_SHARD. Each rank writes OUT_DIR/rank<N>.json.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard


def _fsdp2(model):
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)  # moves the CPU module to the mesh's device: neuron, for the neuron run
    return model, lambda: [p.full_tensor().detach().cpu().flatten().tolist() for p in model.parameters()]


def _fsdp1(model, device):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    wrapped = FSDP(model, device_id=torch.device(device, 0) if device == "neuron" else None,
                   sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=True)

    def full_params():
        with FSDP.summon_full_params(wrapped):
            return [p.detach().cpu().flatten().tolist() for p in wrapped.parameters()]
    return wrapped, full_params


def main() -> None:
    out_dir, device = sys.argv[1], sys.argv[2]
    kind = sys.argv[3] if len(sys.argv) > 3 else "fsdp2"
    dist.init_process_group("neuron" if device == "neuron" else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model, full_params = _fsdp2(model) if kind == "fsdp2" else _fsdp1(model, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = model(torch.randn(4, 8, generator=gen).to(device)).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    result = {
        "device": str(next(model.parameters()).device),
        "losses": losses,
        "params": full_params(),
    }
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
