"""One vLLM-Omni run in its own process, for tests/clients/test_vllm_omni.py.

vLLM and vLLM-Omni pick their platforms once per process (from VLLM_TARGET_DEVICE), and the
engine's mode is read at import (NEURON_ADAPTIVE_EAGER), so each mode is a process:
`python vllm_omni_child.py '<spec as JSON>'` saves the images to spec["out"] and prints one
line, RESULT_MARKER then a summary as JSON. Also `write_tiny_sd3(path)`: a Stable Diffusion 3
pipeline from random configs (a one-layer MMDiT, two small CLIP text encoders, a four-level VAE,
word-level tokenizers), written locally: nothing is downloaded.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

RESULT_MARKER = "@@VLLM_OMNI_RESULT@@"
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
    with torch.inference_mode():
        return [pipe(prompt=p, generator=torch.Generator().manual_seed(s), output_type="pt",
                     max_sequence_length=MAX_SEQUENCE_LENGTH, **CALL).images[0]
                for p, s in zip(prompts, seeds)]


def _launches() -> int:
    import torch

    import adaptive_eager

    torch.neuron.synchronize()
    return adaptive_eager.stats().launches


def run(spec: dict) -> dict:
    """Serve spec's prompts through vLLM-Omni's diffusion engine (the engine its `Omni` entry
    point runs per stage) with the Diffusers adapter and SDPA attention."""
    import torch
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.diffusion_engine import DiffusionEngine
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams
    from vllm_omni.platforms import current_omni_platform

    config = OmniDiffusionConfig(
        model=spec["model"], dtype=torch.float32, diffusion_load_format="diffusers",
        diffusers_load_kwargs=WITHOUT_T5, diffusers_call_kwargs={"max_sequence_length": MAX_SEQUENCE_LENGTH},
        diffusion_attention_config={"default": {"backend": "TORCH_SDPA"}})
    config.enrich_config()
    engine = DiffusionEngine.make_engine(config)
    images, devices, launches = [], set(), []
    try:
        for i, (prompt, seed) in enumerate(zip(spec["prompts"], spec["seeds"])):
            params = OmniDiffusionSamplingParams(seed=seed, output_type="pt", **CALL)
            before = _launches()
            out = engine.add_req_and_wait_for_response(
                OmniDiffusionRequest(prompt=prompt, sampling_params=params, request_id=f"r{i}"))
            launches.append(_launches() - before)
            assert out.error is None, out.error
            devices.add(out.output.device.type)
            images.append(out.output[0].cpu())
    finally:
        engine.close()
    torch.save(images, spec["out"])
    return {"platform": type(current_omni_platform).__name__, "output_devices": sorted(devices), "launches": launches}


def run_child(spec: dict, env: dict) -> dict:
    """run(spec) in a new process with env: its result, or an AssertionError with its stderr."""
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=900)
    for line in proc.stdout.splitlines():
        marker = line.find(RESULT_MARKER)  # vLLM-Omni prefixes its worker's output lines
        if marker >= 0:
            assert proc.returncode == 0, proc.stderr[-4000:]
            return json.loads(line[marker + len(RESULT_MARKER):])
    raise AssertionError(f"the vLLM-Omni child gave no result (exit {proc.returncode}):\n{proc.stderr[-6000:]}")


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    out = run(spec)
    print(RESULT_MARKER + json.dumps(out), flush=True)
