"""The worker gRPC server (worker/server.py) without a model: the internal secret and engine death.

A real grpc.aio worker server on 127.0.0.1 around an agg WorkerCore whose engine is a stand-in
(stats, abort, and a `dead` attribute the test sets), so each check runs in milliseconds:
- without the cluster's secret every Worker call (Reserve, Prefill, Abort, Stats, Generate) is
  UNAUTHENTICATED, with a wrong one too; with it they are served; health stays open;
- an engine whose step loop died: health NOT_SERVING, Stats UNAVAILABLE, then the exit hook runs
  (in production os._exit, so Ray restarts the process).
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.outputs import EngineStats
from proto.internal_auth import METADATA_KEY, call_metadata, client_interceptors
from proto.pdserve.v1 import api_pb2, worker_pb2, worker_pb2_grpc
from worker.agg import AggWorker
from worker.core import WorkerConfig
from worker import server as worker_server

SECRET = "cluster-secret-0123456789"


class FakeEngine:
    dead: BaseException | None = None

    def stats(self) -> EngineStats:
        return EngineStats(kv_blocks_total=10, kv_blocks_used=0, kv_usage=0.0, running=0, waiting=0,
                           waiting_for_remote_kv=0, held_kv=0, num_preemptions=0, prefix_cache_hit_tokens=0,
                           prefix_cache_query_tokens=0, num_evictions=0, num_steps=0, block_size=16)

    async def abort(self, request_id: str) -> None:
        return None

    async def shutdown(self) -> None:
        return None


async def _start(exits: list[float]):
    config = WorkerConfig(worker_id="agg-0", role="agg", internal_secret=SECRET)
    model_config = SimpleNamespace(max_model_len=512, eos_token_ids=[2], vocab_size=100)
    worker = AggWorker(config, FakeEngine(), "/nonexistent", model_config)
    return await worker_server.serve(worker, "127.0.0.1", 0, config.internal_secret,
                                     on_engine_death=lambda: exits.append(time.monotonic()))


def test_worker_api_needs_the_cluster_secret():
    async def go():
        running = await _start([])
        try:
            async with grpc.aio.insecure_channel(running.address) as ch:
                stub = worker_pb2_grpc.WorkerStub(ch)
                calls = {
                    "Reserve": lambda md: stub.Reserve(worker_pb2.ReserveRequest(request_id="x", prompt_token_ids=[1]),
                                                       metadata=md, timeout=5),
                    "Prefill": lambda md: stub.Prefill(worker_pb2.PrefillRequest(request_id="x", prompt_token_ids=[1]),
                                                       metadata=md, timeout=5),
                    "Abort": lambda md: stub.Abort(worker_pb2.AbortRequest(request_id="x"), metadata=md, timeout=5),
                    "Stats": lambda md: stub.Stats(worker_pb2.StatsRequest(), metadata=md, timeout=5),
                }
                refused = {}
                for name, call in calls.items():
                    for md in ((), ((METADATA_KEY, "wrong"),)):
                        try:
                            await call(md)
                            refused[name] = "served"
                        except grpc.RpcError as e:
                            refused[name] = e.code()
                        assert refused[name] == grpc.StatusCode.UNAUTHENTICATED, (name, md, refused[name])
                try:  # a streaming call too
                    [c async for c in stub.Generate(worker_pb2.WorkerGenerateRequest(
                        request_id="x", prompt_token_ids=[1], sampling=api_pb2.SamplingOptions()), timeout=5)]
                    generate = "served"
                except grpc.RpcError as e:
                    generate = e.code()
                # with the secret: served (Reserve/Prefill are not this role's: FAILED_PRECONDITION, past auth)
                stats = await calls["Stats"](call_metadata(SECRET))
                aborted = await calls["Abort"](call_metadata(SECRET))
                with_secret = []
                for name in ("Reserve", "Prefill"):
                    try:
                        await calls[name](call_metadata(SECRET))
                    except grpc.RpcError as e:
                        with_secret.append(e.code())
                health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            async with grpc.aio.insecure_channel(running.address, interceptors=client_interceptors(SECRET)) as ch:
                via_interceptor = await worker_pb2_grpc.WorkerStub(ch).Stats(worker_pb2.StatsRequest(), timeout=5)
            return generate, stats, aborted, with_secret, health, via_interceptor
        finally:
            await running.stop(0)

    generate, stats, aborted, with_secret, health, via = asyncio.run(go())
    assert generate == grpc.StatusCode.UNAUTHENTICATED
    assert stats.kv_blocks_total == 10 and aborted.found and via.kv_blocks_total == 10
    assert with_secret == [grpc.StatusCode.FAILED_PRECONDITION] * 2
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_dead_engine_loop_goes_not_serving_and_exits(monkeypatch):
    # The grace is long against the watch period so that a loaded host cannot blur the order:
    # NOT_SERVING within a few watch periods, the exit not before the grace, and not long after.
    grace_s = 1.0
    monkeypatch.setattr(worker_server, "ENGINE_WATCH_S", 0.05)
    monkeypatch.setattr(worker_server, "ENGINE_DEATH_GRACE_S", grace_s)

    async def go():
        exits: list[float] = []
        running = await _start(exits)
        try:
            async with grpc.aio.insecure_channel(running.address, interceptors=client_interceptors(SECRET)) as ch:
                health = health_pb2_grpc.HealthStub(ch)
                stub = worker_pb2_grpc.WorkerStub(ch)
                died = time.monotonic()
                running.worker.engine.dead = RuntimeError("injected: the step raised")
                # NOT_SERVING within a few watch periods: polled (a loaded host may take longer than
                # a fixed 0.15 s sleep), at most until the grace ends, when the exit is due
                while True:
                    status = (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status
                    if status == health_pb2.HealthCheckResponse.NOT_SERVING or time.monotonic() - died > grace_s:
                        break
                    await asyncio.sleep(0.02)
                try:
                    await stub.Stats(worker_pb2.StatsRequest(), timeout=5)
                    stats = "served"
                except grpc.RpcError as e:
                    stats = e.code()
                exited_early = bool(exits)
                deadline = time.monotonic() + grace_s + 5.0
                while not exits and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                await asyncio.sleep(0.1)  # a second exit would show here
            return status, stats, exited_early, [t - died for t in exits]
        finally:
            await running.stop(0)

    status, stats, exited_early, exits = asyncio.run(go())
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert stats == grpc.StatusCode.UNAVAILABLE
    assert not exited_early and len(exits) == 1 and grace_s <= exits[0] < grace_s + 3.0, exits


def test_secret_file_is_created_private_and_read_back(tmp_path, monkeypatch):
    """--internal-secret-file: serve creates it (0600) with a new secret, a router reads the same;
    a router given a missing file or an empty one is a usage error naming the option."""
    import pytest

    from deploy import router_cmd
    from engine.errors import UserError
    from proto.internal_auth import ENV_VAR

    monkeypatch.delenv(ENV_VAR, raising=False)
    path = tmp_path / "secret"
    made = router_cmd.internal_secret(path, create=True)
    assert router_cmd.internal_secret(path) == made and len(made) >= 40
    assert path.stat().st_mode & 0o777 == 0o600
    for bad in (tmp_path / "missing", tmp_path / "empty"):
        if bad.name == "empty":
            bad.write_text("\n")
        with pytest.raises(UserError, match="--internal-secret-file"):
            router_cmd.internal_secret(bad)
    monkeypatch.setenv(ENV_VAR, "from-env")
    assert router_cmd.internal_secret(path) == "from-env"
