"""Torch reference implementations of the attention ops (kernels/attention.py).

Vectorized: the sequences of a group (decode and short verification chunks of similar context
length together, see ``partition_by_length``; each long prefill chunk alone) have their keys
and values gathered through their block tables into a padded ``[B, num_kv_heads, L, head_dim]``
tensor and are attended with one masked ``scaled_dot_product_attention`` call per group and
layer. GQA without copying K/V: the query heads that share a KV head are stacked along the
query axis, ``[B, Hkv, G * Q, D]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention import AttentionGroup, AttentionMetadata


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value [T, Hkv, D] -> caches [num_blocks, block_size, Hkv, D] at slot_mapping [T]."""
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def gather_context(cache: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """cache [num_blocks, block_size, Hkv, D] -> [Bg, Hkv, L, D] keys (or values) of the group's sequences."""
    num_seqs, max_len = group.context_slots.shape
    flat = cache.view(-1, *cache.shape[2:]).index_select(0, group.context_slots.view(-1))
    return flat.view(num_seqs, max_len, *cache.shape[2:]).transpose(1, 2)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | float | None = None,
                    v_scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """query [T, Hq, D] -> [T, Hq, D]: causal attention of each token over its sequence's cache.

    meta must hold every group (``AttentionMetadata.build(groups="all")``). k_scale/v_scale:
    only None so far (a cache in the compute dtype).
    """
    if k_scale is not None or v_scale is not None:
        raise NotImplementedError("the torch reference has no FP8 KV cache scales yet")
    if len(meta.groups) == 1 and meta.groups[0].token_index is None:
        return _attend_group(query, key_cache, value_cache, meta.groups[0], scale)
    out = torch.empty_like(query)
    for group in meta.groups:
        q = query.index_select(0, group.token_index)
        out.index_copy_(0, group.token_index, _attend_group(q, key_cache, value_cache, group, scale))
    return out


def _attend_group(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  group: AttentionGroup, scale: float) -> torch.Tensor:
    """query [Tg, Hq, D] of the group's tokens -> [Tg, Hq, D]."""
    keys = gather_context(key_cache, group).to(query.dtype)      # [Bg, Hkv, L, D]
    values = gather_context(value_cache, group).to(query.dtype)
    if group.max_query_len == 1:
        return _attend_decode(query, keys, values, group, scale)
    if group.num_seqs == 1:
        return _attend_one_sequence(query, keys, values, group, scale)
    return _attend_padded(query, keys, values, group, scale)


def _attend_decode(query, keys, values, group: AttentionGroup, scale: float) -> torch.Tensor:
    """One query per sequence: a KV head's query heads become its rows, [Bg, Hkv, G, D], so K/V are
    read once per KV head and the [Bg, 1, 1, L] bias broadcasts."""
    num_seqs, num_kv_heads = keys.shape[:2]
    num_tokens, num_heads, head_dim = query.shape
    q = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=group.attn_bias, scale=scale)
    return out.reshape(num_tokens, num_heads, head_dim)


def _attend_one_sequence(query, keys, values, group: AttentionGroup, scale: float) -> torch.Tensor:
    """A long chunk of one sequence: [1, Hq, Q, D]; plain causal when the chunk starts at 0."""
    q = query.transpose(0, 1).unsqueeze(0)
    if group.is_causal_prefill:
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=group.attn_bias, scale=scale,
                                             enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def _attend_padded(query, keys, values, group: AttentionGroup, scale: float) -> torch.Tensor:
    """Short chunks of several sequences (verification): padded to [Bg, Q] queries."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs, num_kv_heads = keys.shape[:2]
    num_groups, max_q = num_heads // num_kv_heads, group.max_query_len
    dense = num_tokens == num_seqs * max_q
    padded = query if dense else query.new_zeros(num_seqs * max_q, num_heads, head_dim).index_copy_(
        0, group.padded_index, query)
    # [B, Q, Hkv, G, D] -> [B, Hkv, G * Q, D]: the query heads of one KV head share one K/V read.
    q = padded.view(num_seqs, max_q, num_kv_heads, num_groups, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(num_seqs, num_kv_heads, num_groups * max_q, head_dim)
    bias = group.attn_bias.expand(num_seqs, num_groups, max_q, group.max_seq_len).reshape(
        num_seqs, 1, num_groups * max_q, group.max_seq_len)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=scale)
    out = out.view(num_seqs, num_kv_heads, num_groups, max_q, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(num_seqs * max_q, num_heads, head_dim)
    return out if dense else out.index_select(0, group.padded_index)


class TorchAttention:
    """The reference backend (CPU and any device torch runs on)."""

    name = "torch"
    metadata_groups = "all"
    write_kv_cache = staticmethod(write_kv_cache)
    paged_attention = staticmethod(paged_attention)
