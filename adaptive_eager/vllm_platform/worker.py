"""vLLM's worker for the emulated device: takes `neuron:<rank>`, builds the model runner, and
sizes the KV cache from the device's memory."""
from contextlib import nullcontext

import torch

from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.utils.mem_utils import format_gib
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.worker_base import CompilationTimes

from .model_runner import NeuronModelRunner

logger = init_logger(__name__)


class NeuronWorker(Worker):
    def init_device(self) -> None:
        if self.use_v2_model_runner:
            raise NotImplementedError(
                "the neuron platform runs vLLM's first model runner; unset VLLM_USE_V2_MODEL_RUNNER."
            )
        self.device = torch.device("neuron", self.local_rank)
        current_platform.set_device(self.device)
        init_worker_distributed_environment(
            self.vllm_config,
            self.rank,
            self.distributed_init_method,
            self.local_rank,
            current_platform.dist_backend,
        )
        set_random_seed(self.model_config.seed)
        self.model_runner = NeuronModelRunner(self.vllm_config, self.device)

    def determine_available_memory(self) -> int:
        """Bytes for the KV cache: the user's `kv_cache_memory_bytes`, else the device's free
        memory times `gpu_memory_utilization` (the weights are already on the device)."""
        explicit = self.cache_config.kv_cache_memory_bytes
        free, total = torch.neuron.mem_get_info(self.device)
        if explicit is not None:
            if explicit > free:
                raise ValueError(
                    f"kv_cache_memory_bytes={explicit} is more than the {free} bytes free on "
                    f"{self.device} ({format_gib(free)} of {format_gib(total)} GiB): ask for less."
                )
            return explicit
        used = total - free
        budget = int(total * self.cache_config.gpu_memory_utilization) - used
        if budget <= 0:
            raise ValueError(
                f"no device memory left for the KV cache: {format_gib(used)} GiB of "
                f"{format_gib(total)} GiB in use, gpu_memory_utilization="
                f"{self.cache_config.gpu_memory_utilization}. Raise gpu_memory_utilization or "
                "set kv_cache_memory_bytes."
            )
        logger.info("KV cache on %s: %s GiB.", self.device, format_gib(budget))
        return budget

    def compile_or_warm_up_model(self) -> CompilationTimes:
        # Nothing to compile (the model runs eagerly); the seed is reset so that profiling
        # leaves the random state as a fresh start would.
        set_random_seed(self.model_config.seed, self.parallel_config.data_parallel_index)
        return CompilationTimes(
            language_model=self.compilation_config.compilation_time,
            encoder=self.compilation_config.encoder_compilation_time,
        )

    def _maybe_get_memory_pool_context(self, tag: str):
        # vLLM's pools back its sleep mode (CUDA's cumem allocator): not on this device.
        return nullcontext()

    def sleep(self, level: int = 1) -> None:
        logger.warning("sleep mode is not supported on the neuron platform; ignored.")

    def wake_up(self, tags: list[str] | None = None) -> None:
        logger.warning("sleep mode is not supported on the neuron platform; ignored.")
