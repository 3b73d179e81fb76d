"""The KV fence's pure parts and its wiring into the in-process ``local`` transport, no model:
the receiver's WriteFence, position-exact landing tags, late writes dropped, expired writes never
started, a concurrent cancel that waits for the first, and the fault-spec parser."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from engine.kv_cache import KVCacheSpec, PagedKVCache
from engine.outputs import ChunkInfo
from kv_transfer import ABORTED_PREFIX, LandingTracker, TransferState, create_transport, layers_tag
from kv_transfer.base import CompatKey
from kv_transfer.faults import FaultSpec
from kv_transfer.fence import WriteFence, reservation_key
from kv_transfer.landing import SETTLED_PREFIX, parse_write_tag, tag_key, write_tag
from prefill_worker.kv_push import KVPusher

SPEC = dict(num_layers=2, num_kv_heads=1, head_dim=4, block_size=4)


def test_fence_admits_only_live_reservations_into_their_own_blocks():
    fence = WriteFence()
    fence.open("r#1", [4, 5, 6])
    assert fence.begin("r#1", 4, 3) and fence.writing("r#1")
    assert not fence.begin("r#1", 6, 2)          # block 7 is not r#1's
    assert not fence.begin("r#2", 4, 1) and not fence.begin(None, 4, 1)
    fence.close("r#1")
    assert not fence.begin("r#1", 4, 1)          # closed: nothing more lands
    assert fence.writing("r#1")                  # ... but the frame admitted before is still landing
    fence.end("r#1")
    assert not fence.writing("r#1") and len(fence) == 0 and fence.discarded_frames == 4
    with pytest.raises(ValueError):
        fence.open("x", [1]) or fence.open("x", [2])
    fence.open("c#3", [9, 10, 11], writable_from=2)  # 9, 10: the decode worker's shared cached blocks
    assert not fence.begin("c#3", 9, 1) and not fence.begin("c#3", 10, 2) and fence.begin("c#3", 11, 1)
    assert fence.blocks("c#3") == (9, 10, 11)


def test_write_tags_name_positions_and_the_tracker_needs_every_chunk_of_every_layer():
    key = reservation_key("a@b", 7)
    assert parse_write_tag(write_tag(key, [1], 16, 40)) == ("a@b#7", [1], (16, 40))
    assert tag_key(layers_tag(key, [0])) == key and parse_write_tag("r@1/5:5") is None
    tracker = LandingTracker()
    tracker.expect(key, 2, num_tokens=10)
    # chunk 1 (positions 0..5) of both layers, chunk 2 (6..9) of layer 0 only: block 1 (4..7) was
    # written by chunk 1 but is incomplete until chunk 2 rewrote it
    tracker.feed([write_tag(key, [0, 1], 0, 6), write_tag(key, [0], 6, 10)])
    assert not tracker.is_complete(key) and tracker.landed_layers(key) == {0}
    assert tracker.feed([write_tag(key, [1], 6, 12)]) == [key]   # a span past the prompt is clipped
    assert tracker.is_complete(key)


def test_settled_notification_releases_an_aborted_reservation():
    tracker = LandingTracker(drain_timeout_s=1000)
    tracker.expect("k", 3, num_tokens=8)
    tracker.feed([write_tag("k", [0], 0, 8), ABORTED_PREFIX + write_tag("k", [1], 0, 4)])
    tracker.abort("k", deadline=float("inf"))
    assert not tracker.is_settled("k") and tracker.releasable() == []
    tracker.feed([SETTLED_PREFIX + "k"])
    assert tracker.is_settled("k") and tracker.releasable() == ["k"]


def _pair():
    src = PagedKVCache(KVCacheSpec(num_blocks=8, **SPEC))
    dst = PagedKVCache(KVCacheSpec(num_blocks=8, **SPEC))
    src.data.copy_(torch.randn_like(src.data))
    a, b = create_transport("local"), create_transport("local")
    a.register_cache(src, CompatKey.from_spec(src.spec, "m"))
    peer = a.add_peer(b.register_cache(dst, CompatKey.from_spec(dst.spec, "m")))
    fence = WriteFence()
    b.set_fence(fence)
    pusher = KVPusher(a, SPEC["block_size"], SPEC["num_layers"], 2 * src.spec.block_bytes, timeout_s=5)
    pusher.receiver = b
    return src, dst, a, b, peer, fence, pusher


def test_a_late_write_for_a_closed_reservation_is_dropped_and_reported_fenced():
    src, dst, a, b, peer, fence, _ = _pair()
    fence.open("r#1", [2, 3])
    assert a.write(peer, [0, 1], [2, 3], [0], write_tag("r#1", [0], 0, 8), 5.0).state is TransferState.DONE
    fence.close("r#1")          # aborted: blocks 2, 3 may be reused by the next reservation
    fence.open("s#2", [2, 3])
    dst.data.zero_()
    late = a.write(peer, [0, 1], [2, 3], [1], write_tag("r#1", [1], 0, 8), 5.0)
    assert late.state is TransferState.CANCELLED and "fenced" in late.error
    assert torch.count_nonzero(dst.data) == 0   # nothing of the old request reached s#2's blocks
    assert b.poll_notifications() == [write_tag("r#1", [0], 0, 8)]


def test_no_write_starts_after_the_reservation_expired():
    _, _, a, _, peer, fence, pusher = _pair()
    fence.open("r#1", [0, 1])
    h = a.write(peer, [0], [0], [0], write_tag("r#1", [0], 0, 4), 5.0, not_after_unix=time.time() - 1)
    assert h.state is TransferState.CANCELLED and "expired" in h.error
    pusher.begin("r", peer, [0, 1], key="r#1", not_after_unix=time.time() - 1)
    pusher.on_layer(0, [ChunkInfo("r", (0, 1), 0, 8, True)])
    assert pusher.expired_writes == 1


def test_a_second_concurrent_cancel_waits_for_the_first_and_the_receiver_hears_settled():
    _, _, a, b, peer, fence, pusher = _pair()
    fence.open("r#1", [0, 1])
    pusher.begin("r", peer, [0, 1], key="r#1")
    pusher.on_layer(0, [ChunkInfo("r", (0, 1), 0, 8, True)])

    async def both():
        first = asyncio.ensure_future(pusher.cancel("r"))
        await asyncio.sleep(0)
        second = asyncio.ensure_future(pusher.cancel("r"))
        await second
        assert first.done() or pusher.active() == 0  # the second never returns before the push stopped
        await first

    asyncio.run(both())
    assert pusher.active() == 0
    assert b.poll_notifications()[-1] == SETTLED_PREFIX + "r#1"


def test_fault_spec_parses_and_names_bad_keys():
    spec = FaultSpec.parse("drop_notify=0.5, delay_notify_s=0.02,match=victim,kill_after_writes=3")
    assert (spec.drop_notify, spec.delay_notify_s, spec.match, spec.kill_after_writes) == (0.5, 0.02, "victim", 3)
    assert not FaultSpec.parse("seed=1").active
    with pytest.raises(ValueError, match="bogus"):
        FaultSpec.parse("bogus=1")
    with pytest.raises(ValueError, match="drop_notify"):
        FaultSpec.parse("drop_notify=2")
