"""Two more Hugging Face transformers models (issue 36), tiny random configs trained with AdamW
on CPU and on neuron in adaptive mode: Whisper (speech to text: convolutions over mel
features, an encoder and a decoder with cross-attention) and Qwen3 MoE (a router's top-k
choice of experts per token). Losses and every parameter and buffer bitwise CPU's, and the
steady steps one launch each (issue 36 asks at most two).
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from clients import assert_bitwise, require, train

transformers = require("transformers")
transformers.logging.set_verbosity_error()

STEPS = 10
STEADY = 7  # steps 8 to 10
MAX_LAUNCHES = 1  # per steady step, from step 4 (issue 36 asks at most 2; bounds only go down)
VOCAB = 64


def _whisper():
    return transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
        max_target_positions=16, pad_token_id=1, bos_token_id=2, eos_token_id=3, decoder_start_token_id=2,
        suppress_tokens=None, begin_suppress_tokens=None, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0))


def _qwen3_moe():
    # The experts as batched matmuls. The default (grouped_mm, which counts each expert's tokens
    # with an integer torch.histc off cpu and mps) is trained in tests/integrations/test_cuda_dtypes.py.
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=32, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=1, experts_implementation="batched_mm"))


def _speech_batch(g):  # 8 mel bins by 32 frames (twice max_source_positions: the encoder's stride-2 conv)
    return {"input_features": torch.randn(2, 8, 32, generator=g), "labels": torch.randint(4, VOCAB, (2, 8), generator=g)}


def _causal_batch(g):
    ids = torch.randint(0, VOCAB, (2, 12), generator=g)
    return {"input_ids": ids, "labels": ids}


@contextlib.contextmanager
def _deterministic_algorithms(enabled):
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(enabled)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


# model, batch, whether it needs deterministic algorithms for CPU's bits to be one result.
# Launches per steady step today: 1 each, from step 4 (Whisper ran 4 until unfold, which
# repeat decomposes into, became a view on neuron).
MODELS = {
    "whisper": (_whisper, _speech_batch, False),
    # Each token's expert weights are gathered by index (gate_up_proj[expert_ids]), so the weights'
    # gradient is an index_put_ that accumulates, which CPU runs with atomic float adds across
    # threads when it has more than one and 32,768 elements or more: two CPU runs of this loop on
    # 2 threads differ within 10 steps. With deterministic algorithms it adds serially, on CPU and
    # on neuron alike.
    "qwen3_moe": (_qwen3_moe, _causal_batch, True),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_training_is_bitwise_cpus_in_one_launch_a_step(name):
    make_model, make_batch, deterministic = MODELS[name]
    with _deterministic_algorithms(deterministic):
        cpu = train("cpu", "eager", make_model, make_batch, STEPS)
        adaptive = train("neuron", "adaptive", make_model, make_batch, STEPS)
    assert_bitwise(cpu, adaptive)
    assert max(adaptive.launches[STEADY:]) <= MAX_LAUNCHES, f"adaptive launches per step {adaptive.launches}"
    assert adaptive.launches[0] > 10 * MAX_LAUNCHES  # the first step ran op by op: the bound means something
