"""The KV-transfer interface every backend implements, its handle states and the compatibility key.

A transport moves blocks of one paged KV cache (``engine.kv_cache``, layout ``LKBTHD``:
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``) into blocks of a peer's cache.

Lifecycle of one transfer (both sides)::

    sender                                   receiver
    register_cache -> metadata  ...........  register_cache -> metadata (sent out of band)
    add_peer(receiver metadata)  -- compat key checked, fail closed (IncompatiblePeer)
    h = write(peer, src, dst, layers, notify)
    h.poll() / h.wait()  PENDING -> DONE      poll_notifications() -> [notify]   (bytes have landed)
    h.cancel()           PENDING -> CANCELLED poll_notifications() -> [ABORTED_PREFIX + notify]
    peer dies / timeout  PENDING -> FAILED

A handle reaches CANCELLED only once the backend confirms that no byte of the transfer can still
land; the receiver learns the same through an aborted notification, so destination blocks are never
reused while a write into them may still land. Nothing received from the network is unpickled:
metadata blobs are JSON, frames are fixed ``struct`` headers followed by raw tensor bytes.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import json
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, fields
from typing import Any, Sequence

import torch

from engine.kv_cache import KVCacheSpec, PagedKVCache

PROTOCOL_VERSION = 1
ABORTED_PREFIX = "aborted:"
"""Prefix of the notification a receiver gets when a write was cancelled (or its sender's
connection dropped) and the backend confirmed that nothing more of it can land."""


class KVTransferError(RuntimeError):
    """Base class of the errors this package raises."""


class IncompatiblePeer(KVTransferError):
    """The peer's cache cannot exchange blocks with ours; the message names both sides' values."""


class TransportUnavailable(KVTransferError):
    """The backend's package or hardware is missing (raised at start-up, by ``create_transport``)."""


class UnknownPeer(KVTransferError):
    """A peer id that ``add_peer`` did not return (or whose connection was lost)."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class CompatKey:
    """Everything two caches must agree on before a single byte moves between them: the protocol,
    the model, the cache's KV format descriptor (``engine.kv_cache.KVFormat``: dtype, layout,
    block size, head layout, digest of the FP8 scales), one field each so a refusal names both
    sides' value of every field that differs, the speculative config and what the weights compute.

    speculative: the speculative-decoding config of the pair (engine/spec_decode/config.py
    ``compat_descriptor``: method, draft model identity, k; "none" without speculation).
    weights: what the worker's linears compute (engine/quantization/apply.py
    ``weights_descriptor``: the method, and for int8 down_proj's activation scheme, which follows
    the CPU): a prefill worker whose KV was computed otherwise than the decode worker would
    continue it gives logprobs that drift apart; "none" for unquantized weights (and from a peer
    that does not send the field).
    """

    protocol_version: int
    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_dtype: str
    layout: str
    kv_scales_digest: str = ""
    speculative: str = "none"
    weights: str = "none"

    @classmethod
    def from_spec(cls, spec: KVCacheSpec, model_id: str, speculative: str = "none",
                  weights: str = "none") -> "CompatKey":
        f = spec.kv_format
        return cls(PROTOCOL_VERSION, model_id, f.num_layers, f.num_kv_heads, f.head_dim, f.block_size, f.dtype,
                   f.layout, kv_scales_digest=f.scales_digest, speculative=speculative, weights=weights)

    def check_matches(self, peer: "CompatKey") -> None:
        """Raise ``IncompatiblePeer`` naming every differing field with both values."""
        diffs = [f"{f.name}: ours={getattr(self, f.name)!r} peer={getattr(peer, f.name)!r}"
                 for f in fields(self) if getattr(self, f.name) != getattr(peer, f.name)]
        if diffs:
            hint = ""
            if self.kv_scales_digest and peer.kv_scales_digest and self.kv_scales_digest != peer.kv_scales_digest:
                # Each machine calibrates its own copy of the model unless given one: in the engine's
                # dtype and quantization, so a bf16 and an fp32 (or int8) worker differ.
                hint = ("; the FP8 KV scales differ: give every worker the same <model dir>/pdserve_kv_scales.json, "
                        "calibrated by one engine")
            raise IncompatiblePeer("KV cache of peer is incompatible, refusing it (" + "; ".join(diffs) + ")" + hint)

    def check_spec(self, spec: KVCacheSpec) -> None:
        """The key must describe the cache it is registered with."""
        expected = CompatKey.from_spec(spec, self.model_id, self.speculative, self.weights)
        if expected != self:
            raise ValueError(f"compat key {self} does not describe the cache {spec}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CompatKey":
        """Parse a peer's key; raises ``IncompatiblePeer`` if fields are missing or mistyped."""
        try:
            # (weights: absent from the keys of peers older than the field; "none" is what they computed)
            kwargs = {f.name: d[f.name] if f.name != "weights" else d.get("weights", "none") for f in fields(cls)}
        except (KeyError, TypeError, AttributeError) as e:
            raise IncompatiblePeer(f"peer metadata has no valid compatibility key: {e!r}") from None
        for f in fields(cls):
            want = str if f.type == "str" else int   # (the annotations, as strings: postponed evaluation)
            if type(kwargs[f.name]) is not want:
                raise IncompatiblePeer(f"peer compatibility key field {f.name}={kwargs[f.name]!r} "
                                       f"is not {want.__name__}")
        return cls(**kwargs)


