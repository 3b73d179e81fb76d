"""The worker's KV-event publisher: numbers the block manager's events and serves them to routers.

The block manager's hook (engine/block_manager.py ``on_event``) runs in the engine thread; the
publisher gives each event the next sequence number of this worker's *epoch* (a random id drawn
when the publisher is created, so a restarted worker is recognisable), keeps the last
``buffer_size`` records for replay and a mirror of the findable hashes for snapshots, all under
one lock, so a snapshot and its sequence number always agree.

Two ways out, carrying the same records (proto/kv_events.py JSON):
  * pulled over the worker gRPC API (``KvEvents``: records after a seq, or a snapshot when the
    caller's position is no longer in the buffer or belongs to another epoch) — the embedded
    default, and the resync path in every mode;
  * pushed to a Redis Stream ``pdserve:kv:<worker id>`` (``RedisKvSink``) when the cluster has a
    Redis registry. Records that could not be pushed while Redis was down are dropped once they
    leave the buffer; routers then see a gap and resync from a snapshot.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import uuid

from proto.kv_events import (STREAM_PREFIX, AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventRecord,
                             KvSnapshot, encode_record)

log = logging.getLogger(__name__)

STREAM_MAXLEN = 10_000


def stream_key(worker_id: str) -> str:
    return STREAM_PREFIX + worker_id


class KvEventPublisher:
    def __init__(self, worker_id: str, buffer_size: int = 4096) -> None:
        self.worker_id = worker_id
        self.epoch = uuid.uuid4().hex[:12]
        self._lock = threading.Lock()
        self._seq = 0
        self._buffer: collections.deque[KvEventRecord] = collections.deque(maxlen=buffer_size)
        self._hashes: set[int] = set()
        self._listeners: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self.skip_next = 0  # fault injection (tests): drop this many records, leaving a seq gap

    def attach(self, block_manager) -> None:
        block_manager.on_event = self.publish

    @property
    def seq(self) -> int:
        return self._seq

    def publish(self, event: KvEvent) -> None:
        """The block manager's hook (engine thread)."""
        with self._lock:
            self._seq += 1
            if isinstance(event, BlockStored):
                self._hashes.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self._hashes.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self._hashes.clear()
            if self.skip_next > 0:
                self.skip_next -= 1
            else:
                self._buffer.append(KvEventRecord(self.worker_id, self.epoch, self._seq, event))
            listeners = list(self._listeners)
        for loop, ev in listeners:
            loop.call_soon_threadsafe(ev.set)

    def snapshot(self) -> KvSnapshot:
        with self._lock:
            return KvSnapshot(self.worker_id, self.epoch, self._seq, frozenset(self._hashes))

    def since(self, epoch: str, after_seq: int) -> list[KvEventRecord] | None:
        """Records after ``after_seq`` of ``epoch``; None if they cannot be replayed (another epoch,
        or some have left the buffer): the caller needs a snapshot."""
        with self._lock:
            if epoch != self.epoch or after_seq > self._seq:
                return None
            out = [r for r in self._buffer if r.seq > after_seq]
            first = out[0].seq if out else self._seq + 1
            return out if first == after_seq + 1 else None

    def listen(self) -> asyncio.Event:
        """An event set (on the caller's loop) whenever a record is published."""
        ev = asyncio.Event()
        with self._lock:
            self._listeners.append((asyncio.get_running_loop(), ev))
        return ev


class RedisKvSink:
    """Pushes the publisher's records to the worker's Redis Stream (XADD, approximate MAXLEN)."""

    def __init__(self, publisher: KvEventPublisher, client) -> None:
        self.publisher = publisher
        self.client = client  # redis.asyncio.Redis
        self.pushed = 0       # last seq pushed (or skipped)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.client.aclose()

    async def _run(self) -> None:
        wake = self.publisher.listen()
        key = stream_key(self.publisher.worker_id)
        while True:
            await wake.wait()
            wake.clear()
            while True:
                p = self.publisher
                records = p.since(p.epoch, self.pushed)
                if records is None:  # fell out of the buffer while Redis was away: routers see the gap
                    records = [r for r in p._buffer if r.seq > self.pushed]
                if not records:
                    break
                try:
                    pipe = self.client.pipeline(transaction=False)
                    for r in records:
                        pipe.xadd(key, {"r": encode_record(r)}, maxlen=STREAM_MAXLEN, approximate=True)
                    await pipe.execute()
                    self.pushed = records[-1].seq
                except Exception as e:  # Redis down: keep serving, retry in a moment
                    log.warning("KV events to Redis failed (%s); retrying", type(e).__name__)
                    await asyncio.sleep(0.5)
