"""flash-attn's ATen ops on neuron: `_flash_attention_forward` and `_flash_attention_backward`,
dense and variable-length (issue 37, item 7).

`torch.nn.attention.varlen.varlen_attn` (torchtitan's "varlen" attention, packed documents)
calls `aten::_flash_attention_forward` with cumulative sequence offsets, and its backward
`aten::_flash_attention_backward`: ops with CUDA kernels only, so on neuron, which runs CPU's
kernels, they raised "has no CPU kernel". CPU can run the same computation one sequence at a
time: each sequence is its own attention, which CPU's flash kernel
(`_scaled_dot_product_flash_attention_for_cpu`, what CPU's `F.scaled_dot_product_attention`
runs) computes, with its log-sum-exp. So these kernels run exactly that, per sequence, on the
device (each call an ATen op on neuron tensors, taking the eager path and the engine's traces
as any other): a packed batch gives the bits of CPU's SDPA on each sequence alone, and its
gradients those of CPU autograd through it.

flash-attn's semantics kept (its README, "Changes in v2.1" and `window_size`): inputs are
(total, heads, head_dim) with int32 offsets `cum_seq_q`/`cum_seq_k` of batch + 1 entries (or
(batch, seqlen, heads, head_dim) without them); the log-sum-exp is (heads, total) float32
(dense: (batch, heads, seqlen)); fewer key/value heads than query heads is grouped-query
attention; a causal mask and a sliding window are aligned to the bottom right of each
sequence's score matrix (query i sees key j when i + sk - sq - left <= j <= i + sk - sq +
right, -1 meaning no bound); `seqused_k` uses only the first keys of each sequence. CPU's
dtypes are accepted (float32 too, which flash-attn's CUDA kernel lacks: the emulated device
runs CPU's arithmetic everywhere).

The offsets are read on the host: the sequences' bounds decide which kernels run. A model
passes one offsets tensor to every layer, forward and backward, so what was read is kept with
the tensor (while it lives and is not written): one wait for the device a step, not one a layer
(in adaptive mode each wait launches what the engine holds). Refused, with what to do instead:
dropout (flash-attn's Philox mask is CUDA's; varlen_attn never asks it), a paged KV cache
(`block_table`) and ALiBi slopes. `num_splits` is a CUDA scheduling hint and changes nothing
here.
"""
from __future__ import annotations

import weakref

import torch
from torch import Tensor

# Each offsets tensor's values as last read, with the tensor's version then: the same tensor
# comes back for every layer and for the backward. By id (a tensor's == is elementwise), with
# a weak reference that proves the id's tensor is the one read and drops the entry with it.
_READ_OFFSETS: dict[int, tuple[weakref.ref, int, list[int]]] = {}

_OP = "aten::_flash_attention_forward"
_BACKWARD = "aten::_flash_attention_backward"


def _refuse_unsupported(op: str, dropout_p: float, block_table: Tensor | None = None,
                        alibi_slopes: Tensor | None = None) -> None:
    if dropout_p != 0.0:
        raise NotImplementedError(
            f"{op} on neuron: dropout_p={dropout_p} is not supported (flash-attn draws its mask with "
            f"CUDA's Philox generator). Use torch.nn.functional.scaled_dot_product_attention(..., "
            f"dropout_p={dropout_p}), which runs on neuron with CPU's random numbers.")
    if block_table is not None:
        raise NotImplementedError(
            f"{op} on neuron: a paged KV cache (block_table) is not supported. Gather each sequence's "
            f"pages into contiguous key and value tensors and pass cum_seq_k instead.")
    if alibi_slopes is not None:
        raise NotImplementedError(
            f"{op} on neuron: alibi_slopes is not supported. Add the ALiBi bias as an attn_mask to "
            f"torch.nn.functional.scaled_dot_product_attention instead.")


def _host_values(t: Tensor) -> list[int]:
    """t's values on the host: read once per version of t (the host waits for the device then)."""
    key = id(t)
    kept = _READ_OFFSETS.get(key)
    if kept is not None and kept[0]() is t and kept[1] == t._version:
        return kept[2]
    values = t.tolist()

    def forget(ref, key=key):
        kept = _READ_OFFSETS.pop(key, None)
        if kept is not None and kept[0] is not ref:  # the id's newer tensor: keep its entry
            _READ_OFFSETS.setdefault(key, kept)

    _READ_OFFSETS[key] = (weakref.ref(t, forget), t._version, values)
    return values


def _offsets(name: str, offsets: Tensor, batch: int | None = None) -> list[int]:
    if offsets.dim() != 1 or offsets.numel() < 2 or offsets.dtype not in (torch.int32, torch.int64):
        raise RuntimeError(
            f"{_OP} on neuron: {name} must be a 1-D int32 tensor of cumulative sequence offsets (batch + 1 "
            f"entries, starting at 0), got {offsets.dtype} of shape {tuple(offsets.shape)}.")
    values = _host_values(offsets)
    if values[0] != 0 or any(b < a for a, b in zip(values, values[1:])):
        raise RuntimeError(f"{_OP} on neuron: {name} must start at 0 and never decrease, got {values}.")
    if batch is not None and len(values) != batch + 1:
        raise RuntimeError(
            f"{_OP} on neuron: cum_seq_q and cum_seq_k must describe the same number of sequences, got "
            f"{batch} and {len(values) - 1}.")
    return values


