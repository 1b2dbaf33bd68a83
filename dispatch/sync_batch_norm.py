"""SyncBatchNorm's kernels on neuron, with CUDA's arithmetic (issue 37, item 7).

`nn.SyncBatchNorm` (torch/nn/modules/_functions.py) runs on "cuda", "hpu", "xpu", "mps" and the
PrivateUse1 device through five ops that have no CPU kernel: `batch_norm_stats`,
`batch_norm_gather_stats_with_counts`, `batch_norm_elemt`, `batch_norm_backward_reduce` and
`batch_norm_backward_elemt`. Neuron runs CPU's kernels, so a SyncBatchNorm model on neuron
raised "has no CPU kernel" at its first training step under torch.distributed (TorchNeuron's
distributed tests train SyncBatchNorm models). With no CPU result to match, each computes what
CUDA's kernel computes (aten/src/ATen/native/cuda/Normalization.cuh), in CUDA's accumulation
type (float32, float64 for float64 inputs), composed of ATen ops on the device: each op takes
the eager path (and the adaptive engine's traces) as any other. The older
`batch_norm_gather_stats` (one count for every rank) and the `.out` forms of all six too.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .out_overload import out_overload


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _reduced_dims(input: Tensor) -> list[int]:
    return [0, *range(2, input.dim())]


def _per_channel(t: Tensor, input: Tensor) -> Tensor:
    """t of shape (C,) broadcast against input (N, C, ...)."""
    return t.reshape(1, -1, *([1] * (input.dim() - 2)))


def batch_norm_stats(input: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(mean, invstd) per channel: the biased variance's 1 / sqrt(var + eps), 0 where var and
    eps are both 0 (CUDA's InvStd)."""
    x = input.to(_accumulation(input.dtype))
    var, mean = torch.var_mean(x, dim=_reduced_dims(input), correction=0)
    invstd = torch.where((var == 0) & (eps == 0), torch.zeros_like(var), 1 / torch.sqrt(var + eps))
    return mean, invstd


def batch_norm_gather_stats_with_counts(input: Tensor, mean: Tensor, invstd: Tensor, running_mean: Tensor | None,
                                        running_var: Tensor | None, momentum: float, eps: float,
                                        counts: Tensor) -> tuple[Tensor, Tensor]:
    """The statistics of all ranks' shards from each one's (mean, invstd, count), merged one rank
    at a time as batch_norm_reduce_statistics_kernel merges them; the running statistics updated
    with the unbiased variance, in place."""
    acc = _accumulation(input.dtype)
    means, invstds, counts = mean.to(acc), invstd.to(acc), counts.to(acc)
    avg = torch.zeros(means.shape[1], dtype=acc, device=means.device)
    var_n = torch.zeros_like(avg)
    n = torch.zeros((), dtype=acc, device=means.device)
    for j in range(means.shape[0]):
        count = counts[j]
        std = 1 / invstds[j]
        v = (std * std - eps) * count
        factor = 1 / (n + count)
        var_n = var_n + v + (avg - means[j]) * (avg - means[j]) * n * count * factor
        avg = n * factor * avg + count * factor * means[j]
        n = n + count
    merged_invstd = 1 / torch.sqrt(var_n / n + eps)
    if running_mean is not None:
        running_mean.copy_(((1 - momentum) * running_mean.to(acc) + momentum * avg).to(running_mean.dtype))
    if running_var is not None:
        unbiased = var_n / (n - 1)
        running_var.copy_(((1 - momentum) * running_var.to(acc) + momentum * unbiased).to(running_var.dtype))
    return avg, merged_invstd


def batch_norm_elemt(input: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, invstd: Tensor,
                     eps: float) -> Tensor:
    """((input - mean) * invstd) * weight + bias, per channel, in the accumulation type."""
    acc = _accumulation(input.dtype)
    out = (input.to(acc) - _per_channel(mean.to(acc), input)) * _per_channel(invstd.to(acc), input)
    if weight is not None:
        out = out * _per_channel(weight.to(acc), input)
    if bias is not None:
        out = out + _per_channel(bias.to(acc), input)
    return out.to(input.dtype).contiguous(memory_format=_memory_format(input))


