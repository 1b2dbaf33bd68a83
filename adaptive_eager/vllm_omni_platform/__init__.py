"""vLLM-Omni on the emulated device: the platform plugin through which vLLM-Omni serves
diffusion pipelines on `neuron`.

vLLM-Omni finds out-of-tree platforms through its own entry-point group,
`vllm_omni.platform_plugins` (pyproject.toml names `platform_plugin` below), asked at its
first `current_omni_platform` lookup; an out-of-tree platform that answers wins over its
built-in ones. Like the vLLM plugin (adaptive_eager/vllm_platform), this one answers only
when the user selects the device with vLLM's own variable, so one setting selects `neuron`
for both vLLM and vLLM-Omni:

    VLLM_TARGET_DEVICE=neuron python serve_diffusion.py

The pieces, one job each: `platform` (what vLLM-Omni asks of a device: `neuron:rank`, SDPA
attention for its diffusion models, the neuron compile backend; on top of the vLLM plugin's
platform), `model_runner` (vLLM-Omni's diffusion model runner, its seeded noise drawn on the host).
"""
import os

from ..vllm_platform import SELECT_ENV

PLATFORM = "adaptive_eager.vllm_omni_platform.platform.NeuronOmniPlatform"


def platform_plugin() -> str | None:
    """vLLM-Omni's platform hook: the platform class's path when the user selected `neuron`, else None."""
    if os.environ.get(SELECT_ENV, "").strip().lower() != "neuron":
        return None
    return PLATFORM
