"""``torch`` backend: torch.distributed point-to-point, one process group per pair of peers.

Each transport that registers a cache hosts a ``TCPStore`` (its rendezvous, advertised in the
metadata). ``add_peer`` joins the peer's store: it appends a join request with its compatibility
key; the peer's acceptor thread checks it (fail closed: a refusal names both sides' values) and both
sides then build a two-rank process group under a key unique to the pair — gloo on CPU (what the
tests use), NCCL for CUDA caches. The framed protocol of ``wire`` runs on top: each frame is a
36-byte header tensor then, for DATA, the cache blocks themselves (sent from and received into
views of the caches, no staging copy). One sender thread and one receiver thread per pair; the
receiver notices a dead peer when gloo reports the connection closed.

Fault injection (``kill_connections``, kv_transfer/faults.py): gloo has no call that drops a
group's connections (its ``abort`` and ``shutdown`` leave the sockets open), so each pair notes
the sockets its group opened (by inode, from /proc/self/fd) and a kill shuts them down mid-frame:
both sides' gloo then fails its pending operations with "Connection closed by peer", exactly as
when the peer process dies, and ``add_peer`` joins a new group.
"""

from __future__ import annotations

import datetime
import json
import os
import queue
import socket
import threading
import uuid

import torch
import torch.distributed as dist

from engine.kv_cache import PagedKVCache
from kv_transfer.base import CompatKey, IncompatiblePeer, KVTransferError, decode_metadata, encode_metadata
from kv_transfer.framed import FramedTransport
from kv_transfer.session import FrameStream, PeerSession, control
from kv_transfer.wire import HEADER, Header, Kind, ProtocolError

_IDLE = datetime.timedelta(days=7)  # a receiver waits for the next frame indefinitely
_ACCEPT_POLL_S = 0.005


class TorchDistTransport(FramedTransport):
    """KV transport over torch.distributed. ``host``/``port``: where this side's rendezvous store listens."""

    name = "torch"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, connect_timeout_s: float = 30.0) -> None:
        super().__init__()
        self.host, self.port = host, port
        self.connect_timeout = datetime.timedelta(seconds=connect_timeout_s)
        self.peer_id = f"torch:{uuid.uuid4().hex[:12]}"
        self._store: dist.TCPStore | None = None
        self._acceptor: threading.Thread | None = None
        self._pairs: list[_Pair] = []
        self._closed = threading.Event()

    def register_cache(self, cache: PagedKVCache, compat: CompatKey) -> bytes:
        self._register(cache, compat)
        self._store = dist.TCPStore(self.host, self.port, None, True, self.connect_timeout, wait_for_workers=False)
        self.port = self._store.port
        self._acceptor = threading.Thread(target=self._accept_loop, name="kv-torch-accept", daemon=True)
        self._acceptor.start()
        return encode_metadata(self.name, compat, cache.spec.num_blocks, host=self.host, port=self.port,
                               peer_id=self.peer_id)

    def _join_request(self) -> bytes:
        return json.dumps({"compat": self.compat.to_dict(), "num_blocks": self.cache.spec.num_blocks,
                           "peer_id": self.peer_id}).encode()

    def add_peer(self, metadata: bytes) -> str:
        self._require_cache()
        meta = decode_metadata(metadata, self.name, self.compat)
        peer_id = str(meta.get("peer_id"))
        if peer_id in self._sessions and self._sessions[peer_id].closed_reason is None:
            return peer_id
        try:
            store = dist.TCPStore(str(meta["host"]), int(meta["port"]), None, False, self.connect_timeout)
            index = store.add("join/count", 1) - 1
            store.set(f"join/{index}", self._join_request())
            reply = store.get(f"join/{index}/reply").decode()
        except (RuntimeError, OSError) as e:
            raise KVTransferError(f"torch: cannot reach the rendezvous of {peer_id}: {e}") from None
        if reply != "ok":
            raise IncompatiblePeer(reply)
        self._start_pair(store, index, rank=0, peer_id=peer_id, peer_num_blocks=meta["num_blocks"])
        return peer_id

    def _accept_loop(self) -> None:
        index = 0
        while not self._closed.wait(_ACCEPT_POLL_S):
            while self._store.check([f"join/{index}"]):
                self._accept(index)
                index += 1

    def _accept(self, index: int) -> None:
        try:
            request = json.loads(self._store.get(f"join/{index}").decode())
            self.compat.check_matches(CompatKey.from_dict(request.get("compat")))
            peer_id, peer_num_blocks = str(request["peer_id"]), int(request["num_blocks"])
        except (IncompatiblePeer, KeyError, TypeError, ValueError) as e:
            reason = str(e) if isinstance(e, IncompatiblePeer) else f"bad join request: {e!r}"
            self._store.set(f"join/{index}/reply", reason)
            return
        self._store.set(f"join/{index}/reply", "ok")
        self._start_pair(self._store, index, rank=1, peer_id=peer_id, peer_num_blocks=peer_num_blocks)

    def _start_pair(self, store: dist.Store, index: int, rank: int, peer_id: str, peer_num_blocks: int) -> None:
        before = _socket_inodes()
        pg = _make_group(dist.PrefixStore(f"pair/{index}", store), rank, self.cache.data.device)
        session = self._new_session(peer_id, peer_num_blocks)
        pair = _Pair(pg, 1 - rank, session)
        pair.sockets = _socket_inodes() - before  # the group's connections (for kill_connections)
        session.send = pair.outbox.put
        self._pairs.append(pair)
        pair.start()

    def kill_connections(self) -> None:
        """Fault injection: shut down every pair's gloo sockets at once, mid-frame if need be (as
        if this process died); the transport stays usable and ``add_peer`` joins a new group. CPU
        (gloo) pairs only: an NCCL pair is left alone."""
        for pair in self._pairs:
            pair.kill()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._store is not None:
            self._acceptor.join(2.0)
        for pair in self._pairs:
            pair.close()
        self._disconnect_all("transport closed")


