"""The attention interface of the model runtime: write new K/V into the paged cache, attend
over each sequence's blocks.

Cache layout (one layer, see engine/kv_cache.py): ``key_cache`` and ``value_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``; token ``p`` of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

A forward's tokens are a flat batch ``[T, ...]`` of chunks from ``B`` sequences (prefill chunks,
decode tokens and verification runs mixed). ``AttentionMetadata`` describes that batch once per
forward; every layer reuses it. Backends implement ``AttentionBackend``; ``"torch"`` (the
reference, kernels/torch_ref.py) runs everywhere and is the one used on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-forward description of the flat token batch (all tensors on the cache's device).

    slot_mapping: [T] int64, the cache slot each new token's K/V is written to.
    seq_lens: [B] int64, context length of each sequence after this forward.
    query_lens: [B] int64, new tokens of each sequence (its queries) in this forward.
    context_slots: [B, L] int64, slot of key position j of sequence b (L = max seq_len; rows
        padded with slot 0, masked out).
    padded_index: [T] int64, row of each token in a padded [B * max_query_len] query layout.
    attn_mask: [B, 1, max_query_len, L] bool, True where query i of sequence b may attend key j
        (causal: j <= start_pos + i, and j < seq_len). Padding query rows see every valid key,
        so no row is fully masked.
    """

    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    query_lens: torch.Tensor
    context_slots: torch.Tensor
    padded_index: torch.Tensor
    attn_mask: torch.Tensor
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @classmethod
    def build(cls, start_pos: Sequence[int], query_lens: Sequence[int],
              block_tables: Sequence[Sequence[int]], block_size: int,
              device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Metadata for sequences whose new tokens sit at ``start_pos[b] .. start_pos[b] + query_lens[b] - 1``.

        block_tables[b] must cover ``start_pos[b] + query_lens[b]`` tokens (checked by the caller).
        """
        num_seqs = len(query_lens)
        start = torch.tensor(start_pos, dtype=torch.int64)
        qlen = torch.tensor(query_lens, dtype=torch.int64)
        seq_lens = start + qlen
        max_q, max_l = int(qlen.max()), int(seq_lens.max())
        max_blocks = -(-max_l // block_size)
        table = torch.zeros(num_seqs, max_blocks, dtype=torch.int64)
        for b, bt in enumerate(block_tables):
            n = min(len(bt), max_blocks)
            table[b, :n] = torch.as_tensor(list(bt[:n]), dtype=torch.int64)
        j = torch.arange(max_l)
        context_slots = table[:, j // block_size] * block_size + j % block_size          # [B, L]
        seq_idx = torch.repeat_interleave(torch.arange(num_seqs), qlen)                  # [T]
        first = torch.cumsum(qlen, 0) - qlen
        i_in_chunk = torch.arange(int(qlen.sum())) - first[seq_idx]                      # [T]
        positions = start[seq_idx] + i_in_chunk
        slot_mapping = context_slots[seq_idx, positions]
        causal_limit = start[:, None] + torch.arange(max_q)[None, :]                     # [B, Q]
        mask = (j[None, None, :] <= causal_limit[:, :, None]) & (j[None, None, :] < seq_lens[:, None, None])
        return cls(
            slot_mapping=slot_mapping.to(device),
            seq_lens=seq_lens.to(device),
            query_lens=qlen.to(device),
            context_slots=context_slots.to(device),
            padded_index=(seq_idx * max_q + i_in_chunk).to(device),
            attn_mask=mask[:, None].to(device),
            max_query_len=max_q,
            max_seq_len=max_l,
        )


class AttentionBackend(Protocol):
    name: str

    def write_kv_cache(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write key/value [T, num_kv_heads, head_dim] into the caches at slot_mapping [T]."""

    def paged_attention(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """query [T, num_heads, head_dim] -> output [T, num_heads, head_dim] (same dtype).

        num_heads must be a multiple of num_kv_heads (GQA: query head h reads KV head
        h // (num_heads // num_kv_heads)).
        """


def get_attention_backend(name: str = "torch") -> AttentionBackend:
    """The attention backend called ``name``; only ``"torch"`` exists so far."""
    if name == "torch":
        from kernels.torch_ref import TorchAttention

        return TorchAttention()
    raise ValueError(f"unknown attention backend {name!r}: available: torch")


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
