"""Prefill failover, decode migration and liveness in the router, against fake workers.

The fake workers are real grpc.aio servers on 127.0.0.1 speaking the worker API, with a
deterministic "model" (token i of a request depends only on its prompt and i), so a migrated
stream can be compared with an uninterrupted one exactly. Faults: a stream that dies
(UNAVAILABLE), stalls or pauses after k tokens, a Prefill or Stats that never answers, Stats
reporting other requests with an engine step counter that moves (busy) or stands still (wedged).
Every failover is also checked in the FailoverEvents the orchestrator and pool report (their
reasons; router/metrics.py counts them). No model, no Ray: the real-cluster versions are
tests/test_serving_failover.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import pytest

from proto.pdserve.v1 import api_pb2, worker_pb2, worker_pb2_grpc
from router.errors import ServiceError
from router.failover_events import FailoverEvents
from router.leg_timeouts import LegTimeouts, WorkRate
from router.orchestrator import FlowConfig, Orchestrator
from router.pool import WorkerPool
from router.registry import StaticRegistry, WorkerEndpoint
from tests.polling import until

FAST = LegTimeouts(floor_s=0.5, slack=2.0, default_s_per_token=0.001, default_gap_s=0.05)
STEP_TOKENS = 1024  # the fake workers' step budget (WorkerInfo.max_step_tokens), for the stall bound


def token(prompt: list[int], i: int) -> int:
    return (sum(prompt) * 7 + i * 13) % 997 + 3


class Faults:
    """Shared by a cluster's workers: the first `streams` streams (any worker) die (UNAVAILABLE),
    go silent, or pause for `pause_s` after `after` tokens (seconds, or a function giving them
    when the pause starts; `paused_s` records the seconds paused)."""

    def __init__(self) -> None:
        self.kind: str | None = None   # "die" | "stall" | "pause"
        self.after = 0
        self.streams = 1
        self.pause_s: float | Callable[[], float] = 0.0
        self.paused_s: float | None = None


class Events(FailoverEvents):
    """Records what the orchestrator and the pool report."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, ...]] = []

    def migration(self, reason: str) -> None:
        self.seen.append(("migration", reason))

    def prefill_failover(self, reason: str) -> None:
        self.seen.append(("prefill_failover", reason))

    def worker_suspect(self, role: str, reason: str) -> None:
        self.seen.append(("suspect", role, reason))


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    """faults: see Faults. stall_prefill / stall_stats: Prefill / Stats never answer. others: the
    requests besides ours Stats reports running (0: none, the worker reports itself idle);
    progressing: its engine_steps moves at each Stats (False: stands still, a wedged step)."""

    def __init__(self, wid: str, role: str, faults: Faults) -> None:
        self.wid, self.role, self.faults = wid, role, faults
        self.stall_prefill = False
        self.stall_stats = False
        self.others = 0
        self.progressing = True
        self.steps = 0
        self.calls: list[tuple[str, str, tuple[int, ...]]] = []  # (rpc, request id, resume tokens)
        self.reserved: dict[str, list[int]] = {}
        self.aborted: list[str] = []

    async def Info(self, request, context):
        return worker_pb2.WorkerInfo(id=self.wid, role=self.role, model_id="fake", max_model_len=4096,
                                     block_size=16, eos_token_ids=[2], max_step_tokens=STEP_TOKENS)

    async def Stats(self, request, context):
        if self.stall_stats:
            await asyncio.sleep(3600)
        self.steps += self.progressing
        return worker_pb2.WorkerStats(kv_blocks_total=1000, running=self.others + (self.others > 0), waiting=0,
                                      engine_steps=self.steps)

    async def ModelFiles(self, request, context):
        return
        yield

    async def KvEvents(self, request, context):
        return worker_pb2.KvEventsResponse(epoch="e", is_snapshot=True, block_size=16)

    async def Reserve(self, request, context):
        self.calls.append(("Reserve", request.request_id, ()))
        self.reserved[request.request_id] = list(request.prompt_token_ids)
        return worker_pb2.ReserveResponse(destination=worker_pb2.KVDestination(worker_id=self.wid, block_ids=[1]))

    async def Prefill(self, request, context):
        self.calls.append(("Prefill", request.request_id, ()))
        if self.stall_prefill:
            await asyncio.sleep(3600)
        return worker_pb2.PrefillResponse(first_token_id=token(list(request.prompt_token_ids), 0),
                                          usage=api_pb2.Usage(prompt_tokens=len(request.prompt_token_ids)))

    async def Decode(self, request, context):
        self.calls.append(("Decode", request.request_id, ()))
        prompt = self.reserved.pop(request.request_id)
        async for c in self._stream(context, prompt, 1, 8):
            yield c

    async def Generate(self, request, context):
        self.calls.append(("Generate", request.request_id, tuple(request.resume_token_ids)))
        prompt, resume = list(request.prompt_token_ids), list(request.resume_token_ids)
        assert resume == [token(prompt, i) for i in range(len(resume))], "resumed tokens are the streamed ones"
        async for c in self._stream(context, prompt, len(resume), request.sampling.max_tokens):
            yield c

    async def _stream(self, context, prompt, start, max_tokens):
        f = self.faults
        faulty = f.kind is not None and f.streams > 0
        f.streams -= faulty
        for i in range(start, max_tokens):
            if faulty and i >= f.after and f.kind == "die":
                await context.abort(grpc.StatusCode.UNAVAILABLE, "injected death")
            if faulty and i >= f.after and f.kind == "wedge":  # silent, Stats still answer, engine_steps stand still
                self.progressing = False
                await asyncio.sleep(3600)
            if faulty and i >= f.after and f.kind == "stall":
                await asyncio.sleep(3600)
            if faulty and i == f.after and f.kind == "pause":
                f.paused_s = f.pause_s() if callable(f.pause_s) else f.pause_s
                await asyncio.sleep(f.paused_s)
            await asyncio.sleep(0.005)
            last = i == max_tokens - 1
            chunk = worker_pb2.TokenChunk(token_ids=[token(prompt, i)], finish_reason="length" if last else "")
            if last:
                chunk.usage.CopyFrom(api_pb2.Usage(prompt_tokens=len(prompt), completion_tokens=max_tokens))
            yield chunk

    async def Abort(self, request, context):
        self.aborted.append(request.request_id)
        return worker_pb2.AbortResponse(found=True)

    async def Release(self, request, context):
        return worker_pb2.ReleaseResponse()


