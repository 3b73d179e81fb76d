"""Pure logic of the KV-transfer layer (planning, compat key, wire format, landing, leases, handles)
and the in-process ``local`` backend. The backends across processes: test_kv_transfer.py."""

from __future__ import annotations

import pickle
import time

import pytest
import torch

from engine.kv_cache import KVCacheSpec
from kv_transfer import (ABORTED_PREFIX, CompatKey, IncompatiblePeer, LandingTracker, LeaseTable, TransferHandle,
                         TransferState, create_transport, layers_tag, parse_tag)
from kv_transfer.base import decode_metadata, encode_metadata
from kv_transfer.plan import Desc, Run, byte_offset, check_blocks, coalesce, plan
from kv_transfer.session import NotificationQueue, PeerSession
from kv_transfer.wire import MAX_CONTROL_BODY, Header, Kind, ProtocolError
from kv_transfer_peer import MODEL_ID, digest, make_cache

SPEC = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=16)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# -- planning ---------------------------------------------------------------------------------
def test_coalesce_merges_runs_consecutive_on_both_sides_only():
    assert coalesce([4, 5, 6, 9, 10], [0, 1, 2, 7, 3]) == [Run(4, 0, 3), Run(9, 7, 1), Run(10, 3, 1)]
    assert coalesce([1, 2], [5, 4]) == [Run(1, 5, 1), Run(2, 4, 1)]


def test_plan_is_layer_major_k_then_v():
    assert plan([2, 0], [Run(1, 3, 2)]) == [Desc(2, 0, 1, 3, 2), Desc(2, 1, 1, 3, 2), Desc(0, 0, 1, 3, 2),
                                            Desc(0, 1, 1, 3, 2)]


def test_byte_offset_matches_the_cache_tensor_layout():
    cache = make_cache(SPEC, 0)
    view = cache.data[2, 1, 5]
    assert view.data_ptr() - cache.data.data_ptr() == byte_offset(SPEC.num_blocks, SPEC.block_bytes, 2, 1, 5)


@pytest.mark.parametrize("src, dst, message", [([1, 2], [3], "2 source blocks but 1"),
                                               ([1, 16], [0, 1], "out of range"), ([1, 2], [3, 3], "repeat"),
                                               ([], [], "no blocks"), ([0.5], [1], "integers")])
def test_bad_block_lists_are_refused(src, dst, message):
    with pytest.raises(ValueError, match=message):
        check_blocks(src, dst, 16, 16)


# -- compatibility key and metadata ------------------------------------------------------------------
def test_compat_mismatch_names_every_differing_field_with_both_values():
    ours = CompatKey.from_spec(SPEC, "m")
    theirs = CompatKey.from_spec(KVCacheSpec(3, 2, 8, 16, 16, dtype=torch.bfloat16), "m")
    with pytest.raises(IncompatiblePeer) as err:
        ours.check_matches(theirs)
    assert "block_size: ours=4 peer=16" in str(err.value)
    assert "kv_dtype: ours='float32' peer='bfloat16'" in str(err.value)
    assert "num_layers" not in str(err.value)


def test_metadata_is_json_and_pickles_are_refused():
    ours = CompatKey.from_spec(SPEC, "m")
    blob = encode_metadata("tcp", ours, 16, host="127.0.0.1", port=1)
    assert decode_metadata(blob, "tcp", ours)["port"] == 1
    with pytest.raises(IncompatiblePeer, match="not valid JSON"):
        decode_metadata(pickle.dumps({"backend": "tcp"}), "tcp", ours)
    with pytest.raises(IncompatiblePeer, match="backend 'tcp', ours is 'nixl'"):
        decode_metadata(blob, "nixl", ours)
    with pytest.raises(IncompatiblePeer, match="model_id: ours='other' peer='m'"):
        decode_metadata(blob, "tcp", CompatKey.from_spec(SPEC, "other"))


def test_compat_key_must_describe_the_registered_cache():
    transport = create_transport("local")
    with pytest.raises(ValueError, match="does not describe"):
        transport.register_cache(make_cache(SPEC, 0), CompatKey.from_spec(KVCacheSpec(3, 2, 8, 8, 16), "m"))


def test_unknown_backend_name_is_a_clear_error():
    with pytest.raises(ValueError, match="nixl, torch, tcp, local"):
        create_transport("rdma")


