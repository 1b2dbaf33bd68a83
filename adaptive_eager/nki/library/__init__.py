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

from adaptive_eager.dispatch.nki_kernels import nki_op

from .attention import flash_attention_backward, flash_attention_forward
from .moe import moe_backward, moe_forward
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


def _moe_fake(x, router_w, w_gate, w_up, w_down, top_k):
    return torch.empty_like(x), x.new_empty((x.shape[0], router_w.shape[1]), dtype=torch.float32)


@nki_op("nki_lib::moe", fake=_moe_fake)
def _moe(x: Tensor, router_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    return moe_forward(x, router_w, w_gate, w_up, w_down, top_k)


def _moe_backward_fake(dy, x, router_w, w_gate, w_up, w_down, gates):
    f32 = torch.float32
    return (torch.empty_like(x), router_w.new_empty(router_w.shape, dtype=f32), w_gate.new_empty(w_gate.shape, dtype=f32),
            w_up.new_empty(w_up.shape, dtype=f32), w_down.new_empty(w_down.shape, dtype=f32))


@nki_op("nki_lib::moe_backward", fake=_moe_backward_fake)
def _moe_backward(dy: Tensor, x: Tensor, router_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                  gates: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return moe_backward(dy.contiguous(), x, router_w, w_gate, w_up, w_down, gates)


def _moe_setup(ctx, inputs, output):
    x, router_w, w_gate, w_up, w_down, _ = inputs
    ctx.save_for_backward(x, router_w, w_gate, w_up, w_down, output[1])


def _moe_grad(ctx, dy, dgates):
    x, router_w, w_gate, w_up, w_down, gates = ctx.saved_tensors
    grads = _moe_backward(dy, x, router_w, w_gate, w_up, w_down, gates)
    return (grads[0],) + tuple(g.to(w.dtype) for g, w in zip(grads[1:], (router_w, w_gate, w_up, w_down))) + (None,)


_moe.register_autograd(_moe_grad, setup_context=_moe_setup)


def moe(x: Tensor, router_w: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, top_k: int = 2) -> Tensor:
    """A mixture-of-experts block (moe.py): x (..., D), router_w (D, E), w_gate and w_up (E, D, F),
    w_down (E, F, D). Each token goes to its top_k experts, SiLU-gated MLPs, weighted by the
    softmax of their router logits."""
    d = x.shape[-1]
    e, d2, f = w_gate.shape
    if (d2, router_w.shape, w_up.shape, w_down.shape) != (d, (d, e), (e, d, f), (e, f, d)):
        raise ValueError(f"moe: shapes do not fit: x (..., {d}), router_w {tuple(router_w.shape)}, w_gate "
                         f"{tuple(w_gate.shape)}, w_up {tuple(w_up.shape)}, w_down {tuple(w_down.shape)}; want "
                         f"router_w (D, E), w_gate and w_up (E, D, F), w_down (E, F, D)")
    if d > 128 or e > 128 or f > 512:
        raise ValueError(f"moe: the kernel takes D <= 128, E <= 128 and F <= 512 (one tile each), got D={d}, E={e}, "
                         f"F={f}")
    if not 1 <= top_k <= e:
        raise ValueError(f"moe: top_k={top_k} must be in [1, {e}]")
    y, _ = _moe(x.reshape(-1, d), router_w, w_gate, w_up, w_down, int(top_k))
    return y.reshape(x.shape)


__all__ = ["flash_attention", "moe", "rms_norm"]
