"""Custom kernels shipped with the device: attention and RMSNorm, one launch each way.

Both are built with `custom_kernel` (custom_kernels.py), as a user's kernel would be, and
both compute exactly what the host computes for the same call, so results stay
bit-identical to CPU:

- `neuron::attention` runs `scaled_dot_product_attention` as one op where the host takes
  its math path (where it takes its flash kernel, neuron issues that ATen op: attention.py).
  `neuron::attention_backward` is a recomputation under host autograd, which runs the very
  backward ops CPU autograd would run. With dropout (always the host's math path),
  `neuron::attention_dropout` draws the mask from the device generator and its backward
  replays it from the generator state the forward started from.
- `neuron::rms_norm` runs `aten::rms_norm`'s composite body on the host (CPU has no fused
  RMSNorm kernel), `neuron::rms_norm_backward` its autograd backward by recomputation.

torch.compile traces them with their host bodies run on FakeTensors (`fake=True`: every
op they call has a meta kernel), so traced shapes and strides are the real ones.
Costs (Note [Custom kernel cost]) are those of fused kernels: attention never writes its
L x L score matrix to HBM; the backward kernels pay for recomputing the forward.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from .custom_kernels import custom_kernel
from .rng import DefaultGeneratorLent

aten = torch.ops.aten
# Keys the autograd kernel above a host op excludes (AutoDispatchBelowADInplaceOrView); a
# backward by recomputation needs them back to record the host graph.
_AUTOGRAD_KEYS = (torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradCPU)
                  | torch._C.DispatchKeySet(torch._C.DispatchKey.ADInplaceOrView))


def _host_autograd():
    """Host autograd on, whatever the dispatcher state we are called in."""
    exclude = torch._C._dispatch_tls_local_exclude_set() - _AUTOGRAD_KEYS
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def _own_saved_tensors():
    """The host graph keeps its saved tensors itself. A fused launch runs this kernel under the
    thread state of whatever op flushed it, which may be inside a checkpointed region's
    recomputation: its saved-tensor hooks (a stack: the top pair applies) would take our host
    tensors as the region's own, and checkpoint then fails its metadata check."""
    if not torch._C._autograd._saved_tensors_hooks_is_enabled():  # disabled: none can apply
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(_keep, _keep)


def _keep(x):
    return x


def _vjp(fn, inputs: tuple, grad: Tensor, needed: tuple) -> list:
    """Gradients of fn(*inputs) against grad for the inputs flagged in needed (None elsewhere),
    by running fn under host autograd: the backward CPU autograd runs for the same graph."""
    with _host_autograd(), torch.enable_grad(), _own_saved_tensors():
        leaves = [x.detach().requires_grad_(n) if x is not None else None for x, n in zip(inputs, needed)]
        out = fn(*leaves)
        wanted = [x for x, n in zip(leaves, needed) if n and x is not None]
        grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
    return [next(grads) if n and x is not None else None for x, n in zip(inputs, needed)]


# -- attention --------------------------------------------------------------------------------

