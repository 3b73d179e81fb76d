"""The request flow across workers: two-phase disaggregation, prefill failover, decode migration.

Workers are chosen by router/routing.py (--router-policy; kv: prefix overlap against load for
agg and prefill workers, KV headroom for decode workers), each choice booked on its worker.
Every leg has a timeout from its work (router/leg_timeouts.py: queue, prompt length, the
worker's measured speed), bounded by the request's deadline; a leg past it counts as a lost worker.

One attempt on a decode-capable worker D (``_attempt``):
  Disaggregated (a live prefill worker and an uncached prompt >= --local-prefill-threshold):
    1. D.Reserve -> destination blocks, a fresh reservation (its own worker request id) per try.
    2. choose a prefill worker P; P.Prefill computes the prompt, writes its KV into D's blocks
       layer by layer and returns the first token once every write landed -> sent to the client
       at once. A prefill that fails (UNAVAILABLE) or runs past its leg timeout is aborted and
       tried on another P with a fresh reservation (prefill attempts, all before any token was
       sent); the old reservation is aborted after its P's abort (the fence order below). When no
       P is left, D prefills the prompt itself (Local).
    3. D.Decode admits the request into D's running batch and streams the rest; its first chunk
       confirms D has the KV, so P.Release drops P's hold.
  Local (agg mode, a short uncached prompt, no live prefill worker): D.Generate does both.
Migration (``run``): when a decode-side leg's worker is lost (Reserve or the stream fails with
UNAVAILABLE, or a chunk is late past its leg timeout while the worker has nothing else to do, or
while its engine completes no step within the stall bound: router/leg_timeouts.py), the router
aborts that attempt's legs and
re-issues the prompt plus every token already streamed to another decode-capable worker
(D'.Generate with resume_token_ids: recomputed there as output, not emitted again), and the
client's stream continues without an error. At most --migration-limit times per request; the
final usage's recomputed_tokens counts the prompt and resumed tokens computed again (prefill
retries included). With greedy or seeded sampling the text equals an uninterrupted run.
Each migration, prefill failover and suspicion is reported with its reason to the pool's
FailoverEvents (router/failover_events.py; the router's Prometheus counters).

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
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc

from proto.pdserve.v1 import api_pb2, worker_pb2
from router.errors import ServiceError
from router.failover_events import (LEG_TIMEOUT, NO_PREFILL_WORKER, NO_PROGRESS, STREAM_ENDED, WORKER_ERROR,
                                    FailoverEvents)
from router.leg_timeouts import LegTimeouts
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
    migration_limit: int = 3             # --migration-limit: moves of one request to another decode-capable worker
    leg_timeouts: LegTimeouts = LegTimeouts()

    def __post_init__(self) -> None:
        if self.mode not in ("disagg", "agg"):
            raise ValueError(f"mode must be disagg or agg, got {self.mode!r}")
        if self.prefill_attempts < 1:
            raise ValueError(f"prefill_attempts must be >= 1, got {self.prefill_attempts}")
        if self.migration_limit < 0:
            raise ValueError(f"--migration-limit must be >= 0, got {self.migration_limit}")
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


class _WorkerLost(Exception):
    """A decode-side leg lost its worker (failed with UNAVAILABLE, or late past its leg timeout):
    the request may migrate. reason: router/failover_events.py."""

    def __init__(self, error: ServiceError, reason: str = WORKER_ERROR) -> None:
        super().__init__(error.message)
        self.error = error
        self.reason = reason

    @classmethod
    def of(cls, error: ServiceError) -> "_WorkerLost":
        return cls(error, getattr(error, "reason", WORKER_ERROR))


class _LegLate(ServiceError):
    """A leg given up on its worker for lateness (UNAVAILABLE): reason LEG_TIMEOUT or NO_PROGRESS."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)
        self.reason = reason


