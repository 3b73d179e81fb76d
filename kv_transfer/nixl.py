"""``nixl`` backend: NVIDIA NIXL with its UCX backend (RDMA, NVLink, shared memory or TCP, whichever
UCX finds). DRAM caches on CPU machines, VRAM on GPUs.

The whole cache tensor is registered once; a write or read is one NIXL transfer request whose
descriptors are the coalesced block runs (``plan``), addressed from the peer's registered base
address in its metadata. Completion is the initiator's ``check_xfer_state``; the peer learns of a
landed write from the notification NIXL delivers after the data.

Machine notes (``../shared/MACHINE-NOTES.md``): the agent runs without its progress thread (on 2
cores it cost 4-5x bandwidth), so whoever waits must poll: handles progress in ``poll``, receivers
must call ``poll_notifications`` about every millisecond. On the sending side the transport runs
its own small progress thread that polls pending handles every ``progress_interval_s`` and sleeps
on an event when nothing is pending (NIXL's thread spins even when idle), so a layer streamed from
the model runner's hook moves while the next layers compute. UCX stays on loopback
(``UCX_NET_DEVICES=lo`` unless set) and the UCX backend is created with
``ucx_error_handling_mode=none``; a dead peer therefore surfaces as a transfer timeout.
The agent is not thread-safe in this mode: every call goes through one lock.

Fault injection (``kill_connections``, kv_transfer/faults.py): as if this side's process died
mid-transfer — every write not yet posted fails (nothing of it ever lands, no notification), writes
already posted run to their end in UCX as a dead process's posted writes may, and every peer is
forgotten, so further writes to it fail (UnknownPeer) until ``add_peer`` again; UCX's endpoints
are kept (tearing one down under an active request is not safe), so the next ``add_peer`` only
restores the peer's entry.
"""

from __future__ import annotations

import base64
import collections
import os
import socket
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from engine.kv_cache import PagedKVCache
from kv_transfer.base import (ABORTED_PREFIX, CompatKey, IncompatiblePeer, KVTransport,
                              TransferHandle, TransferState, TransportUnavailable, UnknownPeer, check_cache,
                              decode_metadata, encode_metadata, expired, expired_handle)
from kv_transfer.plan import check_blocks, check_layers, coalesce_arrays


def _import_nixl():
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as e:
        raise TransportUnavailable(f"kv transport 'nixl' needs the nixl package (pip install nixl): {e}") from None
    return nixl_agent, nixl_agent_config


class NixlTransport(KVTransport):
    """KV transport over a NIXL agent. ``ucx_devices``: UCX devices to use ("" = UCX_NET_DEVICES)."""

    name = "nixl"

    def __init__(self, agent_name: str | None = None, ucx_devices: str = "",
                 progress_interval_s: float = 0.0005) -> None:
        nixl_agent, nixl_agent_config = _import_nixl()
        self.agent_name = agent_name or f"pdserve-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[])
        self._lock = threading.RLock()
        try:
            self.agent = nixl_agent(self.agent_name, config)
            params = {"ucx_error_handling_mode": "none", "num_workers": "1"}
            if ucx_devices:
                params["ucx_devices"] = ucx_devices
            self.agent.create_backend("UCX", params)
        except Exception as e:  # the bindings raise plain exceptions (nixlBackendError, RuntimeError)
            raise TransportUnavailable(f"kv transport 'nixl': cannot create a UCX agent: {e}") from None
        self.cache: PagedKVCache | None = None
        self.compat: CompatKey | None = None
        self._reg = None
        self._peers: dict[str, dict[str, Any]] = {}
        self._loaded: set[str] = set()  # remote agents whose metadata NIXL holds (kill_connections keeps them)
        self._handles: set[NixlHandle] = set()  # not final yet
        self._submitted: collections.deque[NixlHandle] = collections.deque()  # not posted yet
        self._layouts: dict[tuple, _Layout] = {}
        self._closed = False
        self.progress_interval_s = progress_interval_s
        self._wake = threading.Event()
        self._idle = True
        self._progress_thread: threading.Thread | None = None

    def _enqueue(self, handle: "NixlHandle") -> None:
        """Hand a transfer to the progress thread, which posts it and polls it until final. Takes no
        lock (deque and set updates are atomic): the caller never waits behind a post in progress."""
        self._handles.add(handle)
        self._submitted.append(handle)
        if self._progress_thread is None:
            self._progress_thread = threading.Thread(target=self._progress_loop, name="kv-nixl-progress", daemon=True)
            self._progress_thread.start()
        if self._idle:  # a busy thread picks it up within progress_interval_s; waking costs ~0.1 ms here
            self._wake.set()

    def _progress_loop(self) -> None:
        while not self._closed:
            self._wake.clear()
            while True:
                with self._lock:
                    if not self._submitted:
                        break
                    self._submitted.popleft()._post()
            if not self._handles:
                self._idle = True
                if not self._handles:  # re-check: _enqueue reads _idle after adding its handle
                    self._wake.wait(0.1)
                self._idle = False
                continue
            for handle in list(self._handles):
                handle.poll()
            self._wake.wait(self.progress_interval_s)

    def register_cache(self, cache: PagedKVCache, compat: CompatKey) -> bytes:
        if self.cache is not None:
            raise RuntimeError("nixl: a cache is already registered")
        check_cache(cache, compat)
        with self._lock:
            self._reg = self.agent.register_memory(cache.data)
            agent_md = self.agent.get_agent_metadata()
        self.cache, self.compat = cache, compat
        return encode_metadata(self.name, compat, cache.spec.num_blocks, agent=self.agent_name,
                               agent_md=base64.b64encode(agent_md).decode(), base=cache.data.data_ptr(),
                               device_id=max(cache.data.get_device(), 0))

    def add_peer(self, metadata: bytes) -> str:
        if self.cache is None:
            raise RuntimeError("nixl: register_cache() first")
        meta = decode_metadata(metadata, self.name, self.compat)
        try:
            agent_md = base64.b64decode(meta["agent_md"], validate=True)
            base, device_id, name = int(meta["base"]), int(meta["device_id"]), str(meta["agent"])
        except (KeyError, TypeError, ValueError) as e:
            raise IncompatiblePeer(f"nixl: peer metadata is malformed: {e!r}") from None
        if name in self._peers:
            return name
        if name not in self._loaded:
            with self._lock:
                loaded = self.agent.add_remote_agent(agent_md)
            if isinstance(loaded, bytes):
                loaded = loaded.decode()
            if loaded != name:
                raise IncompatiblePeer(f"nixl: peer metadata names agent {name!r} but carries {loaded!r}")
            self._loaded.add(name)
        self._peers[name] = {"base": base, "device_id": device_id, "num_blocks": meta["num_blocks"]}
        return name

    def kill_connections(self) -> None:
        """Fault injection (see the module docstring): unposted writes fail, peers are forgotten."""
        with self._lock:
            self._peers.clear()
            while self._submitted:
                handle = self._submitted.popleft()
                if not handle.state.is_final:
                    handle._settle_final(TransferState.FAILED, "nixl: connection to the peer killed (fault injection)")

    def _peer(self, peer: str) -> dict[str, Any]:
        if peer not in self._peers:
            raise UnknownPeer(f"nixl: unknown peer {peer!r}; call add_peer(metadata) first")
        return self._peers[peer]

    def write(self, peer: str, src_blocks: Sequence[int], dst_blocks: Sequence[int], layers: Sequence[int],
              notify: str, timeout_s: float, not_after_unix: float | None = None) -> TransferHandle:
        if expired(not_after_unix):
            return expired_handle(peer, notify, timeout_s)
        return self._transfer("WRITE", peer, self._layout(peer, src_blocks, dst_blocks),
                              check_layers(layers, self.cache.spec.num_layers), notify, timeout_s, not_after_unix)

    def read(self, peer: str, remote_blocks: Sequence[int], local_blocks: Sequence[int], layers: Sequence[int],
             timeout_s: float, notify: str = "") -> TransferHandle:
        return self._transfer("READ", peer, self._layout(peer, local_blocks, remote_blocks),
                              check_layers(layers, self.cache.spec.num_layers), notify, timeout_s)

    def _layout(self, peer: str, local_blocks, remote_blocks) -> "_Layout":
        """Checked, coalesced descriptor layout of a block mapping, cached: a request streamed layer
        by layer reuses its mapping for every layer, and the hook must stay cheap."""
        remote = self._peer(peer)
        key = (peer, _key(local_blocks), _key(remote_blocks))
        layout = self._layouts.pop(key, None)
        if layout is None:
            spec = self.cache.spec
            local, far = check_blocks(local_blocks, remote_blocks, spec.num_blocks, remote["num_blocks"])
            layout = _Layout.build(coalesce_arrays(local, far), spec.num_blocks, remote["num_blocks"], spec.block_bytes)
            if len(self._layouts) >= _LAYOUT_CACHE:
                self._layouts.pop(next(iter(self._layouts)))
        self._layouts[key] = layout  # most recently used last
        return layout

    def _transfer(self, op: str, peer: str, layout: "_Layout", layers: list[int], notify: str,
                  timeout_s: float, not_after_unix: float | None = None) -> "NixlHandle":
        """Checked here; descriptors are built and posted by the progress thread (keeps hooks cheap)."""
        handle = NixlHandle(self, peer, notify, timeout_s, layout.nbytes_per_layer * len(layers), (op, layout, layers),
                            not_after_unix)
        self._enqueue(handle)
        return handle

    def _descriptors(self, peer: str, layout: "_Layout", layers: list[int]) -> tuple[np.ndarray, np.ndarray]:
        remote = self._peers[peer]
        return layout.descriptors(layers, self.cache.data.data_ptr(), remote["base"],
                                  max(self.cache.data.get_device(), 0), remote["device_id"])

    def poll_notifications(self) -> list[str]:
        with self._lock:
            notifs = self.agent.get_new_notifs()
        return [m.decode(errors="replace") for msgs in notifs.values() for m in msgs]

    def send_notification(self, peer: str, message: str) -> None:
        self._peer(peer)
        with self._lock:
            self.agent.send_notif(peer, message.encode())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        if self._progress_thread is not None:
            self._progress_thread.join(1.0)
        for handle in list(self._handles):
            handle.cancel()
            if not handle.state.is_final:
                handle._finish(TransferState.FAILED, "transport closed")
        with self._lock:
            for name in list(self._loaded):
                try:
                    self.agent.remove_remote_agent(name)
                except Exception:
                    pass
            if self._reg is not None:
                self.agent.deregister_memory(self._reg)
                self._reg = None


