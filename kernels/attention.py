"""The attention interface of the model runtime: write new K/V into the paged cache, attend
over each sequence's blocks.

Cache layout (one layer, see engine/kv_cache.py): ``key_cache`` and ``value_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``; token ``p`` of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

A forward's tokens are a flat batch ``[T, ...]`` of chunks from ``B`` sequences (prefill chunks,
decode tokens and verification runs mixed). ``AttentionMetadata`` describes that batch once per
forward; every layer reuses it. Backends implement ``AttentionBackend``:

- ``"torch"``: the reference (kernels/torch_ref.py), runs everywhere; the test oracle;
- ``"cpu"``: reads K/V in place through the block table (kernels/cpu_attention.py, a C++
  extension built on first use);
- ``"auto"``: ``"cpu"`` on CPU when its extension builds, else ``"torch"`` with the reason logged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import accumulate
from typing import Literal, Protocol, Sequence

import torch

log = logging.getLogger(__name__)

GroupsNeeded = Literal["all", "long", "none"]


# Sequences with at most this many new tokens (decode, speculative verification) are attended
# together in padded groups; longer chunks (prefill) each get their own group, so a long
# prefill chunk never pads every decode row of the batch to its length.
MAX_PADDED_QUERY_LEN = 16

# What one more padded group costs, in padded key positions (one row times one key): the extra
# gather, attention call and index copies of a group, measured on CPU at about the cost of
# attending 64 more keys. Short sequences are split into groups of similar context length
# when that saves more padding than this (see partition_by_length).
GROUP_OVERHEAD_KEYS = 64


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences attended by one padded call (torch reference layout).

    token_index: [Tg] int64, rows of the flat batch that belong to the group (None = all, in order).
    context_slots: [Bg, L] int64, slot of key position j of the group's sequence b (L = the
        group's max seq_len; rows padded with slot 0, masked out).
    padded_index: [Tg] int64, row of each group token in a padded [Bg * max_query_len] layout.
    attn_bias: [Bg, 1, max_query_len, L] additive mask in the attention dtype: 0 where query i of
        sequence b may attend key j (causal: j <= start_pos + i, and j < seq_len), -inf elsewhere.
        Padding query rows see every valid key, so no row is fully masked.
    is_causal_prefill: one sequence whose chunk starts at position 0, so plain causal attention
        over its own keys is exact (attn_bias is not needed).
    """

    token_index: torch.Tensor | None
    context_slots: torch.Tensor
    padded_index: torch.Tensor
    attn_bias: torch.Tensor
    max_query_len: int
    max_seq_len: int
    is_causal_prefill: bool

    @property
    def num_seqs(self) -> int:
        return int(self.context_slots.shape[0])


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-forward description of the flat token batch (all tensors on the cache's device).

    slot_mapping: [T] int64, the cache slot each new token's K/V is written to.
    seq_lens: [B] int64, context length of each sequence after this forward.
    query_start_loc: [B + 1] int64, first row of each sequence's tokens in the flat batch.
    block_tables: [B, max_blocks] int64, padded with 0.
    groups: the reference backend's batching of sequences (see AttentionGroup); only the
        groups the backend asked for (``build(groups=...)``), possibly none.
    """

    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_tables: torch.Tensor
    groups: tuple[AttentionGroup, ...]

    @classmethod
    def build(cls, start_pos: Sequence[int], query_lens: Sequence[int],
              block_tables: Sequence[Sequence[int]], block_size: int,
              device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, *,
              group_by_length: bool = True, groups: GroupsNeeded = "all") -> "AttentionMetadata":
        """Metadata for sequences whose new tokens sit at ``start_pos[b] .. start_pos[b] + query_lens[b] - 1``.

        group_by_length: split the short chunks into groups of similar context length
        (partition_by_length); False attends them as one group padded to the longest.
        groups: which reference groups to build (the backend's ``metadata_groups``): ``"all"``
        (the torch reference), ``"long"`` (only the chunks of more than MAX_PADDED_QUERY_LEN
        tokens, one group each: a backend that attends the short ones itself), ``"none"``.

        block_tables[b] must cover ``start_pos[b] + query_lens[b]`` tokens (checked by the caller).
        """
        # The four tensors are built in Python and made one int64 tensor (split into views): at
        # decode sizes the per-forward cost is then one list-to-tensor copy, not ~25 small torch
        # ops (~100 us a step at batch 16 on these CPUs).
        num_seqs = len(query_lens)
        lens = [s + q for s, q in zip(start_pos, query_lens)]
        max_blocks = -(-max(lens) // block_size)
        flat: list[int] = []                                   # slot_mapping | seq_lens | query_start_loc | tables
        for s, q, bt in zip(start_pos, query_lens, block_tables):
            if q == 1:                                         # a decode row
                flat.append(bt[s // block_size] * block_size + s % block_size)
                continue
            p, stop = s, s + q
            while p < stop:                                    # block by block: one range each
                blk, off = divmod(p, block_size)
                n = min(block_size - off, stop - p)
                base = bt[blk] * block_size + off
                flat.extend(range(base, base + n))
                p += n
        num_tokens = len(flat)
        flat.extend(lens)
        flat.extend(accumulate(query_lens, initial=0))
        for bt in block_tables:
            row = list(bt[:max_blocks])
            flat.extend(row)
            if len(row) < max_blocks:
                flat.extend([0] * (max_blocks - len(row)))
        packed = torch.tensor(flat, dtype=torch.int64)
        slot_mapping, seq_lens, query_start_loc, table = packed.split(
            [num_tokens, num_seqs, num_seqs + 1, num_seqs * max_blocks])
        table = table.view(num_seqs, max_blocks)
        subsets = _group_subsets(query_lens, lens, group_by_length, groups)
        built: tuple[AttentionGroup, ...] = ()
        if subsets:
            start = torch.tensor(start_pos, dtype=torch.int64)
            qlen = torch.tensor(query_lens, dtype=torch.int64)
            covers_all = len(subsets) == 1 and len(subsets[0]) == num_seqs
            built = tuple(_group(subset, start, qlen, query_start_loc[:-1], table, block_size, covers_all, device,
                                 dtype) for subset in subsets)
        on_device = packed.to(device)
        if on_device is not packed:   # one copy to the device, then views of it
            slot_mapping, seq_lens, query_start_loc, table = on_device.split(
                [num_tokens, num_seqs, num_seqs + 1, num_seqs * max_blocks])
            table = table.view(num_seqs, max_blocks)
        return cls(slot_mapping=slot_mapping, seq_lens=seq_lens, query_start_loc=query_start_loc,
                   block_tables=table, groups=built)


def _group_subsets(query_lens: Sequence[int], seq_lens: Sequence[int], group_by_length: bool,
                   groups: GroupsNeeded) -> list[list[int]]:
    """The sequences of each reference group to build (see AttentionMetadata.build)."""
    if groups not in ("all", "long", "none"):
        raise ValueError(f"groups must be 'all', 'long' or 'none', got {groups!r}")
    if groups == "none":
        return []
    long = [[b] for b, q in enumerate(query_lens) if q > MAX_PADDED_QUERY_LEN]
    if groups == "long":
        return long
    short = [b for b, q in enumerate(query_lens) if q <= MAX_PADDED_QUERY_LEN]
    shorts = partition_by_length(short, [seq_lens[b] for b in short]) if group_by_length else [short] if short else []
    return shorts + long


def partition_by_length(seqs: Sequence[int], seq_lens: Sequence[int],
                        overhead: int = GROUP_OVERHEAD_KEYS) -> list[list[int]]:
    """Split sequences into groups, each padded to its longest context, at least total cost.

    A group of ``n`` sequences whose longest context is ``L`` costs ``n * L + overhead`` (padded
    key positions read, plus the fixed cost of one more attention call). Sorted by length, the
    optimal groups are contiguous runs, found by dynamic programming in O(B^2). A padded batch
    of mixed lengths (one 2,000-token context among 31 short ones) otherwise makes every row
    read 2,000 keys. Returns lists of entries of ``seqs``, each in input order (no sequences: []).
    """
    order = sorted(range(len(seqs)), key=lambda i: seq_lens[i])
    lens = [seq_lens[i] for i in order]
    n = len(order)
    best = [0] + [0] * n          # best[j]: least cost of grouping the j shortest
    cut = [0] * (n + 1)           # cut[j]: where the last group of the j shortest begins
    for j in range(1, n + 1):
        best[j], cut[j] = min((best[i] + (j - i) * lens[j - 1] + overhead, i) for i in range(j))
    groups, j = [], n
    while j > 0:
        groups.append([seqs[i] for i in sorted(order[cut[j]:j])])  # members keep their input order
        j = cut[j]
    return groups[::-1]


def _group(seqs: list[int], start: torch.Tensor, qlen: torch.Tensor, first: torch.Tensor, table: torch.Tensor,
           block_size: int, covers_all: bool, device: torch.device | str, dtype: torch.dtype) -> AttentionGroup:
    idx = torch.tensor(seqs, dtype=torch.int64)
    g_start, g_qlen, g_first = start[idx], qlen[idx], first[idx]
    g_seq_lens = g_start + g_qlen
    max_q, max_l = int(g_qlen.max()), int(g_seq_lens.max())
    j = torch.arange(max_l)
    context_slots = table[idx][:, j // block_size] * block_size + j % block_size           # [Bg, L]
    local = torch.repeat_interleave(torch.arange(len(seqs)), g_qlen)                       # [Tg]
    i_in_chunk = torch.arange(int(g_qlen.sum())) - (torch.cumsum(g_qlen, 0) - g_qlen)[local]
    causal_limit = g_start[:, None] + torch.arange(max_q)[None, :]                         # [Bg, Q]
    allowed = (j[None, None, :] <= causal_limit[:, :, None]) & (j[None, None, :] < g_seq_lens[:, None, None])
    bias = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
    return AttentionGroup(
        token_index=None if covers_all else (g_first[local] + i_in_chunk).to(device),
        context_slots=context_slots.to(device),
        padded_index=(local * max_q + i_in_chunk).to(device),
        attn_bias=bias[:, None].to(device),
        max_query_len=max_q,
        max_seq_len=max_l,
        is_causal_prefill=len(seqs) == 1 and int(g_start[0]) == 0,
    )


class AttentionBackend(Protocol):
    """name: what get_attention_backend calls it. metadata_groups: which reference groups
    AttentionMetadata.build must make for it ("all", "long" or "none"). reads_new_kv (optional,
    default False): paged_attention also takes ``key=``/``value=``, the layer's new K/V."""

    name: str
    metadata_groups: GroupsNeeded

    def write_kv_cache(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write key/value [T, num_kv_heads, head_dim] into the caches at slot_mapping [T]."""

    def paged_attention(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | float | None = None,
                        v_scale: torch.Tensor | float | None = None) -> torch.Tensor:
        """query [T, num_heads, head_dim] -> output [T, num_heads, head_dim] (same dtype).

        num_heads must be a multiple of num_kv_heads (GQA: query head h reads KV head
        h // (num_heads // num_kv_heads)). k_scale/v_scale: fp32 scalars or [num_kv_heads]
        dequantization scales of an FP8 cache; None = the cache holds the compute dtype.
        """


BACKENDS = ("auto", "cpu", "torch", "triton")


def get_attention_backend(name: str = "torch", device: torch.device | str = "cpu") -> AttentionBackend:
    """The attention backend called ``name`` (one of BACKENDS) for tensors on ``device``.

    ``"auto"``: on CPU the in-place ``"cpu"`` kernel when its extension builds (first use
    compiles it, then it is cached), else ``"torch"``; on CUDA ``"triton"`` when triton imports,
    else ``"torch"``; the choice and any reason for a fallback are logged. ``"triton"``: GPU
    (kernels/triton/backend.py, needs the triton package). Raises ValueError for an unknown name, RuntimeError when ``"cpu"`` is
    asked for explicitly and cannot be built.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}: available: {', '.join(BACKENDS)}")
    if name == "auto":
        name = _auto_backend(torch.device(device))
    if name == "cpu":
        from kernels.cpu_attention import CpuAttention

        return CpuAttention()
    if name == "triton":
        from kernels.triton.backend import TritonAttention

        return TritonAttention()
    from kernels.torch_ref import TorchAttention

    return TorchAttention()


def _auto_backend(device: torch.device) -> str:
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            log.warning("attention backend auto: triton is not installed; using the torch reference on %s", device)
            return "torch"
        return "triton"
    if device.type != "cpu":
        log.warning("attention backend auto: no kernel for %s yet, using the torch reference", device)
        return "torch"
    from kernels.cpu_attention import load_extension

    op, reason = load_extension()
    if op is None:
        log.warning("attention backend auto: %s; using the torch reference (slower: it copies every "
                    "context out of the paged cache in every layer)", reason)
        return "torch"
    return "cpu"


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The torch reference write (see AttentionBackend.write_kv_cache)."""
    from kernels.torch_ref import write_kv_cache as ref

    ref(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The torch reference paged attention (see AttentionBackend.paged_attention)."""
    from kernels.torch_ref import paged_attention as ref

    return ref(query, key_cache, value_cache, meta, scale)
