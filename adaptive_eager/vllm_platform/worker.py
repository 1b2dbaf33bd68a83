"""vLLM's worker for the emulated device: takes `neuron:<rank>`, builds the model runner, and
sizes the KV cache from the device's memory and the host's."""
from contextlib import nullcontext

import psutil
import torch

from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.utils.mem_utils import format_gib
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.worker_base import CompilationTimes

from .model_runner import NeuronModelRunner

logger = init_logger(__name__)


def kv_cache_budget(explicit: int | None, free: int, total: int, utilization: float, host_available: int,
                    device: str) -> int:
    """The KV cache's bytes. The user's size is taken as given (or refused if the device has
    not that much free). Otherwise `utilization` of the device's memory less what is in use,
    as on a GPU, but no more than `utilization` of the host's available memory: the emulated
    device's bytes are host memory, and a 24 GiB device on a 24 GiB machine would otherwise
    take all of it for the cache (the kernel kills the server, or the machine swaps)."""
    if explicit is not None:
        if explicit > free:
            raise ValueError(
                f"kv_cache_memory_bytes={explicit} is more than the {free} bytes free on "
                f"{device} ({format_gib(free)} of {format_gib(total)} GiB): ask for less."
            )
        return explicit
    used = total - free
    on_device = int(total * utilization) - used
    if on_device <= 0:
        raise ValueError(
            f"no device memory left for the KV cache: {format_gib(used)} GiB of "
            f"{format_gib(total)} GiB in use, gpu_memory_utilization={utilization}. Raise "
            "gpu_memory_utilization or set kv_cache_memory_bytes."
        )
    on_host = int(host_available * utilization)
    if on_host < on_device:
        logger.warning(
            "KV cache bounded by host memory: %s GiB (%s of the host's available %s GiB) instead of %s GiB "
            "of %s's memory; the emulated device's bytes are host memory. Set kv_cache_memory_bytes "
            "to choose the size.", format_gib(on_host), utilization, format_gib(host_available),
            format_gib(on_device), device)
        return on_host
    return on_device


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
        memory times `gpu_memory_utilization` (the weights are already on the device), bounded
        by the host's available memory (kv_cache_budget)."""
        free, total = torch.neuron.mem_get_info(self.device)
        budget = kv_cache_budget(self.cache_config.kv_cache_memory_bytes, free, total,
                                 self.cache_config.gpu_memory_utilization, psutil.virtual_memory().available,
                                 str(self.device))
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
