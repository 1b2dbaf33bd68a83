"""`aten::linear_backward` on neuron, as TorchNeuron registers it (issue 37, item 7).

The op has a kernel for mkldnn tensors only (no CPU kernel), so code written for TorchNeuron,
which registers it for its device, raised "has no CPU kernel" here. It computes what autograd
computes for `F.linear` on CPU, with the same ATen ops in the same arrangement (addmm's backward:
grad @ weight for the input, (input^T @ grad)^T for the weight, grad summed over the rows for
the bias), so its bits are CPU autograd's.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .out_overload import out_overload


def linear_backward(input: Tensor, grad_output: Tensor, weight: Tensor,
                    output_mask: list[bool]) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        grad_input = grad_2d.mm(weight).reshape(input.shape)
    if output_mask[1]:
        grad_weight = input.reshape(-1, input.shape[-1]).t().mm(grad_2d).t().contiguous()
    if output_mask[2]:
        grad_bias = grad_2d.sum(0)
    return grad_input, grad_weight, grad_bias


def register(lib: torch.library.Library) -> None:
    lib.impl("linear_backward", linear_backward, "PrivateUse1")
    lib.impl("linear_backward.out", out_overload(linear_backward, ("out0", "out1", "out2")), "PrivateUse1")