# -- wire format and protocol state ---------------------------------------------------------------
def test_header_round_trips_and_bounds_control_bodies():
    h = Header(Kind.DATA, tid=7, layer=2, kv=1, start=5, count=3, body_len=1 << 30, flags=1)
    assert Header.unpack(h.pack()) == h
    with pytest.raises(ProtocolError, match="exceeds"):
        Header.unpack(Header(Kind.NOTIFY, body_len=MAX_CONTROL_BODY + 1).pack())
    with pytest.raises(ProtocolError, match="unknown frame kind"):
        Header.unpack(b"\x63" + h.pack()[1:])


def test_session_refuses_data_outside_the_cache_or_of_unknown_transfers():
    session = PeerSession("p", make_cache(SPEC, 0).data, SPEC.block_bytes, 16, NotificationQueue())
    with pytest.raises(ProtocolError, match="unknown transfer"):
        session.on_header(Header(Kind.DATA, tid=1, count=1, body_len=SPEC.block_bytes))
    session.on_frame(Header(Kind.BEGIN, tid=1, body_len=1), b"n")
    with pytest.raises(ProtocolError, match="out of range"):
        session.on_header(Header(Kind.DATA, tid=1, layer=0, start=15, count=2, body_len=2 * SPEC.block_bytes))
    with pytest.raises(ProtocolError, match="body"):
        session.on_header(Header(Kind.DATA, tid=1, layer=0, start=0, count=1, body_len=7))


def test_session_disconnect_fails_handles_and_reports_open_incoming_writes_aborted():
    notes = NotificationQueue()
    session = PeerSession("p", make_cache(SPEC, 0).data, SPEC.block_bytes, 16, notes)
    handle = session.start_write(plan([0], [Run(0, 0, 1)]), "mine", 5.0)
    session.on_frame(Header(Kind.BEGIN, tid=9, body_len=5), b"req@0")
    session.on_disconnect("connection lost")
    assert handle.state is TransferState.FAILED and "connection lost" in handle.error
    assert notes.drain() == [ABORTED_PREFIX + "req@0"]
    assert session.start_write(plan([0], [Run(0, 0, 1)]), "x", 5.0).state is TransferState.FAILED


# -- handles -------------------------------------------------------------------------------------
def test_handle_times_out_into_failed_and_final_states_are_sticky():
    handle = TransferHandle("p", "n", timeout_s=0.05, nbytes=0)
    assert handle.poll() is TransferState.PENDING
    t0 = time.monotonic()
    assert handle.wait() is TransferState.FAILED and "timed out" in handle.error
    assert time.monotonic() - t0 < 1.0
    handle._finish(TransferState.DONE)
    assert handle.state is TransferState.FAILED and handle.cancel() is TransferState.FAILED


def test_wait_async_does_not_block_the_loop():
    import asyncio

    async def main():
        handle = TransferHandle("p", "n", timeout_s=5.0, nbytes=0)
        asyncio.get_running_loop().call_later(0.02, handle._finish, TransferState.DONE)
        return await handle.wait_async(10.0)  # done after 20 ms; the bound is headroom for a loaded host

    assert asyncio.run(main()) is TransferState.DONE


# -- landing tracker -----------------------------------------------------------------------------
def test_tags_round_trip_even_with_at_signs_in_request_ids():
    assert parse_tag(layers_tag("a@b", [0, 7])) == ("a@b", [0, 7])
    assert parse_tag("no-tag") is None and parse_tag("r@x") is None


def test_request_is_complete_only_when_every_layer_landed():
    tracker = LandingTracker()
    tracker.expect("r", 3)
    assert tracker.feed([layers_tag("r", [0]), layers_tag("r", [2])]) == []
    assert not tracker.is_complete("r")
    assert tracker.feed(["unknown@0", layers_tag("r", [1])]) == ["r"]
    assert tracker.is_complete("r") and tracker.unknown_notifications == 1
    tracker.finish("r")
    assert len(tracker) == 0


def test_aborted_request_is_held_until_every_layer_is_settled():
    tracker = LandingTracker(drain_timeout_s=30.0)
    tracker.expect("r", 3)
    tracker.feed([layers_tag("r", [0])])
    tracker.abort("r")
    assert tracker.releasable() == [] and tracker.holds("r")
    tracker.feed([ABORTED_PREFIX + layers_tag("r", [1])])
    assert tracker.releasable() == []
    tracker.feed([ABORTED_PREFIX + layers_tag("r", [2])])
    assert tracker.releasable() == ["r"] and not tracker.holds("r")
    assert tracker.releasable() == [] and tracker.drained_by_timeout == 0


