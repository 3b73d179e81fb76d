"""``local`` backend: a copy between two caches of one process (aggregated mode, unit tests).

Peers find each other through a process-wide registry keyed by the id in the metadata; a write is
a synchronous ``copy_`` per coalesced descriptor, so its handle is DONE when ``write`` returns.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Sequence

from engine.kv_cache import PagedKVCache
from kv_transfer.base import (CompatKey, KVTransport, TransferHandle, TransferState, UnknownPeer, check_cache,
                              decode_metadata, encode_metadata, expired, expired_handle)
from kv_transfer.landing import tag_key
from kv_transfer.plan import Desc, check_blocks, check_layers, coalesce, plan, region
from kv_transfer.session import NotificationQueue

_registry: "weakref.WeakValueDictionary[str, LocalTransport]" = weakref.WeakValueDictionary()
_ids = itertools.count(1)
_lock = threading.Lock()


class LocalTransport(KVTransport):
    name = "local"
    fences_writes = True

    def __init__(self) -> None:
        self.local_id = f"local:{next(_ids)}"
        self.cache: PagedKVCache | None = None
        self.compat: CompatKey | None = None
        self._notifications = NotificationQueue()
        self._peers: set[str] = set()
        self.fence = None

    def register_cache(self, cache: PagedKVCache, compat: CompatKey) -> bytes:
        check_cache(cache, compat)
        self.cache, self.compat = cache, compat
        with _lock:
            _registry[self.local_id] = self
        return encode_metadata(self.name, compat, cache.spec.num_blocks, local_id=self.local_id)

    def add_peer(self, metadata: bytes) -> str:
        if self.cache is None:
            raise RuntimeError("local: register_cache() first")
        peer_id = str(decode_metadata(metadata, self.name, self.compat).get("local_id"))
        if _registry.get(peer_id) is None:
            raise UnknownPeer(f"local: no transport {peer_id!r} in this process")
        self._peers.add(peer_id)
        return peer_id

    def _peer(self, peer: str) -> "LocalTransport":
        other = _registry.get(peer) if peer in self._peers else None
        if other is None:
            raise UnknownPeer(f"local: unknown peer {peer!r}")
        return other

    def write(self, peer: str, src_blocks: Sequence[int], dst_blocks: Sequence[int], layers: Sequence[int],
              notify: str, timeout_s: float, not_after_unix: float | None = None) -> TransferHandle:
        other = self._peer(peer)
        if expired(not_after_unix):
            return expired_handle(peer, notify, timeout_s)
        if other.fence is not None:  # the receiver's fence, checked as its frames would be
            key = tag_key(notify)
            admitted = [b for b in dst_blocks if other.fence.begin(key, int(b), 1)]
            try:
                if len(admitted) < len(dst_blocks):
                    handle = TransferHandle(peer, notify, timeout_s, 0)
                    handle._finish(TransferState.CANCELLED, "fenced by the receiver: the reservation is no longer live")
                    return handle
                return self._move(other, self.cache, other.cache, src_blocks, dst_blocks, layers, peer, notify,
                                  timeout_s)
            finally:
                for _ in admitted:
                    other.fence.end(key)
        return self._move(other, self.cache, other.cache, src_blocks, dst_blocks, layers, peer, notify, timeout_s)

    def read(self, peer: str, remote_blocks: Sequence[int], local_blocks: Sequence[int], layers: Sequence[int],
             timeout_s: float, notify: str = "") -> TransferHandle:
        other = self._peer(peer)
        return self._move(other, other.cache, self.cache, remote_blocks, local_blocks, layers, peer, notify,
                          timeout_s)

    def _move(self, other: "LocalTransport", src: PagedKVCache, dst: PagedKVCache, src_blocks: Sequence[int],
              dst_blocks: Sequence[int], layers: Sequence[int], peer: str, notify: str,
              timeout_s: float) -> TransferHandle:
        """Copy src's blocks into dst's (either direction) and notify the peer: write and read alike."""
        src_blocks, dst_blocks = check_blocks(src_blocks, dst_blocks, src.spec.num_blocks, dst.spec.num_blocks)
        descs = plan(check_layers(layers, self.cache.spec.num_layers), coalesce(src_blocks, dst_blocks))
        handle = self._copy(descs, src, dst, peer, notify, timeout_s)
        if notify:
            other._notifications.put(notify)
        return handle

    @staticmethod
    def _copy(descs: list[Desc], src: PagedKVCache, dst: PagedKVCache, peer: str, notify: str,
              timeout_s: float) -> TransferHandle:
        for d in descs:
            region(dst.data, d.layer, d.kv, d.dst, d.count).copy_(region(src.data, d.layer, d.kv, d.src, d.count))
        handle = TransferHandle(peer, notify, timeout_s, sum(d.count for d in descs) * src.spec.block_bytes)
        handle._finish(TransferState.DONE)
        return handle

    def poll_notifications(self) -> list[str]:
        return self._notifications.drain()

    def send_notification(self, peer: str, message: str) -> None:
        self._peer(peer)._notifications.put(message)

    def close(self) -> None:
        with _lock:
            _registry.pop(self.local_id, None)
        self._peers.clear()
