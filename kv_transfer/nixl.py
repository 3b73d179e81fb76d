"""``nixl`` backend: NVIDIA NIXL with its UCX backend (RDMA, NVLink, shared memory or TCP, whichever
UCX finds). DRAM caches on CPU machines, VRAM on GPUs.

The whole cache tensor is registered once; a write or read is one NIXL transfer request whose
descriptors are the coalesced block runs (``plan``), addressed from the peer's registered base
address in its metadata. Completion is the initiator's ``check_xfer_state``; the peer learns of a
landed write from the notification NIXL delivers after the data.

Machine notes (``../shared/MACHINE-NOTES.md``): the agent runs without its progress thread (on 2
cores it cost 4-5x bandwidth), so whoever waits must poll: handles progress in ``poll``, receivers
must call ``poll_notifications`` about every millisecond. UCX stays on loopback
(``UCX_NET_DEVICES=lo`` unless set) and the UCX backend is created with
``ucx_error_handling_mode=none``; a dead peer therefore surfaces as a transfer timeout.
The agent is not thread-safe in this mode: every call goes through one lock.
"""

from __future__ import annotations

import base64
import os
import socket
import threading
import uuid
from typing import Any, Sequence

import numpy as np

from engine.kv_cache import PagedKVCache
from kv_transfer.base import (ABORTED_PREFIX, CompatKey, IncompatiblePeer, KVTransport,
                              TransferHandle, TransferState, TransportUnavailable, UnknownPeer, check_cache,
                              decode_metadata, encode_metadata)
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

    def __init__(self, agent_name: str | None = None, ucx_devices: str = "") -> None:
        nixl_agent, nixl_agent_config = _import_nixl()
        self.agent_name = agent_name or f"pdserve-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[])
        self._lock = threading.Lock()
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
        self._handles: set[NixlHandle] = set()
        self._closed = False

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
        with self._lock:
            loaded = self.agent.add_remote_agent(agent_md)
        if isinstance(loaded, bytes):
            loaded = loaded.decode()
        if loaded != name:
            raise IncompatiblePeer(f"nixl: peer metadata names agent {name!r} but carries {loaded!r}")
        self._peers[name] = {"base": base, "device_id": device_id, "num_blocks": meta["num_blocks"]}
        return name

    def _peer(self, peer: str) -> dict[str, Any]:
        if peer not in self._peers:
            raise UnknownPeer(f"nixl: unknown peer {peer!r}; call add_peer(metadata) first")
        return self._peers[peer]

    def write(self, peer: str, src_blocks: Sequence[int], dst_blocks: Sequence[int], layers: Sequence[int],
              notify: str, timeout_s: float) -> TransferHandle:
        remote = self._peer(peer)
        spec = self.cache.spec
        src_blocks, dst_blocks = check_blocks(src_blocks, dst_blocks, spec.num_blocks, remote["num_blocks"])
        return self._transfer("WRITE", peer, check_layers(layers, spec.num_layers),
                              coalesce_arrays(src_blocks, dst_blocks), notify, timeout_s)

    def read(self, peer: str, remote_blocks: Sequence[int], local_blocks: Sequence[int], layers: Sequence[int],
             timeout_s: float, notify: str = "") -> TransferHandle:
        remote = self._peer(peer)
        spec = self.cache.spec
        local_blocks, remote_blocks = check_blocks(local_blocks, remote_blocks, spec.num_blocks, remote["num_blocks"])
        return self._transfer("READ", peer, check_layers(layers, spec.num_layers),
                              coalesce_arrays(local_blocks, remote_blocks), notify, timeout_s)

    def _transfer(self, op: str, peer: str, layers: list[int], runs: tuple[np.ndarray, np.ndarray, np.ndarray],
                  notify: str, timeout_s: float) -> "NixlHandle":
        """``runs``: (local starts, remote starts, counts), whatever the direction."""
        spec, remote = self.cache.spec, self._peers[peer]
        local_starts, remote_starts, counts = runs
        local = _desc_array(layers, local_starts, counts, self.cache.data.data_ptr(), spec.num_blocks,
                            spec.block_bytes, max(self.cache.data.get_device(), 0))
        far = _desc_array(layers, remote_starts, counts, remote["base"], remote["num_blocks"], spec.block_bytes,
                          remote["device_id"])
        handle = NixlHandle(self, peer, notify, timeout_s, int(local[:, 1].sum()))
        mem = "DRAM" if self.cache.data.device.type == "cpu" else "VRAM"
        with self._lock:
            try:
                xfer = self.agent.initialize_xfer(op, self.agent.get_xfer_descs(local, mem),
                                                  self.agent.get_xfer_descs(far, mem), peer, notify.encode())
                status = self.agent.transfer(xfer)
            except Exception as e:
                handle._finish(TransferState.FAILED, f"nixl: cannot post {op}: {e}")
                return handle
        handle._start(xfer, status)
        return handle

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
        for handle in list(self._handles):
            handle.cancel()
            if not handle.state.is_final:
                handle._finish(TransferState.FAILED, "transport closed")
        with self._lock:
            for name in list(self._peers):
                try:
                    self.agent.remove_remote_agent(name)
                except Exception:
                    pass
            if self._reg is not None:
                self.agent.deregister_memory(self._reg)
                self._reg = None


