"""ATen versions of the Triton kernels vLLM's GPU model runner launches on the device.

vLLM lets a platform replace its Triton kernels (`vllm.triton_utils.dispatcher.register_kernels`);
its CPU platform does so with C++ ops that read host memory. These are ATen ops, so they run
on `neuron` tensors and the adaptive engine sees them like the model's own ops. Each takes
the Triton kernel's arguments in the kernel's order (the dispatcher forwards them so).
"""
import torch


def compute_slot_mapping(num_tokens, max_num_tokens, query_start_loc, positions, block_table,
                         block_table_stride, slot_mapping, KV_CACHE_BLOCK_SIZE, TOTAL_CP_WORLD_SIZE=1,
                         TOTAL_CP_RANK=0, CP_KV_CACHE_INTERLEAVE_SIZE=1, PAD_ID=-1, BLOCK_SIZE=1024):
    """`vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel`: each scheduled token's KV
    slot (its request's block for the token's position, times the block size, plus the offset
    in the block); the buffer's tail past the scheduled tokens gets PAD_ID."""
    if TOTAL_CP_WORLD_SIZE != 1:
        raise NotImplementedError("context parallelism is not supported on the neuron platform")
    block_size = KV_CACHE_BLOCK_SIZE
    tokens = torch.arange(num_tokens, device=positions.device)
    # Request of each token: query_start_loc is [requests + 1] ascending, token t belongs to
    # the request whose [start, end) holds it. On the device (no host round trip).
    ends = query_start_loc[1:].to(torch.int64)
    request = torch.searchsorted(ends, tokens, right=True)
    pos = positions[:num_tokens]
    block = block_table[request, torch.div(pos, block_size, rounding_mode="floor")].to(torch.int64)
    slot_mapping[:num_tokens] = block * block_size + torch.remainder(pos, block_size)
    slot_mapping[num_tokens:max_num_tokens] = PAD_ID
