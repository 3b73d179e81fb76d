"""The state of one connection of the framed protocol (``wire``), without any I/O.

``tcp`` (asyncio streams) and ``torch`` (gloo/NCCL point-to-point) both drive a ``PeerSession``:
they read a header, ask ``on_header`` where a DATA body goes (a validated view of the local cache)
or read a bounded control body, hand the frame to ``on_frame`` and send whatever frames it returns.
Outgoing streams are generators of frames, so a cancel or timeout is noticed between descriptors.

Transfer-id spaces: ``handles`` are keyed by our ids (writes and reads we started), ``incoming``
and ``served`` by the peer's ids (writes into us, reads we serve).

The fence (``fence.WriteFence``, installed by the receiver's owner): each DATA frame of a write
lands only if the reservation its notify tag names is live and owns the frame's blocks; otherwise
its body is read into scratch memory and dropped, and the write's END is answered with a fenced
ACK (the sender's handle ends CANCELLED). The I/O layer calls ``data_done`` once a DATA body is in
(or the connection broke inside it), so the fence knows when no admitted frame is still landing.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Union

import torch

from kv_transfer.base import ABORTED_PREFIX, TransferHandle, TransferState
from kv_transfer.plan import Desc, region
from kv_transfer.fence import WriteFence
from kv_transfer.landing import tag_key
from kv_transfer.wire import (DESC, FLAG_FENCED, FLAG_READ, FLAG_STOP, Header, Kind, ProtocolError, pack_descs,
                              unpack_descs)

Payload = Union[bytes, torch.Tensor, None]
Frame = tuple[Header, Payload]
FrameStream = Iterable[Frame]


def control(kind: Kind, tid: int = 0, body: bytes = b"", flags: int = 0, count: int = 0) -> Frame:
    return Header(kind, tid=tid, count=count, body_len=len(body), flags=flags), (body or None)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (any dtype): what goes on the wire."""
    return t.view(torch.uint8).reshape(-1)


class NotificationQueue:
    """Thread-safe FIFO of notification strings."""

    def __init__(self) -> None:
        self._q: collections.deque[str] = collections.deque()

    def put(self, message: str) -> None:
        self._q.append(message)

    def drain(self) -> list[str]:
        out = []
        while self._q:
            out.append(self._q.popleft())
        return out


class SessionHandle(TransferHandle):
    """A transfer over a framed connection; completes on the peer's ACK (or ABORT of a read)."""

    def __init__(self, session: "PeerSession", notify: str, timeout_s: float, nbytes: int, is_read: bool) -> None:
        super().__init__(session.peer_id, notify, timeout_s, nbytes)
        self.session = session
        self.is_read = is_read

    def _request_cancel(self) -> None:
        if self.is_read:  # the source must stop; a write's own frame generator notices the flag
            self.session.send(iter([control(Kind.ABORT, self.transfer_id, flags=FLAG_READ | FLAG_STOP)]))

    def _on_timeout(self) -> bool:
        """FAILED at once: bytes of it still buffered in the connection may land later, but only
        through the receiver's fence, which drops them once the reservation is closed."""
        self.cancel_requested = True
        self._request_cancel()
        return True


@dataclass
class _Served:
    notify: str
    cancelled: bool = False


