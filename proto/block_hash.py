"""The one chained block-hash function, shared by workers (prefix caching, KV events) and the router.

A block's hash covers its parent's hash and its own token ids, so equal hashes mean equal
prefixes up to and including that block (up to a 2**-64 collision chance; the block manager
also compares stored tokens on a hit). Stable across processes and machines: BLAKE2b over a
fixed little-endian encoding, never Python's salted ``hash()``. Pure Python, no torch.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Iterable, Sequence

HASH_VERSION = 1
_ROOT_PARENT = b"pdserve-block-hash-v1"


def hash_block(parent: int | None, token_ids: Iterable[int]) -> int:
    """Hash of one block given its parent block's hash (None for the first block).

    token_ids: the block's token ids (each in [0, 2**32)). Returns an unsigned 64-bit int.
    """
    h = hashlib.blake2b(digest_size=8)
    h.update(_ROOT_PARENT if parent is None else struct.pack("<Q", parent))
    tokens = list(token_ids)
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return int.from_bytes(h.digest(), "little")


def hash_blocks(token_ids: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """Chained hashes of every *full* block of ``token_ids`` (a trailing partial block has none).

    Raises ValueError if block_size < 1.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes
