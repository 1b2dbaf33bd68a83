"""One rank of an FSDP run, started by torchrun (tests/integrations/test_fsdp.py).

Usage: fsdp_worker.py OUT_DIR DEVICE [fsdp2|fsdp1] [mlp|transformer|titan]. DEVICE 'neuron' runs
with neuron tensors and the "neuron" backend (the mode is NEURON_ADAPTIVE_EAGER's); 'cpu' is
the reference (gloo; the test turns neuron's autoload off, or FSDP would place the mesh on the
accelerator). fsdp1 is FullyShardedDataParallel with FULL_SHARD. Five AdamW steps; with fsdp2,
the sharded model and optimizer state are saved with torch.distributed.checkpoint after the
third, and a fresh model loaded from it runs steps four and five again. Each rank writes
OUT_DIR/rank<N>.json. 'titan' is torchtitan's llama3 debug model with varlen attention (packed
documents); CPU has no kernel for varlen attention's ops, so the CPU reference gives them
neuron's per-sequence kernels (_cpu_runs_varlen_attention).
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

STEPS, SAVED_AFTER = 5, 3


TITAN_SEQ, TITAN_DOCUMENTS, TITAN_VOCAB = 32, (12, 20), 2048


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "titan":
        from torchtitan.models.llama3 import model_registry

        model = model_registry("debugmodel", attn_backend="varlen").model.build()
        with torch.no_grad():
            model.init_states(buffer_device=torch.device("cpu"))
        return model
    if kind == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    blocks = [torch.nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)
              for _ in range(2)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(8, 4))


def _cpu_runs_varlen_attention() -> None:
    """flash-attn's ops on CPU as neuron computes them (each sequence through CPU's flash
    kernel), for the CPU reference of 'titan'. The module is loaded from its file: importing it
    as adaptive_eager.dispatch.flash_attention would register the neuron device, and FSDP would
    then place the CPU run's mesh on it."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "dispatch" / "flash_attention.py"
    spec = importlib.util.spec_from_file_location("_flash_attention_for_cpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_flash_attention_forward", module.flash_attention_forward, "CPU")
    lib.impl("_flash_attention_backward", module.flash_attention_backward, "CPU")
    _LIBRARIES.append(lib)


_LIBRARIES: list = []


def _fsdp2(model):
    if hasattr(model, "layers"):  # titan: each transformer block, as torchtitan shards it
        parts = list(model.layers.values())
    else:
        parts = [layer for layer in model if isinstance(layer, (torch.nn.Linear, torch.nn.TransformerEncoderLayer))]
    for part in parts:
        fully_shard(part)
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


def _loss(model, batch, device):
    if isinstance(batch, tuple):  # titan: tokens, labels, positions (two documents a row)
        tokens, labels, positions = (t.to(device) for t in batch)
        logits = model(tokens, positions, model.get_attention_masks(positions))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    return model(batch.to(device)).square().mean()


def _batches(arch: str, gen: torch.Generator) -> list:
    if arch == "titan":
        positions = torch.cat([torch.arange(n) for n in TITAN_DOCUMENTS]).repeat(2, 1)
        return [(torch.randint(0, TITAN_VOCAB, (2, TITAN_SEQ), generator=gen),
                 torch.randint(0, TITAN_VOCAB, (2, TITAN_SEQ), generator=gen), positions) for _ in range(STEPS)]
    shape = (4, 8) if arch == "mlp" else (2, 3, 8)
    return [torch.randn(*shape, generator=gen) for _ in range(STEPS)]


def _steps(model, opt, batches, device) -> list[float]:
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = _loss(model, batch, device)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    out_dir, device = sys.argv[1], sys.argv[2]
    kind = sys.argv[3] if len(sys.argv) > 3 else "fsdp2"
    arch = sys.argv[4] if len(sys.argv) > 4 else "mlp"
    dist.init_process_group("neuron" if device == "neuron" else "gloo")
    rank = dist.get_rank()
    if arch == "titan" and device == "cpu":
        _cpu_runs_varlen_attention()
    wrap = _fsdp2 if kind == "fsdp2" else lambda m: _fsdp1(m, device)
    model, full_params = wrap(_model(arch))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    batches = _batches(arch, gen)
    losses = _steps(model, opt, batches[:SAVED_AFTER], device)
    result = {"device": str(next(model.parameters()).device)}
    # torchtitan's fused q/k/v projection renames its weights in state_dict hooks, which
    # torch.distributed.checkpoint's get_state_dict cannot follow (on CPU too); torchtitan
    # checkpoints through its own wrapper. So 'titan' trains without the save and resume.
    resumes = kind == "fsdp2" and arch != "titan"
    if resumes:
        checkpoint = os.path.join(out_dir, "checkpoint")
        model_state, optim_state = get_state_dict(model, opt)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=checkpoint)
    losses += _steps(model, opt, batches[SAVED_AFTER:], device)
    result.update(losses=losses, params=full_params())
    if resumes:
        resumed, _ = wrap(_model(arch))
        resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
        model_state, optim_state = get_state_dict(resumed, resumed_opt)  # the layout to load into
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=checkpoint)
        set_state_dict(resumed, resumed_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        result["resumed_losses"] = _steps(resumed, resumed_opt, batches[SAVED_AFTER:], device)
        result["resumed_params"] = [p.full_tensor().detach().cpu().flatten().tolist() for p in resumed.parameters()]
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
