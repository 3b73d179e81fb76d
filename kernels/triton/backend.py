"""The ``"triton"`` attention backend (kernels/attention.py interface), for GPUs.

Decode batches (one new token per sequence, the step CUDA graphs capture) go through the
split-K paged decode kernel (kernels/triton/decode_attention.py), which reads K/V in place
through the block table. Any batch with a longer chunk (prefill, speculative verification) goes
to the torch reference (kernels/torch_ref.py: SDPA over the gathered context); an FP8 cache is
dequantized for it first. The decode path makes no host synchronization: whether a batch is a
decode batch is read off the shapes (T query rows for T sequences means one row each, since
every chunk has at least one token).

K/V are written with torch ops (one ``index_copy_`` per cache; for FP8, a scale, clamp to the
E4M3 range and cast first): a Triton write kernel would save one elementwise pass over the
new tokens only, and the interpreter's fp32 -> fp8 store is unreliable to test on CPU.
"""

from __future__ import annotations

import torch

from kernels.attention import AttentionMetadata
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
                    v_scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """query [T, Hq, D] -> [T, Hq, D] (query's dtype); see AttentionBackend.paged_attention."""
    if query.shape[0] == meta.seq_lens.shape[0]:
        return paged_decode_attention(query, key_cache, value_cache, meta.block_tables, meta.seq_lens, scale,
                                      k_scale, v_scale)
    from kernels.torch_ref import paged_attention as reference

    if k_scale is not None or v_scale is not None or key_cache.dtype == torch.float8_e4m3fn:
        key_cache = _dequantize(key_cache, k_scale, query.dtype)
        value_cache = _dequantize(value_cache, v_scale, query.dtype)
    return reference(query, key_cache, value_cache, meta, scale)


def _dequantize(cache: torch.Tensor, scale, dtype: torch.dtype) -> torch.Tensor:
    """The layer's whole cache times its scale, in ``dtype`` (a copy: prefill fallback only)."""
    if scale is None:
        raise ValueError("an FP8 E4M3 cache needs k_scale and v_scale (a silent 1.0 would be wrong)")
    s = kv_scale_vector(scale, cache.shape[2], cache.device).view(1, 1, -1, 1)
    return (cache.float() * s).to(dtype)


class TritonAttention:
    """Decode through the Triton kernel, longer chunks through the torch reference."""

    name = "triton"
    write_kv_cache = staticmethod(write_kv_cache)
    paged_attention = staticmethod(paged_attention)
