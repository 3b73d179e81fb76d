"""The decode worker: takes remote KV into reserved blocks and decodes with continuous batching.

Lifecycle of one disaggregated request on this worker:
  1. Reserve: check the request, allocate blocks for its prompt (state WAITING_FOR_REMOTE_KV,
     no compute; the prompt's longest prefix in our prefix cache reuses its cached blocks, which
     the prefill worker does not write and the fence never admits a write into) under a
     reservation lease, as a new *reservation* ``"<request id>#<epoch>"``
     (the engine's request id; a Reserve for an id that still has one supersedes it: a retry
     always gets a fresh reservation). The fence opens for it; the landing tracker expects every
     prompt position of every layer. Return the typed destination (our transport metadata, the
     block ids, the epoch and the lease's expiry). Blocks that do not fit: RESOURCE_EXHAUSTED.
  2. (the prefill worker writes the prompt's KV into those blocks, layer by layer and chunk by
     chunk, each write tagged with the reservation; its notifications feed our tracker)
  3. Decode(first_token): admitted only once our own landing tracker says every position of
     every layer landed (waiting briefly for the last notifications), and in debug mode once
     the KV checksum matches; the fence then closes (no write is accepted any more) and the
     request enters the running batch with its first token; the following tokens stream out.
  4. End: the engine frees the blocks on finish. Abort, lease expiry or a superseding Reserve
     *retire* a reservation: the fence closes, and the blocks are freed only once no write into
     them can still land — at once where the transport drops fenced writes itself (tcp, torch,
     local: after any frame being copied in is done), else (NIXL) once the sender settled
     (SETTLED / aborted notifications, or the router's Abort saying every prefill leg answered its
     Abort) or, at the latest, the reservation's expiry plus the transfer timeout (no write is
     posted after the expiry, and a posted one ends within the transfer timeout).
The agg role (no transport) is worker/agg.py.
The transport's notifications are polled every millisecond while reservations are open (NIXL
without its progress thread needs the receiver to poll; the other backends queue them until read),
and every 50 ms otherwise, so that an idle poller does not take CPU from decoding.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

import grpc

from kv_transfer.checksum import kv_checksum
from kv_transfer.fence import WriteFence, reservation_key
from kv_transfer.landing import LandingTracker, write_tag
from kv_transfer.leases import LeaseTable
from proto.pdserve.v1 import api_pb2, worker_pb2
from worker.core import WorkerCore, WorkerError

log = logging.getLogger(__name__)

NOTIFY_POLL_S = 0.001       # while KV may be arriving (reservations open)
NOTIFY_IDLE_POLL_S = 0.05   # otherwise: the poller must not cost the decode loop CPU
LEASE_REAP_S = 0.25
ADMIT_WAIT_S = 10.0         # Decode waits this long for the last landing notifications
DEFAULT_LEASE_S = 30.0
MAX_TOMBSTONES = 65536      # recent Aborts remembered (a Reserve they overtook is retired at once)
RETIRE_SLACK_S = 5.0        # NIXL: beyond expiry + transfer timeout before blocks are freed unsettled


@dataclass
class _Reservation:
    request_id: str
    key: str                 # engine request id and the writes' tag
    blocks: list[int]
    num_tokens: int
    expires_unix: float
    num_cached_blocks: int = 0       # leading blocks from our prefix cache: never written
    retire_at: float | None = None   # monotonic: free by then even unsettled (NIXL only)


class DecodeWorker(WorkerCore):
    def __init__(self, *args, transport, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.transport = transport
        self.reservations: LeaseTable[str] = LeaseTable()
        self.fence = WriteFence()
        transport.set_fence(self.fence)
        self.tracker = LandingTracker()
        self._live: dict[str, _Reservation] = {}      # request id -> its current reservation
        self._retiring: dict[str, _Reservation] = {}  # key -> closed, blocks not yet freed
        self._keys: dict[str, str] = {}               # request id -> engine id while decoding
        self._aborted: collections.OrderedDict[str, None] = collections.OrderedDict()  # recent Aborts
        self._epochs = itertools.count(int(time.time() * 1000) << 16)  # unique across restarts too
        self._tasks: list[asyncio.Task] = []
        self.counters = {"admitted": 0, "checksum_mismatch": 0, "not_landed": 0, "retired": 0,
                         "retired_unsettled": 0, "superseded": 0}

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._reap_leases()))
        self._tasks.append(asyncio.create_task(self._poll_notifications()))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.drain_background()

    @property
    def num_layers(self) -> int:
        return self.transport.cache.spec.num_layers

    async def reserve(self, request_id: str, prompt_ids: list[int], wire: api_pb2.SamplingOptions,
                      lease_s: float) -> worker_pb2.ReserveResponse:
        params = self.check(prompt_ids, wire)
        # shielded: a caller cancelled while the engine allocates must still leave a reservation
        # that its Abort (or the lease) finds; an Abort that overtook it retires it at once
        return await self.settle(self._reserve(request_id, prompt_ids, params, lease_s))

    async def _reserve(self, request_id: str, prompt_ids: list[int], params, lease_s: float
                       ) -> worker_pb2.ReserveResponse:
        old = self._live.pop(request_id, None)
        if old is not None:  # a retry: the old reservation is retired, the new one is fresh
            self.counters["superseded"] += 1
            self.reservations.release(request_id)
            await self._retire(old, senders_quiesced=False)
        key = reservation_key(request_id, next(self._epochs))
        try:
            reservation = await self.engine.reserve_remote(key, prompt_ids, params)
        except Exception as e:  # does not fit (no side effects, per the engine contract)
            raise WorkerError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"cannot reserve KV blocks: {e}") from None
        blocks, cached = list(reservation.block_ids), reservation.num_cached_blocks
        lease = lease_s or DEFAULT_LEASE_S
        res = _Reservation(request_id, key, blocks, len(prompt_ids), time.time() + lease, num_cached_blocks=cached)
        self.fence.open(key, blocks, writable_from=cached)  # shared cached blocks are never writable
        self.tracker.expect(key, self.num_layers, len(prompt_ids))
        if cached:  # positions held by our own prefix cache count as landed
            self.tracker.feed([write_tag(key, range(self.num_layers), 0, cached * self.config.block_size)])
        self._live[request_id] = res
        self.reservations.hold(request_id, blocks, lease)
        if request_id in self._aborted:  # the Abort came first: nothing may stay reserved
            await self.abort(request_id)
            raise WorkerError(grpc.StatusCode.CANCELLED, f"request {request_id} was aborted")
        dest = worker_pb2.KVDestination(worker_id=self.config.worker_id, kv_metadata=self.kv_metadata,
                                        block_ids=blocks, num_cached_blocks=cached,
                                        reservation_epoch=int(key.rpartition("#")[2]), expires_unix=res.expires_unix)
        return worker_pb2.ReserveResponse(destination=dest, lease_expires_unix=res.expires_unix)

    async def decode(self, request_id: str, first_token_id: int, kv_checksum_hex: str = ""
                     ) -> AsyncIterator[worker_pb2.TokenChunk]:
        res = self._live.get(request_id)
        if res is None:
            raise WorkerError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"request {request_id} has no reservation here (expired or aborted)")
        await self._await_landing(res)
        if self._live.get(request_id) is not res:  # aborted or superseded while we waited
            raise WorkerError(grpc.StatusCode.FAILED_PRECONDITION, f"the reservation of {request_id} ended")
        self._check_checksum(res, kv_checksum_hex)
        self._admit(res)
        outputs = self.engine.generate_remote(res.key, first_token_id)
        try:
            async for chunk in self.stream(outputs, res.key):
                yield chunk
        finally:
            self._keys.pop(request_id, None)

    async def _await_landing(self, res: _Reservation) -> None:
        """Admission rule: every prompt position of every layer landed, by our own tracker."""
        end = time.monotonic() + ADMIT_WAIT_S
        while True:
            self._feed()
            if self.tracker.is_complete(res.key) or self._live.get(res.request_id) is not res:
                return
            if time.monotonic() >= end:
                break
            await asyncio.sleep(NOTIFY_POLL_S)
        self.counters["not_landed"] += 1
        landed = len(self.tracker.landed_layers(res.key))
        await self.abort(res.request_id)
        raise WorkerError(grpc.StatusCode.UNAVAILABLE, f"the KV of {res.request_id} has not landed here "
                          f"({landed} of {self.num_layers} layers complete after {ADMIT_WAIT_S:g}s)")

    def _check_checksum(self, res: _Reservation, expected: str) -> None:
        if not (self.config.kv_checksum and expected):
            return
        got = kv_checksum(self.transport.cache, res.blocks, res.num_tokens, res.num_cached_blocks)
        if got != expected:
            self.counters["checksum_mismatch"] += 1
            self.spawn(self.abort(res.request_id))
            raise WorkerError(grpc.StatusCode.DATA_LOSS, f"the KV of {res.request_id} arrived corrupted "
                              f"(checksum {got} here, {expected} as sent)")

    def _admit(self, res: _Reservation) -> None:
        """The blocks pass from the reservation to the running request: no write is accepted any
        more (the tracker says every one landed, so none is still being copied in)."""
        self.fence.close(res.key)
        self.tracker.finish(res.key)
        self.reservations.confirm(res.request_id)
        del self._live[res.request_id]
        self._keys[res.request_id] = res.key
        self.counters["admitted"] += 1

    async def abort(self, request_id: str, senders_quiesced: bool = False) -> bool:
        self._aborted[request_id] = None
        while len(self._aborted) > MAX_TOMBSTONES:
            self._aborted.popitem(last=False)
        had = self.reservations.release(request_id) is not None
        res = self._live.pop(request_id, None)
        if res is not None:
            await self._retire(res, senders_quiesced)
            return True
        for r in self._retiring.values():  # already retiring: the router now says the senders are done
            if r.request_id == request_id and senders_quiesced:
                self.tracker.settle(r.key)
        key = self._keys.get(request_id, request_id)
        await self.settle(self.engine.abort(key))
        await self._free_retired()
        return had

    async def _retire(self, res: _Reservation, senders_quiesced: bool) -> None:
        """Close the reservation; free its blocks once no write into them can still land."""
        self.fence.close(res.key)
        if senders_quiesced:
            self.tracker.settle(res.key)
        if not self.transport.fences_writes:
            res.retire_at = time.monotonic() + max(0.0, res.expires_unix - time.time()) \
                + self.config.transfer_timeout_s + RETIRE_SLACK_S
        self.tracker.abort(res.key, deadline=res.retire_at if res.retire_at is not None else float("inf"))
        self._retiring[res.key] = res
        await self._free_retired()

    def _safe_to_free(self, res: _Reservation) -> bool:
        if self.transport.fences_writes:  # fenced writes are dropped: only a frame being copied in counts
            return not self.fence.writing(res.key)
        return self.tracker.is_settled(res.key) or time.monotonic() >= (res.retire_at or 0.0)

    async def _free_retired(self) -> None:
        self._feed()
        for key, res in list(self._retiring.items()):
            if not self._safe_to_free(res) or self._retiring.pop(key, None) is None:
                continue  # still unsafe, or freed by a concurrent caller while we awaited
            if not self.transport.fences_writes and not self.tracker.is_settled(key):
                self.counters["retired_unsettled"] += 1
                log.warning("reservation %s freed unsettled at its deadline (expiry + transfer timeout)", key)
            self.tracker.forget(key)
            self.counters["retired"] += 1
            await self.settle(self.engine.abort(key))

    def worker_stats(self) -> worker_pb2.WorkerStats:
        retiring = sum(len(r.blocks) for r in self._retiring.values())
        return self.stats(held=self.reservations.held_blocks + retiring,
                          leases=len(self.reservations) + len(self._retiring))

    def _feed(self) -> None:
        try:
            self.tracker.feed(self.transport.poll_notifications())
        except Exception as e:  # a broken peer must not stop the poller
            log.warning("poll_notifications failed: %s", e)

    async def _reap_leases(self) -> None:
        while True:
            await asyncio.sleep(LEASE_REAP_S)
            for lease in self.reservations.expire():
                res = self._live.pop(lease.key, None)
                if res is not None:
                    log.warning("reservation of %s expired before Decode: retiring it", lease.key)
                    await self._retire(res, senders_quiesced=False)
            if self._retiring:
                await self._free_retired()

    async def _poll_notifications(self) -> None:
        while True:
            self._feed()
            if self._retiring:
                await self._free_retired()
            busy = self._live or self._retiring
            await asyncio.sleep(NOTIFY_POLL_S if busy else NOTIFY_IDLE_POLL_S)
