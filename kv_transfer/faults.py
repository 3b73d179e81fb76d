"""Fault injection for tests and debugging: a transport wrapper that misbehaves on purpose.

``FaultyTransport(inner, FaultSpec(...))`` behaves as ``inner`` except that, for requests whose
notify tag contains ``FaultSpec.match`` (all when empty), with the spec's probabilities:

- receiver side (wrap the decode worker's transport): a landed write's notification is dropped
  (``drop_notify``) or delivered ``delay_notify_s`` late; the bytes a landed write carried are
  corrupted (``corrupt``: one byte of each K block it wrote is flipped; needs the fence, which
  knows each reservation's destination blocks) — as if the payload had been damaged on the way;
- sender side (wrap the prefill worker's): after ``kill_after_writes`` writes the transport drops
  every connection at once, mid-frame, as if the peer process died mid-transfer
  (``kill_connections``: tcp aborts its sockets; torch shuts down its gloo groups' sockets; nixl
  fails every write not yet posted and forgets its peers); it reconnects on the next ``add_peer``.

Selected in tests directly, and in workers by ``WorkerConfig.kv_faults`` (a ``FaultSpec.parse``
string such as ``"drop_notify=0.5,match=victim"``). Counters say what was injected.
"""

from __future__ import annotations

import heapq
import itertools
import random
import threading
import time
from dataclasses import dataclass, fields
from typing import Sequence

import torch

from kv_transfer.base import ABORTED_PREFIX, KVTransport, TransferHandle
from kv_transfer.landing import SETTLED_PREFIX, parse_write_tag


@dataclass(frozen=True)
class FaultSpec:
    drop_notify: float = 0.0      # probability a landed-write notification is never delivered
    delay_notify_s: float = 0.0   # every matching notification is delivered this much later
    corrupt: float = 0.0          # probability a landed write's bytes are damaged
    kill_after_writes: int = 0    # sender: drop every connection once, at this many matching writes (0: never)
    match: str = ""               # only requests whose tag contains this ("" = all)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("drop_notify", "corrupt"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"kv fault {name} must be in [0, 1], got {getattr(self, name)}")
        if self.delay_notify_s < 0 or self.kill_after_writes < 0:
            raise ValueError("kv fault delay_notify_s and kill_after_writes must be >= 0")

    @classmethod
    def parse(cls, text: str) -> "FaultSpec":
        """``"drop_notify=0.3,delay_notify_s=0.05,match=victim"``; ValueError naming a bad key or value."""
        kinds = {f.name: f.type for f in fields(cls)}
        kwargs: dict[str, object] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, eq, value = part.partition("=")
            if not eq or name not in kinds:
                raise ValueError(f"kv fault {part!r}: expected one of {', '.join(kinds)} as name=value")
            conv = {"float": float, "int": int, "str": str}[str(kinds[name])]
            try:
                kwargs[name] = conv(value)
            except ValueError:
                raise ValueError(f"kv fault {name}={value!r} is not a {kinds[name]}") from None
        return cls(**kwargs)

    @property
    def active(self) -> bool:
        return bool(self.drop_notify or self.delay_notify_s or self.corrupt or self.kill_after_writes)


class FaultyTransport(KVTransport):
    """``inner`` with the faults of ``spec`` injected. See the module docstring."""

    def __init__(self, inner: KVTransport, spec: FaultSpec) -> None:
        self.inner, self.spec = inner, spec
        self.name = inner.name
        self.fences_writes = inner.fences_writes
        self.fence = None
        self._rng = random.Random(spec.seed)
        self._lock = threading.Lock()
        self._delayed: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self.writes = 0
        self.counters = {"dropped": 0, "delayed": 0, "corrupted": 0, "kills": 0}

    @property
    def cache(self):
        return self.inner.cache

    def set_fence(self, fence) -> None:
        self.fence = fence
        self.inner.set_fence(fence)

    def register_cache(self, cache, compat) -> bytes:
        return self.inner.register_cache(cache, compat)

    def add_peer(self, metadata: bytes) -> str:
        return self.inner.add_peer(metadata)

    def write(self, peer: str, src_blocks: Sequence[int], dst_blocks: Sequence[int], layers: Sequence[int],
              notify: str, timeout_s: float, not_after_unix: float | None = None) -> TransferHandle:
        handle = self.inner.write(peer, src_blocks, dst_blocks, layers, notify, timeout_s, not_after_unix)
        if self.spec.kill_after_writes and self._matches(notify):
            with self._lock:
                self.writes += 1
                kill = self.writes == self.spec.kill_after_writes  # once: the peer "dies" one time
            if kill:
                self.counters["kills"] += 1
                self.inner.kill_connections()
        return handle

    def read(self, peer, remote_blocks, local_blocks, layers, timeout_s, notify: str = "") -> TransferHandle:
        return self.inner.read(peer, remote_blocks, local_blocks, layers, timeout_s, notify)

    def send_notification(self, peer: str, message: str) -> None:
        self.inner.send_notification(peer, message)

    def poll_notifications(self) -> list[str]:
        now = time.monotonic()
        out = []
        for note in self.inner.poll_notifications():
            if not self._matches(note) or note.startswith((ABORTED_PREFIX, SETTLED_PREFIX)):
                out.append(note)  # only landed-write notifications are tampered with
                continue
            with self._lock:
                drop = self._rng.random() < self.spec.drop_notify
                corrupt = self._rng.random() < self.spec.corrupt
            if drop:
                self.counters["dropped"] += 1
                continue
            if corrupt:
                self._corrupt(note)
            if self.spec.delay_notify_s:
                self.counters["delayed"] += 1
                heapq.heappush(self._delayed, (now + self.spec.delay_notify_s, next(self._seq), note))
            else:
                out.append(note)
        while self._delayed and self._delayed[0][0] <= now:
            out.append(heapq.heappop(self._delayed)[2])
        return out

    def _matches(self, tag: str) -> bool:
        return not self.spec.match or self.spec.match in tag

    def _corrupt(self, note: str) -> None:
        """Flip one byte of each K block this write carried (its positions' blocks)."""
        parsed = parse_write_tag(note)
        blocks = self.fence.blocks(parsed[0]) if parsed and self.fence is not None else None
        if not blocks:
            return
        data = self.inner.cache.data
        block_size = data.shape[3]
        start, end = parsed[2] or (0, len(blocks) * block_size)
        for layer in parsed[1]:
            for logical in range(start // block_size, min(len(blocks), -(-end // block_size))):
                view = data[layer, 0, blocks[logical]].view(torch.uint8).reshape(-1)
                view[0] ^= 0x5A
        self.counters["corrupted"] += 1

    def kill_connections(self) -> None:
        self.inner.kill_connections()

    def close(self) -> None:
        self.inner.close()