def _socket_inodes() -> set[str]:
    """The socket inodes this process has open (Linux /proc; empty elsewhere)."""
    out = set()
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:"):
            out.add(link)
    return out


def _make_group(store: dist.Store, rank: int, device: torch.device) -> dist.ProcessGroup:
    """A two-rank group: NCCL for CUDA caches, gloo (over loopback here) otherwise."""
    if device.type == "cuda":
        return dist.ProcessGroupNCCL(store, rank, 2)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = _IDLE
    return dist.ProcessGroupGloo(store, rank, 2, opts)


class _Pair:
    """The I/O of one process group: a sender thread draining ``outbox``, a receiver thread."""

    def __init__(self, pg: dist.ProcessGroup, peer_rank: int, session: PeerSession) -> None:
        self.pg, self.peer, self.session = pg, peer_rank, session
        self.outbox: queue.Queue[FrameStream | None] = queue.Queue()
        self._header = torch.empty(HEADER.size, dtype=torch.uint8)
        self._bye_sent = False
        self.sockets: set[str] = set()  # inodes of the sockets its group opened
        self._threads = [threading.Thread(target=self._send_loop, name="kv-torch-send", daemon=True),
                         threading.Thread(target=self._recv_loop, name="kv-torch-recv", daemon=True)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _say_bye(self) -> None:
        if not self._bye_sent:
            self._bye_sent = True
            self.outbox.put(iter([control(Kind.BYE)]))
        self.outbox.put(None)

    def close(self, timeout_s: float = 2.0) -> None:
        """Orderly close: BYE both ways, so neither side is left blocked in a receive at exit."""
        if self.session.closed_reason is None:
            self._say_bye()
        for t in self._threads:
            t.join(timeout_s)

    def kill(self) -> None:
        """Shut down the group's connected sockets (kill_connections); the threads then fail out."""
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}") not in self.sockets:
                    continue
                s = socket.socket(fileno=os.dup(int(fd)))
            except OSError:
                continue
            try:
                s.getpeername()  # connected: a listening socket is left alone (gloo's loop must not fail)
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            finally:
                s.close()  # the duplicate only
        self.outbox.put(None)  # the sender thread, if idle, ends too

    def _send_loop(self) -> None:
        while (frames := self.outbox.get()) is not None:
            try:
                for header, payload in frames:
                    self._send(torch.frombuffer(bytearray(header.pack()), dtype=torch.uint8))
                    if isinstance(payload, torch.Tensor):
                        self._send(payload)
                    elif payload:
                        self._send(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            except RuntimeError as e:
                self.session.on_disconnect(f"send failed: {e}")
                return

    def _send(self, t: torch.Tensor) -> None:
        self.pg.send([t], self.peer, 0).wait()

    def _recv(self, t: torch.Tensor) -> None:
        self.pg.recv([t], self.peer, 0).wait()

    def _recv_loop(self) -> None:
        try:
            while True:
                self._recv(self._header)
                h = Header.unpack(self._header.numpy().tobytes())
                if h.kind is Kind.BYE:
                    self.session.on_disconnect("peer closed the connection")
                    self._say_bye()
                    return
                dest = self.session.on_header(h)
                if dest is not None:
                    try:
                        self._recv(dest)  # straight into the destination blocks (or scratch, if fenced)
                    finally:
                        self.session.data_done()
                    continue
                body = torch.empty(h.body_len, dtype=torch.uint8)
                if h.body_len:
                    self._recv(body)
                for stream in self.session.on_frame(h, body.numpy().tobytes()):
                    self.outbox.put(stream)
        except RuntimeError as e:  # gloo: "Connection closed by peer"
            self.session.on_disconnect(f"connection lost: {e}")
        except ProtocolError as e:
            self.session.on_disconnect(f"protocol error: {e}")
