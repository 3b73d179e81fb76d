"""Where the router learns which workers exist: a small interface with swappable backends.

The default backend lives in the cluster's controller (deploy/cluster.py: a Ray actor the workers
register with, again after a restart); `StaticRegistry` serves tests and fixed deployments; a
Redis-backed registry comes later. The router only calls `list_workers()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol


@dataclass(frozen=True)
class WorkerEndpoint:
    """A worker as registered: its id, role ("prefill" | "decode" | "agg") and gRPC address host:port."""

    id: str
    role: str
    address: str


class Registry(Protocol):
    async def list_workers(self) -> list[WorkerEndpoint]: ...


class StaticRegistry:
    """A fixed set of workers."""

    def __init__(self, workers: list[WorkerEndpoint]) -> None:
        self._workers = list(workers)

    async def list_workers(self) -> list[WorkerEndpoint]:
        return list(self._workers)


class CallableRegistry:
    """Any async function returning the current workers (e.g. a call to the cluster controller)."""

    def __init__(self, fetch: Callable[[], Awaitable[list[WorkerEndpoint]]]) -> None:
        self._fetch = fetch

    async def list_workers(self) -> list[WorkerEndpoint]:
        return list(await self._fetch())
