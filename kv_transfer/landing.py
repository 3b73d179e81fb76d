"""Receiver side: which layers and blocks of which request have landed, and when reserved blocks
may be freed.

Notification tags name a request (on a decode worker: the reservation key, ``fence.reservation_key``)
and what one write carried: ``layers_tag("req-7", [0, 1])`` is ``"req-7@0,1"`` (every position of
layers 0 and 1); ``write_tag("req-7", [3], 16, 40)`` is ``"req-7@3/16:40"`` (prompt positions
16..39 of layer 3: one chunk of a chunked prefill; a block rewritten by the next chunk counts
only for the positions each write carried). The request id may itself contain ``@``; the last one
separates. A sender passes the tag as a write's ``notify``; the receiver feeds
``poll_notifications()`` to a ``LandingTracker``. ``SETTLED_PREFIX + key`` is the sender's word
that nothing more of ``key`` will come from it (every write final, none posted after). Pure logic,
no I/O, injectable clock.

Decode-side lifecycle of one request's reserved blocks:
1. ``expect(rid, num_layers, num_tokens)`` when the blocks are reserved.
2. ``feed(notifications)`` as they arrive; ``is_complete(rid)`` only once every prompt position
   of every layer has landed: only then may the request be decoded. ``finish(rid)`` forgets it (its blocks
   now belong to the running request).
3. On abort: ``abort(rid)``. The blocks stay held until every layer is *settled* — landed, or
   confirmed aborted by the sender's backend (``ABORTED_PREFIX`` notifications), or the sender
   said ``SETTLED_PREFIX`` — or until the drain deadline passed; ``releasable()`` then returns the
   request once, and the caller frees.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from kv_transfer.base import ABORTED_PREFIX


SETTLED_PREFIX = "settled:"
"""Prefix of the sender's notification that nothing more of a request will come from it."""


def layers_tag(request_id: str, layers: Iterable[int]) -> str:
    """The notify string for a write of every token of ``layers`` of ``request_id``."""
    return f"{request_id}@{','.join(str(int(layer)) for layer in layers)}"


def write_tag(request_id: str, layers: Iterable[int], start: int, end: int) -> str:
    """The notify string for a write of prompt positions ``start .. end-1`` of ``layers`` (one
    chunk of a chunked prefill, or the blocks of a prefix hit)."""
    if not 0 <= start < end:
        raise ValueError(f"bad token range {start}:{end}")
    return f"{layers_tag(request_id, layers)}/{int(start)}:{int(end)}"


def parse_write_tag(tag: str) -> tuple[str, list[int], tuple[int, int] | None] | None:
    """``"req@0,3/16:40"`` -> ``("req", [0, 3], (16, 40))``; the range is None when the tag names
    every token (``"req@0,3"``); None if the tag is not one of ours."""
    request_id, sep, spec = tag.rpartition("@")
    if not sep or not request_id:
        return None
    layer_spec, slash, span = spec.partition("/")
    try:
        layers = [int(x) for x in layer_spec.split(",")]
        if not slash:
            return request_id, layers, None
        a, colon, b = span.partition(":")
        start, end = int(a), int(b)
    except ValueError:
        return None
    if not colon or not 0 <= start < end:
        return None
    return request_id, layers, (start, end)


def parse_tag(tag: str) -> tuple[str, list[int]] | None:
    """``"req@0,3"`` -> ``("req", [0, 3])``; None if the tag is not one of ours."""
    parsed = parse_write_tag(tag)
    return None if parsed is None else (parsed[0], parsed[1])


def tag_key(tag: str) -> str | None:
    """The request (reservation key) a write's notify tag names; None if it is not one of ours."""
    parsed = parse_write_tag(tag)
    return None if parsed is None else parsed[0]


def _covers(spans: list[tuple[int, int]], n: int) -> bool:
    """Whether the union of half-open ``spans`` covers ``0 .. n-1``."""
    reach = 0
    for a, b in sorted(spans):
        if a > reach:
            return False
        reach = max(reach, b)
        if reach >= n:
            return True
    return reach >= n