def _desc_array(layers: list[int], starts: np.ndarray, counts: np.ndarray, base: int, num_blocks: int,
                block_bytes: int, device_id: int) -> np.ndarray:
    """Nx3 uint64 (address, length, device id) NIXL descriptors, layer-major, K then V, one per run."""
    lkv = (np.asarray(layers, dtype=np.int64)[:, None] * 2 + np.arange(2)[None, :]).reshape(-1)
    addr = base + (lkv[:, None] * num_blocks + starts[None, :]) * block_bytes
    length = np.broadcast_to(counts[None, :] * block_bytes, addr.shape)
    return np.stack([addr.reshape(-1), length.reshape(-1), np.full(addr.size, device_id)], axis=1).astype(np.uint64)


class NixlHandle(TransferHandle):
    """A NIXL transfer request; progresses when polled (no progress thread), so ``wait`` polls often."""

    max_poll_interval_s = 0.0002

    def __init__(self, transport: NixlTransport, peer: str, notify: str, timeout_s: float, nbytes: int) -> None:
        super().__init__(peer, notify, timeout_s, nbytes)
        self.transport = transport
        self._xfer = None

    def _start(self, xfer, status: str) -> None:
        self._xfer = xfer
        self.transport._handles.add(self)
        self._settle(status)

    def _progress(self) -> None:
        if self._xfer is None or self.state.is_final:
            return
        with self.transport._lock:
            status = self.transport.agent.check_xfer_state(self._xfer)
        self._settle(status)
        if self.cancel_requested and not self.state.is_final:
            self._try_abort()

    def _settle(self, status: str) -> None:
        if status == "DONE":
            self._release_and_finish(TransferState.DONE)
        elif status == "ERR":
            if self.cancel_requested:
                self._release_and_finish(TransferState.CANCELLED)
            else:
                self._release_and_finish(TransferState.FAILED, "nixl: transfer failed (peer gone or error)")

    def _release_and_finish(self, state: TransferState, error: str | None = None) -> None:
        try:
            with self.transport._lock:
                self._xfer.release()
        except Exception:  # still active in the backend: NIXL keeps it in the agent's leak list
            pass
        self.transport._handles.discard(self)
        if self._finish(state, error) and state is TransferState.CANCELLED and self.notify:
            self._tell_peer_aborted()

    def _try_abort(self) -> None:
        """Releasing an active request asks UCX to cancel it; it raises while the request cannot
        be cancelled yet, and succeeds once nothing of it can still land."""
        try:
            with self.transport._lock:
                self._xfer.release()
        except Exception:
            return
        self.transport._handles.discard(self)
        if self._finish(TransferState.CANCELLED):
            self._tell_peer_aborted()

    def _tell_peer_aborted(self) -> None:
        try:
            self.transport.send_notification(self.peer, ABORTED_PREFIX + self.notify)
        except Exception:
            pass

    def _request_cancel(self) -> None:
        if self._xfer is not None:
            self._try_abort()

    def _on_timeout(self) -> None:
        if self._xfer is not None:
            try:
                with self.transport._lock:
                    self._xfer.release()
            except Exception:
                pass
            self.transport._handles.discard(self)
