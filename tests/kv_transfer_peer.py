"""The other process of the KV-transfer tests: a real OS process holding its own caches and transports.

The test process drives it over a multiprocessing pipe (a local test-control channel, never the
transfer path). The peer keeps polling its transports between commands, as a decode worker would:
notifications feed a ``LandingTracker`` and confirm ``LeaseTable`` holds; releases and expiries are
recorded with a digest of the cache at that moment, so the test can check nothing landed after.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.kv_cache import KVCacheSpec, PagedKVCache

MODEL_ID = "test-model"


def make_cache(spec: KVCacheSpec, seed: int) -> PagedKVCache:
    """A cache filled with seeded random values in [0.5, 1.5): never zero, reproducible elsewhere."""
    cache = PagedKVCache(spec)
    gen = torch.Generator().manual_seed(seed)
    cache.data.copy_((torch.rand(spec.shape, generator=gen) + 0.5).to(spec.dtype))
    return cache


def digest(cache: PagedKVCache, layer: int, blocks: list[int]) -> str:
    """sha256 of K and V of ``blocks`` of ``layer`` (in that order)."""
    return hashlib.sha256(cache.data[layer][:, blocks].contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def whole_digest(cache: PagedKVCache) -> str:
    return hashlib.sha256(cache.data.view(torch.uint8).numpy().tobytes()).hexdigest()


@dataclass
class Slot:
    """One cache + transport in the peer, with receiver-side and source-side bookkeeping."""

    transport: Any
    cache: PagedKVCache
    notes: list[tuple[float, str]] = field(default_factory=list)
    released: dict[str, tuple[float, str]] = field(default_factory=dict)
    expired: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    tracker: Any = None
    leases: Any = None

    def pump(self) -> None:
        notes = self.transport.poll_notifications()
        now = time.monotonic()
        self.notes += [(now, n) for n in notes]
        self.tracker.feed(notes)
        for n in notes:
            self.leases.confirm(n)
        for rid in self.tracker.releasable():
            self.released[rid] = (time.monotonic(), whole_digest(self.cache))
        for lease in self.leases.expire():
            self.expired.append((lease.key, lease.blocks))


class PeerProcess:
    """Test-side proxy of a peer process."""

    def __init__(self, backend: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_main, args=(child, backend), daemon=True)
        self.proc.start()

    def call(self, cmd: str, *args: Any, timeout_s: float = 60.0) -> Any:
        self.conn.send((cmd, *args))
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"peer did not answer {cmd} within {timeout_s}s")
        status, value = self.conn.recv()
        if status == "err":
            raise RuntimeError(value)
        return value

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop", timeout_s=20)
            except (TimeoutError, OSError, EOFError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def _main(conn, backend: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    peer = _Peer(backend)
    while True:
        if conn.poll(0.001):
            cmd, *args = conn.recv()
            if cmd == "stop":
                peer.close()
                conn.send(("ok", None))
                return
            try:
                conn.send(("ok", getattr(peer, "cmd_" + cmd)(*args)))
            except Exception as e:  # reported to the test, which fails with it
                conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        peer.pump()


class _Peer:
    def __init__(self, backend: str) -> None:
        from kv_transfer import create_transport  # imported here: the child sets threads first
        self.create_transport = create_transport
        self.backend = backend
        self.slots: dict[str, Slot] = {}
        self.paused_until = 0.0

    def pump(self) -> None:
        if time.monotonic() < self.paused_until:
            return
        for slot in self.slots.values():
            slot.pump()

    def close(self) -> None:
        for slot in self.slots.values():
            slot.transport.close()

    def cmd_open(self, name: str, spec_kwargs: dict, seed: int, drain_timeout_s: float = 30.0) -> bytes:
        from kv_transfer import CompatKey, LandingTracker, LeaseTable
        spec = KVCacheSpec(**spec_kwargs)
        cache = make_cache(spec, seed)
        transport = self.create_transport(self.backend)
        meta = transport.register_cache(cache, CompatKey.from_spec(spec, MODEL_ID))
        self.slots[name] = Slot(transport, cache, tracker=LandingTracker(drain_timeout_s), leases=LeaseTable())
        return meta

    def cmd_add_peer(self, name: str, meta: bytes) -> str:
        return self.slots[name].transport.add_peer(meta)

    def cmd_digest(self, name: str, layer: int, blocks: list[int]) -> str:
        return digest(self.slots[name].cache, layer, blocks)

    def cmd_whole_digest(self, name: str) -> str:
        return whole_digest(self.slots[name].cache)

    def cmd_notes(self, name: str) -> list[tuple[float, str]]:
        return list(self.slots[name].notes)

    def cmd_expect(self, name: str, rid: str, num_layers: int) -> None:
        self.slots[name].tracker.expect(rid, num_layers)

    def cmd_complete(self, name: str, rid: str) -> bool:
        return self.slots[name].tracker.is_complete(rid)

    def cmd_abort(self, name: str, rid: str) -> bool:
        """Abort a reservation; returns whether it is still held right after."""
        slot = self.slots[name]
        slot.tracker.abort(rid)
        slot.pump()
        return slot.tracker.holds(rid)

    def cmd_holds(self, name: str, rid: str) -> bool:
        return self.slots[name].tracker.holds(rid)

    def cmd_released(self, name: str) -> dict[str, tuple[float, str]]:
        return dict(self.slots[name].released)

    def cmd_drained_by_timeout(self, name: str) -> int:
        return self.slots[name].tracker.drained_by_timeout

    def cmd_hold(self, name: str, key: str, blocks: list[int], ttl_s: float) -> None:
        self.slots[name].leases.hold(key, blocks, ttl_s)

    def cmd_leases(self, name: str) -> dict[str, Any]:
        slot = self.slots[name]
        c = slot.leases.counters
        return {"held": len(slot.leases), "granted": c.granted, "confirmed": c.confirmed, "expired": c.expired,
                "expired_keys": [key for key, _ in slot.expired]}

    def cmd_pause(self, seconds: float) -> None:
        """Stop polling the transports for a while (a receiver that is slow to poll)."""
        self.paused_until = time.monotonic() + seconds

    def cmd_write(self, name: str, peer: str, src: list[int], dst: list[int], layers: list[int], notify: str,
                  timeout_s: float) -> str:
        handle = self.slots[name].transport.write(peer, src, dst, layers, notify, timeout_s)
        return handle.wait().name