@dataclass
class _Legs:
    """One request across its attempts: the legs it has open (worker, worker request id), to
    abort or release when it ends, the tokens the client already has, what was recomputed."""

    request_id: str
    prompt_ids: list[int]
    sampling: api_pb2.SamplingOptions
    deadline: float
    open: dict[tuple[str, str], WorkerHandle] = field(default_factory=dict)  # (worker id, its request id)
    finished: bool = False
    sent: list[int] = field(default_factory=list)
    recomputed: int = 0
    lost: set[str] = field(default_factory=set)   # decode-capable workers this request left
    pending: list[asyncio.Task] = field(default_factory=list)  # Reserves in flight: abort only after they answer
    _ids: int = 0

    def new_id(self) -> str:
        """A worker request id for the next leg: the request id, then request id~1, ~2... (a fresh
        reservation or a migrated stream never reuses an id a worker may still hold)."""
        self._ids += 1
        return self.request_id if self._ids == 1 else f"{self.request_id}~{self._ids - 1}"

    def take_open(self) -> tuple[list[tuple[WorkerHandle, str]], list[asyncio.Task]]:
        """The open legs and the Reserves still in flight, handed to one abort."""
        legs, self.open = [(w, wrid) for (_, wrid), w in self.open.items()], {}
        pending, self.pending = self.pending, []
        return legs, pending

    def add(self, w: WorkerHandle, wrid: str) -> None:
        self.open[(w.id, wrid)] = w


