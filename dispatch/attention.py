"""`scaled_dot_product_attention` on neuron runs the kernel the host would pick.

SDPA is a CompositeImplicitAutograd op whose C++ body asks a per-device DispatchStub
(`_fused_sdp_choice_stub`) which fused kernel to use. A stub can only be registered for
PrivateUse1 from C++, so on neuron the body always takes the math decomposition
(matmul + softmax), while CPU runs its flash kernel (`_scaled_dot_product_flash_attention_for_cpu`):
same model, different bits. The emulated device runs host kernels, so its SDPA picks the
way the host does: a kernel on AutogradPrivateUse1 asks `_fused_sdp_choice` about CPU
tensors with the inputs' metadata (the choice depends only on metadata, dropout and the
`torch.nn.attention.sdpa_kernel` flags) and then mirrors the C++ body. Both branches call
differentiable ATen ops, so autograd records the same backward as on CPU.

Under `torch.inference_mode()` the autograd key is skipped and the op reaches
`__torch_dispatch__` undecomposed, where it runs on the host data: the same choice.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten
_FLASH = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)


def _host_shadow(t):
    # Metadata only: empty_strided does not touch (or commit) the bytes.
    return None if t is None else torch.empty_strided(t.size(), t.stride(), dtype=t.dtype)


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    choice = aten._fused_sdp_choice(
        _host_shadow(query), _host_shadow(key), _host_shadow(value), _host_shadow(attn_mask),
        dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if choice == _FLASH:
        mask = _additive_mask(attn_mask, query.dtype)
        return aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=mask, scale=scale)[0]
    return aten.scaled_dot_product_attention.default.decompose(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


def _additive_mask(attn_mask, dtype):
    """As the C++ body does before a fused kernel: a boolean mask (True = attend) becomes
    0 / -inf in the query's dtype. Both values are exact, so any construction gives the same bits."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    return torch.zeros_like(attn_mask, dtype=dtype).masked_fill_(attn_mask.logical_not(), float("-inf"))


def register(lib: torch.library.Library) -> None:
    lib.impl("scaled_dot_product_attention", _sdpa, "AutogradPrivateUse1")
