"""NKI kernels shipped with the emulator, as torch ops on `neuron` (and CPU) tensors.

| op | kernels | tested against |
|---|---|---|
| `flash_attention(q, k, v, causal=False, scale=None)` | attention.py: tiled, online softmax, causal | F.scaled_dot_product_attention |
| `rms_norm(x, weight, eps=1e-6)` | rmsnorm.py | F.rms_norm |
| `moe(x, router_w, w_gate, w_up, w_down, top_k)` | moe.py: router top-k, SiLU-gated expert MLPs | the PyTorch composite |

Each is an `nki_op` (dispatch/nki_kernels.py): one op of a fused adaptive trace, one launch in
eager mode priced by its kernels' modelled time, one node under torch.compile (its shapes
from a shape function, not from running the kernel), differentiable (the backward runs
the backward kernels). Results match torch within the tolerances of float32 arithmetic in
another order (the tests give them); bfloat16 inputs are rounded where the kernels round them.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from dispatch.nki_kernels import nki_op

from .attention import flash_attention_backward, flash_attention_forward
from .rmsnorm import rmsnorm_backward, rmsnorm_forward


def _attention_fake(q, k, v, scale, causal):
    b, h, s, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, h, s, 1), dtype=torch.float32)


@nki_op("nki_lib::flash_attention", fake=_attention_fake)
def _flash_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    b, h, s, d = q.shape
    flat = [t.reshape(b * h, s, d) for t in (q, k, v)]
    out, lse = flash_attention_forward[b * h](*flat, scale, causal)
    return out.reshape(b, h, s, d), lse.reshape(b, h, s, 1)


def _attention_backward_fake(q, k, v, out, dout, lse, scale, causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@nki_op("nki_lib::flash_attention_backward", fake=_attention_backward_fake)
def _flash_attention_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, dout: Tensor, lse: Tensor, scale: float,
                              causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    b, h, s, d = q.shape
    flat = [t.reshape(b * h, s, -1) for t in (q, k, v, out, dout.contiguous(), lse)]
    dq, dk, dv = flash_attention_backward[b * h](*flat, scale, causal)
    return dq.reshape(b, h, s, d), dk.reshape(b, h, s, d), dv.reshape(b, h, s, d)


def _attention_setup(ctx, inputs, output):
    q, k, v, scale, causal = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1])
    ctx.scale, ctx.causal = scale, causal


def _attention_grad(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _flash_attention_backward(q, k, v, out, dout, lse, ctx.scale, ctx.causal)
    return dq, dk, dv, None, None


_flash_attention.register_autograd(_attention_grad, setup_context=_attention_setup)


def flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: float | None = None) -> Tensor:
    """softmax(q k^T * scale [causally masked]) v for (batch, heads, seq, head_dim) tensors with
    head_dim <= 128, as F.scaled_dot_product_attention(q, k, v, is_causal=causal) computes it."""
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"flash_attention takes q, k, v of one (batch, heads, seq, head_dim) shape, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} (repeat k/v heads first for GQA)")
    if q.shape[-1] > 128:
        raise ValueError(f"flash_attention: head_dim {q.shape[-1]} exceeds the 128 partitions of a NeuronCore")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _flash_attention(q, k, v, scale, bool(causal))[0]


def _rms_fake(x, weight, eps):
    return torch.empty_like(x), x.new_empty((x.shape[0], 1), dtype=torch.float32)


@nki_op("nki_lib::rms_norm", fake=_rms_fake)
def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return rmsnorm_forward(x, weight, eps)


def _rms_backward_fake(dy, x, weight, rstd):
    return torch.empty_like(x), weight.new_empty(weight.shape, dtype=torch.float32)


@nki_op("nki_lib::rms_norm_backward", fake=_rms_backward_fake)
def _rms_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    return rmsnorm_backward(dy.contiguous(), x, weight, rstd)


def _rms_setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_grad(ctx, dy, drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_backward(dy, x, weight, rstd)
    return dx, dw.to(weight.dtype), None


_rms_norm.register_autograd(_rms_grad, setup_context=_rms_setup)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """x * rsqrt(mean(x^2, -1) + eps) * weight over the last dim, as F.rms_norm(x, (D,), weight, eps)."""
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"rms_norm: weight must have shape ({d},), got {tuple(weight.shape)}")
    y, _ = _rms_norm(x.reshape(-1, d), weight, float(eps))
    return y.reshape(x.shape)


__all__ = ["flash_attention", "rms_norm"]