class Orchestrator:
    def __init__(self, pool: WorkerPool, config: FlowConfig, selector: Selector | None = None,
                 events: FailoverEvents | None = None) -> None:
        """events: where migrations and prefill failovers are reported (default: the pool's)."""
        self._pool = pool
        self.config = config
        self.selector = selector or Selector(pool, PrefixIndex(), RoutingConfig())
        self.events = events or pool.events
        self._background: set[asyncio.Task] = set()
        self.migrations = 0        # requests moved to another decode-capable worker (tests, metrics)
        self.prefill_failovers = 0  # prefill legs retried elsewhere or prefilled locally

    async def run(self, request_id: str, prompt_ids: list[int], sampling: api_pb2.SamplingOptions,
                  deadline: float) -> AsyncIterator[Tokens]:
        """Stream the request's tokens; raises ServiceError. `deadline` is in loop.time() seconds."""
        role = "agg" if self.config.mode == "agg" else "decode"
        max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else 16
        legs = _Legs(request_id, prompt_ids, sampling, deadline)
        try:
            while True:  # one attempt per decode-capable worker, until it finishes or the limit
                booking = self.selector.choose(role, prompt_ids + legs.sent, max_tokens - len(legs.sent),
                                               by_headroom=role == "decode", exclude=frozenset(legs.lost))
                try:
                    async with contextlib.aclosing(self._attempt(booking, legs)) as flow:
                        async for tokens in flow:
                            booking.prefilled()
                            legs.sent += tokens.token_ids
                            if tokens.finish_reason and legs.recomputed:
                                tokens.usage = _with_recomputed(tokens.usage, legs.recomputed)
                            yield tokens
                    return
                except _WorkerLost as e:
                    if len(legs.lost) >= self.config.migration_limit:
                        raise e.error from None
                    self._migrate(legs, booking.worker, e)
                finally:
                    booking.done()
        finally:
            if not legs.finished and legs.open:
                self._spawn(self._abort_legs(*legs.take_open()))

    def _migrate(self, legs: _Legs, d: WorkerHandle, lost: _WorkerLost) -> None:
        """Leave worker d: abort this attempt's legs (fence order), recompute elsewhere."""
        legs.lost.add(d.id)
        self.migrations += 1
        self.events.migration(lost.reason)
        self._spawn(self._abort_legs(*legs.take_open()))
        legs.recomputed += len(legs.prompt_ids) + len(legs.sent)
        log.warning("request %s: %s lost after %d tokens (%s); migrating", legs.request_id, d.id, len(legs.sent),
                    lost.error.message)

    async def drain(self) -> None:
        """Wait for background aborts and releases (shutdown, tests)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    def _attempt(self, booking: Booking, legs: _Legs) -> AsyncIterator[Tokens]:
        d = booking.worker
        if legs.sent:  # a migrated request: recompute prompt + the streamed tokens on d
            return self._local(d, legs)
        uncached = len(legs.prompt_ids) - booking.overlap_tokens  # conditional disaggregation decides on this
        if self.config.mode == "agg" or use_local_prefill(uncached, self.config.local_prefill_threshold) \
                or not self._live("prefill"):
            return self._local(d, legs)
        return self._disagg(d, legs)

    def _live(self, role: str) -> bool:
        return any(w.alive for w in self._pool.workers(role))

    async def _local(self, d: WorkerHandle, legs: _Legs) -> AsyncIterator[Tokens]:
        wrid = legs.new_id()
        req = worker_pb2.WorkerGenerateRequest(request_id=wrid, prompt_token_ids=legs.prompt_ids,
                                               sampling=legs.sampling, resume_token_ids=legs.sent)
        queued = _prefill_tokens(d) + len(legs.sent)
        first_timeout = self.config.leg_timeouts.prefill_s(d.rate, queued)
        async for tokens in self._decode_stream(d, wrid, legs, d.stub.Generate, req, first_timeout, queued):
            yield tokens

    async def _disagg(self, d: WorkerHandle, legs: _Legs) -> AsyncIterator[Tokens]:
        got = await self._prefill_with_retry(d, legs)
        if got is None:  # no prefill worker could do it: D prefills the prompt itself
            self.prefill_failovers += 1
            self.events.prefill_failover(NO_PREFILL_WORKER)
            legs.recomputed += len(legs.prompt_ids)
            async for tokens in self._local(d, legs):
                yield tokens
            return
        p, wrid, first = got
        first_tokens = Tokens([first.first_token_id], first.finish_reason or None, first.usage, first.kv_bytes,
                              first.transfer_seconds, [first.first_logprob] if first.HasField("first_logprob") else [])
        if first.finish_reason:  # the first token ended it: D's reservation is not needed
            legs.finished = True
            legs.open.clear()
            self._spawn(self._release(p, legs.request_id))
            self._spawn(self._abort(d, wrid))
            yield first_tokens
            return
        yield first_tokens
        req = worker_pb2.DecodeRequest(request_id=wrid, first_token_id=first.first_token_id,
                                       kv_checksum=first.kv_checksum)  # --kv-checksum: D compares before decoding
        released = False
        stream = self._decode_stream(d, wrid, legs, d.stub.Decode, req, self.config.leg_timeouts.chunk_s(d.rate))
        async with contextlib.aclosing(stream):
            async for tokens in stream:
                if not released:
                    released = True
                    legs.open.pop((p.id, legs.request_id), None)
                    self._spawn(self._release(p, legs.request_id))
                yield tokens

    async def _reserve(self, d: WorkerHandle, legs: _Legs) -> tuple[str, worker_pb2.KVDestination]:
        """A fresh reservation on d; its loss (UNAVAILABLE, late) is d's loss."""
        wrid = legs.new_id()
        legs.add(d, wrid)
        req = worker_pb2.ReserveRequest(request_id=wrid, prompt_token_ids=legs.prompt_ids, sampling=legs.sampling,
                                        lease_seconds=self.config.reservation_lease_s)
        # shielded: a client cancel while D allocates must not let the Abort overtake the Reserve
        # (D would then keep a reservation nobody aborts until its lease ends); the abort awaits it
        task = asyncio.ensure_future(_unary(d, "decode", d.stub.Reserve, req, legs.deadline,
                                            self.config.leg_timeouts.floor_s))
        legs.pending.append(task)
        try:
            reply = await asyncio.shield(task)
        except ServiceError as e:
            if e.code == grpc.StatusCode.UNAVAILABLE:
                raise _WorkerLost.of(e) from None
            raise
        return wrid, reply.destination

    async def _prefill_with_retry(self, d: WorkerHandle, legs: _Legs
                                  ) -> tuple[WorkerHandle, str, worker_pb2.PrefillResponse] | None:
        """(P, D's reservation id, P's answer), or None when no prefill worker could do it.

        The prefill leg's request id on P is the request id (P's holds are keyed by it); every
        try has its own reservation on D, so a late write of an abandoned try can only land in
        blocks nobody else owns yet."""
        tried: set[str] = set()
        for attempt in range(self.config.prefill_attempts):  # every attempt happens before any token was sent
            try:
                booking: Booking = self.selector.choose("prefill", legs.prompt_ids, 0, exclude=frozenset(tried))
            except ServiceError:
                return None
            p = booking.worker
            tried.add(p.id)
            try:
                wrid, dest = await self._reserve(d, legs)
                if attempt:
                    legs.recomputed += len(legs.prompt_ids)
                legs.add(p, legs.request_id)
                return p, wrid, await self._prefill(p, legs, dest)
            except ServiceError as e:
                if e.code != grpc.StatusCode.UNAVAILABLE:
                    raise
                self.prefill_failovers += 1
                self.events.prefill_failover(getattr(e, "reason", WORKER_ERROR))
                self._spawn(self._abort_legs(*legs.take_open()))  # P first, then this try's reservation
                log.warning("prefill of %s failed on %s: %s; %s", legs.request_id, p.id, e.message,
                            "retrying" if attempt + 1 < self.config.prefill_attempts else "prefilling on the decode worker")
            finally:
                booking.done()
        return None

    async def _prefill(self, p: WorkerHandle, legs: _Legs, dest: worker_pb2.KVDestination
                       ) -> worker_pb2.PrefillResponse:
        req = worker_pb2.PrefillRequest(request_id=legs.request_id, prompt_token_ids=legs.prompt_ids,
                                        sampling=legs.sampling, destination=dest, hold_seconds=self.config.hold_lease_s)
        queued = _prefill_tokens(p)
        start = time.monotonic()
        reply = await _unary(p, "prefill", p.stub.Prefill, req, legs.deadline,
                             self.config.leg_timeouts.prefill_s(p.rate, queued))
        p.rate.observe_prefill(queued, time.monotonic() - start)
        return reply

    async def _decode_stream(self, w: WorkerHandle, wrid: str, legs: _Legs, method, request, first_timeout: float,
                             queued: int = 0) -> AsyncIterator[Tokens]:
        """Relay a Decode/Generate stream; each chunk must come within its leg timeout (the first
        within first_timeout). A failure or a late chunk raises _WorkerLost."""
        legs.add(w, wrid)
        call = method(request, timeout=_remaining(legs.deadline))
        timeout, start, last = first_timeout, time.monotonic(), None
        try:
            while True:
                stall = self.config.leg_timeouts.stall_s(w.rate, w.info.max_step_tokens)
                chunk = await _read(call, w, "decode", legs.deadline, timeout, stall)
                if chunk is grpc.aio.EOF:
                    raise _WorkerLost(ServiceError(grpc.StatusCode.UNAVAILABLE,
                                                   f"decode worker {w.id} ended the stream without finishing"),
                                      STREAM_ENDED)
                now = time.monotonic()
                if last is None and queued:
                    w.rate.observe_prefill(queued, now - start)
                elif last is not None:
                    w.rate.observe_gap(now - last)
                last, timeout = now, self.config.leg_timeouts.chunk_s(w.rate)
                finish = chunk.finish_reason or None
                if finish:
                    legs.finished = True
                yield Tokens(list(chunk.token_ids), finish, chunk.usage if chunk.HasField("usage") else None,
                             logprobs=list(chunk.logprobs))
                if finish:
                    return
        except ServiceError as e:
            if e.code == grpc.StatusCode.UNAVAILABLE:
                raise _WorkerLost.of(e) from None
            raise
        finally:
            call.cancel()

    async def _abort_legs(self, legs: list[tuple[WorkerHandle, str]], pending: list[asyncio.Task] = ()) -> None:
        """After the Reserves still in flight answered, prefill legs first: once a prefill worker
        has answered an Abort, none of its writes can still land, so the decode worker may then
        reuse the blocks it frees."""
        await asyncio.gather(*pending, return_exceptions=True)
        answered = await asyncio.gather(*(self._abort(w, rid) for w, rid in legs if w.endpoint.role == "prefill"))
        # the decode side learns whether every sender answered (NIXL blocks may then be freed at once)
        await asyncio.gather(*(self._abort(w, rid, senders_quiesced=all(answered))
                               for w, rid in legs if w.endpoint.role != "prefill"))

    async def _abort(self, w: WorkerHandle, request_id: str, senders_quiesced: bool = False) -> bool:
        """Whether the worker answered (a prefill worker then has no write of the request left)."""
        try:
            await w.stub.Abort(worker_pb2.AbortRequest(request_id=request_id, senders_quiesced=senders_quiesced),
                               timeout=self.config.abort_timeout_s)
            return True
        except grpc.RpcError as e:  # a dead worker frees everything anyway
            log.info("abort of %s on %s failed: %s", request_id, w.id, e.code())
        except Exception as e:  # noqa: BLE001  (grpc's UsageError: the worker left the pool, its channel closed)
            log.info("abort of %s on %s not sent: %s", request_id, w.id, e)
        return False

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


