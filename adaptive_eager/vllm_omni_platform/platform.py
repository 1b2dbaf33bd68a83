"""What vLLM-Omni asks of a device, answered for the emulated `neuron` one.

vLLM-Omni's platforms are vLLM platforms with more to say (its built-in XPU platform is
`OmniPlatform` over vLLM's `XPUPlatform`): this one is `OmniPlatform` over the vLLM plugin's
`NeuronPlatform`, so the device, memory, seeding and dtype answers are the ones vLLM gets, and
only the diffusion-side questions are answered here. Diffusion models run eagerly, op by op,
so the adaptive engine sees their ATen stream and fuses each repeated denoising step.
"""
import torch

from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum

from ..vllm_platform.platform import NeuronPlatform

# vLLM-Omni's scaled-dot-product-attention backend for its own diffusion models: ATen's SDPA,
# which runs on `neuron` tensors (flash-attention and the other backends are CUDA kernels).
SDPA_BACKEND = "TORCH_SDPA"
MODEL_RUNNER = "adaptive_eager.vllm_omni_platform.model_runner.NeuronDiffusionModelRunner"


class NeuronOmniPlatform(OmniPlatform, NeuronPlatform):
    _omni_enum = OmniPlatformEnum.OOT
    # What vLLM-Omni's and vLLM's helpers compile with: the package's torch.compile backend
    # (adaptive_eager/dispatch/compile_backend.py), where a compiled graph is one launch.
    simple_compile_backend: str = "neuron"

    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("neuron") if local_rank is None else torch.device("neuron", local_rank)

    @classmethod
    def get_device_count(cls) -> int:
        return torch.neuron.device_count()

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def synchronize(cls) -> None:
        torch.neuron.synchronize()

    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        return torch.neuron.mem_get_info(device)[0]

    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        return torch.neuron.mem_get_info(device)

    @classmethod
    def memory_reserved(cls, device: torch.device | int | None = None) -> int:
        return int(torch.neuron.memory_reserved(device))

    @classmethod
    def record_device_event(cls) -> torch.Event:
        # A device-agnostic event on the current stream (vLLM-Omni's XPU platform explains why
        # not a device-specific one): the output thread waits on it before its host copy.
        event = torch.Event(device="neuron")
        event.record()
        return event

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        # Inductor's kernels are C++/OpenMP or Triton code for CPU or GPU memory; a model
        # compiled with it would leave the device. False: the model runner keeps it eager.
        return False

    @classmethod
    def get_diffusion_model_runner_cls(cls) -> str:
        # Seeded noise from a host generator (Note [Diffusion noise on the host]).
        return MODEL_RUNNER

    @classmethod
    def get_diffusion_attn_backend_cls(cls, selected_backend: str | None, head_size: int,
                                       allow_trtllm_default: bool = False) -> str:
        from vllm_omni.diffusion.attention.backends.registry import DiffusionAttentionBackendEnum

        if selected_backend is not None and selected_backend.upper() != SDPA_BACKEND:
            raise ValueError(
                f"the neuron platform's diffusion attention backend is {SDPA_BACKEND} (ATen's "
                f"scaled_dot_product_attention); got {selected_backend}. Select {SDPA_BACKEND} or none.")
        return DiffusionAttentionBackendEnum[SDPA_BACKEND].get_path()
