"""Paged decode attention in Triton: split-K over the context (flash-decoding), grouped GQA.

Each query row attends a prefix of one sequence's context: a decode token its whole context,
the ``i``-th token of a short chunk (speculative verification) the keys up to itself. The
context of row ``t`` (``context_lens[t]`` tokens, in the blocks named by
``block_tables[row_to_seq[t]]``) is cut into ``num_splits`` slices; program
``(t, kv_head, split)`` attends the query heads that share ``kv_head`` (GQA: query head ``h``
reads KV head ``h // group``) over one slice, reading each K/V tile of that slice once for all
of them, and writes the slice's normalized partial output and its log-sum-exp. A second small
kernel merges the slices of each (row, query head). A row with context length 0 is skipped
(its output is 0). Splitting keeps the GPU busy at small
batch sizes, where ``B * num_kv_heads`` programs alone would leave most SMs idle.

Cache layout (engine/kv_cache.py, one layer): ``[num_blocks, block_size, num_kv_heads, head_dim]``,
token ``p`` in slot ``block_tables[b, p // block_size] * block_size + p % block_size``.
Caches may be fp16, bf16, fp32 or FP8 E4M3 (``torch.float8_e4m3fn``); an FP8 cache is
dequantized in the kernel with ``k_scale``/``v_scale`` (one fp32 per layer or one per KV head):
``K = k_fp8 * k_scale``. Softmax, accumulation and the merge run in fp32.

Sources: Dao et al., "Flash-Decoding for long-context inference" (2023) for the split-K scheme;
Milakov & Gimelshein, "Online normalizer calculation for softmax" (2018) for the running max/sum.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn)
QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_SPLITS = 16


# -- torch reference (the test oracle) ----------------------------------------------------------
def decode_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                         k_scale: torch.Tensor | float | None = None,
                         v_scale: torch.Tensor | float | None = None,
                         row_to_seq: torch.Tensor | None = None) -> torch.Tensor:
    """query [T, Hq, D] -> [T, Hq, D] (query's dtype): row t attends the first context_lens[t] keys
    of sequence row_to_seq[t] (default t), in fp32; a row with context 0 gives 0.

    A plain loop over rows: gather the context's K/V through the block table, dequantize
    (times k_scale / v_scale, scalar or [Hkv]), softmax(q K^T * scale) V per KV head's group.
    """
    num_rows, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    ks = kv_scale_vector(k_scale, num_kv_heads, key_cache.device).view(1, num_kv_heads, 1)
    vs = kv_scale_vector(v_scale, num_kv_heads, key_cache.device).view(1, num_kv_heads, 1)
    flat_k = key_cache.reshape(-1, num_kv_heads, head_dim)
    flat_v = value_cache.reshape(-1, num_kv_heads, head_dim)
    out = torch.zeros_like(query)
    for t in range(num_rows):
        seq = t if row_to_seq is None else int(row_to_seq[t])
        pos = torch.arange(int(context_lens[t]), device=key_cache.device)
        if len(pos) == 0:
            continue
        slots = block_tables[seq].long()[pos // block_size] * block_size + pos % block_size
        keys = flat_k[slots].float() * ks                                   # [L, Hkv, D]
        values = flat_v[slots].float() * vs
        q = query[t].float().view(num_kv_heads, group, head_dim)
        scores = torch.einsum("hgd,lhd->hgl", q, keys) * scale
        o = torch.einsum("hgl,lhd->hgd", scores.softmax(dim=-1), values)
        out[t] = o.reshape(num_heads, head_dim).to(query.dtype)
    return out


def kv_scale_vector(s: torch.Tensor | float | None, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """A dequantization scale as an fp32 [num_kv_heads] tensor on ``device`` (None = 1.0).

    Built with ``torch.full``/``expand`` on the device, never copied from host memory, so it is
    safe inside a CUDA graph capture when ``s`` is already a device tensor or a Python number.
    """
    if s is None:
        return torch.ones(num_kv_heads, dtype=torch.float32, device=device)
    if not isinstance(s, torch.Tensor):
        return torch.full((num_kv_heads,), float(s), dtype=torch.float32, device=device)
    if s.numel() not in (1, num_kv_heads):
        raise ValueError(f"scale must be a scalar or have num_kv_heads={num_kv_heads} entries, got shape "
                         f"{tuple(s.shape)}")
    if s.device != device:
        raise ValueError(f"scale is on {s.device}, the cache on {device}")
    return s.to(torch.float32).reshape(-1).expand(num_kv_heads).contiguous()


# -- kernels -----------------------------------------------------------------------------------
@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, row_to_seq_ptr, k_scale_ptr, v_scale_ptr,
    part_out_ptr, part_lse_ptr,
    sm_scale,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (b, kv_head, split): partial attention of KV head kv_head's GROUP query heads of
    query row b over one slice of its context. Writes out [BLOCK_H, D] (normalized) and its lse
    (base 2); an empty slice writes lse = -inf and a zero output."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(context_lens_ptr + b).to(tl.int32)
    seq = tl.load(row_to_seq_ptr + b).to(tl.int64)
    # Slices are whole BLOCK_N tiles, so only the last tile of a sequence is partial.
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + offs_g
    head_mask = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=head_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    k_scale = tl.load(k_scale_ptr + kv_head)
    v_scale = tl.load(v_scale_ptr + kv_head)
    # exp2 instead of exp: fold log2(e) into the score scale (and the K dequantization scale).
    qk_scale = sm_scale * k_scale * 1.4426950408889634

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for tile in range(start, end, BLOCK_N):
        offs_n = tile + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        block = tl.load(block_tables_ptr + seq * stride_bt + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_block = (offs_n % BLOCK_SIZE).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + block[:, None] * stride_kb + in_block[:, None] * stride_kt
                    + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N]
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + block[:, None] * stride_vb + in_block[:, None] * stride_vt
                    + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    # V's dequantization scale is one number per KV head: apply it once, to the sum.
    # An empty slice has l_i = 0, acc = 0 and m_i = -inf: divide by 1 so it writes 0 and lse = -inf.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc * v_scale / l_safe[:, None]
    lse = m_i + tl.log2(l_safe)
    tl.store(part_out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :],
             out, mask=head_mask[:, None] & d_mask[None, :])
    tl.store(part_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=head_mask)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Program (b, head): out = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse)."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(part_lse_ptr + b * stride_lb + head * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    # Every slice is empty only for a skipped row (context 0): weights 0, output 0.
    lse_max = tl.max(lse, axis=0)
    weight = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))
    parts = tl.load(part_out_ptr + b * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(weight, axis=0)
    out = tl.sum(parts * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


# -- wrapper -----------------------------------------------------------------------------------
def default_num_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Slices per sequence: enough programs for about two waves of the GPU's SMs, at most
    MAX_SPLITS. Depends on the batch shape only (never on context lengths), so one CUDA graph
    per batch size stays valid as contexts grow; on CPU (interpreter, where every program costs
    tens of milliseconds) a fixed 2."""
    if device.type != "cuda":
        return 2
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SPLITS, math.ceil(2 * sms / max(1, num_seqs * num_kv_heads))))


