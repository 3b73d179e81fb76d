"""Receiver side of the KV fence: which reservations may still be written, and into which blocks.

A decode worker reserves destination blocks under a *reservation key* (``"<request id>#<epoch>"``,
the epoch unique per reservation on that worker, so a retry is a different key). Every write a
prefill worker sends carries the key in its notify tag (``landing.write_tag``). A backend that
receives the bytes itself (``tcp``, ``torch``: the framed protocol, and ``local``) asks the fence
before each DATA frame lands:

- ``begin(key, start, count)`` admits the frame only while the key is live and blocks
  ``start .. start+count-1`` all belong to it, and counts it as landing; ``end(key)`` after the
  bytes are in. A frame not admitted is read into scratch memory and dropped, and its transfer is
  answered "fenced" (the sender's handle ends CANCELLED): the sender learns the reservation is gone.
- ``close(key)`` (Decode admitted the request, Abort, lease expiry, a newer reservation) stops
  admitting; the blocks may be reused once ``writing(key)`` is False, i.e. no admitted frame is
  still being copied in.

Backends whose writes the receiver never sees (NIXL: one-sided RDMA) cannot consult it; there the
decode worker holds closed blocks until the sender has settled (decode_worker/worker.py). Pure
logic, thread-safe (receivers run on their own threads).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Iterable


def reservation_key(request_id: str, epoch: int) -> str:
    """The key a reservation's writes are tagged with."""
    return f"{request_id}#{int(epoch)}"


class WriteFence:
    """Live reservations and their destination blocks; in-flight frame counts per key."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, tuple[int, ...]] = {}
        self._live_sets: dict[str, frozenset[int]] = {}
        self._landing: Counter[str] = Counter()
        self.discarded_frames = 0

    def open(self, key: str, blocks: Iterable[int], writable_from: int = 0) -> None:
        """Admit writes for ``key`` from now on into ``blocks[writable_from:]`` (the leading blocks
        are the decode worker's shared prefix-cache blocks: never written). ``blocks`` are in the
        prompt's logical order. Raises ValueError if already open."""
        blocks = tuple(int(b) for b in blocks)
        with self._lock:
            if key in self._live:
                raise ValueError(f"reservation {key!r} is already open")
            self._live[key] = blocks
            self._live_sets[key] = frozenset(blocks[writable_from:])

    def close(self, key: str) -> None:
        """Admit nothing more for ``key`` (idempotent). Frames already admitted may still be landing."""
        with self._lock:
            self._live.pop(key, None)
            self._live_sets.pop(key, None)

    def begin(self, key: str | None, start: int, count: int) -> bool:
        """Whether a frame for blocks ``start .. start+count-1`` of ``key`` may land; if so it
        counts as landing until ``end(key)``."""
        with self._lock:
            owned = self._live_sets.get(key) if key is not None else None
            if owned is None or not all(b in owned for b in range(start, start + count)):
                self.discarded_frames += 1
                return False
            self._landing[key] += 1
            return True

    def end(self, key: str) -> None:
        with self._lock:
            self._landing[key] -= 1
            if self._landing[key] <= 0:
                del self._landing[key]

    def writing(self, key: str) -> bool:
        """Whether an admitted frame of ``key`` is still being copied in."""
        with self._lock:
            return self._landing.get(key, 0) > 0

    def is_live(self, key: str) -> bool:
        with self._lock:
            return key in self._live

    def blocks(self, key: str) -> tuple[int, ...] | None:
        """All destination blocks of a live reservation in logical order (None once closed)."""
        with self._lock:
            return self._live.get(key)

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)