def test_aborted_request_is_released_after_the_drain_timeout_and_counted():
    clock = FakeClock()
    tracker = LandingTracker(drain_timeout_s=5.0, clock=clock)
    tracker.expect("r", 2)
    tracker.abort("r")
    clock.now += 4.9
    assert tracker.releasable() == []
    clock.now += 0.2
    assert tracker.releasable() == ["r"] and tracker.drained_by_timeout == 1


# -- leases --------------------------------------------------------------------------------------
def test_lease_expiry_frees_blocks_and_is_counted():
    clock = FakeClock()
    leases = LeaseTable(default_ttl_s=10.0, clock=clock)
    leases.hold("a", [1, 2])
    leases.hold("b", [3], ttl_s=2.0)
    assert leases.held_blocks == 3 and leases.next_expiry() == 102.0
    clock.now += 2.0
    assert [lease.key for lease in leases.expire()] == ["b"]
    assert leases.confirm("a").blocks == (1, 2) and leases.confirm("a") is None
    assert (leases.counters.granted, leases.counters.confirmed, leases.counters.expired) == (2, 1, 1)
    assert len(leases) == 0 and leases.expire() == []


def test_lease_rejects_double_hold_and_bad_ttl():
    leases = LeaseTable()
    leases.hold("a", [1])
    with pytest.raises(ValueError, match="already"):
        leases.hold("a", [2])
    with pytest.raises(ValueError, match="ttl_s"):
        leases.hold("b", [2], ttl_s=0)
    assert leases.release("a") is not None and leases.counters.released == 1


# -- local backend -------------------------------------------------------------------------------
def test_local_backend_write_and_read_are_byte_exact_with_notifications():
    a, b = create_transport("local"), create_transport("local")
    ca, cb = make_cache(SPEC, 1), make_cache(SPEC, 2)
    compat = CompatKey.from_spec(SPEC, MODEL_ID)
    a.register_cache(ca, compat)
    peer = a.add_peer(b.register_cache(cb, compat))
    handle = a.write(peer, [1, 2, 9], [4, 5, 0], [0, 2], layers_tag("r", [0, 2]), 5.0)
    assert handle.state is TransferState.DONE
    assert b.poll_notifications() == ["r@0,2"]
    for layer in (0, 2):
        assert digest(cb, layer, [4, 5, 0]) == digest(ca, layer, [1, 2, 9])
    assert digest(cb, 1, [4, 5, 0]) != digest(ca, 1, [1, 2, 9])
    assert a.read(peer, [7], [15], [1], 5.0, notify="got").state is TransferState.DONE
    assert digest(ca, 1, [15]) == digest(cb, 1, [7]) and b.poll_notifications() == ["got"]
    a.close(), b.close()


def test_nixl_descriptors_address_each_run_of_each_layer_k_then_v():
    import numpy as np

    from kv_transfer.nixl import _Layout
    from kv_transfer.plan import coalesce_arrays
    layout = _Layout.build(coalesce_arrays(np.array([3, 4, 9]), np.array([0, 1, 5])), 16, 32, 64)
    local, far = layout.descriptors([2, 0], 1000, 5000, 0, 1)
    want_local = [(1000 + byte_offset(16, 64, layer, kv, s), c * 64, 0)
                  for layer in (2, 0) for kv in (0, 1) for s, c in ((3, 2), (9, 1))]
    want_far = [(5000 + byte_offset(32, 64, layer, kv, s), c * 64, 1)
                for layer in (2, 0) for kv in (0, 1) for s, c in ((0, 2), (5, 1))]
    assert [tuple(int(x) for x in row) for row in local] == want_local
    assert [tuple(int(x) for x in row) for row in far] == want_far


