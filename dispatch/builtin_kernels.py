"""Custom kernels shipped with the device: attention and RMSNorm, one launch each way.

Both are built with `custom_kernel` (custom_kernels.py), as a user's kernel would be, and
both compute exactly what the host computes for the same call, so results stay
bit-identical to CPU:

- `neuron::attention` runs `scaled_dot_product_attention` as one op where the host takes
  its math path (where it takes its flash kernel, neuron issues that ATen op: attention.py).
  `neuron::attention_backward` is a recomputation under host autograd, which runs the very
  backward ops CPU autograd would run. With dropout (always the host's math path),
  `neuron::attention_dropout` draws the mask from torch's default generator and its backward
  replays it from the generator state the forward started from.
- `neuron::rms_norm` runs `aten::rms_norm`'s composite body on the host (CPU has no fused
  RMSNorm kernel), `neuron::rms_norm_backward` its autograd backward by recomputation, the
  input's gradient one read at a time (Note [RMSNorm's input gradient, use by use]).

torch.compile traces them with their host bodies run on FakeTensors (`fake=True`: every
op they call has a meta kernel), so traced shapes and strides are the real ones.
Costs (Note [Custom kernel cost]) are those of fused kernels: attention never writes its
L x L score matrix to HBM; the backward kernels pay for recomputing the forward.
"""
from __future__ import annotations

import contextlib
import math

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


# Note [SDPA's math path reads requires_grad]: at::matmul folds a batched operand into one mm
# when the 2-D operand facing it requires a gradient (should_fold, LinearAlgebra.cpp), and
# takes bmm otherwise: other bits. So CPU's math path computes other bits for a 2-D query (or
# key/value) that requires a gradient, forward and backward (1.2e-7 for a 2-D query against
# 3-D key and value). The math kernels therefore get the flags CPU's graph would carry (an
# input's requires_grad, under grad mode) and compute on leaves flagged so under host
# autograd; the backward recomputes with the same flags and asks gradients of those inputs
# only, as CPU autograd does.

def _flagged(fn, inputs: tuple, requires_grad) -> Tensor:
    """fn(*inputs) computed as CPU computes it for a caller whose inputs flagged in requires_grad
    need a gradient (Note [SDPA's math path reads requires_grad]): the result, detached."""
    if not any(requires_grad):
        return fn(*inputs)
    with _host_autograd(), torch.enable_grad(), _own_saved_tensors():
        leaves = [x.detach().requires_grad_(n) for x, n in zip(inputs, requires_grad)]
        return fn(*leaves).detach()


def _or_empty(grads: list, like: Tensor) -> tuple:
    """A custom op returns tensors: an input whose gradient was not asked gets an empty one."""
    return tuple(like.new_empty(0) if g is None else g for g in grads)


def _asked(grads, requires_grad) -> list:
    """The backward kernel's gradients, None where none was asked (its empty placeholders)."""
    return [g if n else None for g, n in zip(grads, requires_grad)]


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


def _attention_cost(q, k, v, attn_mask, is_causal, scale, enable_gqa, requires_grad):
    mask_bytes = 0 if attn_mask is None else attn_mask.nbytes
    out_bytes = q.numel() * v.shape[-1] // q.shape[-1] * v.element_size()
    return {"flops": 2 * _score_flops(q, k), "bytes": q.nbytes + k.nbytes + v.nbytes + mask_bytes + out_bytes}


@custom_kernel("neuron::attention", cost=_attention_cost, fake=True)
def attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, is_causal: bool,
              scale: float | None, enable_gqa: bool, requires_grad: list[bool]) -> Tensor:
    """SDPA without dropout, as the host's math path computes it for inputs that need a
    gradient where requires_grad says so (Note [SDPA's math path reads requires_grad])."""
    mask = additive_mask(attn_mask, query.dtype)
    return _flagged(lambda q, k, v: _math(q, k, v, mask, is_causal, scale, enable_gqa), (query, key, value),
                    requires_grad)