def _prefill_tokens(w: WorkerHandle) -> int:
    """Prompt tokens the router has booked on w before their first token (its queue, ours included)."""
    return w.booked_prefill_blocks * (w.info.block_size or 16)


def _with_recomputed(usage: api_pb2.Usage | None, recomputed: int) -> api_pb2.Usage:
    out = api_pb2.Usage()
    if usage is not None:
        out.CopyFrom(usage)
    out.recomputed_tokens = recomputed
    return out


async def _read(call, w: WorkerHandle, leg: str, deadline: float, leg_timeout: float, stall_s: float):
    """The stream's next message (or grpc.aio.EOF) within the leg timeout and the deadline; a
    worker queueing ours behind other work may take longer while its engine progresses (a step
    completed within the last `stall_s` seconds)."""
    read = asyncio.ensure_future(call.read())
    try:
        while True:
            waited_from, left = time.monotonic(), _remaining(deadline)
            done, _ = await asyncio.wait({read}, timeout=min(leg_timeout, left))
            if done:
                return read.result()
            if left <= leg_timeout:
                raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
            if w.wedged_at_steps is not None:  # found wedged already (by another request's leg)
                message, reason = f"{leg} worker {w.id} is wedged: its engine completes no step", NO_PROGRESS
            elif not _queueing(w, waited_from):
                message, reason = f"{leg} worker {w.id} sent nothing for {leg_timeout:.1f} s (leg timeout)", LEG_TIMEOUT
            elif (still := time.monotonic() - w.progressed_at) > stall_s:
                message = (f"{leg} worker {w.id} is wedged: busy, but its engine completed no step for {still:.1f} s "
                           f"(stall bound {stall_s:.1f} s)")
                reason = NO_PROGRESS
            else:
                continue  # a worker that answers its polls with requests waiting, and progresses, is busy
            w.suspect(reason)  # no new requests until its Stats answer again (router/pool.py)
            raise _LegLate(message, reason)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            w.suspect(WORKER_ERROR)
        raise ServiceError.from_rpc(e, leg) from None
    finally:
        if not read.done():
            read.cancel()


