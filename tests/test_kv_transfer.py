"""KV transfer between two real OS processes, for the nixl, torch (gloo) and tcp backends.

This process holds one side (its own caches and transports); ``kv_transfer_peer`` runs the other.
Caches hold seeded random values (never zero), so this side can compute what the peer's blocks
must contain and compare sha256 digests. None of these tests is skipped: a missing backend
package fails them.
"""

from __future__ import annotations

import time

import pytest
import torch

from engine.kv_cache import KVCacheSpec
from kv_transfer import (ABORTED_PREFIX, CompatKey, IncompatiblePeer, LayerStream, TransferState,
                         create_transport, layers_tag)
from kv_transfer_peer import MODEL_ID, PeerProcess, digest, make_cache

BACKENDS = ["nixl", "torch", "tcp"]
SMALL = dict(num_layers=4, num_kv_heads=2, head_dim=16, block_size=4, num_blocks=32)  # 512 B blocks
BIG = dict(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, num_blocks=512)  # 16 KiB blocks, 64 MiB
TIMEOUT_S = 10.0

pytestmark = pytest.mark.timeout(120)


class Side:
    """This process's cache + transport for one spec."""

    def __init__(self, backend: str, spec_kwargs: dict, seed: int) -> None:
        self.spec = KVCacheSpec(**spec_kwargs)
        self.cache = make_cache(self.spec, seed)
        self.transport = create_transport(backend)
        self.meta = self.transport.register_cache(self.cache, CompatKey.from_spec(self.spec, MODEL_ID))


@pytest.fixture(scope="module", params=BACKENDS)
def pair(request):
    """(backend, peer process with slots "small" and "big", this side's small and big transports + peer ids)."""
    backend = request.param
    peer = PeerProcess(backend)
    sides = {}
    try:
        for name, spec, seed in (("small", SMALL, 11), ("big", BIG, 12)):
            peer_meta = peer.call("open", name, spec, seed + 100)
            side = Side(backend, spec, seed)
            side.peer = side.transport.add_peer(peer_meta)
            peer.call("add_peer", name, side.meta)
            sides[name] = side
        yield backend, peer, sides
    finally:
        peer.stop()
        for side in sides.values():
            side.transport.close()


def wait_for(predicate, timeout_s: float = TIMEOUT_S, what: str = "condition"):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.005)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def note_arrived(peer: PeerProcess, slot: str, note: str) -> bool:
    return any(n == note for _, n in peer.call("notes", slot))


# Scattered destinations (of 32 blocks), with runs consecutive on both sides that coalesce.
SCATTER_1 = ([2, 3, 4, 9, 15, 16, 21, 27, 30], [17, 18, 19, 0, 5, 6, 31, 11, 24])
SCATTER_2 = ([0, 1, 5, 6, 7, 8, 12, 13, 22, 23, 28, 31], [30, 2, 9, 10, 11, 1, 25, 26, 14, 3, 20, 21])
SCATTER_3 = ([10, 11, 14, 17, 18, 19, 25], [7, 8, 29, 12, 13, 4, 16])


def test_scattered_write_layer_by_layer_lands_byte_exact(pair):
    backend, peer, sides = pair
    side = sides["small"]
    src, dst = SCATTER_1
    untouched = [b for b in range(SMALL["num_blocks"]) if b not in dst]
    before = [peer.call("digest", "small", layer, untouched) for layer in range(SMALL["num_layers"])]
    peer.call("expect", "small", "req-lbl", SMALL["num_layers"])
    for layer in range(SMALL["num_layers"]):
        assert not peer.call("complete", "small", "req-lbl"), f"complete before layer {layer} landed"
        tag = layers_tag("req-lbl", [layer])
        handle = side.transport.write(side.peer, src, dst, [layer], tag, TIMEOUT_S)
        assert handle.wait() is TransferState.DONE, handle.error
        wait_for(lambda: note_arrived(peer, "small", tag), what=f"notification {tag}")
        assert peer.call("digest", "small", layer, dst) == digest(side.cache, layer, src), f"layer {layer} differs"
    assert peer.call("complete", "small", "req-lbl")
    after = [peer.call("digest", "small", layer, untouched) for layer in range(SMALL["num_layers"])]
    assert after == before, "blocks outside the destination list changed"


def test_scattered_write_whole_request_lands_byte_exact(pair):
    backend, peer, sides = pair
    side = sides["small"]
    src, dst = SCATTER_2
    layers = list(range(SMALL["num_layers"]))
    peer.call("expect", "small", "req-whole", len(layers))
    handle = side.transport.write(side.peer, src, dst, layers, layers_tag("req-whole", layers), TIMEOUT_S)
    assert handle.wait() is TransferState.DONE, handle.error
    wait_for(lambda: peer.call("complete", "small", "req-whole"), what="request complete")
    for layer in layers:
        assert peer.call("digest", "small", layer, dst) == digest(side.cache, layer, src), f"layer {layer} differs"


