"""Paged attention in ATen ops: vLLM's KV cache and attention on `neuron` tensors.

vLLM's CPU attention is C++ (`torch.ops._C.cpu_attention_with_kv_cache`) that reads host
memory; its CUDA ones are Triton and FlashAttention. This backend is made of ATen ops only
(index_copy_, index, scaled_dot_product_attention), so it runs on the device's tensors, the
engine sees and fuses it, and the cost model prices it.

The cache. One tensor per layer, vLLM's logical [blocks, kv_heads, block_size, 2*head_size]
in the LBNHC layout (physically [blocks, block_size, kv_heads, 2*head_size]: keys then
values in the last axis), so that `(block, offset)` flattens to a slot index with a view.
`do_kv_cache_update` writes each new token's key and value at its slot.

Note [Context buckets]
~~~~~~~~~~~~~~~~~~~~~~
Each request attends to its whole context, gathered from its blocks through the block
table: [requests, blocks_read * block_size, kv_heads, head_size]. blocks_read is the batch's
longest context rounded up to a power of two of blocks (capped by the block table's width),
not the exact length: decode steps then repeat the same shapes for many tokens, so the
adaptive engine replays one cached launch for them instead of meeting a new shape each
token; positions past a request's length are masked out. This is how Neuron's serving
stack works too (NxD Inference compiles one graph per sequence-length bucket). The price:
up to twice the attention reads an exact-length kernel would make, for the longest request.

Queries are packed ([tokens, heads, head_size], requests one after another); attention
wants [requests, heads, query_len, head_size]. With one query per request (decode) that is
a view; otherwise the queries are scattered into a padded [requests, longest_query] layout
and gathered back after (index tensors made on the host from vLLM's CPU-side metadata).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_layout import KVCacheLayout


class NeuronPagedAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        # vLLM's registry has no entry for an out-of-tree backend; "CUSTOM" is its slot for one.
        return "CUSTOM"

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # (block, offset) must flatten into one slot axis with a view (module docstring).
        return (KVCacheLayout.LBNHC,)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @staticmethod
    def get_impl_cls() -> type[NeuronPagedAttentionImpl]:
        return NeuronPagedAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[NeuronPagedAttentionMetadataBuilder]:
        return NeuronPagedAttentionMetadataBuilder


@dataclass
class NeuronPagedAttentionMetadata:
    num_actual_tokens: int
    # [requests, blocks_read]: the blocks each request reads (Note [Context buckets]).
    block_table: torch.Tensor
    # [requests, 1, longest_query, blocks_read * block_size], True where a query sees a key.
    mask: torch.Tensor
    num_reqs: int
    max_query_len: int
    # Prefill or mixed batches: where each packed token goes in [requests * longest_query],
    # and back. None when every request has one query (decode).
    padded_index: torch.Tensor | None
    slot_mapping: torch.Tensor


def context_blocks(max_seq_len: int, block_size: int, table_width: int) -> int:
    """Blocks each request reads: the longest context's blocks, rounded up to a power of two
    and capped by the block table's width (Note [Context buckets])."""
    needed = max(1, -(-max_seq_len // block_size))
    return min(1 << (needed - 1).bit_length(), table_width)


class NeuronPagedAttentionMetadataBuilder(AttentionMetadataBuilder[NeuronPagedAttentionMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> NeuronPagedAttentionMetadata:
        m = common_attn_metadata
        if isinstance(m.causal, torch.Tensor) or not m.causal:
            raise NotImplementedError("the neuron attention backend is causal decoder attention only")
        num_reqs = m.num_reqs
        table = m.block_table_tensor[:num_reqs]
        blocks = context_blocks(m.max_seq_len, self.block_size, table.shape[1])
        context = blocks * self.block_size

        # Host-side metadata (vLLM keeps CPU copies; no device round trip).
        starts = m.query_start_loc_cpu[: num_reqs + 1].to(torch.int64)
        query_lens = starts[1:] - starts[:-1]
        seq_lens = self._seq_lens_on_host(m)
        longest_query = m.max_query_len
        # Absolute position of query i of request r: seq_len - query_len + i.
        q_pos = (seq_lens - query_lens)[:, None] + torch.arange(longest_query)[None, :]
        k_pos = torch.arange(context)
        mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < seq_lens[:, None, None])
        padded_index = None
        if longest_query > 1:
            # Padding rows (i >= query_len) see key 0 only: finite softmax, results discarded.
            valid = torch.arange(longest_query)[None, :] < query_lens[:, None]
            mask &= valid[:, :, None]
            mask[:, :, 0] |= ~valid
            rows = torch.arange(num_reqs)[:, None] * longest_query + torch.arange(longest_query)[None, :]
            padded_index = rows[valid].to(self.device, non_blocking=True)
        return NeuronPagedAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            block_table=table[:, :blocks],
            mask=mask[:, None].to(self.device, non_blocking=True),
            num_reqs=num_reqs,
            max_query_len=longest_query,
            padded_index=padded_index,
            slot_mapping=m.slot_mapping,
        )

    @staticmethod
    def _seq_lens_on_host(m: CommonAttentionMetadata) -> torch.Tensor:
        # Exact without asynchronous speculative decoding, which this platform turns off.
        if m.seq_lens_cpu_upper_bound is not None:
            return m.seq_lens_cpu_upper_bound[: m.num_reqs].to(torch.int64)
        return m.seq_lens[: m.num_reqs].cpu().to(torch.int64)


class NeuronPagedAttentionImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes, sliding_window, kv_cache_dtype: str, logits_soft_cap=None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 sinks=None) -> None:
        unsupported = [name for name, given in (
            ("ALiBi slopes", alibi_slopes is not None),
            ("a sliding window", sliding_window is not None),
            ("a logits soft cap", logits_soft_cap not in (None, 0)),
            ("attention sinks", sinks is not None),
            ("a shared KV cache", kv_sharing_target_layer_name is not None),
            (f"attention type {attn_type}", attn_type != AttentionType.DECODER),
            (f"KV cache dtype {kv_cache_dtype}", kv_cache_dtype != "auto"),
        ) if given]
        if unsupported:
            raise NotImplementedError(
                "the neuron attention backend does not implement " + ", ".join(unsupported)
                + "; serve this model on vLLM's CPU platform (unset VLLM_TARGET_DEVICE).")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_sharing_target_layer_name = None

    def _caches(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Logical [blocks, kv_heads, block_size, 2D] over LBNHC memory: transposed, it is
        # [blocks, block_size, kv_heads, 2D] with standard strides; keys then values in 2D.
        by_slot = kv_cache.transpose(1, 2)
        return by_slot[..., : self.head_size], by_slot[..., self.head_size:]

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        key_cache, value_cache = self._caches(kv_cache)
        tokens = slot_mapping.shape[0]
        # Only the scheduled tokens (vLLM pads nothing without CUDA graphs, but a longer
        # key tensor would be padding: its slot ids are -1 and must not be written).
        key_cache.flatten(0, 1).index_copy_(0, slot_mapping, key[:tokens])
        value_cache.flatten(0, 1).index_copy_(0, slot_mapping, value[:tokens])

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: NeuronPagedAttentionMetadata | None,
                output: torch.Tensor, output_scale=None, output_block_scale=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported on neuron")
        if attn_metadata is None:  # vLLM's profiling run: no cache yet
            return output
        m = attn_metadata
        tokens = m.num_actual_tokens
        key_cache, value_cache = self._caches(kv_cache)
        # [requests, blocks_read, block_size, kv_heads, D] -> [requests, kv_heads, context, D]
        keys = key_cache[m.block_table].flatten(1, 2).transpose(1, 2)
        values = value_cache[m.block_table].flatten(1, 2).transpose(1, 2)

        q = query[:tokens]
        if m.padded_index is None:
            q = q.view(m.num_reqs, 1, self.num_heads, self.head_size)
        else:
            padded = q.new_zeros(m.num_reqs * m.max_query_len, self.num_heads, self.head_size)
            padded.index_copy_(0, m.padded_index, q)
            q = padded.view(m.num_reqs, m.max_query_len, self.num_heads, self.head_size)
        attended = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=m.mask, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads)
        # [requests, heads, query_len, D] -> packed [tokens, heads, D]
        attended = attended.transpose(1, 2).flatten(0, 1)
        if m.padded_index is not None:
            attended = attended.index_select(0, m.padded_index)
        output[:tokens].view(tokens, self.num_heads, self.head_size).copy_(attended)
        return output