class PeerSession:
    """Protocol state for one peer. ``send`` is installed by the I/O layer (thread-safe enqueue)."""

    def __init__(self, peer_id: str, data: torch.Tensor, block_bytes: int, peer_num_blocks: int,
                 notifications: NotificationQueue) -> None:
        self.peer_id = peer_id
        self.data = data
        self.block_bytes = block_bytes
        self.num_layers, _, self.num_blocks = data.shape[:3]
        self.peer_num_blocks = peer_num_blocks
        self.notifications = notifications
        self.handles: dict[int, SessionHandle] = {}
        self.incoming: dict[tuple[int, int], str] = {}
        self.served: dict[int, _Served] = {}
        self.closed_reason: str | None = None
        self.send: Callable[[FrameStream], None] = lambda frames: None
        self.fence: Callable[[], WriteFence | None] = lambda: None  # installed by the transport
        self.fenced: set[int] = set()        # peer's write ids whose frames were discarded
        self._admitted: str | None = None    # key of the DATA frame being copied in, if admitted
        self._lock = threading.Lock()

    # -- starting transfers ------------------------------------------------------------------
    def start_write(self, descs: list[Desc], notify: str, timeout_s: float) -> SessionHandle:
        handle = self._new_handle(descs, notify, timeout_s, is_read=False)
        if not handle.state.is_final:
            self.send(self._stream(handle.transfer_id, descs, notify.encode(), 0, lambda: _stopped(handle)))
        return handle

    def start_read(self, descs: list[Desc], notify: str, timeout_s: float) -> SessionHandle:
        handle = self._new_handle(descs, notify, timeout_s, is_read=True)
        if not handle.state.is_final:
            body = pack_descs(descs) + notify.encode()
            self.send(iter([control(Kind.READ, handle.transfer_id, body, count=len(descs))]))
        return handle

    def _new_handle(self, descs: list[Desc], notify: str, timeout_s: float, is_read: bool) -> SessionHandle:
        handle = SessionHandle(self, notify, timeout_s, sum(d.count for d in descs) * self.block_bytes, is_read)
        with self._lock:
            if self.closed_reason is not None:
                handle._finish(TransferState.FAILED, f"peer {self.peer_id} disconnected: {self.closed_reason}")
            else:
                self.handles[handle.transfer_id] = handle
        return handle

    def _stream(self, tid: int, descs: list[Desc], notify: bytes, flags: int,
                stopped: Callable[[], bool]) -> Iterator[Frame]:
        """BEGIN, one DATA per descriptor (source blocks ``d.src``, landing at ``d.dst``), END;
        ABORT instead of the rest as soon as ``stopped()``."""
        yield control(Kind.BEGIN, tid, notify, flags)
        for d in descs:
            if stopped():
                yield control(Kind.ABORT, tid, flags=flags)
                return
            payload = as_bytes(region(self.data, d.layer, d.kv, d.src, d.count))
            yield Header(Kind.DATA, tid, d.layer, d.kv, d.dst, d.count, payload.numel(), flags), payload
        yield control(Kind.END, tid, flags=flags)

    def send_notification(self, message: str) -> None:
        self.send(iter([control(Kind.NOTIFY, body=message.encode())]))

    # -- receiving ---------------------------------------------------------------------------
    def on_header(self, h: Header) -> torch.Tensor | None:
        """For DATA: the flat uint8 view of the local blocks the body must be read into (validated).
        Otherwise None: read the (bounded) body as bytes and call ``on_frame``."""
        if h.kind is not Kind.DATA:
            return None
        if (h.tid, h.flags & FLAG_READ) not in self.incoming:
            raise ProtocolError(f"DATA for unknown transfer {h.tid}")
        if not (0 <= h.layer < self.num_layers and h.kv in (0, 1) and h.count > 0
                and 0 <= h.start and h.start + h.count <= self.num_blocks):
            raise ProtocolError(f"DATA out of range: layer {h.layer} kv {h.kv} blocks {h.start}+{h.count}")
        if h.body_len != h.count * self.block_bytes:
            raise ProtocolError(f"DATA body {h.body_len} bytes != {h.count} blocks x {self.block_bytes}")
        fence = self.fence()
        if fence is not None and not h.flags & FLAG_READ:
            key = tag_key(self.incoming[(h.tid, 0)])
            if h.tid in self.fenced or not fence.begin(key, h.start, h.count):
                self.fenced.add(h.tid)  # the rest of this write is dropped too
                return torch.empty(h.body_len, dtype=torch.uint8)  # scratch: read and dropped
            self._admitted = key
        return as_bytes(region(self.data, h.layer, h.kv, h.start, h.count))

    def data_done(self) -> None:
        """The body of the last DATA frame is in (or the connection broke inside it)."""
        key, self._admitted = self._admitted, None
        fence = self.fence()
        if key is not None and fence is not None:
            fence.end(key)

    def on_frame(self, h: Header, body: bytes) -> list[FrameStream]:
        """Apply a non-DATA frame (or a DATA frame whose body has landed); return frames to send."""
        handler = _HANDLERS.get(h.kind)
        if handler is None:
            raise ProtocolError(f"unexpected {h.kind.name} frame")
        return handler(self, h, body) or []

    def _on_begin(self, h: Header, body: bytes) -> None:
        read = h.flags & FLAG_READ
        if read and h.tid not in self.handles:
            raise ProtocolError(f"read response for unknown transfer {h.tid}")
        self.incoming[(h.tid, read)] = body.decode(errors="replace")

    def _on_end(self, h: Header, body: bytes) -> list[FrameStream]:
        read = h.flags & FLAG_READ
        notify = self.incoming.pop((h.tid, read), None)
        if notify is None:
            raise ProtocolError(f"END for unknown transfer {h.tid}")
        if read:
            self._finish(h.tid, TransferState.DONE)
        elif h.tid in self.fenced or (self.fence() is not None and not self.fence().is_live(tag_key(notify) or "")):
            self.fenced.discard(h.tid)  # discarded (or nothing at all landed for a dead reservation)
            return [iter([control(Kind.ACK, h.tid, flags=FLAG_FENCED, count=TransferState.CANCELLED)])]
        elif notify:
            self.notifications.put(notify)
        return [iter([control(Kind.ACK, h.tid, flags=read, count=TransferState.DONE)])]

    def _on_abort(self, h: Header, body: bytes) -> list[FrameStream]:
        if h.flags & FLAG_STOP:  # the requester asks us to stop serving its read
            if h.tid in self.served:
                self.served[h.tid].cancelled = True
            return []
        read = h.flags & FLAG_READ
        notify = self.incoming.pop((h.tid, read), None)
        if read:
            self._finish(h.tid, TransferState.CANCELLED)
            return []
        self.fenced.discard(h.tid)
        if notify:
            self.notifications.put(ABORTED_PREFIX + notify)
        return [iter([control(Kind.ACK, h.tid, count=TransferState.CANCELLED)])]

    def _on_ack(self, h: Header, body: bytes) -> None:
        if h.flags & FLAG_READ:
            served = self.served.pop(h.tid, None)
            if served is not None and served.notify and h.count == TransferState.DONE:
                self.notifications.put(served.notify)
            return
        state = TransferState.CANCELLED if h.count == TransferState.CANCELLED else TransferState.DONE
        fenced = state is TransferState.CANCELLED and h.flags & FLAG_FENCED
        self._finish(h.tid, state, "fenced by the receiver: the reservation is no longer live" if fenced else None)

    def _on_read(self, h: Header, body: bytes) -> list[FrameStream]:
        descs = unpack_descs(body, h.count)
        for d in descs:  # d.src is ours (the source), d.dst the requester's
            if not (0 <= d.layer < self.num_layers and d.kv in (0, 1) and d.count > 0 and d.src >= 0
                    and d.src + d.count <= self.num_blocks and d.dst >= 0 and d.dst + d.count <= self.peer_num_blocks):
                raise ProtocolError(f"READ descriptor out of range: {d}")
        served = self.served[h.tid] = _Served(body[len(descs) * DESC.size:].decode(errors="replace"))
        return [self._stream(h.tid, descs, b"", FLAG_READ, lambda: served.cancelled)]

    def _on_notify(self, h: Header, body: bytes) -> None:
        self.notifications.put(body.decode(errors="replace"))

    def _finish(self, tid: int, state: TransferState, error: str | None = None) -> None:
        handle = self.handles.pop(tid, None)
        if handle is not None:
            handle._finish(state, error)

    def on_disconnect(self, reason: str) -> None:
        """The connection is gone: nothing more can land in either direction."""
        with self._lock:
            if self.closed_reason is not None:
                return
            self.closed_reason = reason
            handles, self.handles = self.handles, {}
            incoming, self.incoming = self.incoming, {}
            self.served.clear()
        for handle in handles.values():
            handle._finish(TransferState.FAILED, f"peer {self.peer_id} disconnected: {reason}")
        for (_, read), notify in incoming.items():
            if not read and notify:
                self.notifications.put(ABORTED_PREFIX + notify)


def _stopped(handle: TransferHandle) -> bool:
    return handle.cancel_requested or handle.state.is_final


_HANDLERS: dict[Kind, Callable[[PeerSession, Header, bytes], list[FrameStream] | None]] = {
    Kind.BEGIN: PeerSession._on_begin,
    Kind.END: PeerSession._on_end,
    Kind.ABORT: PeerSession._on_abort,
    Kind.ACK: PeerSession._on_ack,
    Kind.READ: PeerSession._on_read,
    Kind.NOTIFY: PeerSession._on_notify,
}
