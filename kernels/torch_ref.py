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


FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448

Scale = torch.Tensor | float | None
"""A KV dequantization scale: an fp32 scalar, an fp32 [num_kv_heads] tensor, or None (a cache in
the compute dtype). The cache holds ``x / scale``; attention reads ``stored * scale``."""


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: Scale = None,
                   v_scale: Scale = None) -> None:
    """key/value [T, Hkv, D] -> caches [num_blocks, block_size, Hkv, D] at slot_mapping [T].

    An FP8 E4M3 cache stores ``x / scale`` rounded to E4M3 and saturated at +-448 (E4M3 has no
    infinity: an out-of-range cast would be NaN). Raises ValueError for an FP8 cache without
    scales (a silent 1.0 loses the small values of K/V to underflow).
    """
    _write_one(key, key_cache, slot_mapping, k_scale)
    _write_one(value, value_cache, slot_mapping, v_scale)


def _write_one(x: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, scale: Scale) -> None:
    if cache.dtype == torch.float8_e4m3fn:
        if scale is None:
            raise ValueError("an FP8 E4M3 KV cache needs k_scale and v_scale")
        x = quantize_kv(x, scale)
        # As bytes: index_copy_ has no float8 kernel on CPU.
        cache.view(torch.uint8).view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, x.view(torch.uint8))
        return
    if scale is not None:
        raise ValueError(f"KV scales given for a {cache.dtype} cache (scales are for an FP8 cache)")
    cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, x.to(cache.dtype))


def quantize_kv(x: torch.Tensor, scale: Scale) -> torch.Tensor:
    """x [T, Hkv, D] -> float8_e4m3fn ``x / scale`` (scale: scalar or [Hkv]), saturated at +-448."""
    s = _scale_view(scale, x.shape[1], x.device, 3)
    return (x.float() / s).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize_kv(stored: torch.Tensor, scale: Scale, dtype: torch.dtype, head_dim_axis: int) -> torch.Tensor:
    """stored (E4M3) -> ``stored * scale`` in ``dtype``; the KV-head axis is ``head_dim_axis``."""
    s = _scale_view(scale, stored.shape[head_dim_axis], stored.device, stored.dim(), head_dim_axis)
    return (stored.float() * s).to(dtype)


def _scale_view(scale: Scale, num_kv_heads: int, device: torch.device, ndim: int, axis: int = 1) -> torch.Tensor:
    s = torch.as_tensor(scale, dtype=torch.float32, device=device).reshape(-1)
    if s.numel() not in (1, num_kv_heads):
        raise ValueError(f"a KV scale must be a scalar or [{num_kv_heads}], got {tuple(s.shape)}")
    shape = [1] * ndim
    shape[axis] = s.numel()
    return s.view(shape)


def gather_context(cache: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """cache [num_blocks, block_size, Hkv, D] -> [Bg, Hkv, L, D] keys (or values) of the group's sequences."""
    num_seqs, max_len = group.context_slots.shape
    flat = cache.view(-1, *cache.shape[2:]).index_select(0, group.context_slots.view(-1))
    return flat.view(num_seqs, max_len, *cache.shape[2:]).transpose(1, 2)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | float | None = None,
                    v_scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """query [T, Hq, D] -> [T, Hq, D]: causal attention of each token over its sequence's cache.

    meta must hold every group (``AttentionMetadata.build(groups="all")``). k_scale/v_scale: the
    dequantization scales of an FP8 cache (see ``Scale``); every path, prefill and decode, reads
    the same stored bytes. Raises ValueError for an FP8 cache without scales.
    """
    if len(meta.groups) == 1 and meta.groups[0].token_index is None:
        return _attend_group(query, key_cache, value_cache, meta.groups[0], scale, k_scale, v_scale)
    out = torch.empty_like(query)
    for group in meta.groups:
        q = query.index_select(0, group.token_index)
        out.index_copy_(0, group.token_index, _attend_group(q, key_cache, value_cache, group, scale, k_scale, v_scale))
    return out


def _attend_group(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  group: AttentionGroup, scale: float, k_scale: Scale = None, v_scale: Scale = None) -> torch.Tensor:
    """query [Tg, Hq, D] of the group's tokens -> [Tg, Hq, D]."""
    keys = _read(gather_context(key_cache, group), k_scale, query.dtype)      # [Bg, Hkv, L, D]
    values = _read(gather_context(value_cache, group), v_scale, query.dtype)
    if group.max_query_len == 1:
        return _attend_decode(query, keys, values, group, scale)
    if group.num_seqs == 1:
        return _attend_one_sequence(query, keys, values, group, scale)
    return _attend_padded(query, keys, values, group, scale)


def _read(stored: torch.Tensor, scale: Scale, dtype: torch.dtype) -> torch.Tensor:
    """Gathered [Bg, Hkv, L, D] context in the compute dtype (dequantized when the cache is FP8)."""
    if stored.dtype == torch.float8_e4m3fn:
        if scale is None:
            raise ValueError("an FP8 E4M3 KV cache needs k_scale and v_scale")
        return dequantize_kv(stored, scale, dtype, 1)
    return stored.to(dtype)


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
    supports_kv_scales = True   # FP8 E4M3 caches with k_scale/v_scale
    write_kv_cache = staticmethod(write_kv_cache)
    paged_attention = staticmethod(paged_attention)