@dataclass
class _Expected:
    num_layers: int
    num_tokens: int = 1  # 1 when only whole layers are tracked
    landed: dict[int, list[tuple[int, int]]] = field(default_factory=dict)   # layer -> token spans
    aborted: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    sender_settled: bool = False
    abort_deadline: float | None = None

    def mark(self, layers: list[int], span: tuple[int, int] | None, aborted: bool) -> None:
        target = self.aborted if aborted else self.landed
        for layer in layers:
            target.setdefault(layer, []).append(span or (0, self.num_tokens))

    def _full(self, layer: int, *maps: dict[int, list[tuple[int, int]]]) -> bool:
        return _covers([s for m in maps for s in m.get(layer, ())], self.num_tokens)

    @property
    def landed_layers(self) -> set[int]:
        return {layer for layer in range(self.num_layers) if self._full(layer, self.landed)}

    @property
    def complete(self) -> bool:
        return all(self._full(layer, self.landed) for layer in range(self.num_layers))

    @property
    def settled(self) -> bool:
        return self.sender_settled or all(self._full(layer, self.landed, self.aborted)
                                          for layer in range(self.num_layers))


class LandingTracker:
    """Tracks per-request landed layers from transport notifications. Not thread-safe."""

    def __init__(self, drain_timeout_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.drain_timeout_s = drain_timeout_s
        self.clock = clock
        self._requests: dict[str, _Expected] = {}
        self.unknown_notifications = 0
        self.drained_by_timeout = 0

    def expect(self, request_id: str, num_layers: int, num_tokens: int | None = None) -> None:
        """Track ``request_id``: ``num_layers`` layers, and when ``num_tokens`` is given, every
        prompt position of every layer (writes then name their positions: ``write_tag``)."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already expected")
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if num_tokens is not None and num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        self._requests[request_id] = _Expected(num_layers, num_tokens or 1)

    def feed(self, notifications: Iterable[str]) -> list[str]:
        """Apply notifications; return the requests that became complete with them."""
        completed = []
        for note in notifications:
            if note.startswith(SETTLED_PREFIX):
                req = self._requests.get(note[len(SETTLED_PREFIX):])
                if req is None:
                    self.unknown_notifications += 1
                else:
                    req.sender_settled = True
                continue
            aborted = note.startswith(ABORTED_PREFIX)
            parsed = parse_write_tag(note[len(ABORTED_PREFIX):] if aborted else note)
            req = self._requests.get(parsed[0]) if parsed else None
            if req is None or any(not 0 <= layer < req.num_layers for layer in parsed[1]) or (
                    parsed[2] is not None and parsed[2][0] >= req.num_tokens):
                self.unknown_notifications += 1
                continue
            was_complete = req.complete
            req.mark(parsed[1], parsed[2], aborted)
            if req.complete and not was_complete and req.abort_deadline is None:
                completed.append(parsed[0])
        return completed

    def is_complete(self, request_id: str) -> bool:
        """True once every layer of the request has landed (and it was not aborted)."""
        req = self._requests.get(request_id)
        return req is not None and req.complete and req.abort_deadline is None

    def landed_layers(self, request_id: str) -> set[int]:
        """Layers of which every tracked block has landed."""
        return self._requests[request_id].landed_layers

    def finish(self, request_id: str) -> None:
        """Forget a complete request (its blocks passed on to decoding)."""
        if not self.is_complete(request_id):
            raise ValueError(f"request {request_id!r} has not landed completely")
        del self._requests[request_id]

    def abort(self, request_id: str, deadline: float | None = None) -> None:
        """Start releasing: the blocks are freed by ``releasable`` once nothing can still land, or
        at ``deadline`` (the tracker's clock; default ``drain_timeout_s`` from now)."""
        req = self._requests.get(request_id)
        if req is not None and req.abort_deadline is None:
            req.abort_deadline = self.clock() + self.drain_timeout_s if deadline is None else deadline

    def settle(self, request_id: str) -> None:
        """Nothing more of the request can land (known by other means: the senders answered Abort)."""
        req = self._requests.get(request_id)
        if req is not None:
            req.sender_settled = True

    def is_settled(self, request_id: str) -> bool:
        """Whether nothing more of the request can land (unknown requests count as settled)."""
        req = self._requests.get(request_id)
        return req is None or req.settled

    def forget(self, request_id: str) -> None:
        """Drop a request whatever its state (the caller knows no write into it can land)."""
        self._requests.pop(request_id, None)

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
