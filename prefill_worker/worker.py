"""The prefill worker: computes prompts (chunked, batched across requests by the engine), streams
their KV layer by layer into a decode worker's reserved blocks, and returns the first token.

Lifecycle of one request on this worker:
  1. Prefill: check the request; connect to the destination's transport (once per peer; an
     incompatible cache is refused at this handshake); register the push, then run the engine with
     max_tokens=1 and hold_kv=True: its layer hook writes each layer's new blocks as soon as the
     layer is computed (prefill_worker/kv_push.py).
  2. When the engine has sampled the first token, send blocks it did not compute (prefix-cache
     hits) and wait until the transport confirms every write landed; only then answer, so the
     router's Decode call always finds the KV complete. A failed write fails the call
     (UNAVAILABLE) and frees everything: the router retries once on another prefill worker.
  3. Hold: the blocks stay held under a hold lease until Release (the decode worker has admitted
     the request) or expiry; then the engine frees them (full blocks may stay in its prefix cache).
  4. Abort at any point cancels the writes, waits until none can still land, and frees everything;
     a second Abort while one is in progress waits for the same cancel. An aborted request id is
     remembered (a tombstone): a Prefill for it that arrives later (it overtook the Prefill) is
     refused, so once Abort answered, no write of that request can start here, ever.
The fence (docs/architecture.md): the destination names its reservation (epoch) and expiry; every
write is tagged with the reservation, none starts after the expiry, and work whose reservation
expired before it ran is dropped (UNAVAILABLE: the router retries with a fresh reservation).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

import grpc

from kv_transfer.checksum import kv_checksum
from kv_transfer.fence import reservation_key
from kv_transfer.leases import LeaseTable
from prefill_worker.kv_push import KVPusher, TransferFailed
from proto.pdserve.v1 import worker_pb2
from proto.stop import token_stop_reason
from worker.core import WorkerCore, WorkerError, logprob_pb, usage_pb

log = logging.getLogger(__name__)

LEASE_REAP_S = 0.25
TOMBSTONE_S = 600.0         # how long an aborted request id is refused (>> any reservation lease)
MAX_TOMBSTONES = 65536


class PrefillWorker(WorkerCore):
    def __init__(self, *args, transport, pusher: KVPusher, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.transport = transport
        self.pusher = pusher
        self.holds: LeaseTable[str] = LeaseTable()
        self._tasks: list[asyncio.Task] = []
        self._tombstones: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.dropped_expired = 0
        self.engine.set_layer_hook(pusher.on_layer)

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._reap_holds()))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.drain_background()

    async def prefill(self, req: worker_pb2.PrefillRequest) -> worker_pb2.PrefillResponse:
        rid, ids, dest = req.request_id, list(req.prompt_token_ids), req.destination
        params = self.check(ids, req.sampling)
        first_params = self.check(ids, req.sampling, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        if self._aborted(rid):
            raise WorkerError(grpc.StatusCode.CANCELLED, f"request {rid} was aborted before its prefill arrived")
        expires = dest.expires_unix or None
        if expires is not None and time.time() >= expires:
            self.dropped_expired += 1
            raise WorkerError(grpc.StatusCode.UNAVAILABLE, f"the reservation of {rid} expired before its prefill ran")
        if not 0 <= dest.num_cached_blocks <= len(dest.block_ids):
            raise WorkerError(grpc.StatusCode.INVALID_ARGUMENT, f"destination.num_cached_blocks must be within "
                                                                f"0..{len(dest.block_ids)}, got {dest.num_cached_blocks}")
        peer = self._peer(dest.kv_metadata)
        key = reservation_key(rid, dest.reservation_epoch) if dest.reservation_epoch else rid
        self.pusher.begin(rid, peer, list(dest.block_ids), dest.num_cached_blocks, key, expires)
        done = False
        try:
            final = await self._run_until(expires, self._prefill_once(ids, first_params, rid))
            self.metrics.observe(final)
            blocks = list(final.kv_block_ids or [])
            nbytes, seconds = await self.pusher.finish(rid, blocks)
            checksum = kv_checksum(self.transport.cache, blocks, len(ids), dest.num_cached_blocks) \
                if self.config.kv_checksum else ""
            self.holds.hold(rid, blocks, req.hold_seconds or None)
            done = True
        except TransferFailed as e:
            raise WorkerError(grpc.StatusCode.UNAVAILABLE, f"KV transfer to {dest.worker_id} failed: {e}")
        except TimeoutError:
            self.dropped_expired += 1
            raise WorkerError(grpc.StatusCode.UNAVAILABLE, f"the reservation of {rid} expired during its prefill")
        finally:
            if not done:  # cancelled, failed: nothing may stay held or in flight
                self.spawn(self._abort_push(rid))
        first = final.new_token_ids[0]
        response = worker_pb2.PrefillResponse(first_token_id=first,
                                              finish_reason=self._finish_reason(first, ids, params),
                                              usage=usage_pb(final.usage), kv_bytes=nbytes, transfer_seconds=seconds,
                                              kv_checksum=checksum)
        if final.logprobs:
            response.first_logprob.CopyFrom(logprob_pb(final.logprobs[0]))
        return response

    async def _prefill_once(self, ids: list[int], params, rid: str):
        final = None
        async for out in self.engine.generate(ids, params, rid, hold_kv=True):
            final = out
        if final is None or not final.new_token_ids or final.finish_reason in ("error", "abort"):
            raise WorkerError(grpc.StatusCode.UNAVAILABLE, f"prefill of {rid} ended without a token")
        return final

    @staticmethod
    async def _run_until(expires_unix: float | None, coro):
        """Run ``coro``; past the reservation's expiry (wall clock) it is cancelled (TimeoutError)."""
        if expires_unix is None:
            return await coro
        loop = asyncio.get_running_loop()
        async with asyncio.timeout_at(loop.time() + max(0.0, expires_unix - time.time())):
            return await coro

    def _finish_reason(self, token: int, prompt_ids: list[int], params) -> str:
        """Whether the first token already ends the request (as the engine would decide)."""
        return token_stop_reason(token, 1, params, self.model_config.eos_token_ids, len(prompt_ids) + 1,
                                 self.max_model_len) or ""

    async def release(self, request_id: str) -> None:
        if self.holds.confirm(request_id) is not None:
            await self.settle(self.engine.release_kv(request_id))

    async def abort(self, request_id: str, senders_quiesced: bool = False) -> bool:
        had = request_id in self.holds
        self._tombstone(request_id)
        await self.settle(self._abort_push(request_id))
        return had

    def _tombstone(self, request_id: str) -> None:
        now = time.monotonic()
        self._tombstones[request_id] = now
        self._tombstones.move_to_end(request_id)
        while self._tombstones and (len(self._tombstones) > MAX_TOMBSTONES
                                    or next(iter(self._tombstones.values())) < now - TOMBSTONE_S):
            self._tombstones.popitem(last=False)

    def _aborted(self, request_id: str) -> bool:
        at = self._tombstones.get(request_id)
        return at is not None and at >= time.monotonic() - TOMBSTONE_S

    async def _abort_push(self, request_id: str) -> None:
        await self.pusher.cancel(request_id)  # first: no write may still read our blocks
        self.holds.release(request_id)
        await self.engine.abort(request_id)

    def worker_stats(self) -> worker_pb2.WorkerStats:
        return self.stats(held=self.holds.held_blocks, leases=len(self.holds))

    def _peer(self, metadata: bytes) -> str:
        """The destination's peer id (``add_peer`` is idempotent, and reconnects a dropped peer)."""
        try:
            return self.transport.add_peer(metadata)
        except Exception as e:
            raise WorkerError(grpc.StatusCode.FAILED_PRECONDITION, f"cannot connect to the decode worker: {e}")

    async def _reap_holds(self) -> None:
        while True:
            await asyncio.sleep(LEASE_REAP_S)
            for lease in self.holds.expire():
                log.info("hold of %s expired without a release: freeing it", lease.key)
                await self.engine.release_kv(lease.key)
