"""Turn (source blocks -> destination blocks) x layers into coalesced descriptors. Pure logic.

In the ``LKBTHD`` layout, blocks ``b .. b+n-1`` of one layer's K (or V) are one contiguous byte
range, so a run of pairs that are consecutive on both sides moves as one descriptor: fewer, larger
descriptors are what keeps NIXL/UCX near memcpy speed (4 KiB pieces run at a fraction of it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
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


def block_array(blocks: Sequence[int] | np.ndarray) -> np.ndarray:
    """Block ids as an int64 array (converted once per transfer; ValueError if not integers)."""
    ids = np.asarray(blocks)
    if ids.size and ids.dtype.kind not in "iu":
        raise ValueError(f"block ids must be integers, got {ids.dtype}")
    return ids.astype(np.int64, copy=False).reshape(-1)


def coalesce(src_blocks: Sequence[int] | np.ndarray, dst_blocks: Sequence[int] | np.ndarray) -> list[Run]:
    """Merge pairs that are consecutive on both sides, in the given order (vectorized: a whole
    cache's worth of block ids coalesces in well under a millisecond).

    >>> coalesce([4, 5, 6, 9], [0, 1, 2, 3])
    [Run(src=4, dst=0, count=3), Run(src=9, dst=3, count=1)]
    """
    src, dst, counts = coalesce_arrays(block_array(src_blocks), block_array(dst_blocks))
    return [Run(s, d, c) for s, d, c in zip(src.tolist(), dst.tolist(), counts.tolist())]


def coalesce_arrays(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``coalesce`` as arrays: (source starts, destination starts, counts)."""
    if src.size == 0:
        return src, dst, src
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [src.size])))
    return src[starts], dst[starts], counts


def check_blocks(src_blocks: Sequence[int] | np.ndarray, dst_blocks: Sequence[int] | np.ndarray,
                 src_num_blocks: int, dst_num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """Return both lists as int64 arrays; raise ValueError unless they have equal length, ids are
    in range and destinations are distinct."""
    src, dst = block_array(src_blocks), block_array(dst_blocks)
    if src.size != dst.size:
        raise ValueError(f"{src.size} source blocks but {dst.size} destination blocks")
    if src.size == 0:
        raise ValueError("no blocks to transfer")
    for side, ids, n in (("source", src, src_num_blocks), ("destination", dst, dst_num_blocks)):
        bad = ids[(ids < 0) | (ids >= n)]
        if bad.size:
            raise ValueError(f"{side} block ids {bad[:5].tolist()} out of range [0, {n})")
    increasing = dst.size == 1 or bool(np.all(np.diff(dst) > 0))
    if not increasing and np.unique(dst).size != dst.size:
        raise ValueError("destination block ids repeat: two writes into one block")
    return src, dst


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
