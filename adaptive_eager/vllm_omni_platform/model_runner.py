"""vLLM-Omni's diffusion model runner, with seeded noise drawn by a host generator.

Note [Diffusion noise on the host]: given a seed and no generator device, vLLM-Omni's runner
makes the request's generator on the worker's device. Diffusers' `randn_tensor`, the noise of
its pipelines, draws every `neuron` tensor on the host instead (torch-neuronx has no device-side
random sampling) and fails on a `neuron` generator. So the default here is a host generator, which
is also what makes a seed give the same image on `neuron` as on the CPU. A request that names its
`generator_device` keeps it.
"""
import torch

from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner


class NeuronDiffusionModelRunner(DiffusionModelRunner):
    def _initialize_generator(self, sampling_params) -> None:
        if sampling_params.generator is None and sampling_params.seed is not None \
                and sampling_params.generator_device is None:
            sampling_params.generator = torch.Generator(device="cpu").manual_seed(sampling_params.seed)
        super()._initialize_generator(sampling_params)
