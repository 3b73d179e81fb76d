"""The router's view of its workers: one gRPC channel each, their info and last load.

A background loop asks the registry who exists, connects to new workers (Info; from the first
one also the model's tokenizer files, Worker.ModelFiles, so the router never reads a worker's
disk and may run on another node), drops gone ones,
and polls Stats with a deadline (``rpc_timeout_s``, 2 s). Liveness: a worker whose poll fails or
misses its deadline (a stopped process, a wedged host), or whose request leg failed or ran past
its leg timeout (router/orchestrator.py), is suspect: ``alive`` is False and no new request is
routed to it; the first poll it answers makes it live again (a resumed process; a restarted one
re-registers, possibly at a new address) — except a worker found wedged (busy, its engine
completing no step within the stall bound, reason NO_PROGRESS): it answers its polls all along,
so it stays suspect until a poll shows its ``engine_steps`` moved or it has nothing left to do.
Each poll also notes when the worker last made progress (``progressed_at``: its step counter
moved, or it was idle). The loop never waits for one worker's poll: a stuck
worker delays nobody else's Stats. Loads combine the worker's last Stats with the
requests the router has sent it since, so a burst does not all land on one worker.
Every fall into suspicion is reported once to ``events`` (router/failover_events.py).

KV events: with a ``kv_sync`` (router/kv_sync.py) each poll also pulls the worker's KV events
into the router's prefix index over gRPC, unless ``kv_events_pushed()`` says a Redis stream
consumer is delivering them; a worker that goes away has its index entries dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc

from proto.internal_auth import client_interceptors
from proto.model_files import join_chunks
from proto.tls import TlsFiles
from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc
from router.failover_events import MISSED_POLL, NO_PROGRESS, FailoverEvents
from router.leg_timeouts import WorkRate
from router.registry import Registry, WorkerEndpoint
from router.selection import WorkerLoad

log = logging.getLogger(__name__)

RPC_TIMEOUT_S = 2.0
MODEL_FILES_TIMEOUT_S = 30.0  # a few MB, once
# A worker that left the registry (drained, restarted elsewhere) keeps its channel until no
# request of ours has been on it for this long: its streams finish and their Abort/Release
# calls still go through, instead of failing on a closed channel.
RETIRE_GRACE_S = 30.0


@dataclass
class WorkerHandle:
    endpoint: WorkerEndpoint
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    info: worker_pb2.WorkerInfo
    stats: worker_pb2.WorkerStats = field(default_factory=worker_pb2.WorkerStats)
    alive: bool = True
    inflight: int = 0  # requests the router has on this worker now
    booked_prefill_blocks: int = 0  # uncached prompt blocks of requests sent here, before their first token
    booked_decode_blocks: int = 0   # prompt + max_tokens blocks of requests the router has here now
    # our bookings when the last Stats arrived: what the report shows beyond them is other routers' load
    booked_at_poll: int = 0
    inflight_at_poll: int = 0
    rate: WorkRate = field(default_factory=WorkRate)  # measured speed, for the leg timeouts
    missed_polls: int = 0  # consecutive Stats polls that failed or missed their deadline
    polled_at: float = 0.0  # time.monotonic() of the last Stats that answered
    progressed_at: float = 0.0  # time.monotonic() of the first poll that saw its engine_steps now (or it idle)
    wedged_at_steps: int | None = None  # suspect for NO_PROGRESS at this engine_steps: live once it moves
    events: FailoverEvents = field(default_factory=FailoverEvents, repr=False)

    @property
    def id(self) -> str:
        return self.endpoint.id

    @property
    def busy(self) -> bool:
        return self.stats.running + self.stats.waiting > 0

    def suspect(self, reason: str) -> None:
        """No new requests until it answers a poll again (router/failover_events.py reasons);
        NO_PROGRESS: until a poll shows its engine progressed."""
        if reason == NO_PROGRESS:
            self.wedged_at_steps = self.stats.engine_steps
        if self.alive:
            self.events.worker_suspect(self.endpoint.role, reason)
        self.alive = False

    def observe(self, stats: worker_pb2.WorkerStats, now: float) -> None:
        """An answered poll: progress, and live again (a wedged worker only once it progressed)."""
        if stats.engine_steps != self.stats.engine_steps or not (stats.running + stats.waiting) \
                or not self.progressed_at:
            self.progressed_at = now
        self.stats, self.polled_at = stats, now
        if self.wedged_at_steps is not None:
            if stats.engine_steps == self.wedged_at_steps and self.busy:
                return  # still wedged: answering, but no step completed
            self.wedged_at_steps = None
            log.info("worker %s progresses again (engine_steps %d): live", self.id, stats.engine_steps)
        if not self.alive or self.missed_polls:
            log.info("worker %s answers again after %d missed polls: live", self.id, self.missed_polls)
        self.alive, self.missed_polls = True, 0

    def load(self) -> WorkerLoad:
        s = self.stats
        return WorkerLoad(self.id, s.kv_blocks_total, s.kv_blocks_used, max(s.running, self.inflight), s.waiting,
                          self.alive)


class WorkerPool:
    def __init__(self, registry: Registry, poll_interval_s: float = 0.2, rpc_timeout_s: float = RPC_TIMEOUT_S,
                 kv_sync=None, internal_secret: str | None = None, internal_tls: TlsFiles | None = None,
                 events: FailoverEvents | None = None) -> None:
        self._registry = registry
        self.events = events or FailoverEvents()
        self._tls = internal_tls.channel_credentials() if internal_tls else None  # workers serve TLS
        self._interceptors = client_interceptors(internal_secret)  # every call carries the cluster's secret
        self.kv_sync = kv_sync
        self.kv_events_pushed = lambda: False  # set by the router when a Redis consumer runs
        self._poll_s = poll_interval_s
        self._rpc_timeout_s = rpc_timeout_s
        self._workers: dict[str, WorkerHandle] = {}
        self._retired: list[list] = []   # [handle, monotonic time its in-flight count was last seen 0, or None]
        self._task: asyncio.Task | None = None
        self._polls: dict[str, asyncio.Task] = {}  # worker id -> its poll in flight (the loop's)
        self.changed = asyncio.Event()
        self.model_files: dict[str, bytes] | None = None  # from the first worker (all serve one model)

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        for t in [self._task, *self._polls.values()]:
            if t is not None:
                t.cancel()
        await asyncio.gather(*(t for t in [self._task, *self._polls.values()] if t is not None),
                             return_exceptions=True)
        for w in [*self._workers.values(), *(r[0] for r in self._retired)]:
            await w.channel.close()
        self._workers.clear()
        self._retired.clear()

    def workers(self, role: str | None = None) -> list[WorkerHandle]:
        return [w for w in self._workers.values() if role is None or w.endpoint.role == role]

    def get(self, worker_id: str) -> WorkerHandle | None:
        return self._workers.get(worker_id)

    def loads(self, role: str) -> list[WorkerLoad]:
        return [w.load() for w in self.workers(role)]


    def any_info(self) -> worker_pb2.WorkerInfo | None:
        return next((w.info for w in self._workers.values() if w.alive), None)

    async def refresh(self, wait: bool = True) -> None:
        """Follow the registry and poll every worker's Stats; wait=False (the loop) starts the polls
        without waiting for them, one in flight per worker."""
        try:
            endpoints = {e.id: e for e in await self._registry.list_workers()}
        except Exception as e:  # the registry being briefly unreachable must not kill the router
            log.warning("registry unavailable: %s", e)
            return
        for wid in [w for w in self._workers if w not in endpoints or endpoints[w] != self._workers[w].endpoint]:
            self._retired.append([self._workers.pop(wid), None])
            if self.kv_sync is not None:
                self.kv_sync.index.drop(wid)
        await asyncio.gather(*(self._connect(e) for e in endpoints.values() if e.id not in self._workers))
        if wait:
            await asyncio.gather(*(self._poll_stats(w) for w in list(self._workers.values())))
        else:
            for w in list(self._workers.values()):
                if w.id not in self._polls:
                    task = asyncio.create_task(self._poll_stats(w))
                    self._polls[w.id] = task
                    task.add_done_callback(lambda _t, wid=w.id: self._polls.pop(wid, None))
        await self._close_retired()

    async def _close_retired(self) -> None:
        now, keep = time.monotonic(), []
        for entry in self._retired:
            handle, idle_since = entry
            if handle.inflight:
                entry[1] = None
            elif idle_since is None:
                entry[1] = now
            if entry[1] is not None and now - entry[1] >= RETIRE_GRACE_S:
                await handle.channel.close()
            else:
                keep.append(entry)
        self._retired = keep

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            await self.refresh(wait=False)

    async def _connect(self, e: WorkerEndpoint) -> None:
        channel = grpc.aio.secure_channel(e.address, self._tls, interceptors=self._interceptors) if self._tls \
            else grpc.aio.insecure_channel(e.address, interceptors=self._interceptors)
        stub = worker_pb2_grpc.WorkerStub(channel)
        try:
            info = await stub.Info(worker_pb2.InfoRequest(), timeout=self._rpc_timeout_s)
            if self.model_files is None:
                self.model_files = join_chunks([c async for c in stub.ModelFiles(
                    worker_pb2.ModelFilesRequest(), timeout=MODEL_FILES_TIMEOUT_S)])
        except grpc.RpcError as err:
            log.info("worker %s at %s not reachable yet: %s", e.id, e.address, err.code())
            await channel.close()
            return
        self._workers[e.id] = WorkerHandle(e, channel, stub, info, events=self.events)
        self.changed.set()

    async def _poll_stats(self, w: WorkerHandle) -> None:
        try:
            stats = await w.stub.Stats(worker_pb2.StatsRequest(), timeout=self._rpc_timeout_s)
        except grpc.RpcError as e:
            w.missed_polls += 1
            if w.alive or w.missed_polls == 1:
                log.warning("worker %s missed a Stats poll (%s): suspect, no new requests", w.id, e.code().name)
            w.suspect(MISSED_POLL)
            return
        w.booked_at_poll, w.inflight_at_poll = w.booked_decode_blocks, w.inflight
        w.observe(stats, time.monotonic())
        if self.kv_sync is not None and not self.kv_events_pushed():
            await self.kv_sync.poll(w)
