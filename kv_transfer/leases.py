"""Source-side holds with expiry: the prefill worker keeps a request's KV blocks until the decode
side confirms it has them (a landed write, or the notification of its read), or the lease expires.

Pure logic with an injectable clock. Every hold ends exactly once — ``confirm`` (the peer has the
data), ``release`` (aborted locally) or expiry (the peer never confirmed) — and the blocks come back
to the caller, who frees them. Counters say how each ended; ``expired`` is what an operator watches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Lease(Generic[K]):
    key: K
    blocks: tuple[int, ...]
    expires_at: float


@dataclass
class LeaseCounters:
    granted: int = 0
    confirmed: int = 0
    released: int = 0
    expired: int = 0


class LeaseTable(Generic[K]):
    """Holds keyed by request id (or any hashable). Not thread-safe."""

    def __init__(self, default_ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        if default_ttl_s <= 0:
            raise ValueError(f"default_ttl_s must be > 0, got {default_ttl_s}")
        self.default_ttl_s = default_ttl_s
        self.clock = clock
        self.counters = LeaseCounters()
        self._leases: dict[K, Lease[K]] = {}

    def hold(self, key: K, blocks: list[int] | tuple[int, ...], ttl_s: float | None = None) -> Lease[K]:
        """Hold ``blocks`` until confirmed, released or ``ttl_s`` seconds from now."""
        if key in self._leases:
            raise ValueError(f"{key!r} already holds a lease")
        ttl = self.default_ttl_s if ttl_s is None else ttl_s
        if ttl <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl}")
        lease = Lease(key, tuple(blocks), self.clock() + ttl)
        self._leases[key] = lease
        self.counters.granted += 1
        return lease

    def confirm(self, key: K) -> Lease[K] | None:
        """The peer has the data: end the hold. None if unknown (already ended: idempotent)."""
        lease = self._leases.pop(key, None)
        self.counters.confirmed += lease is not None
        return lease

    def release(self, key: K) -> Lease[K] | None:
        """End the hold without confirmation (local abort). None if unknown."""
        lease = self._leases.pop(key, None)
        self.counters.released += lease is not None
        return lease

    def expire(self) -> list[Lease[K]]:
        """End and return every hold past its expiry; each is counted in ``counters.expired``."""
        now = self.clock()
        expired = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in expired:
            del self._leases[lease.key]
        self.counters.expired += len(expired)
        return expired

    def next_expiry(self) -> float | None:
        return min((lease.expires_at for lease in self._leases.values()), default=None)

    def __contains__(self, key: object) -> bool:
        return key in self._leases

    def __len__(self) -> int:
        return len(self._leases)

    @property
    def held_blocks(self) -> int:
        return sum(len(lease.blocks) for lease in self._leases.values())
