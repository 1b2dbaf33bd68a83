"""A Llama training step split over ranks, for `adaptive-eager project` (README, "Projection").

    torchrun --nproc-per-node=8 --no-python adaptive-eager project --tokens-per-step 4096 \
        bench/project_llama.py --parallel tp
    NEURON_PROJECTION=1 python bench/project_llama.py --parallel fsdp2 --fake-world 64 --checkpoint

The model is built on the meta device from a Hugging Face config (`--size 8b`: Llama-3-8B's;
`tiny` for a quick look), split with DTensor (`--parallel tp`: attention and MLP projections
column- then row-wise, the embedding and the head by vocabulary, as torchtitan splits Llama;
`fsdp2`: `fully_shard` on each decoder layer, then the model), then `to_empty` on neuron: no
values anywhere, so it is meant for projection. AdamW, bf16, batch 1 of --seq tokens a rank.
Under torchrun each process is a rank; `--fake-world N` projects rank 0 of N ranks alone, on
torch's fake process group.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

SIZES = {
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=8),
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8),
}
LAYER_PLAN = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
              "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
              "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="8b")
    p.add_argument("--seq", type=int, default=4096, help="tokens a rank trains on a step (default 4096)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--parallel", choices=("tp", "fsdp2"), default="tp")
    p.add_argument("--fake-world", type=int, metavar="N", help="project rank 0 of N ranks in this one process")
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing (recompute in backward)")
    args = p.parse_args()
    import transformers

    transformers.logging.set_verbosity_error()
    if args.fake_world:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.fake_world)
    else:
        dist.init_process_group("neuron")
    mesh = init_device_mesh("neuron", (dist.get_world_size(),))
    config = transformers.LlamaConfig(**SIZES[args.size])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if args.checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.parallel == "tp":
        parallelize_module(model, mesh, {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate())})
        for layer in model.model.layers:
            parallelize_module(layer, mesh, LAYER_PLAN)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.to_empty(device="neuron")
    with torch.device("neuron"):  # a buffer to_empty leaves unset
        model.model.rotary_emb = type(model.model.rotary_emb)(config)
    # foreach=False under TP: its parameters are DTensors and plain tensors (the norms), which
    # one foreach kernel cannot take (on CUDA neither).
    opt = torch.optim.AdamW(model.parameters(), foreach=args.parallel != "tp")
    tokens = torch.randint(0, config.vocab_size, (1, args.seq), device="neuron")
    for _ in range(args.steps):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
