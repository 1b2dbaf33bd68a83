"""A tiny Stable Diffusion 3 pipeline from random configs, for tests/clients/test_vllm_omni.py and
test_diffusers.py: a one-layer MMDiT, two small CLIP text encoders (no T5: the pipeline feeds
zeros in its place), a four-level VAE and word-level tokenizers (`w4` ... `w999`), written
locally (nothing is downloaded); and the reference, the pipeline through Diffusers on the CPU.
"""
from __future__ import annotations

VOCAB = 1000
# What the pipeline is called with besides prompt, seed and output type, on both sides.
CALL = {"num_inference_steps": 3, "height": 64, "width": 64, "guidance_scale": 1.0}
MAX_SEQUENCE_LENGTH = 16
# SD3's third text encoder (T5) is optional; without it the pipeline feeds zeros in its place.
WITHOUT_T5 = {"text_encoder_3": None, "tokenizer_3": None}


def _tokenizer():
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>", pad_token="<pad>", model_max_length=77)


def write_tiny_sd3(path: str) -> str:
    """The pipeline, saved with save_pretrained. The VAE has four levels (8x down) and the
    transformer's position table covers 512x512 images: vLLM-Omni warms every engine up with
    one 512x512 image."""
    import diffusers
    import torch
    import transformers

    torch.manual_seed(0)
    clip = transformers.CLIPTextConfig(
        bos_token_id=0, eos_token_id=2, pad_token_id=1, hidden_size=32, intermediate_size=37, num_attention_heads=4,
        num_hidden_layers=2, vocab_size=VOCAB, hidden_act="gelu", projection_dim=32, max_position_embeddings=77)
    transformer = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, pos_embed_max_size=32, in_channels=4, out_channels=4, num_layers=1,
        attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=64,
        pooled_projection_dim=64)
    vae = diffusers.AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4, 4, 4, 4),
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=1,
        latent_channels=4, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609,
        scaling_factor=1.5035)
    pipe = diffusers.StableDiffusion3Pipeline(
        transformer=transformer, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae,
        text_encoder=transformers.CLIPTextModelWithProjection(clip), tokenizer=_tokenizer(),
        text_encoder_2=transformers.CLIPTextModelWithProjection(clip), tokenizer_2=_tokenizer(), **WITHOUT_T5)
    pipe.save_pretrained(path)
    return path


def diffusers_on_cpu(model: str, prompts: list[str], seeds: list[int]):
    """The reference: the same pipeline through Diffusers alone, on the CPU."""
    import diffusers
    import torch

    pipe = diffusers.StableDiffusion3Pipeline.from_pretrained(model, dtype=torch.float32, **WITHOUT_T5)
    _into_fresh_memory(pipe)
    with torch.inference_mode():
        return [pipe(prompt=p, generator=torch.Generator().manual_seed(s), output_type="pt",
                     max_sequence_length=MAX_SEQUENCE_LENGTH, **CALL).images[0]
                for p, s in zip(prompts, seeds)]


def _into_fresh_memory(pipe) -> None:
    """Every weight copied into memory of its own, as `.to("neuron")` copies them. Read from the
    safetensors file, they stay where the file's layout puts them (56 bytes past a 64-byte
    boundary here), and MKL's matrix kernels on AVX-512 sum in another order for operands so
    placed: the same Linear on the same values gave CPU 1 ulp apart from its result on a copy
    (README: CPU's bits, and where operands sit). The reference is CPU's result on the values
    as any allocation holds them, which is what the device computes from."""
    import torch

    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            for tensor in [*component.parameters(), *component.buffers()]:
                tensor.data = tensor.data.clone()
