"""Receiver side: which layers of which request have landed, and when reserved blocks may be freed.

Notification tags name a request and the layers one write carried: ``layers_tag("req-7", [0, 1])``
is ``"req-7@0,1"`` (the request id may itself contain ``@``; the last one separates). A sender
passes the tag as a write's ``notify``; the receiver feeds ``poll_notifications()`` to a
``LandingTracker``. Pure logic, no I/O, injectable clock.

Decode-side lifecycle of one request's reserved blocks:
1. ``expect(rid, num_layers)`` when the blocks are reserved.
2. ``feed(notifications)`` as they arrive; ``is_complete(rid)`` only once every layer has landed:
   only then may the request be decoded. ``finish(rid)`` forgets it (its blocks now belong to the
   running request).
3. On abort: ``abort(rid)``. The blocks stay held until every layer is *settled* — landed, or
   confirmed aborted by the sender's backend (``ABORTED_PREFIX`` notifications) — or until
   ``drain_timeout_s`` passed; ``releasable()`` then returns the request once, and the caller frees.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from kv_transfer.base import ABORTED_PREFIX


def layers_tag(request_id: str, layers: Iterable[int]) -> str:
    """The notify string for a write of ``layers`` of ``request_id``."""
    return f"{request_id}@{','.join(str(int(layer)) for layer in layers)}"


def parse_tag(tag: str) -> tuple[str, list[int]] | None:
    """``"req@0,3"`` -> ``("req", [0, 3])``; None if the tag is not one of ours."""
    request_id, sep, spec = tag.rpartition("@")
    if not sep or not request_id:
        return None
    try:
        return request_id, [int(x) for x in spec.split(",")]
    except ValueError:
        return None


@dataclass
class _Expected:
    num_layers: int
    landed: set[int] = field(default_factory=set)
    aborted: set[int] = field(default_factory=set)
    abort_deadline: float | None = None

    @property
    def complete(self) -> bool:
        return len(self.landed) == self.num_layers

    @property
    def settled(self) -> bool:
        return len(self.landed | self.aborted) == self.num_layers


class LandingTracker:
    """Tracks per-request landed layers from transport notifications. Not thread-safe."""

    def __init__(self, drain_timeout_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.drain_timeout_s = drain_timeout_s
        self.clock = clock
        self._requests: dict[str, _Expected] = {}
        self.unknown_notifications = 0
        self.drained_by_timeout = 0

    def expect(self, request_id: str, num_layers: int) -> None:
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already expected")
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self._requests[request_id] = _Expected(num_layers)

    def feed(self, notifications: Iterable[str]) -> list[str]:
        """Apply notifications; return the requests that became complete with them."""
        completed = []
        for note in notifications:
            aborted = note.startswith(ABORTED_PREFIX)
            parsed = parse_tag(note[len(ABORTED_PREFIX):] if aborted else note)
            req = self._requests.get(parsed[0]) if parsed else None
            if req is None or any(not 0 <= layer < req.num_layers for layer in parsed[1]):
                self.unknown_notifications += 1
                continue
            was_complete = req.complete
            (req.aborted if aborted else req.landed).update(parsed[1])
            if req.complete and not was_complete and req.abort_deadline is None:
                completed.append(parsed[0])
        return completed

    def is_complete(self, request_id: str) -> bool:
        """True once every layer of the request has landed (and it was not aborted)."""
        req = self._requests.get(request_id)
        return req is not None and req.complete and req.abort_deadline is None

    def landed_layers(self, request_id: str) -> set[int]:
        return set(self._requests[request_id].landed)

    def finish(self, request_id: str) -> None:
        """Forget a complete request (its blocks passed on to decoding)."""
        if not self.is_complete(request_id):
            raise ValueError(f"request {request_id!r} has not landed completely")
        del self._requests[request_id]

    def abort(self, request_id: str) -> None:
        """Start releasing: the blocks are freed by ``releasable`` once nothing can still land."""
        req = self._requests.get(request_id)
        if req is not None and req.abort_deadline is None:
            req.abort_deadline = self.clock() + self.drain_timeout_s

    def releasable(self) -> list[str]:
        """Aborted requests whose blocks may now be freed (each returned once, then forgotten)."""
        now, out = self.clock(), []
        for rid, req in list(self._requests.items()):
            if req.abort_deadline is None:
                continue
            if req.settled or now >= req.abort_deadline:
                self.drained_by_timeout += not req.settled
                del self._requests[rid]
                out.append(rid)
        return out

    def holds(self, request_id: str) -> bool:
        """Whether the request's destination blocks are still held by this tracker."""
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)
