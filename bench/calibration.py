"""The cost model against published Trainium2 figures: a full-size model's inference projected
with tensor parallelism, one process per rank (README, "Calibration").

    NEURON_PROJECTION=1 torchrun --nproc-per-node=4 bench/calibration.py llama-3.1-8b \
        --prompt 1500 --batch 1

Each rank builds its shard of the model from the published config (on the meta device, then
`to_empty` on neuron: no values anywhere), splits it as vLLM and NxD Inference split Llama
(attention heads and the MLP column- then row-wise, the embedding and the head by vocabulary)
with DTensor's `parallelize_module`, and runs a prefill of --prompt tokens and --decode tokens
of generation with a KV cache, logits for the last position only. Prefill is run --warmup times
first and generation is measured after --warmup tokens: the adaptive engine then replays each as
one fused launch a step, as the chip runs a compiled graph. Rank 0 prints the modelled time to
first token (one prefill) and time per output token (mean of the measured decode steps).
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

# The published configs (Hugging Face config.json of each model).
CONFIGS = {
    "llama-3.1-8b": ("LlamaConfig", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                         rope_theta=500000.0, max_position_embeddings=131072)),
    "qwen3-32b": ("Qwen3Config", dict(vocab_size=151936, hidden_size=5120, intermediate_size=25600,
                                      num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                                      head_dim=128, max_position_embeddings=40960)),
}
LAYER_PLAN = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
              "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
              "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}


def build(name: str, mesh):
    import transformers

    kind, fields = CONFIGS[name]
    config = getattr(transformers, kind)(**fields, attn_implementation="sdpa")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    parallelize_module(model, mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    })
    for layer in model.model.layers:
        parallelize_module(layer, mesh, LAYER_PLAN)
    model.to_empty(device="neuron")
    with torch.device("neuron"):  # a buffer to_empty leaves unset
        model.model.rotary_emb = type(model.model.rotary_emb)(config)
    return model.eval()


def _device_ms() -> float:
    import adaptive_eager

    return adaptive_eager.stats().device_time_us / 1e3  # waits for what was launched


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", choices=sorted(CONFIGS))
    p.add_argument("--prompt", type=int, default=1500, help="prompt tokens (default 1500)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1)")
    p.add_argument("--decode", type=int, default=8, help="generated tokens measured (default 8)")
    p.add_argument("--warmup", type=int, default=3, help="prefills and tokens before measuring (default 3)")
    args = p.parse_args()
    dist.init_process_group("neuron")
    mesh = init_device_mesh("neuron", (dist.get_world_size(),))
    model = build(args.model, mesh)
    from transformers import DynamicCache

    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, args.prompt), device="neuron")
    with torch.no_grad():
        for _ in range(args.warmup + 1):  # the last one measured
            before = _device_ms()
            model(prompt, logits_to_keep=1, past_key_values=DynamicCache(config=model.config))
            ttft = _device_ms() - before
        cache = DynamicCache(config=model.config)
        tokens = torch.randint(0, vocab, (args.batch, args.prompt), device="neuron")
        logits = model(tokens, logits_to_keep=1, past_key_values=cache).logits
        times = []
        for _ in range(args.warmup + args.decode):
            before = _device_ms()
            logits = model(logits[:, -1:].argmax(-1), past_key_values=cache).logits
            times.append(_device_ms() - before)
        logits.argmax(-1)  # the last step's logits too: DTensor's all-gather is waited for where it is used
    tpot = sum(times[args.warmup:]) / args.decode
    if dist.get_rank() == 0:
        print(f"{args.model} TP={dist.get_world_size()} prompt {args.prompt} batch {args.batch} "
              f"({os.environ.get('NEURON_PROFILE', 'trn2')}): time to first token {ttft:,.1f} ms (modelled), "
              f"time per output token {tpot:,.2f} ms (modelled, mean of {args.decode})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