def batch_norm_backward_reduce(grad_out: Tensor, input: Tensor, mean: Tensor, invstd: Tensor, weight: Tensor | None,
                               input_g: bool, weight_g: bool, bias_g: bool):
    """(sum_dy, sum_dy_xmu, grad_weight, grad_bias) per channel; each undefined where not asked
    for (the sums when input_g is False), as CUDA's."""
    acc = _accumulation(input.dtype)
    dims = _reduced_dims(input)
    dy = grad_out.to(acc)
    sum_dy = dy.sum(dims)
    sum_dy_xmu = (dy * (input.to(acc) - _per_channel(mean.to(acc), input))).sum(dims)
    param_dtype = weight.dtype if weight is not None else input.dtype
    grad_weight = (sum_dy_xmu * invstd.to(acc)).to(param_dtype) if weight_g else None
    grad_bias = sum_dy.to(param_dtype) if bias_g else None
    if not input_g:
        sum_dy = sum_dy_xmu = None
    return sum_dy, sum_dy_xmu, grad_weight, grad_bias


def batch_norm_backward_elemt(grad_out: Tensor, input: Tensor, mean: Tensor, invstd: Tensor, weight: Tensor | None,
                              sum_dy: Tensor, sum_dy_xmu: Tensor, count: Tensor) -> Tensor:
    """The input's gradient from the all-reduced sums over every rank's count of elements."""
    acc = _accumulation(input.dtype)
    norm = 1 / count.to(acc).sum()
    mean_dy = sum_dy.to(acc) * norm
    invstd = invstd.to(acc)
    projection = invstd * invstd * sum_dy_xmu.to(acc) * norm
    scale = invstd * weight.to(acc) if weight is not None else invstd
    x_mu = input.to(acc) - _per_channel(mean.to(acc), input)
    grad = (grad_out.to(acc) - _per_channel(mean_dy, input) - x_mu * _per_channel(projection, input))
    grad = grad * _per_channel(scale, input)
    return grad.to(input.dtype).contiguous(memory_format=_memory_format(input))


def _memory_format(input: Tensor) -> torch.memory_format:
    if input.dim() == 4 and input.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if input.dim() == 5 and input.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def batch_norm_gather_stats(input: Tensor, mean: Tensor, invstd: Tensor, running_mean: Tensor | None,
                            running_var: Tensor | None, momentum: float, eps: float, count: int) -> tuple[Tensor, Tensor]:
    """The older form of batch_norm_gather_stats_with_counts: every rank's shard holds `count`
    elements per channel."""
    counts = torch.full((mean.shape[0],), count, dtype=mean.dtype, device=mean.device)
    return batch_norm_gather_stats_with_counts(input, mean, invstd, running_mean, running_var, momentum, eps, counts)


KERNELS = {
    "batch_norm_stats": batch_norm_stats,
    "batch_norm_gather_stats": batch_norm_gather_stats,
    "batch_norm_gather_stats_with_counts": batch_norm_gather_stats_with_counts,
    "batch_norm_elemt": batch_norm_elemt,
    "batch_norm_backward_reduce": batch_norm_backward_reduce,
    "batch_norm_backward_elemt": batch_norm_backward_elemt,
}
# The out= forms' result names (their schemas' Tensor(a!) arguments).
OUT_NAMES = {
    "batch_norm_stats": ("out0", "out1"),
    "batch_norm_gather_stats": ("out0", "out1"),
    "batch_norm_gather_stats_with_counts": ("out0", "out1"),
    "batch_norm_elemt": ("out",),
    "batch_norm_backward_reduce": ("out0", "out1", "out2", "out3"),
    "batch_norm_backward_elemt": ("out",),
}


def register(lib: torch.library.Library) -> None:
    """Give neuron SyncBatchNorm's kernels and their out= forms (none has a CPU kernel to run)."""
    for name, kernel in KERNELS.items():
        lib.impl(name, kernel, "PrivateUse1")
        lib.impl(f"{name}.out", out_overload(kernel, OUT_NAMES[name]), "PrivateUse1")