def _dot_precision(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> str:
    """TF32 tensor cores hold fp16, bf16 and E4M3 values exactly (10-bit mantissa, 8-bit exponent),
    so with such inputs only the softmax weights are rounded (~1e-3 relative, below a bf16
    output's rounding); fp32 inputs keep full fp32 products (what an fp32 model asks for)."""
    return "ieee" if torch.float32 in (query_dtype, cache_dtype) else "tf32"


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           k_scale: torch.Tensor | float | None = None, v_scale: torch.Tensor | float | None = None,
                           *, row_to_seq: torch.Tensor | None = None, num_splits: int | None = None,
                           block_n: int = 32) -> torch.Tensor:
    """query [T, Hq, D] -> [T, Hq, D] in query's dtype: row t attends the first context_lens[t]
    keys of sequence row_to_seq[t] (default: t, one decode token per sequence).

    key_cache, value_cache: [num_blocks, block_size, Hkv, D], last dim contiguous; Hq % Hkv == 0.
    block_tables: [B, max_blocks] int32/int64 (B = T without row_to_seq). context_lens: [T]
    int32/int64, the keys each row attends, its own included (their K/V must already be in the
    cache); 0 skips the row (output 0). row_to_seq: [T] int32/int64 block-table row of each
    query row. scale: softmax scale. k_scale / v_scale: dequantization scales (Python number,
    1-element or [Hkv] fp32 tensor); required for an FP8 cache, optional (default 1.0) otherwise.
    num_splits: context slices per row (default: default_num_splits). block_n: keys per tile.
    No host synchronization: the wrapper checks shapes, dtypes, devices and strides only
    (context_lens values are trusted), so it can be captured in a CUDA graph.
    Raises ValueError naming the offending argument.
    """
    _check(query, key_cache, value_cache, block_tables, context_lens, row_to_seq, k_scale, v_scale)
    num_rows, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    if row_to_seq is None:
        row_to_seq = torch.arange(num_rows, device=query.device)
    splits = num_splits or default_num_splits(num_rows, num_kv_heads, query.device)
    ks = kv_scale_vector(k_scale, num_kv_heads, key_cache.device)
    vs = kv_scale_vector(v_scale, num_kv_heads, key_cache.device)
    part_out = torch.empty(num_rows, num_heads, splits, head_dim, dtype=torch.float32, device=query.device)
    part_lse = torch.empty(num_rows, num_heads, splits, dtype=torch.float32, device=query.device)
    out = torch.empty_like(query)
    block_d = triton.next_power_of_2(head_dim)
    # tl.dot needs at least 16 rows: a KV head's group (3 heads for SmolLM2) is padded and masked.
    block_h = max(16, triton.next_power_of_2(group))
    _decode_split_kernel[(num_rows, num_kv_heads, splits)](
        query, key_cache, value_cache, block_tables, context_lens, row_to_seq, ks, vs, part_out, part_lse,
        float(scale),
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d, NUM_SPLITS=splits,
        DOT_PRECISION=_dot_precision(query.dtype, key_cache.dtype),
    )
    _merge_splits_kernel[(num_rows, num_heads)](
        part_out, part_lse, out,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits),
    )
    return out


