"""``tcp`` backend: the framed protocol (``wire``) over asyncio streams, for clusters with neither
RDMA nor NCCL.

The transport runs its own event loop on a daemon thread, so it can be used from synchronous code
(the model runner's layer hook) and from other event loops alike. Payloads go out straight from
tensor memory (a ``memoryview`` of the cache's bytes) and land in the destination blocks with one
copy. Connections are symmetric: either side can write, read or notify once connected.
Handshake: the connecting side sends HELLO (its compatibility key); the listener answers HELLO or
REFUSE naming both sides' values, and both refuse on mismatch.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from typing import Any

import numpy as np
import torch

from engine.kv_cache import PagedKVCache
from kv_transfer.base import CompatKey, IncompatiblePeer, KVTransferError, decode_metadata, encode_metadata
from kv_transfer.framed import FramedTransport
from kv_transfer.session import FrameStream, PeerSession, control
from kv_transfer.wire import HEADER, Header, Kind, ProtocolError

_STREAM_LIMIT = 4 << 20
_SLICE = 1 << 20  # payloads move in 1 MiB slices: asyncio's buffers stay small (no O(n^2) front-trimming)


class TcpTransport(FramedTransport):
    """KV transport over TCP. ``host``/``port``: where to listen (port 0: any free port)."""

    name = "tcp"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, connect_timeout_s: float = 10.0) -> None:
        super().__init__()
        self.host, self.port = host, port
        self.connect_timeout_s = connect_timeout_s
        self.peer_id = f"tcp:{uuid.uuid4().hex[:12]}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kv-tcp", daemon=True)
        self._thread.start()
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self._connections: set[_Connection] = set()
        self._closed = False

    # -- setup --------------------------------------------------------------------------------
    def register_cache(self, cache: PagedKVCache, compat: CompatKey) -> bytes:
        self._register(cache, compat)
        self._server = self._call(asyncio.start_server(self._accept, self.host, self.port, limit=_STREAM_LIMIT))
        self.port = self._server.sockets[0].getsockname()[1]
        return encode_metadata(self.name, compat, cache.spec.num_blocks, host=self.host, port=self.port,
                               peer_id=self.peer_id)

    def add_peer(self, metadata: bytes) -> str:
        cache = self._require_cache()
        meta = decode_metadata(metadata, self.name, self.compat)
        peer_id = str(meta.get("peer_id"))
        if peer_id in self._sessions and self._sessions[peer_id].closed_reason is None:
            return peer_id
        try:
            return self._call(self._connect(str(meta["host"]), int(meta["port"]), cache), self.connect_timeout_s)
        except (OSError, asyncio.TimeoutError) as e:
            raise KVTransferError(f"tcp: cannot connect to {meta.get('host')}:{meta.get('port')}: {e!r}") from None

    def _hello(self) -> bytes:
        assert self.compat is not None and self.cache is not None
        return json.dumps({"compat": self.compat.to_dict(), "num_blocks": self.cache.spec.num_blocks,
                           "peer_id": self.peer_id}).encode()

    async def _connect(self, host: str, port: int, cache: PagedKVCache) -> str:
        reader, writer = await asyncio.open_connection(host, port, limit=_STREAM_LIMIT)
        try:
            await _send(writer, control(Kind.HELLO, body=self._hello()))
            h, body = await _read_control(reader)
            if h.kind is Kind.REFUSE:
                raise IncompatiblePeer(body.decode(errors="replace"))
            peer = self._parse_hello(h, body)
        except BaseException:
            writer.close()
            raise
        self._start_connection(peer["peer_id"], peer["num_blocks"], reader, writer)
        return peer["peer_id"]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            h, body = await asyncio.wait_for(_read_control(reader), self.connect_timeout_s)
            peer = self._parse_hello(h, body)
        except IncompatiblePeer as e:
            await _send(writer, control(Kind.REFUSE, body=str(e).encode()))
            writer.close()
            return
        except (ProtocolError, OSError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            writer.close()
            return
        await _send(writer, control(Kind.HELLO, body=self._hello()))
        self._start_connection(peer["peer_id"], peer["num_blocks"], reader, writer)

    def _parse_hello(self, h: Header, body: bytes) -> dict[str, Any]:
        if h.kind is not Kind.HELLO:
            raise ProtocolError(f"expected HELLO, got {h.kind.name}")
        try:
            hello = json.loads(body.decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ProtocolError(f"bad HELLO: {e}") from None
        self.compat.check_matches(CompatKey.from_dict(hello.get("compat")))
        if type(hello.get("num_blocks")) is not int or not isinstance(hello.get("peer_id"), str):
            raise ProtocolError("HELLO lacks num_blocks / peer_id")
        return hello

    def _start_connection(self, peer_id: str, peer_num_blocks: int, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        writer.transport.set_write_buffer_limits(high=2 * _SLICE)
        session = self._new_session(peer_id, peer_num_blocks)
        conn = _Connection(session, reader, writer, self._spawn)
        self._connections.add(conn)
        conn.on_close = self._connections.discard
        session.send = lambda frames: self._loop.call_soon_threadsafe(self._spawn, conn.send_stream(frames))
        self._spawn(conn.read_loop())

    # -- loop plumbing --------------------------------------------------------------------------
    def _call(self, coro, timeout_s: float | None = None):
        if self._closed:
            raise KVTransferError("tcp: transport is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def _spawn(self, coro) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        if self._closed:
            return
        self._call(self._shutdown(), 5.0)
        self._closed = True
        self._disconnect_all("transport closed")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)

    def kill_connections(self) -> None:
        """Fault injection: drop every connection at once, mid-frame if need be (as if this process
        died); the transport stays usable and ``add_peer`` reconnects."""
        async def kill() -> None:
            for conn in list(self._connections):
                conn.writer.transport.abort()
        self._call(kill(), 5.0)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for session in list(self._sessions.values()):
            session.send(iter([control(Kind.BYE)]))
        await asyncio.sleep(0.01)
        for task in list(self._tasks):
            task.cancel()


class _Connection:
    """The I/O of one TCP connection: a reader task and serialized frame sending."""

    def __init__(self, session: PeerSession, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 spawn) -> None:
        self.session, self.reader, self.writer, self.spawn = session, reader, writer, spawn
        self.lock = asyncio.Lock()
        self.on_close = lambda conn: None

    async def send_stream(self, frames: FrameStream) -> None:
        try:
            for frame in frames:  # a write's generator checks for cancel between frames
                async with self.lock:
                    await _send(self.writer, frame)
        except (OSError, RuntimeError) as e:
            self._drop(f"send failed: {e!r}")

    async def read_loop(self) -> None:
        try:
            while True:
                h = Header.unpack(await self.reader.readexactly(HEADER.size))
                if h.kind is Kind.BYE:
                    self._drop("peer closed the connection")
                    return
                dest = self.session.on_header(h)
                if dest is not None:
                    out = dest.numpy()
                    try:
                        for off in range(0, h.body_len, _SLICE):
                            data = await self.reader.readexactly(min(_SLICE, h.body_len - off))
                            out[off:off + len(data)] = np.frombuffer(data, dtype=np.uint8)
                    finally:  # landed, or broken inside the body: either way no more of it comes
                        self.session.data_done()
                    continue
                body = await self.reader.readexactly(h.body_len) if h.body_len else b""
                for stream in self.session.on_frame(h, body):
                    self.spawn(self.send_stream(stream))
        except asyncio.CancelledError:
            self._drop("transport closed")
        except (asyncio.IncompleteReadError, OSError) as e:
            self._drop(f"connection lost: {e!r}")
        except ProtocolError as e:
            self._drop(f"protocol error: {e}")

    def _drop(self, reason: str) -> None:
        self.session.on_disconnect(reason)
        self.writer.close()
        self.on_close(self)


async def _send(writer: asyncio.StreamWriter, frame) -> None:
    header, payload = frame
    writer.write(header.pack())
    if isinstance(payload, torch.Tensor):
        view = memoryview(payload.numpy())  # straight from the cache's memory
        for off in range(0, len(view), _SLICE):
            writer.write(view[off:off + _SLICE])
            await writer.drain()
        return
    if payload:
        writer.write(payload)
    await writer.drain()


async def _read_control(reader: asyncio.StreamReader) -> tuple[Header, bytes]:
    h = Header.unpack(await reader.readexactly(HEADER.size))
    if h.kind is Kind.DATA:
        raise ProtocolError("DATA frame during handshake")
    return h, (await reader.readexactly(h.body_len) if h.body_len else b"")
