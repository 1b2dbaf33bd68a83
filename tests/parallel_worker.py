"""One rank of a data- or tensor-parallel run of a tiny Hugging Face Llama, started by torchrun
(tests/clients/test_parallel_projection.py).

Usage: parallel_worker.py OUT_DIR DEVICE KIND. KIND 'tp': the attention and MLP projections
split over the ranks with DTensor's `parallelize_module` (q/k/v and gate/up column-wise, o and
down row-wise: each block's output all-reduced), as torchtitan splits Llama; embeddings, norms
and the head replicated; every rank the same batch. 'ddp': DistributedDataParallel. 'fsdp2':
`fully_shard` on each decoder layer, then the model. Four AdamW steps. DEVICE 'neuron' runs on
neuron tensors with the "neuron" backend (NEURON_ADAPTIVE_EAGER's mode; NEURON_PROJECTION=1 for a
run without values), 'cpu' is the reference (gloo). Each rank writes OUT_DIR/rank<N>.json: its
losses and final local parameters (not in projection, where there are none), and per step what
the device spent. Without torchrun, FAKE_WORLD=N NEURON_PROJECTION=1 projects rank 0 of N ranks
alone, on torch's fake process group (the other ranks are taken to hold what it holds: Note
[Projected collectives]).
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

STEPS = 4
LAYER_PLAN = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
              "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
              "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64,
                         attn_implementation="eager")
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _device_figures():
    import adaptive_eager

    s = adaptive_eager.stats()
    return {"launches": s.launches, "ops": s.ops, "device_us": s.device_time_us, "memory": s.memory_bytes,
            "peak": s.peak_memory_bytes, "transfers": s.transfers, "transfer_bytes": s.transfer_bytes}


def _probe_collective(device: str) -> dict:
    """An all-reduce of 1 MiB of float32: what the device spent on it, and where its future's
    value lives (Note [A collective's future holds device tensors])."""
    x = torch.ones(512, 512, device=device)
    before = _device_figures()
    dist.all_reduce(x)
    after = _device_figures()
    value = dist.all_reduce(x, async_op=True).get_future().wait()[0]
    value_device = value.device
    total = x.sum().item()  # in projection, a placeholder: the same ops either way
    return {"launches": after["launches"] - before["launches"], "device_us": after["device_us"] - before["device_us"],
            "future_device": str(value_device), "sum": None if _projected(device) else total}


def _projected(device: str) -> bool:
    return device == "neuron" and os.environ.get("NEURON_PROJECTION") == "1"


def _parallel(model, kind: str, device: str, world: int):
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model.to(device))
    mesh = init_device_mesh(device, (world,))
    if kind == "fsdp2":
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)  # moves the CPU model to the mesh's device
    model = model.to(device)
    for layer in model.model.layers:
        parallelize_module(layer, mesh, LAYER_PLAN)
    return model


def main() -> None:
    out_dir, device, kind = sys.argv[1], sys.argv[2], sys.argv[3]
    if os.environ.get("FAKE_WORLD"):  # no torchrun: rank 0 of a job of FAKE_WORLD ranks, alone
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=int(os.environ["FAKE_WORLD"]))
    else:
        dist.init_process_group("neuron" if device == "neuron" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _parallel(_model(), kind, device, world)
    # foreach=False: the parameters are DTensors and plain tensors (the replicated ones), which
    # one foreach kernel cannot take (on CUDA neither); CPU's default is the same loop.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    # Tensor parallelism's ranks see the same tokens; data parallelism's each their own.
    gen = torch.Generator().manual_seed(7 if kind == "tp" else 7 + rank)
    tokens = torch.randint(0, 128, (2, 16), generator=gen).to(device)
    projected = _projected(device)
    losses, steps = [], []
    before = _device_figures() if device == "neuron" else None
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())  # in projection, a placeholder (counted)
        if device == "neuron":
            now = _device_figures()
            steps.append({k: now[k] - before[k] if k not in ("memory", "peak") else now[k] for k in now})
            before = now
    # After the steps: gloo's thread may still hold its host aliases of a collective's tensors
    # for a moment after its work completes, which would move the steps' memory figures.
    probe = _probe_collective(device) if device == "neuron" else None
    result = {"world": world, "losses": [] if projected else losses, "steps": steps, "probe": probe,
              "local_shapes": [list(getattr(p, "_local_tensor", p).shape) for p in model.parameters()]}
    if not projected:
        result["params"] = [getattr(p, "_local_tensor", p).detach().cpu().flatten().tolist() for p in model.parameters()]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