def _check(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
           context_lens: torch.Tensor, row_to_seq: torch.Tensor | None, k_scale, v_scale) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be [num_rows, num_heads, head_dim], got shape {tuple(query.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(f"key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    num_rows, num_heads, head_dim = query.shape
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"key_cache head_dim {key_cache.shape[3]} != query head_dim {head_dim}")
    if num_heads % key_cache.shape[2]:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of num_kv_heads ({key_cache.shape[2]})")
    if query.dtype not in QUERY_DTYPES:
        raise ValueError(f"query dtype {query.dtype} not supported: {QUERY_DTYPES}")
    if key_cache.dtype not in CACHE_DTYPES or value_cache.dtype != key_cache.dtype:
        raise ValueError(f"key_cache/value_cache dtypes {key_cache.dtype}/{value_cache.dtype}: both must be one of "
                         f"{CACHE_DTYPES}")
    if key_cache.dtype == torch.float8_e4m3fn and (k_scale is None or v_scale is None):
        raise ValueError("an FP8 E4M3 cache needs k_scale and v_scale (a silent 1.0 would be wrong)")
    if query.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("query, key_cache and value_cache must be contiguous in head_dim (stride 1)")
    if block_tables.dim() != 2 or block_tables.stride(1) != 1 or (
            row_to_seq is None and block_tables.shape[0] != num_rows):
        raise ValueError(f"block_tables must be [num_seqs, max_blocks] with contiguous rows (num_seqs = "
                         f"num_rows={num_rows} without row_to_seq), got shape {tuple(block_tables.shape)}")
    if context_lens.shape != (num_rows,):
        raise ValueError(f"context_lens must be [num_rows={num_rows}], got shape {tuple(context_lens.shape)}")
    if row_to_seq is not None and row_to_seq.shape != (num_rows,):
        raise ValueError(f"row_to_seq must be [num_rows={num_rows}], got shape {tuple(row_to_seq.shape)}")
    ints = [("block_tables", block_tables), ("context_lens", context_lens)]
    for name, t in ints + ([("row_to_seq", row_to_seq)] if row_to_seq is not None else []):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    tensors = [query, key_cache, value_cache, block_tables, context_lens] + ([row_to_seq] if row_to_seq is not None else [])
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"query, caches, block_tables, context_lens and row_to_seq must be on one device, got "
                         f"{sorted(map(str, devices))}")
