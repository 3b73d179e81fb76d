"""The decode worker: takes remote KV into reserved blocks and decodes with continuous batching.

Lifecycle of one disaggregated request on this worker:
  1. Reserve: check the request, allocate blocks for its prompt (state WAITING_FOR_REMOTE_KV,
     no compute; the prompt's longest prefix in our prefix cache reuses its cached blocks) under a
     reservation lease; return the typed destination (our transport metadata, the block ids, and
     how many leading blocks are cached here, which the prefill worker does not write). Blocks that do not fit: RESOURCE_EXHAUSTED, nothing held.
  2. (the prefill worker writes the prompt's KV into those blocks, layer by layer; the router
     calls Decode only after the prefill worker's transport confirmed every write landed)
  3. Decode(first_token): take the lease, admit the request into the running batch with its
     first token, stream the following tokens.
  4. End: the engine frees the blocks on finish; Abort frees them in any state; a lease that
     expires before Decode (the router or the prefill worker vanished) aborts the request.
The agg role (no transport) is worker/agg.py.
The transport's notifications are polled every millisecond while reservations are open (NIXL
without its progress thread needs the receiver to poll; the other backends queue them until read),
and every 50 ms otherwise, so that an idle poller does not take CPU from decoding.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

import grpc

from kv_transfer.leases import LeaseTable
from proto.pdserve.v1 import api_pb2, worker_pb2
from worker.core import WorkerCore, WorkerError

log = logging.getLogger(__name__)

NOTIFY_POLL_S = 0.001       # while KV may be arriving (reservations open)
NOTIFY_IDLE_POLL_S = 0.05   # otherwise: the poller must not cost the decode loop CPU
LEASE_REAP_S = 0.25


class DecodeWorker(WorkerCore):
    def __init__(self, *args, transport, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.transport = transport
        self.reservations: LeaseTable[str] = LeaseTable()
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._reap_leases()))
        self._tasks.append(asyncio.create_task(self._poll_notifications()))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.drain_background()

    async def reserve(self, request_id: str, prompt_ids: list[int], wire: api_pb2.SamplingOptions,
                      lease_s: float) -> worker_pb2.ReserveResponse:
        params = self.check(prompt_ids, wire)
        try:
            reservation = await self.engine.reserve_remote(request_id, prompt_ids, params)
        except Exception as e:  # does not fit (no side effects, per the engine contract)
            raise WorkerError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"cannot reserve KV blocks: {e}") from None
        blocks = reservation.block_ids
        self.reservations.hold(request_id, blocks, lease_s or None)
        # the prompt's prefix this worker caches is not sent again: the prefill worker writes only the rest
        dest = worker_pb2.KVDestination(worker_id=self.config.worker_id, kv_metadata=self.kv_metadata,
                                        block_ids=blocks, num_cached_blocks=reservation.num_cached_blocks)
        return worker_pb2.ReserveResponse(destination=dest, lease_expires_unix=time.time() + (lease_s or 30.0))

    async def decode(self, request_id: str, first_token_id: int) -> AsyncIterator[worker_pb2.TokenChunk]:
        if self.reservations.confirm(request_id) is None:
            raise WorkerError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"request {request_id} has no reservation here (expired or aborted)")
        outputs = self.engine.generate_remote(request_id, first_token_id)
        async for chunk in self.stream(outputs, request_id):
            yield chunk

    async def abort(self, request_id: str) -> bool:
        had = self.reservations.release(request_id) is not None
        await self.settle(self.engine.abort(request_id))
        return had

    def worker_stats(self) -> worker_pb2.WorkerStats:
        return self.stats(held=self.reservations.held_blocks, leases=len(self.reservations))

    async def _reap_leases(self) -> None:
        while True:
            await asyncio.sleep(LEASE_REAP_S)
            for lease in self.reservations.expire():
                log.warning("reservation of %s expired before Decode: freeing it", lease.key)
                await self.engine.abort(lease.key)

    async def _poll_notifications(self) -> None:
        while True:
            try:
                self.transport.poll_notifications()
            except Exception as e:  # a broken peer must not stop the poller
                log.warning("poll_notifications failed: %s", e)
            await asyncio.sleep(NOTIFY_POLL_S if len(self.reservations) else NOTIFY_IDLE_POLL_S)
