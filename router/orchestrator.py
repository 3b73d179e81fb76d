"""The two-phase request flow across workers, with abort fan-out and one prefill retry.

Workers are chosen by router/routing.py (--router-policy; kv: prefix overlap against load for
agg and prefill workers, KV headroom for decode workers), each choice booked on its worker.

Disaggregated (uncached prompt >= --local-prefill-threshold tokens):
  1. choose a decode worker D (KV headroom); D.Reserve -> destination blocks
  2. choose a prefill worker P (kv cost); P.Prefill computes the prompt, writes its KV into
     D's blocks layer by layer and returns the first token once every write landed -> sent to the
     client at once. A failure here (before any token was sent) is retried once on another P.
  3. D.Decode admits the request into D's running batch and streams the rest; its first chunk
     confirms D has the KV, so P.Release drops P's hold.
Local (agg mode, or a prompt whose part D has not cached is short): D.Generate does prefill and
decode on one worker.

Whatever ends the request early (client cancel or disconnect, deadline, a stop string seen by
the router, a failed leg), every leg still open gets an Abort, sent in the background so that
cancellation of the caller cannot skip it; workers free everything on Abort and it is idempotent.
The prefill leg is aborted first (it returns once none of its writes can still land), then the
decode leg, so reserved blocks are never reused while a write into them is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc

from proto.pdserve.v1 import api_pb2, worker_pb2
from router.errors import ServiceError
from router.pool import WorkerHandle, WorkerPool
from router.prefix_index import PrefixIndex
from router.routing import Booking, RoutingConfig, Selector
from router.selection import use_local_prefill

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class FlowConfig:
    mode: str = "disagg"                 # "disagg" | "agg"
    local_prefill_threshold: int = 0     # prompts shorter than this skip the prefill worker
    reservation_lease_s: float = 120.0   # D frees a reservation whose Decode never starts (> prefill queueing + transfer timeout)
    hold_lease_s: float = 30.0           # P frees its hold if no Release comes
    prefill_attempts: int = 2            # tries on distinct prefill workers, all before any token was sent
    abort_timeout_s: float = ABORT_TIMEOUT_S  # per Abort / Release RPC

    def __post_init__(self) -> None:
        if self.mode not in ("disagg", "agg"):
            raise ValueError(f"mode must be disagg or agg, got {self.mode!r}")
        if self.prefill_attempts < 1:
            raise ValueError(f"prefill_attempts must be >= 1, got {self.prefill_attempts}")
        for name in ("reservation_lease_s", "hold_lease_s", "abort_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass
class Tokens:
    """New tokens from a worker; the last one carries the finish reason and the worker's usage."""

    token_ids: list[int]
    finish_reason: str | None = None
    usage: api_pb2.Usage | None = None
    kv_bytes: int = 0
    transfer_seconds: float = 0.0
    logprobs: list[api_pb2.TokenLogprob] = field(default_factory=list)  # one per token when asked for


@dataclass
class _Legs:
    """The workers a request has open, to abort or release when it ends."""

    request_id: str
    open: dict[str, WorkerHandle] = field(default_factory=dict)
    finished: bool = False


