"""Torch reference implementations of the attention ops (kernels/attention.py).

Vectorized over the whole batch: each sequence's keys and values are gathered through its block
table into a padded ``[B, num_kv_heads, L, head_dim]`` tensor and attended with one masked
``scaled_dot_product_attention`` call per layer. GQA without copying K/V: the query heads that
share a KV head are stacked along the query axis, ``[B, Hkv, G * Q, D]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention import AttentionMetadata


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value [T, Hkv, D] -> caches [num_blocks, block_size, Hkv, D] at slot_mapping [T]."""
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def gather_context(cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """cache [num_blocks, block_size, Hkv, D] -> [B, Hkv, L, D] keys (or values) of every sequence."""
    num_seqs, max_len = meta.context_slots.shape
    flat = cache.view(-1, *cache.shape[2:]).index_select(0, meta.context_slots.view(-1))
    return flat.view(num_seqs, max_len, *cache.shape[2:]).transpose(1, 2)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """query [T, Hq, D] -> [T, Hq, D]: causal attention of each token over its sequence's cache."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    num_seqs, max_q = meta.num_seqs, meta.max_query_len
    keys = gather_context(key_cache, meta).to(query.dtype)
    values = gather_context(value_cache, meta).to(query.dtype)
    if num_tokens == num_seqs * max_q:  # every sequence has max_q new tokens (e.g. all decode)
        padded = query
    else:
        padded = query.new_zeros(num_seqs * max_q, num_heads, head_dim).index_copy_(0, meta.padded_index, query)
    # [B, Q, Hkv, G, D] -> [B, Hkv, G * Q, D]: a KV head's query heads share one K/V read.
    q = padded.view(num_seqs, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(num_seqs, num_kv_heads, group * max_q, head_dim)
    mask = meta.attn_mask.expand(num_seqs, group, max_q, meta.max_seq_len).reshape(
        num_seqs, 1, group * max_q, meta.max_seq_len)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    out = out.view(num_seqs, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(num_seqs * max_q, num_heads, head_dim)
    if num_tokens == num_seqs * max_q:
        return out
    return out.index_select(0, meta.padded_index)


class TorchAttention:
    """The reference backend (CPU and any device torch runs on)."""

    name = "torch"
    write_kv_cache = staticmethod(write_kv_cache)
    paged_attention = staticmethod(paged_attention)