def _bounds(window_size_left: int | None, window_size_right: int | None, is_causal: bool) -> tuple[int, int]:
    left = -1 if window_size_left is None else window_size_left
    right = -1 if window_size_right is None else window_size_right
    if is_causal:
        right = 0  # flash-attn: is_causal is window_size_right=0
    return left, right


def _window_mask(sq: int, sk: int, left: int, right: int, like: Tensor) -> Tensor | None:
    """The additive mask (0 where query i may see key j, -inf elsewhere) of a window aligned to
    the bottom right, or None where the plain kernel computes the same (no bound at all)."""
    if left < 0 and right < 0:
        return None
    i = torch.arange(sq, device=like.device).unsqueeze(1) + (sk - sq)
    j = torch.arange(sk, device=like.device).unsqueeze(0)
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=like.device)
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    zero = torch.zeros((), dtype=like.dtype, device=like.device)
    return torch.where(allowed, zero, torch.full((), float("-inf"), dtype=like.dtype, device=like.device))


def _causal_only(sq: int, sk: int, left: int, right: int) -> bool:
    """The window is plain causal on a square matrix: CPU's kernel's own is_causal, top-left
    aligned, is then the same mask, and what CPU's SDPA(is_causal=True) runs."""
    return left < 0 and right == 0 and sq == sk


def _heads_first(t: Tensor) -> Tensor:
    """(seqlen, heads, dim) -> (1, heads, seqlen, dim), the layout of CPU's kernel."""
    return t.transpose(0, 1).unsqueeze(0)


def _tokens_first(t: Tensor) -> Tensor:
    return t.squeeze(0).transpose(0, 1)


def _segment_forward(q: Tensor, k: Tensor, v: Tensor, left: int, right: int,
                     scale: float | None) -> tuple[Tensor, Tensor]:
    """One sequence: q (sq, h, d), k and v (sk, hk, d) -> out (sq, h, d), lse (h, sq)."""
    sq, sk = q.shape[0], k.shape[0]
    causal = _causal_only(sq, sk, left, right)
    mask = None if causal else _window_mask(sq, sk, left, right, q)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _heads_first(q), _heads_first(k), _heads_first(v), 0.0, causal, attn_mask=mask, scale=scale)
    return _tokens_first(out), lse.squeeze(0)


def _segment_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, left: int,
                      right: int, scale: float | None) -> tuple[Tensor, Tensor, Tensor]:
    sq, sk = q.shape[0], k.shape[0]
    causal = _causal_only(sq, sk, left, right)
    mask = None if causal else _window_mask(sq, sk, left, right, q)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _heads_first(grad), _heads_first(q), _heads_first(k), _heads_first(v), _heads_first(out),
        lse.unsqueeze(0), 0.0, causal, attn_mask=mask, scale=scale)
    return _tokens_first(dq), _tokens_first(dk), _tokens_first(dv)


def _check_layout(query: Tensor, key: Tensor, value: Tensor, varlen: bool) -> None:
    rank = 3 if varlen else 4
    layout = "(total, heads, head_dim)" if varlen else "(batch, seqlen, heads, head_dim)"
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != rank:
            raise RuntimeError(
                f"{_OP} on neuron: {name} must be {rank}-D {layout}"
                f"{' with cum_seq_q and cum_seq_k' if varlen else ' without cumulative offsets'}, "
                f"got shape {tuple(t.shape)}.")
    if query.shape[-2] % key.shape[-2] != 0 or key.shape[-2] != value.shape[-2]:
        raise RuntimeError(
            f"{_OP} on neuron: the query's heads ({query.shape[-2]}) must be a multiple of the key's and "
            f"value's ({key.shape[-2]}, {value.shape[-2]}), which must be equal.")


def _rng_outputs(query: Tensor) -> tuple[Tensor, Tensor]:
    """flash-attn's (seed, offset) of the dropout mask: no mask is drawn, so zeros."""
    return (torch.zeros(2, dtype=torch.uint64, device=query.device),
            torch.zeros((), dtype=torch.uint64, device=query.device))


def _spans(cum_seq_q: Tensor | None, cum_seq_k: Tensor | None, seqused_k: Tensor | None,
           query: Tensor, key: Tensor) -> list[tuple[int, int, int, int]]:
    """(q start, q end, k start, k end) of each sequence."""
    if cum_seq_q is None:
        raise AssertionError("dense inputs have no spans")
    qs = _offsets("cum_seq_q", cum_seq_q)
    ks = _offsets("cum_seq_k", cum_seq_k, batch=len(qs) - 1) if cum_seq_k is not None else qs
    if qs[-1] > query.shape[0] or ks[-1] > key.shape[0]:
        raise RuntimeError(
            f"{_OP} on neuron: the offsets run past the tensors: cum_seq_q ends at {qs[-1]} for "
            f"{query.shape[0]} query tokens, cum_seq_k at {ks[-1]} for {key.shape[0]} key tokens.")
    used = None if seqused_k is None else _host_values(seqused_k)
    spans = []
    for b in range(len(qs) - 1):
        k_end = ks[b + 1] if used is None else ks[b] + min(used[b], ks[b + 1] - ks[b])
        spans.append((qs[b], qs[b + 1], ks[b], k_end))
    return spans


