"""Turn (source blocks -> destination blocks) x layers into coalesced descriptors. Pure logic.

In the ``LKBTHD`` layout, blocks ``b .. b+n-1`` of one layer's K (or V) are one contiguous byte
range, so a run of pairs that are consecutive on both sides moves as one descriptor: fewer, larger
descriptors are what keeps NIXL/UCX near memcpy speed (4 KiB pieces run at a fraction of it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from engine.kv_cache import KVCacheSpec


@dataclass(frozen=True)
class Run:
    """``count`` consecutive blocks from ``src`` onwards go to ``dst`` onwards."""

    src: int
    dst: int
    count: int


@dataclass(frozen=True)
class Desc:
    """One contiguous piece: K (kv=0) or V (kv=1) of ``layer``, blocks ``src..src+count-1`` ->
    ``dst..dst+count-1``."""

    layer: int
    kv: int
    src: int
    dst: int
    count: int


def coalesce(src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> list[Run]:
    """Merge pairs that are consecutive on both sides, in the given order.

    >>> coalesce([4, 5, 6, 9], [0, 1, 2, 3])
    [Run(src=4, dst=0, count=3), Run(src=9, dst=3, count=1)]
    """
    runs: list[Run] = []
    for s, d in zip(src_blocks, dst_blocks):
        last = runs[-1] if runs else None
        if last is not None and s == last.src + last.count and d == last.dst + last.count:
            runs[-1] = Run(last.src, last.dst, last.count + 1)
        else:
            runs.append(Run(s, d, 1))
    return runs


def check_blocks(src_blocks: Sequence[int], dst_blocks: Sequence[int], src_num_blocks: int,
                 dst_num_blocks: int) -> None:
    """Raise ValueError unless both lists have equal length, ids are in range, destinations distinct."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks but {len(dst_blocks)} destination blocks")
    if not src_blocks:
        raise ValueError("no blocks to transfer")
    for side, blocks, n in (("source", src_blocks, src_num_blocks), ("destination", dst_blocks, dst_num_blocks)):
        bad = [b for b in blocks if not isinstance(b, int) or not 0 <= b < n]
        if bad:
            raise ValueError(f"{side} block ids {bad[:5]} out of range [0, {n})")
    if len(set(dst_blocks)) != len(dst_blocks):
        raise ValueError("destination block ids repeat: two writes into one block")


def check_layers(layers: Sequence[int], num_layers: int) -> list[int]:
    layers = list(layers)
    if not layers:
        raise ValueError("no layers to transfer")
    bad = [layer for layer in layers if not isinstance(layer, int) or not 0 <= layer < num_layers]
    if bad or len(set(layers)) != len(layers):
        raise ValueError(f"layers {layers} must be distinct ids in [0, {num_layers})")
    return layers


def plan(layers: Sequence[int], runs: Sequence[Run]) -> list[Desc]:
    """Descriptors in layer order (K then V), so a receiver sees layer ``l`` complete before ``l+1``."""
    return [Desc(layer, kv, r.src, r.dst, r.count) for layer in layers for kv in (0, 1) for r in runs]


def region(data: torch.Tensor, layer: int, kv: int, start: int, count: int) -> torch.Tensor:
    """Contiguous view of ``count`` blocks of one layer's K or V: ``[count, block_size, H, D]``."""
    return data[layer, kv, start:start + count]


def byte_offset(num_blocks: int, block_bytes: int, layer: int, kv: int, block: int) -> int:
    """Offset in bytes of one block of a cache with ``num_blocks`` blocks from the cache tensor's start."""
    return ((layer * 2 + kv) * num_blocks + block) * block_bytes


def total_bytes(spec: KVCacheSpec, descs: Sequence[Desc]) -> int:
    return sum(d.count for d in descs) * spec.block_bytes