def encode_metadata(backend: str, compat: CompatKey, num_blocks: int, **fields_: Any) -> bytes:
    """A metadata blob: UTF-8 JSON (never pickle)."""
    return json.dumps({"backend": backend, "compat": compat.to_dict(), "num_blocks": num_blocks,
                       **fields_}).encode()


def decode_metadata(blob: bytes, backend: str, ours: CompatKey) -> dict[str, Any]:
    """Parse and check a peer's metadata blob: right backend, compatible cache (fail closed)."""
    try:
        meta = json.loads(blob.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IncompatiblePeer(f"peer metadata is not valid JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("backend") != backend:
        got = meta.get("backend") if isinstance(meta, dict) else None
        raise IncompatiblePeer(f"peer metadata is for backend {got!r}, ours is {backend!r}")
    ours.check_matches(CompatKey.from_dict(meta.get("compat")))
    if type(meta.get("num_blocks")) is not int or meta["num_blocks"] < 1:
        raise IncompatiblePeer(f"peer metadata has an invalid num_blocks {meta.get('num_blocks')!r}")
    return meta


class TransferState(enum.IntEnum):
    """PENDING, then exactly one of the final states."""

    PENDING = 0
    DONE = 1
    FAILED = 2
    CANCELLED = 3

    @property
    def is_final(self) -> bool:
        return self is not TransferState.PENDING

    def __str__(self) -> str:
        return self.name


_POLL_S = 0.0005
_POLL_MAX_S = 0.005
_transfer_ids = itertools.count(1)


class TransferHandle:
    """One write or read in flight.

    The state only moves PENDING -> DONE | FAILED | CANCELLED, once. ``poll`` drives backends
    that need the caller's thread to make progress (NIXL without its progress thread) and turns
    a transfer that is still pending past its deadline into FAILED. Thread-safe.
    Backends subclass it and override ``_progress`` / ``_request_cancel`` / ``_on_timeout``.
    """

    max_poll_interval_s = _POLL_MAX_S  # how long ``wait`` may sleep between polls

    def __init__(self, peer: str, notify: str, timeout_s: float, nbytes: int) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.transfer_id = next(_transfer_ids)
        self.peer = peer
        self.notify = notify
        self.nbytes = nbytes
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.error: str | None = None
        self.cancel_requested = False
        self._state = TransferState.PENDING
        self._lock = threading.Lock()
        self._final = threading.Event()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} #{self.transfer_id} {self._state.name} peer={self.peer} notify={self.notify!r}>"

    @property
    def state(self) -> TransferState:
        return self._state

    def poll(self) -> TransferState:
        """Make progress if the backend needs it; return the current state."""
        if self._state.is_final:
            return self._state
        self._progress()
        if not self._state.is_final and time.monotonic() > self.deadline and self._on_timeout():
            self._finish(TransferState.FAILED, f"timed out after {self.timeout_s:g}s")
        return self._state

    def wait(self, timeout_s: float | None = None) -> TransferState:
        """Block until final or ``timeout_s`` passed (None: the handle's own deadline); return the state."""
        end = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s + 1.0)
        sleep = _POLL_S
        while not self.poll().is_final and time.monotonic() < end:
            self._final.wait(sleep)
            sleep = min(sleep * 2, self.max_poll_interval_s)
        return self._state

    async def wait_async(self, timeout_s: float | None = None) -> TransferState:
        """``wait`` for asyncio code: never blocks the event loop."""
        end = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s + 1.0)
        sleep = _POLL_S
        while not self.poll().is_final and time.monotonic() < end:
            await asyncio.sleep(sleep)
            sleep = min(sleep * 2, self.max_poll_interval_s)
        return self._state

    def cancel(self) -> TransferState:
        """Ask the backend to stop. The state becomes CANCELLED only when the backend confirms
        nothing more can land (DONE if it had already landed); until then it stays PENDING."""
        if self._state.is_final:
            return self._state
        self.cancel_requested = True
        self._request_cancel()
        return self.poll()

    # -- for backends ---------------------------------------------------------------------------
    def _finish(self, state: TransferState, error: str | None = None) -> bool:
        """Move to a final state once; later calls are ignored. Returns whether this call did it."""
        with self._lock:
            if self._state.is_final:
                return False
            self.error = error
            self._state = state
        self._final.set()
        return True

    def _progress(self) -> None:
        """Drive the backend (default: it progresses on its own threads)."""

    def _request_cancel(self) -> None:
        """Start cancelling (default: the backend's sender notices ``cancel_requested``)."""

    def _on_timeout(self) -> bool:
        """Release backend resources of a transfer that timed out; return whether nothing of it can
        still land (only then does the handle become FAILED; otherwise it stays PENDING, with a
        cancel requested, until the backend confirms)."""
        return True


