"""Layer-wise KV push (prefill_worker/kv_push.py) over the real in-process `local` transport:
logical block i of the prompt lands in destination block i, chunk by chunk and layer by layer,
blocks the engine never computed (prefix-cache hits) are sent by finish(), and the blocks the
destination already caches are never written. No model."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine.kv_cache import KVCacheSpec, PagedKVCache
from engine.outputs import ChunkInfo
from kv_transfer import create_transport
from kv_transfer.base import CompatKey
from prefill_worker.kv_push import KVPusher, TransferFailed

SPEC = dict(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4)


def _pair():
    src = PagedKVCache(KVCacheSpec(num_blocks=16, **SPEC))
    dst = PagedKVCache(KVCacheSpec(num_blocks=32, **SPEC))
    src.data.copy_(torch.randn_like(src.data))
    a, b = create_transport("local"), create_transport("local")
    a.register_cache(src, CompatKey.from_spec(src.spec, "m"))
    peer = a.add_peer(b.register_cache(dst, CompatKey.from_spec(dst.spec, "m")))
    pusher = KVPusher(a, SPEC["block_size"], SPEC["num_layers"], 2 * src.spec.block_bytes, timeout_s=5)
    pusher.receiver = b  # peers are found through a weak registry: keep the receiver alive
    return src, dst, pusher, peer


def test_chunks_and_prefix_hits_land_in_the_matching_destination_blocks():
    src, dst, pusher, peer = _pair()
    src_blocks, dst_blocks = [3, 7, 1, 9], [20, 21, 22, 23]  # a 14-token prompt: 4 blocks of 4
    pusher.begin("r1", peer, dst_blocks)
    # block 0 was a prefix-cache hit; chunk 1 computes positions 4..9, chunk 2 positions 10..13
    chunks = [ChunkInfo("r1", (7, 1), 4, 6, False), ChunkInfo("r1", (1, 9), 10, 4, True)]
    for c in chunks:
        for layer in range(SPEC["num_layers"]):
            pusher.on_layer(layer, [c, ChunkInfo("other", (5,), 0, 4, True)])  # not pushed: ignored
    nbytes, _ = asyncio.run(pusher.finish("r1", src_blocks))
    for s, d in zip(src_blocks, dst_blocks):
        assert torch.equal(src.data[:, :, s], dst.data[:, :, d])
    assert nbytes > 0 and pusher.active() == 0
    untouched = [b for b in range(32) if b not in dst_blocks]
    assert torch.count_nonzero(dst.data[:, :, untouched]) == 0


def test_more_blocks_than_reserved_fails_loudly():
    _, _, pusher, peer = _pair()
    pusher.begin("r2", peer, [0])
    with pytest.raises(TransferFailed):
        asyncio.run(pusher.finish("r2", [1, 2]))
    asyncio.run(pusher.cancel("r2"))  # what the worker does on any failure
    assert pusher.active() == 0


def test_cancel_forgets_the_push():
    _, _, pusher, peer = _pair()
    pusher.begin("r3", peer, [0, 1])
    pusher.on_layer(0, [ChunkInfo("r3", (4,), 0, 4, False)])
    asyncio.run(pusher.cancel("r3"))
    assert pusher.active() == 0


def test_blocks_the_destination_caches_are_never_written():
    src, dst, pusher, peer = _pair()
    src_blocks, dst_blocks = [3, 7, 1, 9], [20, 21, 22, 23]
    pusher.begin("r4", peer, dst_blocks, skip_blocks=2)  # the decode worker caches blocks 0 and 1
    # the prefill engine itself hit block 0 in its cache; it computes positions 4..13
    for layer in range(SPEC["num_layers"]):
        pusher.on_layer(layer, [ChunkInfo("r4", (7, 1, 9), 4, 10, True)])
    nbytes, _ = asyncio.run(pusher.finish("r4", src_blocks))
    assert nbytes == 2 * SPEC["num_layers"] * 2 * src.spec.block_bytes  # two blocks, every layer
    for s, d in zip(src_blocks[2:], dst_blocks[2:]):
        assert torch.equal(src.data[:, :, s], dst.data[:, :, d])
    assert torch.count_nonzero(dst.data[:, :, dst_blocks[:2]]) == 0


def test_cached_blocks_beyond_the_reservation_are_refused():
    _, _, pusher, peer = _pair()
    with pytest.raises(ValueError, match="num_cached_blocks"):
        pusher.begin("r5", peer, [0, 1], skip_blocks=3)
    assert pusher.active() == 0
