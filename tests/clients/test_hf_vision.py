"""Vision models of code no one here wrote, trained on neuron bitwise as on CPU.

torchvision and timm cannot be installed beside torch 2.13's CPU build on a fresh x86_64
machine: PyPI's torchvision releases for torch 2.13 (0.28.x) are CUDA builds whose `_C.so`
links libtorch_cuda.so, absent from the CPU build (import fails: "operator torchvision::nms
does not exist"), PyPI has no torchvision source to build, and timm requires torchvision
(timm.layers imports torchvision.ops). The same architectures come from transformers instead:
ResNet (convolutions, BatchNorm with running statistics) and ViT.
"""
from __future__ import annotations

import pytest
import torch

from clients import assert_bitwise, require, train

transformers = require("transformers")
transformers.logging.set_verbosity_error()

STEPS = 8
WARMUP = 4


def _resnet():
    return transformers.ResNetForImageClassification(transformers.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=5))


def _vit():
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _images(g):
    return {"pixel_values": torch.randn(4, 3, 16, 16, generator=g), "labels": torch.randint(0, 5, (4,), generator=g)}


@pytest.mark.parametrize("make_model", [_resnet, _vit], ids=["resnet", "vit"])
def test_training_and_inference_mode_evaluation_are_bitwise_cpus(make_model):
    cpu = train("cpu", "eager", make_model, _images, STEPS)
    eager = train("neuron", "eager", make_model, _images, STEPS)
    adaptive = train("neuron", "adaptive", make_model, _images, STEPS)
    assert_bitwise(cpu, eager)
    assert_bitwise(cpu, adaptive)
    # One launch per step: the stem convolution's backward, which returns no input gradient,
    # is deferred like any op (it cut every step into pieces before).
    assert adaptive.launches[WARMUP:] == [1] * (STEPS - WARMUP), adaptive.launches

    if make_model is _resnet:  # BatchNorm's running statistics moved, and were compared above
        running = [v for k, v in cpu.state.items() if k.endswith("running_var")]
        assert running and not all(torch.equal(v, torch.ones_like(v)) for v in running)
    images = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(9))
    logits = []
    for device, run in (("cpu", cpu), ("neuron", adaptive)):
        model = make_model()
        model.load_state_dict(run.state)
        model = model.to(device).eval()
        with torch.inference_mode():
            logits.append(model(pixel_values=images.to(device)).logits.cpu())
    assert torch.equal(logits[0], logits[1])
