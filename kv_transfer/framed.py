"""What the framed-protocol backends (``tcp``, ``torch``) share: validation, planning, sessions.

Subclasses own the I/O: they connect peers, create a ``PeerSession`` per connection with
``_new_session`` and install its ``send``.
"""

from __future__ import annotations

import threading
from typing import Sequence

from engine.kv_cache import PagedKVCache
from kv_transfer.base import (CompatKey, KVTransport, TransferHandle, UnknownPeer, check_cache, expired,
                              expired_handle)
from kv_transfer.fence import WriteFence
from kv_transfer.plan import check_blocks, check_layers, coalesce, plan
from kv_transfer.session import NotificationQueue, PeerSession


class FramedTransport(KVTransport):
    def __init__(self) -> None:
        self.cache: PagedKVCache | None = None
        self.compat: CompatKey | None = None
        self._sessions: dict[str, PeerSession] = {}
        self._sessions_lock = threading.Lock()
        self._notifications = NotificationQueue()
        self.fence: WriteFence | None = None

    fences_writes = True  # the receiver sees every DATA frame and drops those the fence refuses

    def set_fence(self, fence: WriteFence | None) -> None:
        """Check every incoming write against ``fence`` (None: accept every in-range write)."""
        self.fence = fence

    def _register(self, cache: PagedKVCache, compat: CompatKey) -> None:
        if self.cache is not None:
            raise RuntimeError(f"{self.name}: a cache is already registered")
        check_cache(cache, compat)
        self.cache, self.compat = cache, compat

    def _require_cache(self) -> PagedKVCache:
        if self.cache is None:
            raise RuntimeError(f"{self.name}: register_cache() first")
        return self.cache

    def _new_session(self, peer_id: str, peer_num_blocks: int) -> PeerSession:
        cache = self._require_cache()
        session = PeerSession(peer_id, cache.data, cache.spec.block_bytes, peer_num_blocks, self._notifications)
        session.fence = lambda: self.fence
        with self._sessions_lock:
            old = self._sessions.get(peer_id)
            self._sessions[peer_id] = session
        if old is not None:
            old.on_disconnect("replaced by a new connection")
        return session

    def _session(self, peer: str) -> PeerSession:
        session = self._sessions.get(peer)
        if session is None:
            raise UnknownPeer(f"{self.name}: unknown peer {peer!r}; call add_peer(metadata) first")
        return session

    def write(self, peer: str, src_blocks: Sequence[int], dst_blocks: Sequence[int], layers: Sequence[int],
              notify: str, timeout_s: float, not_after_unix: float | None = None) -> TransferHandle:
        cache, session = self._require_cache(), self._session(peer)
        if expired(not_after_unix):
            return expired_handle(peer, notify, timeout_s)
        src_blocks, dst_blocks = check_blocks(src_blocks, dst_blocks, cache.spec.num_blocks,
                                              session.peer_num_blocks)
        descs = plan(check_layers(layers, cache.spec.num_layers), coalesce(src_blocks, dst_blocks))
        return session.start_write(descs, notify, timeout_s)

    def read(self, peer: str, remote_blocks: Sequence[int], local_blocks: Sequence[int], layers: Sequence[int],
             timeout_s: float, notify: str = "") -> TransferHandle:
        cache, session = self._require_cache(), self._session(peer)
        remote_blocks, local_blocks = check_blocks(remote_blocks, local_blocks, session.peer_num_blocks,
                                                   cache.spec.num_blocks)
        descs = plan(check_layers(layers, cache.spec.num_layers), coalesce(remote_blocks, local_blocks))
        return session.start_read(descs, notify, timeout_s)

    def poll_notifications(self) -> list[str]:
        return self._notifications.drain()

    def send_notification(self, peer: str, message: str) -> None:
        self._session(peer).send_notification(message)

    def _disconnect_all(self, reason: str) -> None:
        with self._sessions_lock:
            sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            session.on_disconnect(reason)
