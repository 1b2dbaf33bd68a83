"""A diffusers UNet (issue 36): a tiny random UNet2DConditionModel (ResNet blocks with
GroupNorm, cross-attention to a text embedding, a timestep embedding, down- and upsampling)
trained to predict noise with an MSE loss, with AdamW on CPU and on neuron in adaptive mode.
Losses and every parameter bitwise CPU's, and the steady steps one launch
each.
"""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

import adaptive_eager
from clients import assert_bitwise, require, train

diffusers = require("diffusers")

STEPS = 10
STEADY = 7  # steps 8 to 10
MAX_LAUNCHES = 1  # per steady step, from step 6 (issue 36 asks at most 2; bounds only go down)


class _NoisePrediction(torch.nn.Module):
    """The UNet with a denoising objective's loss, in the `.loss` that train() reads."""

    def __init__(self):
        super().__init__()
        self.unet = diffusers.UNet2DConditionModel(
            sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32)

    def forward(self, sample, timestep, encoder_hidden_states, noise):
        predicted = self.unet(sample, timestep, encoder_hidden_states=encoder_hidden_states).sample
        return types.SimpleNamespace(loss=F.mse_loss(predicted, noise))


def _noisy_latents(g):
    return {"sample": torch.randn(2, 4, 16, 16, generator=g), "timestep": torch.randint(0, 1000, (2,), generator=g),
            "encoder_hidden_states": torch.randn(2, 7, 32, generator=g), "noise": torch.randn(2, 4, 16, 16, generator=g)}


def test_unet_training_is_bitwise_cpus_in_one_launch_a_step():
    cpu = train("cpu", "eager", _NoisePrediction, _noisy_latents, STEPS)
    adaptive = train("neuron", "adaptive", _NoisePrediction, _noisy_latents, STEPS)
    assert_bitwise(cpu, adaptive)
    assert max(adaptive.launches[STEADY:]) <= MAX_LAUNCHES, f"adaptive launches per step {adaptive.launches}"
    assert adaptive.launches[0] > 10 * MAX_LAUNCHES  # the first step ran op by op: the bound means something


PROMPT = "w5 w6 w7"


def test_sd3_pipeline_after_a_larger_image_is_bitwise_cpus_in_adaptive_mode(tmp_path):
    from tiny_sd3 import CALL, MAX_SEQUENCE_LENGTH, WITHOUT_T5, diffusers_on_cpu, write_tiny_sd3

    model = write_tiny_sd3(str(tmp_path / "sd3"))
    (want,) = diffusers_on_cpu(model, [PROMPT], [0])
    pipe = diffusers.StableDiffusion3Pipeline.from_pretrained(model, dtype=torch.float32, **WITHOUT_T5).to("neuron")
    with adaptive_eager.mode("adaptive"), torch.inference_mode():
        pipe(prompt="dummy run", generator=torch.Generator().manual_seed(0), output_type="pt", num_inference_steps=2,
             height=512, width=512, guidance_scale=0.0, max_sequence_length=MAX_SEQUENCE_LENGTH)
        got = pipe(prompt=PROMPT, generator=torch.Generator().manual_seed(0), output_type="pt",
                   max_sequence_length=MAX_SEQUENCE_LENGTH, **CALL).images[0].cpu()
    assert torch.equal(got, want), f"max difference {(got - want).abs().max().item()}"