def additive_mask(attn_mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """As CPU's SDPA converts a boolean mask (True = attend) before a fused kernel: 0 / -inf in
    the query's dtype, one `where` (both values are exact: any construction gives the same bits).
    -inf is a CPU 0-dim tensor, a scalar to a neuron op as on CUDA (attention.py issues this on
    neuron tensors); made per call, not cached: under torch.compile's fake mode a real tensor
    would be refused."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    return torch.where(attn_mask, 0.0, torch.tensor(float("-inf"), dtype=dtype))


def _math(q, k, v, mask, is_causal, scale, enable_gqa):
    return aten._scaled_dot_product_attention_math(
        q, k, v, mask, 0.0, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]


def _score_flops(q: Tensor, k: Tensor) -> float:
    """FLOPs of one L x S x E matmul over all batches and heads (q @ k^T, or p @ v)."""
    return 2.0 * q.numel() * k.shape[-2]


def _attention_cost(q, k, v, attn_mask, is_causal, scale, enable_gqa):
    mask_bytes = 0 if attn_mask is None else attn_mask.nbytes
    out_bytes = q.numel() * v.shape[-1] // q.shape[-1] * v.element_size()
    return {"flops": 2 * _score_flops(q, k), "bytes": q.nbytes + k.nbytes + v.nbytes + mask_bytes + out_bytes}


@custom_kernel("neuron::attention", cost=_attention_cost, fake=True)
def attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, is_causal: bool,
              scale: float | None, enable_gqa: bool) -> Tensor:
    """SDPA without dropout, as the host's math path computes it."""
    return _math(query, key, value, additive_mask(attn_mask, query.dtype), is_causal, scale, enable_gqa)


def _attention_backward_cost(grad, q, k, v, attn_mask, is_causal, scale, enable_gqa):
    mask_bytes = 0 if attn_mask is None else attn_mask.nbytes
    # recompute q @ k^T and p @ v's softmax, then dq, dk, dv, dp: five score-sized matmuls
    return {"flops": 5 * _score_flops(q, k), "bytes": 2 * (q.nbytes + k.nbytes + v.nbytes) + grad.nbytes + mask_bytes}


@custom_kernel("neuron::attention_backward", cost=_attention_backward_cost, fake=True)
def attention_backward(grad: Tensor, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None,
                       is_causal: bool, scale: float | None, enable_gqa: bool) -> tuple[Tensor, Tensor, Tensor]:
    mask = additive_mask(attn_mask, query.dtype)
    dq, dk, dv = _vjp(lambda q, k, v: _math(q, k, v, mask, is_causal, scale, enable_gqa),
                      (query, key, value), grad, (True, True, True))
    return dq, dk, dv


def _attention_setup(ctx, inputs, output):
    query, key, value, attn_mask, is_causal, scale, enable_gqa = inputs
    ctx.save_for_backward(query, key, value, attn_mask)
    ctx.flags = (is_causal, scale, enable_gqa)
    ctx.set_materialize_grads(False)


def _attention_grad(ctx, grad_out):
    if grad_out is None:  # the output took no part in the loss
        return (None,) * 7
    query, key, value, attn_mask = ctx.saved_tensors
    dq, dk, dv = attention_backward(grad_out, query, key, value, attn_mask, *ctx.flags)
    return dq, dk, dv, None, None, None, None


attention.register_autograd(_attention_grad, setup_context=_attention_setup)


def fused_attention_applies(attn_mask) -> bool:
    """True if one launch each way computes this SDPA call exactly: a mask that needs a
    gradient gets none from these kernels, so it keeps the host's decomposition (several ops)."""
    return attn_mask is None or not attn_mask.requires_grad or not torch.is_grad_enabled()


# With dropout the host always takes the math path (its flash kernel has no dropout). The
# forward draws the dropout mask where the decomposition would, from the device's generator
# (random=True: run_on_host lends it as torch's default generator), and returns the
# generator state it started from. The backward recomputes the forward from that state
# under host autograd, without advancing any generator: the same mask, and the backward
# ops CPU autograd runs for the decomposition.

def _math_dropout(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    return aten._scaled_dot_product_attention_math(
        q, k, v, additive_mask(attn_mask, q.dtype), dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]


def _attention_dropout_cost(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    return _attention_cost(q, k, v, attn_mask, is_causal, scale, enable_gqa)


def _attention_dropout_fake(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    # The kernel's own computation, dropout included: its output's layout is the kernel's
    # by construction (a compiled graph asserts it).
    out = _math_dropout(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    # The state's size from a real one, the tensor made from the inputs: under torch.compile's
    # fake mode, `empty_like` of the real state tensor is refused ("convert all Tensors to
    # FakeTensors first"), which broke compiling any model with attention dropout in training.
    state_bytes = torch.default_generator.get_state().numel()
    return out, query.new_empty((state_bytes,), dtype=torch.uint8)


@custom_kernel("neuron::attention_dropout", cost=_attention_dropout_cost, fake=_attention_dropout_fake, random=True)
def attention_dropout(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, dropout_p: float,
                      is_causal: bool, scale: float | None, enable_gqa: bool) -> tuple[Tensor, Tensor]:
    """SDPA with dropout as the host's math path computes it: (out, the generator state its
    dropout started from)."""
    state = torch.default_generator.get_state()
    return _math_dropout(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa), state


def _attention_dropout_backward_cost(grad, q, k, v, attn_mask, rng_state, dropout_p, is_causal, scale, enable_gqa):
    mask_bytes = 0 if attn_mask is None else attn_mask.nbytes
    return {"flops": 5 * _score_flops(q, k), "bytes": 2 * (q.nbytes + k.nbytes + v.nbytes) + grad.nbytes + mask_bytes}


def _math_dropout_vjp(grad, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    return tuple(_vjp(lambda q, k, v: _math_dropout(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa),
                      (query, key, value), grad, (True, True, True)))


def _attention_dropout_backward_fake(grad, query, key, value, attn_mask, rng_state, dropout_p, is_causal, scale,
                                     enable_gqa):
    # The kernel's own computation on fake tensors, for its gradients' strides (those of the
    # math path's backward, not the inputs': a compiled graph asserts them), without the
    # generator: fake dropout draws nothing.
    return _math_dropout_vjp(grad, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


@custom_kernel("neuron::attention_dropout_backward", cost=_attention_dropout_backward_cost,
               fake=_attention_dropout_backward_fake)
def attention_dropout_backward(grad: Tensor, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None,
                               rng_state: Tensor, dropout_p: float, is_causal: bool, scale: float | None,
                               enable_gqa: bool) -> tuple[Tensor, Tensor, Tensor]:
    forward_rng = torch.Generator()
    forward_rng.set_state(rng_state)  # the forward's dropout mask again; no real generator advances
    with DefaultGeneratorLent(forward_rng):
        return _math_dropout_vjp(grad, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _attention_dropout_setup(ctx, inputs, output):
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa = inputs
    ctx.save_for_backward(query, key, value, attn_mask, output[1])
    ctx.flags = (dropout_p, is_causal, scale, enable_gqa)
    ctx.set_materialize_grads(False)


def _attention_dropout_grad(ctx, grad_out, grad_state):
    if grad_out is None:
        return (None,) * 8
    query, key, value, attn_mask, rng_state = ctx.saved_tensors
    dq, dk, dv = attention_dropout_backward(grad_out, query, key, value, attn_mask, rng_state, *ctx.flags)
    return dq, dk, dv, None, None, None, None, None


attention_dropout.register_autograd(_attention_dropout_grad, setup_context=_attention_dropout_setup)


# -- RMSNorm ----------------------------------------------------------------------------------

def _rms_norm_cost(input, normalized_shape, weight, eps):
    w_bytes = 0 if weight is None else weight.nbytes
    return {"flops": 4.0 * input.numel(), "bytes": 2 * input.nbytes + w_bytes}


@custom_kernel("neuron::rms_norm", cost=_rms_norm_cost, fake=True)
def rms_norm(input: Tensor, normalized_shape: list[int], weight: Tensor | None, eps: float | None) -> Tensor:
    """`aten::rms_norm` as the host computes it (its composite body: CPU has no fused kernel)."""
    return aten.rms_norm.default.decompose(input, normalized_shape, weight, eps)


def _rms_norm_backward_cost(grad, input, normalized_shape, weight, eps, output_mask):
    w_bytes = 0 if weight is None else 2 * weight.nbytes
    return {"flops": 12.0 * input.numel(), "bytes": 3 * input.nbytes + w_bytes}


@custom_kernel("neuron::rms_norm_backward", cost=_rms_norm_backward_cost, fake=True)
def rms_norm_backward(grad: Tensor, input: Tensor, normalized_shape: list[int], weight: Tensor | None,
                      eps: float | None, output_mask: list[bool]) -> tuple[Tensor, Tensor]:
    """(d input, d weight); an output not asked for in output_mask is an empty tensor."""
    dx, dw = _vjp(lambda x, w: aten.rms_norm.default.decompose(x, normalized_shape, w, eps),
                  (input, weight), grad, tuple(output_mask))
    return (input.new_empty(0) if dx is None else dx), (input.new_empty(0) if dw is None else dw)


def _rms_norm_setup(ctx, inputs, output):
    input, normalized_shape, weight, eps = inputs
    ctx.save_for_backward(input, weight)
    ctx.args = (normalized_shape, eps)


def _rms_norm_grad(ctx, grad):
    input, weight = ctx.saved_tensors
    normalized_shape, eps = ctx.args
    mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[2]]
    dx, dw = rms_norm_backward(grad, input, normalized_shape, weight, eps, mask)
    return (dx if mask[0] else None), None, (dw if mask[1] else None), None


rms_norm.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


def _rms_norm_kernel(input, normalized_shape, weight=None, eps=None):
    # AutogradPrivateUse1 kernel of aten::rms_norm: the whole norm is one op each way.
    return rms_norm(input, list(normalized_shape), weight, eps)


def register(lib: torch.library.Library) -> None:
    """Route aten ops on neuron to the shipped kernels (attention: see attention.py)."""
    lib.impl("rms_norm", _rms_norm_kernel, "AutogradPrivateUse1")
    # inference_mode skips the autograd key: one op below it too.
    lib.impl("rms_norm", _rms_norm_kernel, "PrivateUse1")
