"""One rank of an FSDP2 run, started by torchrun (tests/native/test_native_distributed.py).

Usage: fsdp2_worker.py OUT_DIR DEVICE. DEVICE 'neuron' runs with native tensors and the
"neuron" backend; 'cpu' is the reference (gloo; the test turns neuron's autoload off, or
FSDP2 would place the mesh on the accelerator). Each rank writes OUT_DIR/rank<N>.json.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard


def main() -> None:
    out_dir, device = sys.argv[1], sys.argv[2]
    dist.init_process_group("neuron" if device == "neuron" else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)  # moves the CPU module to the mesh's device: neuron, for the neuron run
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
        "params": [p.full_tensor().detach().cpu().flatten().tolist() for p in model.parameters()],
    }
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
