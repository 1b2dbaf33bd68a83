"""vLLM's model runner on `neuron`: the GPU runner's structure, the device's buffers real.

vLLM's GPU model runner keeps each input buffer twice (`CpuGpuBuffer`: a host tensor the
scheduler fills, a device tensor the model reads, copied each step). Its CPU runner folds the
two into one host tensor; here they stay two, the device half on `neuron`, so token ids,
positions, slot mappings and block tables reach the model as the chip would see them: one
host-to-device copy each per step. The CPU runner's host-only helpers (loading, list
conversion) are inherited; its CUDA stand-ins (streams, events) are used while the GPU
runner's constructor asks for them.
"""
import torch

from vllm.v1.worker.cpu_model_runner import CPUModelRunner, _torch_cuda_wrapper
from vllm.v1.worker.gpu_model_runner import GPUModelRunner


class NeuronModelRunner(CPUModelRunner):
    def __init__(self, vllm_config, device: torch.device):
        if device.type != "neuron":
            raise ValueError(f"NeuronModelRunner runs on a neuron device, got {device}")
        # Not CPUModelRunner.__init__: it points the device buffers at the host ones and
        # turns torch.accelerator's synchronize off for the whole process.
        with _torch_cuda_wrapper():
            GPUModelRunner.__init__(self, vllm_config, device)
        self.use_cuda_graph = False

    def _sync_device(self) -> None:
        torch.neuron.synchronize(self.device)

    def warming_up_model(self) -> None:
        # Eager: no graphs to compile ahead of the first request.
        return None