_LAYOUT_CACHE = 256


def _key(blocks) -> bytes | tuple:
    return blocks.tobytes() if isinstance(blocks, np.ndarray) else tuple(blocks)


@dataclass(frozen=True)
class _Layout:
    """Byte offsets of each run's K and V in layer 0 on both sides, and their lengths; layer ``l``
    is layer 0 shifted by ``l * 2 * num_blocks * block_bytes`` (the ``LKBTHD`` layout)."""

    local: np.ndarray
    remote: np.ndarray
    lengths: np.ndarray
    local_layer_stride: int
    remote_layer_stride: int

    @classmethod
    def build(cls, runs: tuple[np.ndarray, np.ndarray, np.ndarray], local_num_blocks: int, remote_num_blocks: int,
              block_bytes: int) -> "_Layout":
        local_starts, remote_starts, counts = runs
        kv = np.arange(2)[:, None]
        return cls(((kv * local_num_blocks + local_starts[None, :]) * block_bytes).reshape(-1),
                   ((kv * remote_num_blocks + remote_starts[None, :]) * block_bytes).reshape(-1),
                   np.tile(counts * block_bytes, 2), 2 * local_num_blocks * block_bytes,
                   2 * remote_num_blocks * block_bytes)

    @property
    def nbytes_per_layer(self) -> int:
        return int(self.lengths.sum())

    def descriptors(self, layers: list[int], local_base: int, remote_base: int, local_dev: int,
                    remote_dev: int) -> tuple[np.ndarray, np.ndarray]:
        """Nx3 uint64 (address, length, device id) NIXL descriptor lists, layer-major, K then V."""
        lay = np.asarray(layers, dtype=np.int64)[:, None]
        lengths = np.tile(self.lengths, len(layers))
        out = []
        for base, offsets, stride, dev in ((local_base, self.local, self.local_layer_stride, local_dev),
                                           (remote_base, self.remote, self.remote_layer_stride, remote_dev)):
            addr = (base + lay * stride + offsets[None, :]).reshape(-1)
            out.append(np.column_stack((addr, lengths, np.full(addr.size, dev))).astype(np.uint64))
        return out[0], out[1]


