"""`scaled_dot_product_attention` on neuron runs the kernel the host would pick.

SDPA is a CompositeImplicitAutograd op whose C++ body asks a per-device DispatchStub
(`_fused_sdp_choice_stub`) which fused kernel to use. A stub can only be registered for
PrivateUse1 from C++, so on neuron the body always takes the math decomposition
(matmul + softmax), while CPU runs its flash kernel (`_scaled_dot_product_flash_attention_for_cpu`):
same model, different bits. The emulated device runs host kernels, so its SDPA picks the
way the host does: a kernel on AutogradPrivateUse1 asks `_fused_sdp_choice` about CPU
tensors with the inputs' metadata (the choice depends only on metadata, dropout and the
`torch.nn.attention.sdpa_kernel` flags, read now: a deferred replay must not see later flags).
It runs that choice as the host would run it:
- flash: CPU's own ATen op `_scaled_dot_product_flash_attention_for_cpu` (its backward the ATen
  op CPU autograd records), issued like any ATen op, so it runs on the device's executor; a
  boolean mask first becomes 0 / -inf with one `where`, as CPU converts it. One launch each way
  (two forward with a boolean mask), the bits CPU's by construction.
- math: a one-launch kernel each way (builtin_kernels.py): `neuron::attention` and
  `neuron::attention_backward` without dropout, `neuron::attention_dropout` and its backward
  with dropout (the mask drawn from torch's default generator where the decomposition would draw
  it), computing exactly what the host's math path and CPU autograd compute. Only a mask that
  needs a gradient keeps the C++ body's differentiable ATen ops (several launches), so
  autograd records the same backward as on CPU.

Before choosing, the kernel makes the input checks CPU's composite makes, with CPU's errors
(Note [SDPA's input checks]); under `sdpa_kernel(SDPBackend.OVERRIDEABLE)`, the device's own
fused kernel torch offers PrivateUse1 backends, it runs the host's default pick (Note [The
overrideable SDPA backend]); the math kernels compute for the inputs that need a gradient as
CPU's graph does (Note [SDPA's math path reads requires_grad]).

Under `torch.inference_mode()` the autograd key is skipped: the same function is the op's
PrivateUse1 kernel, not the C++ decomposition, whose PrivateUse1 choice stub would always
take the math path.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

from adaptive_eager.device import native

from . import builtin_kernels

aten = torch.ops.aten
_FLASH = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)


def _host_shadow(t):
    # Metadata only: empty_strided does not touch (or commit) the bytes. requires_grad is
    # metadata the choice reads too (a mask that needs a gradient rules out the flash kernel).
    if t is None:
        return None
    # torch.compile's dynamic shapes give symbolic sizes, and a CPU tensor needs numbers (it
    # raised "SymIntArrayRef expected to contain only concrete integers": a compiled SDPA failed
    # at its second sequence length). int() specialises each: the graph holds for these sizes
    # and another size compiles again, as without dynamic shapes, taking the choice eager takes.
    return torch.empty_strided([int(s) for s in t.size()], [int(s) for s in t.stride()], dtype=t.dtype,
                               requires_grad=t.requires_grad)


def _plain(t) -> bool:
    return type(t) is torch.Tensor


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    # CPU's composite checks its inputs before choosing; this kernel replaces that composite, so
    # it makes the same checks, in CPU's words (Note [SDPA's input checks]).
    native.validate_sdpa_input(query, key, value, attn_mask)
    # Outside any dispatch mode: under torch.compile's fake/functional modes the shadows would
    # be fake tensors, whose choice is always math, and the traced graph would then differ from eager.
    # The choice is CPU's, but for sdpa_kernel(SDPBackend.OVERRIDEABLE), the device's own fused
    # kernel, which CPU lacks: then the host's pick with its backends on (Note [The overrideable
    # SDPA backend]).
    if _plain(query) and _plain(key) and _plain(value) and (attn_mask is None or _plain(attn_mask)):
        # The same shadows, made in C++ (host_shadow in kernels.cpp): about 10 µs a call less,
        # twice a layer per token of a decode loop, in both modes.
        choice = native.device_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    else:  # a tensor subclass (a fake or functional tensor under torch.compile, a DTensor's)
        with _disable_current_modes():
            choice = native.host_sdp_choice(
                _host_shadow(query), _host_shadow(key), _host_shadow(value), _host_shadow(attn_mask),
                dropout_p, is_causal, scale, enable_gqa)
    if choice == _FLASH:
        # The host's flash kernel is an ATen op: issued as one, it runs on the device's executor
        # like any other op (a custom kernel's Python body runs on the issuing thread, whose
        # OpenMP team then fights the executor's for the cores: Note [The device executor] in
        # device/csrc/runtime/executor.cpp), and autograd records its ATen backward, the one
        # CPU autograd runs.
        return aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=builtin_kernels.additive_mask(attn_mask, query.dtype),
            scale=scale)[0]
    if builtin_kernels.fused_attention_applies(attn_mask):
        # The host's math path, one launch forward and one backward, computing what it computes,
        # for the inputs that need a gradient (Note [SDPA's math path reads requires_grad]).
        requires_grad = builtin_kernels.autograd_flags(query, key, value)
        if dropout_p == 0.0:
            return builtin_kernels.attention(query, key, value, attn_mask, is_causal, scale, enable_gqa, requires_grad)
        return builtin_kernels.attention_dropout(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                                 enable_gqa, requires_grad)[0]
    return aten.scaled_dot_product_attention.default.decompose(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


def register(lib: torch.library.Library) -> None:
    lib.impl("scaled_dot_product_attention", _sdpa, "AutogradPrivateUse1")
    # inference_mode skips the autograd key: the same choice below it.
    lib.impl("scaled_dot_product_attention", _sdpa, "PrivateUse1")
