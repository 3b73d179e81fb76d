"""Feeding the router's prefix index from the workers' KV events.

Two sources, one set of rules (router/prefix_index.py: in order, per epoch; a gap or a new epoch
is a resync from a snapshot over the worker gRPC API):
  * ``poll(worker)``: ask the worker for the records after our position (``KvEvents``), piggy-
    backed on the pool's Stats polls — the embedded default, and the fallback while Redis is down;
  * ``RedisKvConsumer``: read every worker's Redis Stream (``pdserve:kv:<id>``, XREAD BLOCK) when
    the cluster has a Redis registry; a gap found there triggers the same gRPC snapshot.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from proto.kv_events import STREAM_PREFIX, KvSnapshot, decode_record
from proto.pdserve.v1 import worker_pb2
from router.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

RPC_TIMEOUT_S = 2.0


class KvEventSync:
    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self.snapshots = 0  # resyncs done (tests, metrics)

    async def poll(self, w) -> None:
        """Apply the worker's records after our position (or its snapshot). w: router.pool.WorkerHandle."""
        pos = self.index.position(w.id)
        epoch, seq = pos if pos else ("", 0)
        try:
            resp = await w.stub.KvEvents(worker_pb2.KvEventsRequest(epoch=epoch, after_seq=seq, snapshot=pos is None),
                                         timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as e:
            log.debug("KvEvents from %s failed: %s", w.id, e.code())
            return
        self._apply(w.id, resp)
        if pos is not None and not resp.is_snapshot and self.index.position(w.id) is None:
            await self.resync(w)

    async def resync(self, w) -> None:
        """Replace the worker's entries with its snapshot."""
        try:
            resp = await w.stub.KvEvents(worker_pb2.KvEventsRequest(snapshot=True), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as e:
            log.info("KV snapshot from %s failed: %s; its index entries are dropped", w.id, e.code())
            self.index.drop(w.id)
            return
        self._apply(w.id, resp)

    def _apply(self, worker_id: str, resp: worker_pb2.KvEventsResponse) -> None:
        if resp.is_snapshot:
            self.snapshots += 1
            self.index.load_snapshot(KvSnapshot(worker_id, resp.epoch, resp.seq, frozenset(resp.block_hashes)))
            return
        for text in resp.records:
            if not self.index.apply(decode_record(text)):
                self.index.drop(worker_id)  # position None: the caller resyncs
                return

    def apply_record_text(self, text: str | bytes) -> str | None:
        """One record from a stream; returns the worker id if it needs a resync."""
        r = decode_record(text)
        if self.index.position(r.worker_id) is None and r.seq != 1:
            return r.worker_id
        if not self.index.apply(r):
            return r.worker_id
        return None


class RedisKvConsumer:
    """XREAD BLOCK over the streams of the workers the pool knows; gaps resync over gRPC.

    ``connected`` is False while Redis cannot be read; the pool then polls KvEvents over gRPC."""

    def __init__(self, sync: KvEventSync, pool, client, block_ms: int = 500) -> None:
        self.sync = sync
        self.pool = pool
        self.client = client  # redis.asyncio.Redis
        self.block_ms = block_ms
        self.connected = False
        self._last_ids: dict[str, str] = {}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            try:
                await self._read_once()
                if not self.connected:
                    self.connected = True
                    log.info("KV events: reading Redis streams")
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if self.connected:
                    log.warning("KV events: Redis unreachable (%s); polling workers over gRPC", type(e).__name__)
                self.connected = False
                self._last_ids.clear()  # read from the start of the streams when Redis is back
                await asyncio.sleep(0.5)

    async def _read_once(self) -> None:
        ids = [w.id for w in self.pool.workers()]
        if not ids:
            await asyncio.sleep(self.block_ms / 1000)
            return
        streams = {STREAM_PREFIX + wid: self._last_ids.get(wid, "0-0") for wid in ids}
        if not self.connected:  # a fresh read: catch the index up from snapshots, then follow the streams
            for wid in ids:
                last = await self.client.xrevrange(STREAM_PREFIX + wid, count=1)
                streams[STREAM_PREFIX + wid] = self._last_ids[wid] = _id(last[0][0]) if last else "0-0"
            for w in self.pool.workers():
                await self.sync.resync(w)
        else:  # a worker that joined (or rejoined) has no position yet: load it now, not at its next event
            for w in self.pool.workers():
                if self.sync.index.position(w.id) is None:
                    await self.sync.resync(w)
        replies = await self.client.xread(streams, block=self.block_ms, count=1000)
        stale: set[str] = set()
        for key, entries in replies or []:
            wid = _text(key)[len(STREAM_PREFIX):]
            for entry_id, fields in entries:
                self._last_ids[wid] = _id(entry_id)
                record = fields.get(b"r", fields.get("r"))
                if wid not in stale and self.sync.apply_record_text(record) is not None:
                    stale.add(wid)
        for wid in stale:
            if w := self.pool.get(wid):
                await self.sync.resync(w)


def _text(x) -> str:
    return x.decode() if isinstance(x, bytes) else x


def _id(x) -> str:
    return _text(x)