class NixlHandle(TransferHandle):
    """A NIXL transfer request. Posted and polled by the transport's progress thread: with UCX over
    shared memory (CMA) the copy happens inside the post, so posting on the caller's thread would
    put the whole copy on the critical path of the forward that streams it.
    All state changes happen under the transport's lock."""

    max_poll_interval_s = 0.0002

    def __init__(self, transport: NixlTransport, peer: str, notify: str, timeout_s: float, nbytes: int,
                 job: tuple, not_after_unix: float | None = None) -> None:
        super().__init__(peer, notify, timeout_s, nbytes)
        self.transport = transport
        self._job = job
        self._xfer = None
        self.not_after_unix = not_after_unix

    def _post(self) -> None:
        """Called by the progress thread, under the lock. A write whose destination reservation
        expired meanwhile is never posted (the fence for one-sided writes: the receiver cannot
        drop them, so they are only ever posted while the reservation is live)."""
        if self.state.is_final:
            return
        if expired(self.not_after_unix):
            self._settle_final(TransferState.CANCELLED, "the destination reservation expired before the write was posted")
            return
        op, layout, layers = self._job
        agent = self.transport.agent
        mem = "DRAM" if self.transport.cache.data.device.type == "cpu" else "VRAM"
        try:
            local, far = self.transport._descriptors(self.peer, layout, layers)
            self._xfer = agent.initialize_xfer(op, agent.get_xfer_descs(local, mem), agent.get_xfer_descs(far, mem),
                                               self.peer, self.notify.encode())
            status = agent.transfer(self._xfer)
        except Exception as e:
            self._settle_final(TransferState.FAILED, f"nixl: cannot post {op}: {e}")
            return
        self._settle(status)

    def _progress(self) -> None:
        with self.transport._lock:  # a released request must never be checked again
            if self._xfer is None or self.state.is_final:
                return
            self._settle(self.transport.agent.check_xfer_state(self._xfer))
            if self.cancel_requested and not self.state.is_final:
                self._try_abort()

    def _settle(self, status: str) -> None:
        if status == "DONE":
            self._settle_final(TransferState.DONE)
        elif status == "ERR":
            cancelled = self.cancel_requested
            self._settle_final(TransferState.CANCELLED if cancelled else TransferState.FAILED,
                               None if cancelled else "nixl: transfer failed (peer gone or error)")

    def _settle_final(self, state: TransferState, error: str | None = None) -> None:
        if self._xfer is not None:
            try:
                self._xfer.release()
            except Exception:  # still active in the backend: NIXL keeps it in the agent's leak list
                pass
        self.transport._handles.discard(self)
        if self._finish(state, error) and state is TransferState.CANCELLED and self.notify:
            try:  # the receiver may free the destination blocks now
                self.transport.agent.send_notif(self.peer, (ABORTED_PREFIX + self.notify).encode())
            except Exception:
                pass

    def _try_abort(self) -> None:
        """Releasing an active request asks UCX to cancel it; it raises while the request cannot
        be cancelled yet, and succeeds once nothing of it can still land."""
        try:
            self._xfer.release()
        except Exception:
            return
        self._settle_final(TransferState.CANCELLED)

    def _request_cancel(self) -> None:
        with self.transport._lock:
            if self.state.is_final:
                return
            if self._xfer is None:  # never posted: nothing can land
                self._unsubmit()
                self._settle_final(TransferState.CANCELLED)
            else:
                self._try_abort()

    def _on_timeout(self) -> bool:
        """A timed-out request becomes FAILED only once UCX released it (nothing of it can still
        land); while it is still active it stays PENDING with a cancel requested, and the progress
        thread keeps trying: a handle never says "over" while the peer's blocks may still be written."""
        with self.transport._lock:
            self._unsubmit()
            if self._xfer is not None:
                try:
                    self._xfer.release()
                except Exception:  # still active
                    self.cancel_requested = True
                    return False
                self._xfer = None
            self.transport._handles.discard(self)
            return True

    def _unsubmit(self) -> None:
        try:
            self.transport._submitted.remove(self)
        except ValueError:
            pass