class Cluster:
    """Fake workers behind a real WorkerPool. rpc_timeout_s: the Stats poll deadline; the production
    default (2 s) unless a test is about missed polls. A shorter one makes every test's exact event
    list depend on the host: a loaded CI machine once missed a 0.3 s poll to both workers."""

    def __init__(self, roles: list[tuple[str, str]], rpc_timeout_s: float = 2.0) -> None:
        self.roles, self.rpc_timeout_s = roles, rpc_timeout_s
        self.workers: dict[str, FakeWorker] = {}
        self.servers: list[grpc.aio.Server] = []
        self.endpoints: list[WorkerEndpoint] = []

    async def __aenter__(self) -> "Cluster":
        self.faults = Faults()
        for wid, role in self.roles:
            server = grpc.aio.server()
            fake = FakeWorker(wid, role, self.faults)
            worker_pb2_grpc.add_WorkerServicer_to_server(fake, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            self.workers[wid], self.servers = fake, [*self.servers, server]
            self.endpoints.append(WorkerEndpoint(wid, role, f"127.0.0.1:{port}"))
        self.events = Events()
        self.pool = WorkerPool(StaticRegistry(self.endpoints), poll_interval_s=0.05, rpc_timeout_s=self.rpc_timeout_s,
                               events=self.events)
        await self.pool.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.pool.close()
        for s in self.servers:
            await s.stop(0)

    def orchestrator(self, **flow) -> Orchestrator:
        return Orchestrator(self.pool, FlowConfig(leg_timeouts=FAST, **flow))

    async def run(self, orch: Orchestrator, prompt: list[int], max_tokens: int = 8):
        loop = asyncio.get_running_loop()
        sampling = api_pb2.SamplingOptions(temperature=0, max_tokens=max_tokens)
        tokens, usage = [], None
        async for t in orch.run("r1", prompt, sampling, loop.time() + 30):
            tokens += t.token_ids
            usage = t.usage or usage
        await orch.drain()
        return tokens, usage


PROMPT = list(range(10, 50))
WANT = [token(PROMPT, i) for i in range(8)]


def test_decode_worker_death_mid_stream_migrates_with_the_same_tokens():
    async def go():
        async with Cluster([("p0", "prefill"), ("d0", "decode"), ("d1", "decode")]) as c:
            c.faults.kind, c.faults.after = "die", 3
            orch = c.orchestrator()
            got, usage = await c.run(orch, PROMPT)
            return c, got, usage, orch

    c, got, usage, orch = asyncio.run(go())
    assert got == WANT and orch.migrations == 1
    gen = [(w.wid, call) for w in c.workers.values() for call in w.calls if call[0] == "Generate"]
    died = next(w for w in c.workers.values() if any(k[0] == "Decode" for k in w.calls))
    assert len(gen) == 1 and gen[0][0] != died.wid, gen
    assert gen[0][1][2] == tuple(WANT[:3]) and gen[0][1][1] == "r1~1"
    assert died.aborted == ["r1"]
    assert usage.recomputed_tokens == len(PROMPT) + 3 and usage.completion_tokens == 8
    assert c.events.seen == [("suspect", "decode", "worker_error"), ("migration", "worker_error")]


def test_stalled_decode_stream_migrates_within_its_leg_timeout():
    async def go():
        async with Cluster([("d0", "agg"), ("d1", "agg")]) as c:
            c.faults.kind, c.faults.after = "stall", 2
            orch = c.orchestrator(mode="agg")
            loop = asyncio.get_running_loop()
            got, t_stall, waited = [], None, None
            async for t in orch.run("r1", PROMPT, api_pb2.SamplingOptions(max_tokens=8), loop.time() + 30):
                got += t.token_ids
                if len(got) == 2:
                    t_stall = time.monotonic()
                if len(got) == 3:
                    waited = time.monotonic() - t_stall
            await orch.drain()
            stalled = next(w for w in c.workers.values() if w.aborted)
            return got, waited, stalled, c.events.seen

    got, waited, stalled, events = asyncio.run(go())
    assert got == WANT and stalled.aborted == ["r1"]
    assert events == [("suspect", "agg", "leg_timeout"), ("migration", "leg_timeout")]
    # the bound: floor + slack x the measured gap (5 ms here), plus one stream start; 3 s of slack
    # for a loaded host, still far below the 30 s request deadline a lost stream would run into
    assert FAST.floor_s <= waited < FAST.floor_s + 3.0, waited


def test_stuck_prefill_is_abandoned_and_prefilled_on_the_decode_worker():
    async def go():
        async with Cluster([("p0", "prefill"), ("d0", "decode")]) as c:
            c.workers["p0"].stall_prefill = True
            orch = c.orchestrator()
            start = time.monotonic()
            got, usage = await c.run(orch, PROMPT)
            return c, got, usage, time.monotonic() - start, orch

    c, got, usage, took, orch = asyncio.run(go())
    d, p = c.workers["d0"], c.workers["p0"]
    assert got == WANT and orch.prefill_failovers >= 1
    assert [k[0] for k in d.calls] == ["Reserve", "Generate"] and d.calls[1][2] == ()
    assert p.aborted == ["r1"] and d.aborted == ["r1"]  # the abandoned try: P, then its reservation
    assert usage.recomputed_tokens == len(PROMPT)
    # one prefill leg timeout, then the local prefill and decode; 3 s of slack for a loaded host,
    # far below the 30 s request deadline a stuck leg would run into
    assert took < FAST.prefill_s(WorkRate(), 3 * 16) + 3.0, took
    assert c.events.seen == [("suspect", "prefill", "leg_timeout"), ("prefill_failover", "leg_timeout"),
                             ("prefill_failover", "no_prefill_worker")]


def test_migration_limit_zero_fails_the_stream():
    async def go():
        async with Cluster([("d0", "agg"), ("d1", "agg")]) as c:
            c.faults.kind, c.faults.after, c.faults.streams = "die", 2, 2
            with pytest.raises(ServiceError) as e:
                await c.run(c.orchestrator(mode="agg", migration_limit=0), PROMPT)
            return e.value

    assert asyncio.run(go()).code == grpc.StatusCode.UNAVAILABLE


def test_a_worker_missing_its_polls_is_suspect_until_it_answers_again():
    async def go():
        # 1 s: short, as the test waits for missed polls, yet d0 (which must miss none, and add no
        # event) would need this process stalled for a whole second to miss one
        async with Cluster([("p0", "prefill"), ("d0", "decode")], rpc_timeout_s=1.0) as c:
            p = c.pool.get("p0")
            c.workers["p0"].stall_stats = True
            await until(lambda: not p.alive, 10.0, "p0 suspect after its missed polls")
            await asyncio.sleep(1.2)  # more missed polls (one a second): still one event
            suspect, decode_polled = p.alive, c.pool.get("d0").missed_polls
            # new requests skip it: prefilled on the decode worker, no Prefill call
            got, _ = await c.run(c.orchestrator(), PROMPT)
            c.workers["p0"].stall_stats = False
            await until(lambda: p.alive, 10.0, "p0 live again once it answers")
            return suspect, decode_polled, got, p.alive, c.workers["p0"].calls, c.events.seen

    suspect, decode_missed, got, back, p_calls, events = asyncio.run(go())
    assert suspect is False and decode_missed == 0 and got == WANT and p_calls == [] and back is True
    assert events == [("suspect", "prefill", "missed_poll")]  # once, not once per missed poll


async def _timed_run(c: Cluster, orch: Orchestrator, gap_at: int) -> tuple[list[int], float]:
    """(tokens, seconds between token gap_at - 1 and token gap_at) of one request."""
    loop = asyncio.get_running_loop()
    got, t_last, waited = [], None, None
    async for t in orch.run("r1", PROMPT, api_pb2.SamplingOptions(max_tokens=8), loop.time() + 30):
        got += t.token_ids
        if len(got) == gap_at:
            t_last = time.monotonic()
        if len(got) == gap_at + 1:
            waited = time.monotonic() - t_last
    await orch.drain()
    return got, waited


def test_busy_worker_whose_engine_progresses_is_waited_for_not_migrated():
    """The static-batching / queued case (581c658): the stream sends nothing for longer than its leg
    timeout and the stall bound, while the worker answers its polls with other requests running
    and its engine_steps moving: ours is queued, not lost; it finishes there, no migration.
    The pause is set when it starts, from the bounds then in force (they come from the speed the
    router measured, slower on a loaded host): past both by one leg timeout and 0.5 s."""
    async def go():
        async with Cluster([("d0", "agg"), ("d1", "agg")]) as c:
            for w in c.workers.values():
                w.others = 3
            bounds: dict[str, float] = {}

            def pause_s() -> float:
                w = next(h for h in c.pool.workers() if c.workers[h.id].calls)
                bounds.update(chunk_s=FAST.chunk_s(w.rate), stall_s=FAST.stall_s(w.rate, STEP_TOKENS))
                return max(bounds.values()) + bounds["chunk_s"] + 0.5

            c.faults.kind, c.faults.after, c.faults.pause_s = "pause", 2, pause_s
            orch = c.orchestrator(mode="agg")
            got, waited = await _timed_run(c, orch, 2)
            return c, got, waited, orch, c.faults.paused_s, bounds

    c, got, waited, orch, paused_s, bounds = asyncio.run(go())
    assert got == WANT and orch.migrations == 0 and c.events.seen == []
    assert waited >= paused_s > max(bounds.values()), (waited, paused_s, bounds)  # both bounds were passed
    assert sum(len(w.calls) for w in c.workers.values()) == 1


def test_wedged_worker_that_answers_its_polls_is_migrated_after_the_stall_bound():
    """An engine wedged inside one step: the stream goes silent, the worker still answers Stats with
    other requests running, but engine_steps stands still. Past the stall bound (floor + slack x
    max_step_tokens x measured s/token; router/leg_timeouts.py) it is suspect (no_progress) and the
    request migrates with the same tokens; it stays suspect while it answers without progress, and
    is live again once its counter moves."""
    async def go():
        async with Cluster([("d0", "agg"), ("d1", "agg")]) as c:
            for w in c.workers.values():
                w.others = 3
            c.faults.kind, c.faults.after = "wedge", 2
            orch = c.orchestrator(mode="agg")
            got, waited = await _timed_run(c, orch, 2)
            wedged = next(w for w in c.workers.values() if not w.progressing)
            handle = c.pool.get(wedged.wid)
            stall_s, chunk_s = FAST.stall_s(handle.rate, STEP_TOKENS), FAST.chunk_s(handle.rate)
            await asyncio.sleep(0.5)  # ~10 answered polls without progress
            held = handle.alive
            wedged.progressing = True
            # live at the first poll that sees the counter move (50 ms)
            await until(lambda: handle.alive, 10.0, "the wedged worker live again once it progresses")
            return c, got, waited, orch, wedged, stall_s, chunk_s, held, handle.alive

    c, got, waited, orch, wedged, stall_s, chunk_s, held, back = asyncio.run(go())
    assert got == WANT and orch.migrations == 1 and wedged.aborted == ["r1"]
    # found at the first leg-timeout check past the bound (the counter is seen every 50 ms poll);
    # 3 s of slack for a loaded host, far below the 30 s request deadline
    print(f"wedged: migrated after {waited:.2f} s (stall bound {stall_s:.2f} s, leg timeout {chunk_s:.2f} s)")
    assert stall_s <= waited + 0.06 < stall_s + chunk_s + 3.0, (waited, stall_s, chunk_s)
    assert c.events.seen == [("suspect", "agg", "no_progress"), ("migration", "no_progress")]
    assert held is False and back is True