def _attention_backward_cost(grad, q, k, v, attn_mask, is_causal, scale, enable_gqa, requires_grad):
    mask_bytes = 0 if attn_mask is None else attn_mask.nbytes
    # recompute q @ k^T and p @ v's softmax, then dq, dk, dv, dp: five score-sized matmuls
    return {"flops": 5 * _score_flops(q, k), "bytes": 2 * (q.nbytes + k.nbytes + v.nbytes) + grad.nbytes + mask_bytes}


@custom_kernel("neuron::attention_backward", cost=_attention_backward_cost, fake=True)
def attention_backward(grad: Tensor, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None,
                       is_causal: bool, scale: float | None, enable_gqa: bool,
                       requires_grad: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    """(d query, d key, d value), each empty where requires_grad did not ask for it."""
    mask = additive_mask(attn_mask, query.dtype)
    return _or_empty(_vjp(lambda q, k, v: _math(q, k, v, mask, is_causal, scale, enable_gqa),
                          (query, key, value), grad, tuple(requires_grad)), query)


def _attention_setup(ctx, inputs, output):
    query, key, value, attn_mask, is_causal, scale, enable_gqa, requires_grad = inputs
    ctx.save_for_backward(query, key, value, attn_mask)
    ctx.flags = (is_causal, scale, enable_gqa, requires_grad)
    ctx.set_materialize_grads(False)


def _attention_grad(ctx, grad_out):
    if grad_out is None:  # the output took no part in the loss
        return (None,) * 8
    query, key, value, attn_mask = ctx.saved_tensors
    grads = attention_backward(grad_out, query, key, value, attn_mask, *ctx.flags)
    return (*_asked(grads, ctx.flags[-1]), None, None, None, None, None)


attention.register_autograd(_attention_grad, setup_context=_attention_setup)


def autograd_flags(query: Tensor, key: Tensor, value: Tensor) -> list[bool]:
    """Which of query, key and value CPU's graph would carry a gradient for: the kernels'
    `requires_grad` argument (Note [SDPA's math path reads requires_grad])."""
    grad_mode = torch.is_grad_enabled()
    return [grad_mode and t.requires_grad for t in (query, key, value)]


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


def _math_dropout_flagged(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, requires_grad):
    return _flagged(lambda q, k, v: _math_dropout(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa),
                    (q, k, v), requires_grad)


def _attention_dropout_cost(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, requires_grad):
    return _attention_cost(q, k, v, attn_mask, is_causal, scale, enable_gqa, requires_grad)


def _attention_dropout_fake(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, requires_grad):
    # The kernel's own computation, dropout included: its output's layout is the kernel's
    # by construction (a compiled graph asserts it).
    out = _math_dropout_flagged(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, requires_grad)
    # The state's size from a real one, the tensor made from the inputs: under torch.compile's
    # fake mode, `empty_like` of the real state tensor is refused ("convert all Tensors to
    # FakeTensors first"), which broke compiling any model with attention dropout in training.
    state_bytes = torch.default_generator.get_state().numel()
    return out, query.new_empty((state_bytes,), dtype=torch.uint8)


def _attention_dropout_draws(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, requires_grad):
    """The kernel's draws, made at issue (Note [Deferred random ops draw at issue]): the host's
    math path (aten::_scaled_dot_product_attention_math) drops out its attention weights with
    at::dropout, which on a CPU tensor draws `empty_like(weights).bernoulli_(1 - p)` (none for
    p == 0 or 1, or no weights). The weights: the batch dims of query and key broadcast (key's
    heads repeated to query's under GQA), query's length by key's, in float for half and
    bfloat16 (the math path computes in float)."""
    key_batch = key.shape[:-2]
    if enable_gqa and key.dim() >= 3 and query.dim() >= 3:
        key_batch = key.shape[:-3] + query.shape[-3:-2]
    shape = [*torch.broadcast_shapes(query.shape[:-2], key_batch), query.shape[-2], key.shape[-2]]
    dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    if 0.0 < dropout_p < 1.0 and math.prod(shape) > 0:
        torch.empty(shape, dtype=dtype).bernoulli_(1.0 - dropout_p)


@custom_kernel("neuron::attention_dropout", cost=_attention_dropout_cost, fake=_attention_dropout_fake, random=True,
               draws=_attention_dropout_draws)
def attention_dropout(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, dropout_p: float,
                      is_causal: bool, scale: float | None, enable_gqa: bool,
                      requires_grad: list[bool]) -> tuple[Tensor, Tensor]:
    """SDPA with dropout as the host's math path computes it (Note [SDPA's math path reads
    requires_grad]): (out, the generator state its dropout started from)."""
    state = torch.default_generator.get_state()
    return _math_dropout_flagged(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                 requires_grad), state


def _attention_dropout_backward_cost(grad, q, k, v, attn_mask, rng_state, dropout_p, is_causal, scale, enable_gqa,
                                     requires_grad):
    mask_bytes = 0 if attn_mask is None else attn_mask.nbytes
    return {"flops": 5 * _score_flops(q, k), "bytes": 2 * (q.nbytes + k.nbytes + v.nbytes) + grad.nbytes + mask_bytes}


def _math_dropout_vjp(grad, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, requires_grad):
    return _or_empty(_vjp(lambda q, k, v: _math_dropout(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa),
                          (query, key, value), grad, tuple(requires_grad)), query)


def _attention_dropout_backward_fake(grad, query, key, value, attn_mask, rng_state, dropout_p, is_causal, scale,
                                     enable_gqa, requires_grad):
    # The kernel's own computation on fake tensors, for its gradients' strides (those of the
    # math path's backward, not the inputs': a compiled graph asserts them), without the
    # generator: fake dropout draws nothing.
    return _math_dropout_vjp(grad, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                             requires_grad)


@custom_kernel("neuron::attention_dropout_backward", cost=_attention_dropout_backward_cost,
               fake=_attention_dropout_backward_fake)
def attention_dropout_backward(grad: Tensor, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None,
                               rng_state: Tensor, dropout_p: float, is_causal: bool, scale: float | None,
                               enable_gqa: bool, requires_grad: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    forward_rng = torch.Generator()
    forward_rng.set_state(rng_state)  # the forward's dropout mask again; no real generator advances
    with DefaultGeneratorLent(forward_rng):
        return _math_dropout_vjp(grad, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                 requires_grad)


def _attention_dropout_setup(ctx, inputs, output):
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, requires_grad = inputs
    ctx.save_for_backward(query, key, value, attn_mask, output[1])
    ctx.flags = (dropout_p, is_causal, scale, enable_gqa, requires_grad)
    ctx.set_materialize_grads(False)


def _attention_dropout_grad(ctx, grad_out, grad_state):
    if grad_out is None:
        return (None,) * 9
    query, key, value, attn_mask, rng_state = ctx.saved_tensors
    grads = attention_dropout_backward(grad_out, query, key, value, attn_mask, rng_state, *ctx.flags)
    return (*_asked(grads, ctx.flags[-1]), None, None, None, None, None, None)


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


# Note [RMSNorm's input gradient, use by use]: in float32 and float64 the composite reads its
# input twice (the mean of squares, then the scaling; half precision reads one upcast copy),
# and CPU autograd adds each read's gradient into the input's gradient buffer as its node
# runs: the scaling's, then the mean of squares'. Any gradient the input already got from an
# op recorded later comes first: (g + d_scale) + d_square for `x + rms_norm(x)`. A backward
# that returned their sum as one gradient would add g + (d_scale + d_square): 1 ulp off CPU.
# So the backward returns the input's gradient per read, in the order CPU's engine adds them,
# and the norm's autograd node (_RMSNorm) has an edge to the input for each, so the engine
# adds them one by one, as on CPU.

def _gradients_into(grad_fn, leaf: Tensor) -> list:
    """The graph's nodes that hand `leaf` a gradient, each with the indices of its edges to it."""
    found, seen, stack = [], set(), [grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        edges = [i for i, (nxt, _) in enumerate(node.next_functions) if getattr(nxt, "variable", None) is leaf]
        if edges:
            found.append((node, edges))
        stack.extend(nxt for nxt, _ in node.next_functions)
    return found


@custom_kernel("neuron::rms_norm_backward", cost=_rms_norm_backward_cost, fake=True)
def rms_norm_backward(grad: Tensor, input: Tensor, normalized_shape: list[int], weight: Tensor | None,
                      eps: float | None, output_mask: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    """(d input from its first read, d input from its second read, d weight), the reads in the
    order CPU autograd adds their gradients (Note [RMSNorm's input gradient, use by use]); an
    output not asked for in output_mask, or a read the composite does not make, is an empty
    tensor."""
    with _host_autograd(), torch.enable_grad(), _own_saved_tensors():
        x = input.detach().requires_grad_(output_mask[0])
        w = weight.detach().requires_grad_(output_mask[1]) if weight is not None else None
        out = aten.rms_norm.default.decompose(x, normalized_shape, w, eps)
        reads = []  # in the order the nodes run: the order CPU's engine adds them
        if output_mask[0]:
            for node, edges in _gradients_into(out.grad_fn, x):
                node.register_hook(lambda grad_inputs, _, edges=edges: reads.extend(grad_inputs[i] for i in edges))
        wanted = [t for t, n in zip((x, w), output_mask) if n and t is not None]
        grads = torch.autograd.grad(out, wanted, grad) if wanted else ()  # the reads' gradients land in `reads`
        dw = grads[-1] if output_mask[1] and w is not None else None
    if len(reads) > 2:
        raise AssertionError(f"rms_norm's composite read its input {len(reads)} times; neuron::rms_norm_backward "
                             "returns at most 2 gradients for it (Note [RMSNorm's input gradient, use by use])")
    empty = input.new_empty(0)
    reads += [empty] * (2 - len(reads))
    return reads[0], reads[1], (empty if dw is None else dw)


class _RMSNorm(torch.autograd.Function):
    """aten::rms_norm on neuron: one op each way. The input is passed once per read of the
    composite, so its gradients reach it one by one (Note [RMSNorm's input gradient, use by
    use]); the weight first, whose gradient CPU's engine hands out before the input's."""

    @staticmethod
    def forward(weight, input, input_again, normalized_shape, eps):
        return rms_norm(input, normalized_shape, weight, eps)

    @staticmethod
    def setup_context(ctx, inputs, output):  # apart from forward: torch.func's transforms need it so
        weight, input, _, normalized_shape, eps = inputs
        ctx.save_for_backward(input, weight)
        ctx.args = (normalized_shape, eps)

    @staticmethod
    def backward(ctx, grad):
        input, weight = ctx.saved_tensors
        normalized_shape, eps = ctx.args
        mask = [ctx.needs_input_grad[1], weight is not None and ctx.needs_input_grad[0]]
        first, second, dw = rms_norm_backward(grad, input, normalized_shape, weight, eps, mask)

        def read(t):  # an empty placeholder is not a gradient (an input of that shape is empty too)
            return t if mask[0] and t.shape == input.shape else None
        return (dw if mask[1] else None), read(first), read(second), None, None


def _rms_norm_kernel(input, normalized_shape, weight=None, eps=None):
    # AutogradPrivateUse1 kernel of aten::rms_norm: the whole norm is one op each way.
    return _RMSNorm.apply(weight, input, input, list(normalized_shape), eps)


def _rms_norm_no_autograd(input, normalized_shape, weight=None, eps=None):
    # PrivateUse1 kernel: below autograd (inference_mode skips its key), the forward op alone.
    return rms_norm(input, list(normalized_shape), weight, eps)


def register(lib: torch.library.Library) -> None:
    """Route aten ops on neuron to the shipped kernels (attention: see attention.py)."""
    lib.impl("rms_norm", _rms_norm_kernel, "AutogradPrivateUse1")
    # inference_mode skips the autograd key: one op below it too.
    lib.impl("rms_norm", _rms_norm_no_autograd, "PrivateUse1")
