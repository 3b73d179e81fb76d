"""The ``"triton"`` attention backend (kernels/attention.py interface), for GPUs.

Rows of decode tokens and of short chunks (at most MAX_PADDED_QUERY_LEN tokens: speculative
verification) go through the split-K paged decode kernel (kernels/triton/decode_attention.py),
which reads K/V in place through the block table, each row attending the keys up to itself.
Long chunks (prefill) are attended by SDPA over the chunk's new K/V when it starts at position
0 in a compute-dtype cache, else by the torch reference (kernels/torch_ref.py) over the
gathered context, an FP8 cache dequantized for it first. A decode batch makes no host
synchronization (it is recognized from shapes: T rows for T sequences means one row each,
since every chunk has at least one token), so it can be captured in a CUDA graph.

K/V are written with torch ops (one ``index_copy_`` per cache; for FP8, a scale, clamp to the
E4M3 range and cast first): a Triton write kernel would save one elementwise pass over the
new tokens only, and the interpreter's fp32 -> fp8 store is unreliable to test on CPU.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from kernels.attention import MAX_PADDED_QUERY_LEN, AttentionMetadata
from kernels.triton.decode_attention import kv_scale_vector, paged_decode_attention

FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: torch.Tensor | float | None = None,
                   v_scale: torch.Tensor | float | None = None) -> None:
    """key/value [T, Hkv, D] -> caches [num_blocks, block_size, Hkv, D] at slot_mapping [T].

    With a scale (scalar or [Hkv]) the value stored is ``x / scale`` (saturated to +-448 for an
    E4M3 cache), so that attention's ``stored * scale`` recovers ``x``.
    """
    _write_one(key, key_cache, slot_mapping, k_scale)
    _write_one(value, value_cache, slot_mapping, v_scale)


def _write_one(x: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, scale) -> None:
    if scale is not None:
        x = x.float() / kv_scale_vector(scale, cache.shape[2], cache.device).view(1, -1, 1)
    if cache.dtype == torch.float8_e4m3fn:
        if scale is None:
            raise ValueError("an FP8 E4M3 cache needs k_scale and v_scale (a silent 1.0 would be wrong)")
        x = x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)  # E4M3 has no infinity: out of range casts to NaN
        # Copied as bytes: index_copy_ has no fp8 implementation on CPU.
        cache = cache.view(torch.uint8)
        x = x.to(torch.float8_e4m3fn).view(torch.uint8)
    cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, x.to(cache.dtype))


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | float | None = None,
                    v_scale: torch.Tensor | float | None = None, *, key: torch.Tensor | None = None,
                    value: torch.Tensor | None = None) -> torch.Tensor:
    """query [T, Hq, D] -> [T, Hq, D] (query's dtype); see AttentionBackend.paged_attention.

    meta: built with ``groups="long"`` (metadata_groups): its groups are the long chunks.
    key/value [T, Hkv, D]: the layer's new K/V, used for long chunks that start at position 0
    when the cache holds the compute dtype (an FP8 cache is always read, so that prefill and
    decode attend the same quantized bytes).
    """
    num_rows, num_seqs = query.shape[0], meta.seq_lens.shape[0]
    if num_rows == num_seqs:                         # one row per sequence: a decode batch
        return paged_decode_attention(query, key_cache, value_cache, meta.block_tables, meta.seq_lens, scale,
                                      k_scale, v_scale)
    out = torch.empty_like(query)
    num_long_rows = sum(num_rows if g.token_index is None else g.token_index.shape[0] for g in meta.groups)
    if num_long_rows < num_rows:                     # rows of short chunks: through the kernel
        rows, row_to_seq, context_lens = short_chunk_rows(meta, num_rows, num_rows - num_long_rows)
        out.index_copy_(0, rows, paged_decode_attention(
            query.index_select(0, rows), key_cache, value_cache, meta.block_tables, context_lens, scale,
            k_scale, v_scale, row_to_seq=row_to_seq))
    _attend_long_chunks(out, query, key_cache, value_cache, meta, scale, k_scale, v_scale, key, value)
    return out


def short_chunk_rows(meta: AttentionMetadata, num_rows: int,
                     num_short_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, row_to_seq, context_lens), each [num_short_rows]: the rows of the flat batch that
    belong to short chunks (at most MAX_PADDED_QUERY_LEN tokens), in order, their sequence, and
    the keys each attends (row i of a chunk starting at start_pos: start_pos + i + 1).
    Device ops only: the count comes from the caller (the long groups' sizes), not from a sync."""
    starts = meta.query_start_loc
    num_seqs = meta.seq_lens.shape[0]
    query_lens = starts[1:] - starts[:-1]
    row_to_seq = torch.repeat_interleave(torch.arange(num_seqs, device=starts.device), query_lens,
                                         output_size=num_rows)
    offset = torch.arange(num_rows, device=starts.device) - starts[:-1][row_to_seq]
    row_query_lens = query_lens[row_to_seq]
    context_lens = meta.seq_lens[row_to_seq] - row_query_lens + offset + 1
    # Short rows first, each part in order (a stable sort of 0/1 flags), then keep the short ones.
    rows = torch.argsort((row_query_lens > MAX_PADDED_QUERY_LEN).to(torch.int8), stable=True)[:num_short_rows]
    return rows, row_to_seq[rows], context_lens[rows]


def _attend_long_chunks(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, k_scale, v_scale, key, value) -> None:
    """Write the rows of meta's (long-chunk) groups into ``out``: SDPA over the new K/V for a
    chunk from position 0, else the torch reference over the cache."""
    quantized = key_cache.dtype == torch.float8_e4m3fn or k_scale is not None or v_scale is not None
    from_cache = []
    for group in meta.groups:
        if key is None or value is None or quantized or not group.is_causal_prefill:
            from_cache.append(group)
            continue
        rows = group.token_index
        pick = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))  # noqa: E731
        q, k, v = (pick(t).transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), is_causal=True, scale=scale,
                                           enable_gqa=True)
        _put(out, rows, o.squeeze(0).transpose(0, 1))
    if not from_cache:
        return
    from kernels.torch_ref import paged_attention as reference

    if quantized:
        key_cache = _dequantize(key_cache, k_scale, query.dtype)
        value_cache = _dequantize(value_cache, v_scale, query.dtype)
    ref = reference(query, key_cache, value_cache, replace(meta, groups=tuple(from_cache)), scale)
    for group in from_cache:
        rows = group.token_index
        _put(out, rows, ref if rows is None else ref.index_select(0, rows))


def _put(out: torch.Tensor, rows: torch.Tensor | None, values: torch.Tensor) -> None:
    if rows is None:
        out.copy_(values)
    else:
        out.index_copy_(0, rows, values.to(out.dtype))


def _dequantize(cache: torch.Tensor, scale, dtype: torch.dtype) -> torch.Tensor:
    """The layer's whole cache times its scale, in ``dtype`` (a copy: prefill fallback only)."""
    if scale is None:
        raise ValueError("an FP8 E4M3 cache needs k_scale and v_scale (a silent 1.0 would be wrong)")
    s = kv_scale_vector(scale, cache.shape[2], cache.device).view(1, 1, -1, 1)
    return (cache.float() * s).to(dtype)


class TritonAttention:
    """Decode and short chunks through the Triton kernel, long chunks through SDPA / the reference."""

    name = "triton"
    metadata_groups = "long"      # the reference's groups for long chunks only
    reads_new_kv = True           # paged_attention takes key=/value= (long chunks from position 0)
    supports_kv_scales = True   # FP8 E4M3 caches with k_scale/v_scale (read by engine.model_runner)
    write_kv_cache = staticmethod(write_kv_cache)
    paged_attention = staticmethod(paged_attention)
