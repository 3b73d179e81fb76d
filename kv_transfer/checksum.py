"""Per-request KV checksum (debug mode, ``--kv-checksum``): detects KV that arrived corrupted.

Both sides digest the same bytes: K and V of every layer at the prompt's positions
``0 .. num_tokens-1``, read through the request's block table (logical block i is ``blocks[i]``),
in the cache's own dtype. Positions past the prompt in the last block are left out (they hold
whatever that block held before). The prefill worker digests its blocks once every write landed
and returns the digest with the first token; the decode worker digests its reserved blocks before
admitting the request and refuses it (DATA_LOSS) on a mismatch. BLAKE2b-128 over the raw bytes:
about 1 GB/s here, so ~10 ms for a 200-token prompt of the bundled model — debug only.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch

from engine.kv_cache import PagedKVCache


def kv_checksum(cache: PagedKVCache, blocks: Sequence[int], num_tokens: int, skip_blocks: int = 0) -> str:
    """Hex digest of the prompt's K/V (layout ``[layers, 2, blocks, block_size, kv_heads, head_dim]``)
    from logical block ``skip_blocks`` on (the leading blocks the decode worker caches itself are
    not sent, and were computed elsewhere: they are left out on both sides).

    Raises ValueError if ``blocks`` cannot hold ``num_tokens`` tokens."""
    data = cache.data
    block_size = data.shape[3]
    needed = -(-num_tokens // block_size)
    if num_tokens < 1 or len(blocks) < needed or not 0 <= skip_blocks <= needed:
        raise ValueError(f"{len(blocks)} blocks (skipping {skip_blocks}) cannot hold {num_tokens} tokens of {block_size}")
    index = torch.as_tensor(list(blocks[skip_blocks:needed]), dtype=torch.long, device=data.device)
    kv = data.index_select(2, index).flatten(2, 3)[:, :, :num_tokens - skip_blocks * block_size]  # [L, 2, t, H, D]
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{tuple(kv.shape)}:{kv.dtype}".encode())
    digest.update(kv.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
