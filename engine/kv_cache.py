"""The paged KV cache: one tensor per worker, fixed-size blocks, per-layer K/V views.

Layout (``KV_LAYOUT = "LKBTHD"``), one contiguous allocation::

    data: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]   dtype = spec.dtype
            layer     K=0/V=1  block id   slot in block

so ``key(l)`` and ``value(l)`` are contiguous ``[num_blocks, block_size, num_kv_heads, head_dim]``
tensors, one block of one layer's K (or V) is ``block_size * num_kv_heads * head_dim`` contiguous
elements, and a run of consecutive block ids is one contiguous byte range (what the KV-transfer
layer coalesces into one descriptor). Token ``i`` of a sequence lives in block
``block_table[i // block_size]`` at offset ``i % block_size``; its *slot* is
``block_id * block_size + offset`` (the slot mapping).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.huge_pages import advise_huge_pages

KV_LAYOUT = "LKBTHD"


@dataclass(frozen=True)
class KVFormat:
    """What the bytes of a block mean: two caches exchange blocks only if their formats are equal.

    dtype: element dtype name ("bfloat16", "float8_e4m3fn", ...); layout: KV_LAYOUT; head layout:
    num_layers x num_kv_heads x head_dim; scales_digest: digest of an FP8 cache's dequantization
    scales and offsets (engine/quantization/kv_scales.py; "" for a cache in the compute dtype): the
    same E4M3 bytes under different scales or offsets are different numbers.
    """

    dtype: str
    layout: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    scales_digest: str = ""

    def __str__(self) -> str:
        scales = f"/scales:{self.scales_digest}" if self.scales_digest else ""
        return (f"{self.dtype}/{self.layout}/bs{self.block_size}/L{self.num_layers}/"
                f"kv{self.num_kv_heads}x{self.head_dim}{scales}")


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of a paged KV cache. Two caches can exchange blocks only if their specs match
    (apart from num_blocks): see ``kv_format``.

    scales_digest: digest of the FP8 dequantization scales and offsets ("" for a cache in the compute dtype).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: torch.dtype = torch.float32
    layout: str = KV_LAYOUT
    scales_digest: str = ""

    @property
    def kv_format(self) -> KVFormat:
        """The immutable descriptor of what a block's bytes mean (everything but num_blocks)."""
        return KVFormat(str(self.dtype).removeprefix("torch."), self.layout, self.block_size, self.num_layers,
                        self.num_kv_heads, self.head_dim, self.scales_digest)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V)."""
        return self.block_size * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_block_all_layers(self) -> int:
        """Bytes one block holds across every layer, K and V."""
        return 2 * self.num_layers * self.block_bytes

    @classmethod
    def blocks_for_memory(cls, memory_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int,
                          block_size: int, dtype: torch.dtype) -> int:
        per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        return max(1, memory_bytes // per_block)


class PagedKVCache:
    """Owns the cache tensor. Block ids are allocated elsewhere (the block manager)."""

    def __init__(self, spec: KVCacheSpec, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        # On huge pages where the OS allows (engine/huge_pages.py): decode attention reads blocks
        # scattered over the whole cache. Advised before the zeroing, which faults the pages in.
        self.data = torch.empty(spec.shape, dtype=spec.dtype, device=device)
        advise_huge_pages(self.data)
        self.data.zero_()

    def key(self, layer: int) -> torch.Tensor:
        """[num_blocks, block_size, num_kv_heads, head_dim] view of layer ``layer``'s K."""
        return self.data[layer, 0]

    def value(self, layer: int) -> torch.Tensor:
        """[num_blocks, block_size, num_kv_heads, head_dim] view of layer ``layer``'s V."""
        return self.data[layer, 1]
