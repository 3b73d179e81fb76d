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
  4. Abort at any point cancels the writes, waits until none can still land, and frees everything.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from kv_transfer.leases import LeaseTable
from prefill_worker.kv_push import KVPusher, TransferFailed
from proto.pdserve.v1 import worker_pb2
from proto.stop import token_stop_reason
from worker.core import WorkerCore, WorkerError, logprob_pb, usage_pb

log = logging.getLogger(__name__)

LEASE_REAP_S = 0.25


class PrefillWorker(WorkerCore):
    def __init__(self, *args, transport, pusher: KVPusher, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.transport = transport
        self.pusher = pusher
        self.holds: LeaseTable[str] = LeaseTable()
        self._peers: dict[bytes, str] = {}
        self._tasks: list[asyncio.Task] = []
        self.engine.set_layer_hook(pusher.on_layer)

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._reap_holds()))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.drain_background()

    async def prefill(self, req: worker_pb2.PrefillRequest) -> worker_pb2.PrefillResponse:
        rid, ids = req.request_id, list(req.prompt_token_ids)
        params = self.check(ids, req.sampling)
        first_params = self.check(ids, req.sampling, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        dest = req.destination
        if not 0 <= dest.num_cached_blocks <= len(dest.block_ids):
            raise WorkerError(grpc.StatusCode.INVALID_ARGUMENT, f"destination.num_cached_blocks must be within "
                                                                f"0..{len(dest.block_ids)}, got {dest.num_cached_blocks}")
        peer = self._peer(dest.kv_metadata)
        self.pusher.begin(rid, peer, list(dest.block_ids), dest.num_cached_blocks)
        done = False
        try:
            final = None
            async for out in self.engine.generate(ids, first_params, rid, hold_kv=True):
                final = out
            if final is None or not final.new_token_ids or final.finish_reason in ("error", "abort"):
                raise WorkerError(grpc.StatusCode.UNAVAILABLE, f"prefill of {rid} ended without a token")
            self.metrics.observe(final)
            nbytes, seconds = await self.pusher.finish(rid, list(final.kv_block_ids or []))
            self.holds.hold(rid, list(final.kv_block_ids or []), req.hold_seconds or None)
            done = True
        except TransferFailed as e:
            raise WorkerError(grpc.StatusCode.UNAVAILABLE, f"KV transfer to {req.destination.worker_id} failed: {e}")
        finally:
            if not done:  # cancelled, failed: nothing may stay held or in flight
                self.spawn(self._abort_push(rid))
        first = final.new_token_ids[0]
        response = worker_pb2.PrefillResponse(first_token_id=first,
                                              finish_reason=self._finish_reason(first, ids, params),
                                              usage=usage_pb(final.usage), kv_bytes=nbytes, transfer_seconds=seconds)
        if final.logprobs:
            response.first_logprob.CopyFrom(logprob_pb(final.logprobs[0]))
        return response

    def _finish_reason(self, token: int, prompt_ids: list[int], params) -> str:
        """Whether the first token already ends the request (as the engine would decide)."""
        return token_stop_reason(token, 1, params, self.model_config.eos_token_ids, len(prompt_ids) + 1,
                                 self.max_model_len) or ""

    async def release(self, request_id: str) -> None:
        if self.holds.confirm(request_id) is not None:
            await self.settle(self.engine.release_kv(request_id))

    async def abort(self, request_id: str) -> bool:
        had = request_id in self.holds
        await self.settle(self._abort_push(request_id))
        return had

    async def _abort_push(self, request_id: str) -> None:
        await self.pusher.cancel(request_id)  # first: no write may still read our blocks
        self.holds.release(request_id)
        await self.engine.abort(request_id)

    def worker_stats(self) -> worker_pb2.WorkerStats:
        return self.stats(held=self.holds.held_blocks, leases=len(self.holds))

    def _peer(self, metadata: bytes) -> str:
        if metadata not in self._peers:
            try:
                self._peers[metadata] = self.transport.add_peer(metadata)
            except Exception as e:
                raise WorkerError(grpc.StatusCode.FAILED_PRECONDITION, f"cannot connect to the decode worker: {e}")
        return self._peers[metadata]

    async def _reap_holds(self) -> None:
        while True:
            await asyncio.sleep(LEASE_REAP_S)
            for lease in self.holds.expire():
                log.info("hold of %s expired without a release: freeing it", lease.key)
                await self.engine.release_kv(lease.key)