def test_layer_stream_issues_one_tagged_write_per_layer_and_reports_bad_blocks():
    from kv_transfer import LayerStream
    a, b = create_transport("local"), create_transport("local")
    compat = CompatKey.from_spec(SPEC, MODEL_ID)
    ca, cb = make_cache(SPEC, 1), make_cache(SPEC, 2)
    a.register_cache(ca, compat)
    peer = a.add_peer(b.register_cache(cb, compat))
    stream = LayerStream(a, peer, [0, 1], [5, 6], "r", SPEC.num_layers, 5.0)
    for layer in (2, 0, 1):
        stream.layer_done(layer)
    assert stream.wait() is TransferState.DONE
    assert sorted(b.poll_notifications()) == ["r@0", "r@1", "r@2"]
    assert all(digest(cb, layer, [5, 6]) == digest(ca, layer, [0, 1]) for layer in range(SPEC.num_layers))
    bad = LayerStream(a, peer, [0], [99], "bad", 1, 5.0)
    bad.layer_done(0)
    assert bad.wait() is TransferState.FAILED and "out of range" in bad.error


class FramePipe:
    """Two PeerSessions wired back to back in memory, frames delivered one at a time (for exact
    interleavings of cancels with data)."""

    def __init__(self) -> None:
        import collections
        self.caches = [make_cache(SPEC, 1), make_cache(SPEC, 2)]
        self.notes = [NotificationQueue(), NotificationQueue()]
        self.sessions = [PeerSession(f"s{i}", c.data, SPEC.block_bytes, SPEC.num_blocks, n)
                         for i, (c, n) in enumerate(zip(self.caches, self.notes))]
        self.queues = [collections.deque(), collections.deque()]  # streams sent by side i
        for i, s in enumerate(self.sessions):
            s.send = self.queues[i].append

    def step(self, side: int) -> bool:
        """Deliver the next frame sent by ``side`` to the other side; False if none."""
        queue, other = self.queues[side], self.sessions[1 - side]
        while queue:
            frame = next(queue[0], None)  # streams are iterators: generators or iter([...])
            if frame is None:
                queue.popleft()
                continue
            header, payload = frame
            dest = other.on_header(header)
            if dest is not None:
                dest.copy_(payload)
            else:
                body = payload.numpy().tobytes() if isinstance(payload, torch.Tensor) else (payload or b"")
                self.queues[1 - side].extend(iter(stream) for stream in other.on_frame(header, body))
            return True
        return False

    def drain(self) -> None:
        while self.step(0) or self.step(1):
            pass


def test_framed_protocol_write_cancel_between_descriptors_reports_aborted_and_stops():
    pipe = FramePipe()
    a = pipe.sessions[0]
    handle = a.start_write(plan([0, 1, 2], [Run(0, 0, 4)]), "req@0,1,2", 5.0)
    for _ in range(3):  # BEGIN, DATA layer 0 K, DATA layer 0 V
        assert pipe.step(0)
    handle.cancel()
    assert handle.state is TransferState.PENDING  # not confirmed yet
    pipe.drain()
    assert handle.state is TransferState.CANCELLED
    assert pipe.notes[1].drain() == [ABORTED_PREFIX + "req@0,1,2"]
    assert digest(pipe.caches[1], 0, [0, 1, 2, 3]) == digest(pipe.caches[0], 0, [0, 1, 2, 3])
    assert digest(pipe.caches[1], 1, [0, 1, 2, 3]) != digest(pipe.caches[0], 1, [0, 1, 2, 3])


def test_framed_protocol_read_lands_and_notifies_source_and_can_be_cancelled():
    pipe = FramePipe()
    a = pipe.sessions[0]
    done = a.start_read(plan([1], [Run(2, 7, 3)]), "pulled", 5.0)  # remote 2..4 -> local 7..9
    pipe.drain()
    assert done.state is TransferState.DONE
    assert digest(pipe.caches[0], 1, [7, 8, 9]) == digest(pipe.caches[1], 1, [2, 3, 4])
    assert pipe.notes[1].drain() == ["pulled"] and pipe.notes[0].drain() == []
    cancelled = a.start_read(plan([0, 2], [Run(0, 0, 2)]), "never", 5.0)
    assert pipe.step(0)  # READ reaches the source, which queues its response stream
    assert pipe.step(1) and pipe.step(1)  # BEGIN, first DATA
    cancelled.cancel()
    pipe.drain()
    assert cancelled.state is TransferState.CANCELLED and pipe.notes[1].drain() == []
    assert digest(pipe.caches[0], 2, [0, 1]) != digest(pipe.caches[1], 2, [0, 1])