class KVTransport(ABC):
    """Moves blocks of the local paged KV cache to and from peers. See the module docstring."""

    name: str = ""
    fences_writes: bool = False
    """Whether this backend, as receiver, drops writes that the installed ``fence.WriteFence``
    refuses (tcp, torch, local). False for one-sided backends (NIXL): there the receiver must keep
    a closed reservation's blocks until every sender settled (decode_worker/worker.py)."""

    def set_fence(self, fence) -> None:
        """Install the receiver's ``fence.WriteFence`` (see ``fences_writes``)."""
        self.fence = fence

    @abstractmethod
    def register_cache(self, cache: PagedKVCache, compat: CompatKey) -> bytes:
        """Register the local cache (once) and return the metadata blob a peer passes to ``add_peer``.

        Raises ValueError if ``compat`` does not describe ``cache.spec`` or the cache is not contiguous.
        """

    @abstractmethod
    def add_peer(self, metadata: bytes) -> str:
        """Connect to a peer from its metadata blob; return its peer id (idempotent per peer).

        Raises IncompatiblePeer (message naming both sides' values) when the caches differ in
        protocol version, model, layer count, KV heads, head dim, block size, dtype or layout.
        """

    @abstractmethod
    def write(self, peer: str, src_blocks: Sequence[int], dst_blocks: Sequence[int], layers: Sequence[int],
              notify: str, timeout_s: float, not_after_unix: float | None = None) -> TransferHandle:
        """Push K and V of ``layers`` from local ``src_blocks[i]`` into the peer's ``dst_blocks[i]``.

        The peer's ``poll_notifications`` returns ``notify`` once every byte has landed. Contiguous
        runs (consecutive in both lists) move as one descriptor. ``not_after_unix``: the
        destination reservation's expiry (wall clock); a write not yet started by then never
        starts (its handle ends CANCELLED). Raises ValueError on bad block ids or layers (before
        anything moves), UnknownPeer for a peer not added.
        """

    @abstractmethod
    def read(self, peer: str, remote_blocks: Sequence[int], local_blocks: Sequence[int], layers: Sequence[int],
             timeout_s: float, notify: str = "") -> TransferHandle:
        """Pull K and V of ``layers`` from the peer's ``remote_blocks[i]`` into local ``local_blocks[i]``.

        The handle is DONE once the bytes are in the local cache; the peer's ``poll_notifications``
        then returns ``notify`` (if non-empty), telling it its source blocks may be released.
        """

    @abstractmethod
    def poll_notifications(self) -> list[str]:
        """Notifications that arrived since the last call (landed writes, finished reads, aborts)."""

    def send_notification(self, peer: str, message: str) -> None:
        """Send a standalone notification (e.g. ``ABORTED_PREFIX + tag`` for layers never sent).
        Ordered after every earlier write to that peer once those writes' handles are final."""
        raise NotImplementedError(f"{self.name} does not send standalone notifications")

    @abstractmethod
    def close(self) -> None:
        """Fail pending transfers, disconnect peers, release registrations. Idempotent."""

    def __enter__(self) -> "KVTransport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def expired(not_after_unix: float | None) -> bool:
    """Whether a destination reservation with this expiry (wall clock; None: none) is over."""
    return not_after_unix is not None and time.time() >= not_after_unix


def expired_handle(peer: str, notify: str, timeout_s: float) -> TransferHandle:
    """The handle of a write refused because its reservation expired before it started."""
    handle = TransferHandle(peer, notify, timeout_s, 0)
    handle._finish(TransferState.CANCELLED, "the destination reservation expired before the write started")
    return handle


def check_cache(cache: PagedKVCache, compat: CompatKey) -> None:
    """Shared validation for ``register_cache``."""
    compat.check_spec(cache.spec)
    if not cache.data.is_contiguous():
        raise ValueError("the KV cache tensor must be contiguous")