def flash_attention_forward(query: Tensor, key: Tensor, value: Tensor, cum_seq_q: Tensor | None,
                            cum_seq_k: Tensor | None, max_q: int, max_k: int, dropout_p: float, is_causal: bool,
                            return_debug_mask: bool, *, scale: float | None = None,
                            window_size_left: int | None = None, window_size_right: int | None = None,
                            seqused_k: Tensor | None = None, alibi_slopes: Tensor | None = None,
                            block_table: Tensor | None = None, num_splits: int | None = None):
    _refuse_unsupported(_OP, dropout_p, block_table, alibi_slopes)
    varlen = cum_seq_q is not None
    _check_layout(query, key, value, varlen)
    left, right = _bounds(window_size_left, window_size_right, is_causal)
    debug_mask = torch.empty(0, dtype=query.dtype, device=query.device)
    seed, offset = _rng_outputs(query)
    if not varlen:
        if seqused_k is not None:
            raise RuntimeError(f"{_OP} on neuron: seqused_k needs cum_seq_q and cum_seq_k (the varlen layout).")
        # (batch, seqlen, heads, dim): CPU's kernel takes (batch, heads, seqlen, dim) views.
        sq, sk = query.shape[1], key.shape[1]
        causal = _causal_only(sq, sk, left, right)
        mask = None if causal else _window_mask(sq, sk, left, right, query)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), 0.0, causal, attn_mask=mask,
            scale=scale)
        return out.transpose(1, 2), lse, seed, offset, debug_mask
    outs, lses = [], []
    for q0, q1, k0, k1 in _spans(cum_seq_q, cum_seq_k, seqused_k, query, key):
        out, lse = _segment_forward(query[q0:q1], key[k0:k1], value[k0:k1], left, right, scale)
        outs.append(out)
        lses.append(lse)
    out = torch.cat(outs)
    if out.shape[0] < query.shape[0]:  # tokens past the last offset: flash-attn leaves them; zeros here
        out = torch.cat([out, query.new_zeros(query.shape[0] - out.shape[0], *out.shape[1:])])
    lse = torch.cat(lses, dim=1)
    if lse.shape[1] < query.shape[0]:
        lse = torch.cat([lse, lse.new_zeros(lse.shape[0], query.shape[0] - lse.shape[1])], dim=1)
    return out, lse, seed, offset, debug_mask


def flash_attention_forward_no_dropout_inplace(out: Tensor, query: Tensor, key: Tensor, value: Tensor,
                                               cum_seq_q: Tensor | None, cum_seq_k: Tensor | None, max_q: int,
                                               max_k: int, dropout_p: float, is_causal: bool,
                                               return_debug_mask: bool, **options) -> Tensor:
    result, lse, *_ = flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                                              is_causal, return_debug_mask, **options)
    out.copy_(result)
    return lse


def flash_attention_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor,
                             logsumexp: Tensor, cum_seq_q: Tensor, cum_seq_k: Tensor, max_q: int, max_k: int,
                             dropout_p: float, is_causal: bool, rng_state: Tensor, unused: Tensor, *,
                             scale: float | None = None, window_size_left: int | None = None,
                             window_size_right: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    _refuse_unsupported(_BACKWARD, dropout_p)
    left, right = _bounds(window_size_left, window_size_right, is_causal)
    # The forward's dense call has undefined offsets; they arrive here as empty tensors.
    varlen = cum_seq_q is not None and cum_seq_q.numel() > 0
    _check_layout(query, key, value, varlen)
    if not varlen:
        sq, sk = query.shape[1], key.shape[1]
        causal = _causal_only(sq, sk, left, right)
        mask = None if causal else _window_mask(sq, sk, left, right, query)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.transpose(1, 2), query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
            out.transpose(1, 2), logsumexp, 0.0, causal, attn_mask=mask, scale=scale)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    for q0, q1, k0, k1 in _spans(cum_seq_q, cum_seq_k, None, query, key):
        gq, gk, gv = _segment_backward(grad_out[q0:q1], query[q0:q1], key[k0:k1], value[k0:k1], out[q0:q1],
                                       logsumexp[:, q0:q1], left, right, scale)
        dq[q0:q1] = gq
        dk[k0:k1] = gk
        dv[k0:k1] = gv
    return dq, dk, dv


def register(lib: torch.library.Library) -> None:
    """Give neuron flash-attn's forward (plain and in place) and backward."""
    lib.impl("_flash_attention_forward", flash_attention_forward, "PrivateUse1")
    lib.impl("_flash_attention_forward_no_dropout_inplace", flash_attention_forward_no_dropout_inplace, "PrivateUse1")
    lib.impl("_flash_attention_backward", flash_attention_backward, "PrivateUse1")