class Orchestrator:
    def __init__(self, pool: WorkerPool, config: FlowConfig, selector: Selector | None = None) -> None:
        self._pool = pool
        self.config = config
        self.selector = selector or Selector(pool, PrefixIndex(), RoutingConfig())
        self._background: set[asyncio.Task] = set()

    async def run(self, request_id: str, prompt_ids: list[int], sampling: api_pb2.SamplingOptions,
                  deadline: float) -> AsyncIterator[Tokens]:
        """Stream the request's tokens; raises ServiceError. `deadline` is in loop.time() seconds."""
        agg = self.config.mode == "agg"
        max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else 16
        booking = self.selector.choose("agg" if agg else "decode", prompt_ids, max_tokens, by_headroom=not agg)
        d = booking.worker
        legs = _Legs(request_id)
        uncached = len(prompt_ids) - booking.overlap_tokens  # conditional disaggregation decides on this
        try:
            if agg or use_local_prefill(uncached, self.config.local_prefill_threshold):
                flow = self._local(d, legs, prompt_ids, sampling, deadline)
            else:
                flow = self._disagg(d, legs, prompt_ids, sampling, deadline)
            async with contextlib.aclosing(flow):
                async for tokens in flow:
                    booking.prefilled()
                    yield tokens
        finally:
            booking.done()
            if not legs.finished and legs.open:
                self._spawn(self._abort_legs(list(legs.open.values()), request_id))

    async def drain(self) -> None:
        """Wait for background aborts and releases (shutdown, tests)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    async def _local(self, d: WorkerHandle, legs: _Legs, prompt_ids: list[int],
                     sampling: api_pb2.SamplingOptions, deadline: float) -> AsyncIterator[Tokens]:
        legs.open[d.id] = d
        req = worker_pb2.WorkerGenerateRequest(request_id=legs.request_id, prompt_token_ids=prompt_ids,
                                               sampling=sampling)
        stream = self._stream(d, d.stub.Generate(req, timeout=_remaining(deadline)), legs, "decode")
        async with contextlib.aclosing(stream):
            async for tokens in stream:
                yield tokens

    async def _disagg(self, d: WorkerHandle, legs: _Legs, prompt_ids: list[int],
                      sampling: api_pb2.SamplingOptions, deadline: float) -> AsyncIterator[Tokens]:
        rid = legs.request_id
        legs.open[d.id] = d
        reserve = await _unary(d, "decode", d.stub.Reserve, worker_pb2.ReserveRequest(
            request_id=rid, prompt_token_ids=prompt_ids, sampling=sampling,
            lease_seconds=self.config.reservation_lease_s), deadline)
        p, first = await self._prefill_with_retry(legs, prompt_ids, sampling, reserve.destination, deadline)
        first_tokens = Tokens([first.first_token_id], first.finish_reason or None, first.usage, first.kv_bytes,
                              first.transfer_seconds, [first.first_logprob] if first.HasField("first_logprob") else [])
        if first.finish_reason:  # the first token ended it: D's reservation is not needed
            legs.finished = True
            self._spawn(self._release(p, rid))
            self._spawn(self._abort(d, rid))
            yield first_tokens
            return
        yield first_tokens
        call = d.stub.Decode(worker_pb2.DecodeRequest(request_id=rid, first_token_id=first.first_token_id),
                             timeout=_remaining(deadline))
        released = False
        stream = self._stream(d, call, legs, "decode")
        async with contextlib.aclosing(stream):
            async for tokens in stream:
                if not released:
                    released = True
                    legs.open.pop(p.id, None)
                    self._spawn(self._release(p, rid))
                yield tokens

    async def _prefill_with_retry(self, legs: _Legs, prompt_ids: list[int], sampling: api_pb2.SamplingOptions,
                                  dest: worker_pb2.KVDestination, deadline: float
                                  ) -> tuple[WorkerHandle, worker_pb2.PrefillResponse]:
        req = worker_pb2.PrefillRequest(request_id=legs.request_id, prompt_token_ids=prompt_ids, sampling=sampling,
                                        destination=dest, hold_seconds=self.config.hold_lease_s)
        tried: set[str] = set()
        error: ServiceError | None = None
        attempts = self.config.prefill_attempts
        for _ in range(attempts):  # every attempt happens before any token was sent
            try:
                booking: Booking = self.selector.choose("prefill", prompt_ids, 0, exclude=frozenset(tried))
            except ServiceError as e:
                error = error or e
                break
            p, wid = booking.worker, booking.worker.id
            tried.add(wid)
            legs.open[wid] = p
            try:
                return p, await _unary(p, "prefill", p.stub.Prefill, req, deadline)
            except ServiceError as e:
                if e.code != grpc.StatusCode.UNAVAILABLE:
                    raise
                error = e
                legs.open.pop(wid)
                self._spawn(self._abort(p, legs.request_id))
                log.warning("prefill of %s failed on %s, %s: %s", legs.request_id, wid,
                            "retrying" if len(tried) < attempts else "giving up", e.message)
            finally:
                booking.done()
        raise error or ServiceError(grpc.StatusCode.UNAVAILABLE, "no live prefill worker; retry later")

    async def _stream(self, w: WorkerHandle, call, legs: _Legs, leg: str) -> AsyncIterator[Tokens]:
        try:
            async for chunk in call:
                finish = chunk.finish_reason or None
                if finish:
                    legs.finished = True
                yield Tokens(list(chunk.token_ids), finish, chunk.usage if chunk.HasField("usage") else None,
                             logprobs=list(chunk.logprobs))
                if finish:
                    return
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                self._pool.mark_dead(w.id)
            raise ServiceError.from_rpc(e, leg) from None
        finally:
            call.cancel()
        raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"{leg} worker {w.id} ended the stream without finishing")

    async def _abort_legs(self, workers: list[WorkerHandle], request_id: str) -> None:
        """Prefill legs first: once a prefill worker has answered an Abort, none of its writes can
        still land, so the decode worker may then reuse the blocks it frees."""
        senders = [w for w in workers if w.endpoint.role == "prefill"]
        await asyncio.gather(*(self._abort(w, request_id) for w in senders))
        await asyncio.gather(*(self._abort(w, request_id) for w in workers if w not in senders))

    async def _abort(self, w: WorkerHandle, request_id: str) -> None:
        try:
            await w.stub.Abort(worker_pb2.AbortRequest(request_id=request_id), timeout=self.config.abort_timeout_s)
        except grpc.RpcError as e:  # a dead worker frees everything anyway
            log.info("abort of %s on %s failed: %s", request_id, w.id, e.code())
        except Exception as e:  # noqa: BLE001  (grpc's UsageError: the worker left the pool, its channel closed)
            log.info("abort of %s on %s not sent: %s", request_id, w.id, e)

    async def _release(self, w: WorkerHandle, request_id: str) -> None:
        try:
            await w.stub.Release(worker_pb2.ReleaseRequest(request_id=request_id), timeout=self.config.abort_timeout_s)
        except grpc.RpcError as e:  # the hold lease frees it
            log.info("release of %s on %s failed: %s", request_id, w.id, e.code())
        except Exception as e:  # noqa: BLE001  (the worker left the pool, its channel closed)
            log.info("release of %s on %s not sent: %s", request_id, w.id, e)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


async def _unary(w: WorkerHandle, leg: str, method, request, deadline: float):
    try:
        return await method(request, timeout=_remaining(deadline))
    except grpc.RpcError as e:
        raise ServiceError.from_rpc(e, leg) from None


def _remaining(deadline: float) -> float:
    left = deadline - asyncio.get_running_loop().time()
    if left <= 0:
        raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
    return left