def _queueing(w: WorkerHandle, since: float) -> bool:
    """The worker answered a Stats poll during the wait and has other requests than ours running
    or waiting: ours may be queued behind them (static batching, a long prefill of a burst, a full
    batch), which a leg timeout derived from its chunk gap does not foresee. Whether its engine
    still progresses is the caller's second question (WorkerHandle.progressed_at). A stopped
    worker misses its polls and a dead engine loop makes Stats fail (worker/server.py): both
    count as lost at once."""
    return w.alive and w.polled_at > since and w.stats.running + w.stats.waiting > 1


async def _unary(w: WorkerHandle, leg: str, method, request, deadline: float, leg_timeout: float):
    """A unary leg within its leg timeout and the deadline; late past the leg timeout = UNAVAILABLE."""
    left = _remaining(deadline)
    try:
        return await method(request, timeout=min(leg_timeout, left))
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and left > leg_timeout:
            w.suspect(LEG_TIMEOUT)  # no new requests until its Stats answer again (router/pool.py)
            raise _LegLate(f"{leg} worker {w.id} did not answer in {leg_timeout:.1f} s (leg timeout)",
                           LEG_TIMEOUT) from None
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            w.suspect(WORKER_ERROR)
        raise ServiceError.from_rpc(e, leg) from None


def _remaining(deadline: float) -> float:
    left = deadline - asyncio.get_running_loop().time()
    if left <= 0:
        raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
    return left