def test_layer_stream_from_a_forward_hook_lands_every_layer(pair):
    backend, peer, sides = pair
    side = sides["small"]
    src, dst = SCATTER_3
    layers = range(SMALL["num_layers"])
    assert all(peer.call("digest", "small", layer, dst) != digest(side.cache, layer, src) for layer in layers)
    peer.call("expect", "small", "req-stream", SMALL["num_layers"])
    stream = LayerStream(side.transport, side.peer, src, dst, "req-stream", SMALL["num_layers"], TIMEOUT_S)
    for layer in layers:  # what ModelRunner.forward(..., layer_hook=stream.layer_done) does
        stream.layer_done(layer)
    assert stream.wait() is TransferState.DONE, stream.error
    wait_for(lambda: peer.call("complete", "small", "req-stream"), what="request complete")
    for layer in layers:
        assert peer.call("digest", "small", layer, dst) == digest(side.cache, layer, src), f"layer {layer} differs"


def test_read_pull_confirms_lease_and_unconfirmed_lease_expires(pair):
    backend, peer, sides = pair
    side = sides["small"]
    remote, local = [3, 4, 5, 20], [30, 0, 1, 9]
    expected = {layer: peer.call("digest", "small", layer, remote) for layer in (1, 3)}
    assert all(digest(side.cache, layer, local) != want for layer, want in expected.items())
    peer.call("hold", "small", "pull-ok", remote, 30.0)
    peer.call("hold", "small", "pull-never", [6, 7], 0.5)
    handle = side.transport.read(side.peer, remote, local, [1, 3], TIMEOUT_S, notify="pull-ok")
    assert handle.wait() is TransferState.DONE, handle.error
    for layer, want in expected.items():
        assert digest(side.cache, layer, local) == want, f"layer {layer} differs"
    leases = wait_for(lambda: (lambda s: s if s["confirmed"] == 1 and s["expired"] == 1 else None)(
        peer.call("leases", "small")), what="lease confirmed and lease expired")
    assert leases["held"] == 0 and leases["expired_keys"] == ["pull-never"]


def test_cancel_keeps_destination_held_until_backend_confirms(pair):
    backend, peer, sides = pair
    side = sides["big"]
    blocks = list(range(BIG["num_blocks"]))
    layers = list(range(BIG["num_layers"]))
    tag = layers_tag("req-cancel", layers)
    peer.call("expect", "big", "req-cancel", len(layers))
    assert peer.call("abort", "big", "req-cancel"), "released before anything was confirmed"
    handle = side.transport.write(side.peer, blocks, blocks, layers, tag, TIMEOUT_S)
    handle.cancel()
    final = handle.wait()
    if backend == "nixl":  # one UCX request; over shared memory it lands within the post, before the cancel
        assert final in (TransferState.CANCELLED, TransferState.DONE), handle.error
    else:  # 8 descriptors of 8 MiB: the cancel is seen between them
        assert final is TransferState.CANCELLED, handle.error
    terminal = ABORTED_PREFIX + tag if final is TransferState.CANCELLED else tag
    wait_for(lambda: note_arrived(peer, "big", terminal), what=f"notification {terminal!r}")
    released = wait_for(lambda: peer.call("released", "big").get("req-cancel"), what="release")
    note_time = next(t for t, n in peer.call("notes", "big") if n == terminal)
    assert released[0] >= note_time, "destination blocks released before the backend confirmed"
    assert peer.call("drained_by_timeout", "big") == 0
    time.sleep(0.3)
    assert peer.call("whole_digest", "big") == released[1], "bytes landed after the blocks were released"


def test_incompatible_peer_refused_at_handshake_naming_both_values(pair):
    backend, peer, sides = pair
    peer_meta = peer.call("open", "small-2", SMALL, 5)
    cases = [("block_size", dict(SMALL, block_size=8), "8", "4"),
             ("num_layers", dict(SMALL, num_layers=3), "3", "4"),
             ("kv_dtype", dict(SMALL, dtype=torch.bfloat16), "'bfloat16'", "'float32'")]
    for field, spec, this_value, peer_value in cases:
        side = Side(backend, spec, seed=6)
        try:
            with pytest.raises(IncompatiblePeer) as err:
                side.transport.add_peer(peer_meta)
            assert f"{field}: ours={this_value} peer={peer_value}" in str(err.value)
            with pytest.raises(RuntimeError, match="IncompatiblePeer") as err:  # refused from the other side too
                peer.call("add_peer", "small-2", side.meta)
            assert f"{field}: ours={peer_value} peer={this_value}" in str(err.value)
        finally:
            side.transport.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_peer_killed_mid_transfer_fails_handle_within_timeout(backend):
    peer = PeerProcess(backend)
    side = Side(backend, BIG, seed=21)
    try:
        side.peer = side.transport.add_peer(peer.call("open", "big", BIG, 22))
        blocks, layers = list(range(BIG["num_blocks"])), list(range(BIG["num_layers"]))
        timeout_s = 3.0
        in_flight = side.transport.write(side.peer, blocks, blocks, layers, "doomed", timeout_s)
        peer.kill()
        after = side.transport.write(side.peer, blocks, blocks, layers, "after-death", timeout_s)
        start = time.monotonic()
        states = [in_flight.wait(timeout_s + 2), after.wait(timeout_s + 2)]
        assert time.monotonic() - start < 2 * timeout_s + 3, "a handle hung past its timeout"
        assert after.state is TransferState.FAILED, after.error
        if backend != "nixl":  # 64 MiB over a socket cannot finish before SIGKILL lands
            assert states[0] is TransferState.FAILED, in_flight.error
        else:
            assert states[0].is_final
    finally:
        peer.kill()
        side.transport.close()
