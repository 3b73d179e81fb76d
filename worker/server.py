"""The worker gRPC service (pdserve.v1.Worker) for every role, and what building any role needs.

`load_engine(config)` loads the engine; `create_kv_transport(config, runner)` creates and
registers the KV transport (prefill and decode roles); `serve(worker, host, port)` serves a built
role on host:port (0 = any free port) and returns the running `WorkerServer` with its bound
address. Which role class to build is chosen above the roles (deploy/worker_process.py), so this
package never imports a role package. RPCs a role does not serve answer FAILED_PRECONDITION.
Worker failures become gRPC statuses; a handler cancelled by the router (cancel, disconnect,
deadline) aborts the request on the engine.

With a secret (WorkerConfig.internal_secret) every Worker call must carry it (proto/internal_auth.py).
Health (grpc.health.v1, open) says SERVING while the engine can run. When the engine's step loop
has died (a model/runtime failure), the worker goes NOT_SERVING, answers Stats UNAVAILABLE (the
router stops choosing it at its next poll) and, after ENGINE_DEATH_GRACE_S for in-flight streams
to end with their error, exits the process (`on_engine_death`, default os._exit(1)) so Ray
restarts it with a fresh engine; it never keeps attracting requests.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from worker.core import WorkerConfig, WorkerCore, WorkerError
from proto.internal_auth import InternalSecretInterceptor
from proto.model_files import file_chunks
from proto.tls import TlsFiles, add_port
from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


def _role_error(role: str, rpc: str) -> WorkerError:
    return WorkerError(grpc.StatusCode.FAILED_PRECONDITION, f"a {role} worker does not serve {rpc}")


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker: WorkerCore) -> None:
        self.w = worker

    async def Info(self, request, context):
        return self.w.info()

    async def Stats(self, request, context):
        dead = getattr(self.w.engine, "dead", None)
        if dead is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine loop died: {dead!r}; restarting")
        return self.w.worker_stats()

    async def ModelFiles(self, request, context):
        for chunk in file_chunks(self.w.model_dir):
            yield chunk

    async def Reserve(self, request, context):
        if not hasattr(self.w, "reserve"):
            return await _fail(context, _role_error(self.w.config.role, "Reserve"))
        try:
            return await self.w.reserve(request.request_id, list(request.prompt_token_ids), request.sampling,
                                        request.lease_seconds)
        except WorkerError as e:
            await _fail(context, e)

    async def Prefill(self, request, context):
        if not hasattr(self.w, "prefill"):
            return await _fail(context, _role_error(self.w.config.role, "Prefill"))
        try:
            return await self.w.prefill(request)
        except WorkerError as e:
            await _fail(context, e)

    async def Decode(self, request, context):
        if not hasattr(self.w, "decode"):
            await _fail(context, _role_error(self.w.config.role, "Decode"))
        try:
            async for chunk in self.w.decode(request.request_id, request.first_token_id, request.kv_checksum):
                yield chunk
        except WorkerError as e:
            await _fail(context, e)

    async def Generate(self, request, context):
        try:
            async for chunk in self.w.generate(request.request_id, list(request.prompt_token_ids), request.sampling,
                                               list(request.resume_token_ids)):
                yield chunk
        except WorkerError as e:
            await _fail(context, e)

    async def Release(self, request, context):
        if hasattr(self.w, "release"):
            await self.w.release(request.request_id)
        return worker_pb2.ReleaseResponse()

    async def Abort(self, request, context):
        return worker_pb2.AbortResponse(found=await self.w.abort(request.request_id, request.senders_quiesced))

    async def KvEvents(self, request, context):
        return self.w.kv_event_batch(request.epoch, request.after_seq, request.snapshot)


async def _fail(context, e: WorkerError):
    await context.abort(e.code, e.message)


ENGINE_WATCH_S = 0.5        # how often the server checks that the engine loop lives
ENGINE_DEATH_GRACE_S = 1.0  # then in-flight streams have this long to end before the process exits


def _exit_process() -> None:
    os._exit(1)  # no cleanup: the engine is broken; Ray restarts the actor's process


@dataclass
class WorkerServer:
    worker: WorkerCore
    server: grpc.aio.Server
    address: str
    health: health.aio.HealthServicer | None = None
    watchdog: asyncio.Task | None = None

    async def stop(self, grace_s: float = 5.0) -> None:
        if self.watchdog is not None:
            self.watchdog.cancel()
        await self.server.stop(grace_s)
        await self.worker.close()
        transport = getattr(self.worker, "transport", None)
        await self.worker.engine.shutdown()
        if transport is not None:
            transport.close()


def load_engine(config: WorkerConfig):
    """Load the engine for config (heavy: imports torch, loads weights).

    Returns (engine, model_dir, runner): the AsyncEngine, the resolved HF-layout model directory
    and the engine's ModelRunner (for its KV cache and model config)."""
    from engine.async_engine import AsyncEngine
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.model_loader import resolve_model

    model_dir = resolve_model(config.model)
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(model_dir),
        scheduler=SchedulerConfig(max_num_seqs=config.max_num_seqs,
                                  max_num_batched_tokens=config.max_num_batched_tokens,
                                  # a prefill worker never decodes: every step would be "idle"; keep its chunks
                                  idle_max_num_batched_tokens=None if config.role == "prefill"
                                  else config.idle_max_num_batched_tokens,
                                  prefill_first_ratio=config.prefill_first_ratio,
                                  max_waiting=config.max_waiting, max_model_len=config.max_model_len,
                                  batching=config.batching),
        cache=CacheConfig(block_size=config.block_size, num_blocks=config.num_blocks,
                          memory_bytes=config.kv_cache_memory_bytes,
                          enable_prefix_caching=config.enable_prefix_caching),
        dtype=config.dtype, num_threads=config.num_threads, cpu_cores=config.cpu_cores, device=config.device,
        quantization=config.quantization, kv_cache_dtype=config.kv_cache_dtype,
        speculative=config.speculative if config.role != "prefill" else None))
    return engine, model_dir, _runner(engine)


def _runner(engine):
    """The engine's ModelRunner (for its KV cache and model config)."""
    for path in ("runner", "model_runner", "engine.runner", "engine.model_runner", "core.runner",
                 "core.model_runner", "llm_engine.runner", "llm_engine.model_runner"):
        obj = engine
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        if hasattr(obj, "kv_cache"):
            return obj
    raise RuntimeError("cannot find the engine's model runner (kv_cache, model_config)")


def create_kv_transport(config: WorkerConfig, runner):
    """The role's KV transport with the engine's cache registered; returns (transport, metadata)."""
    from kv_transfer import create_transport
    from kv_transfer.base import CompatKey

    transport = create_transport(config.kv_transport)
    from engine.spec_decode.config import compat_descriptor

    compat = CompatKey.from_spec(runner.kv_cache.spec, runner.model_config.name, compat_descriptor(config.speculative),
                                 weights=runner.weights_descriptor)
    if config.kv_faults:  # debug: fault injection (kv_transfer/faults.py)
        from kv_transfer.faults import FaultSpec, FaultyTransport

        transport = FaultyTransport(transport, FaultSpec.parse(config.kv_faults))
    return transport, transport.register_cache(runner.kv_cache, compat)


async def serve(worker: WorkerCore, host: str, port: int, secret: str | None = None,
                on_engine_death: Callable[[], None] = _exit_process, tls: TlsFiles | None = None) -> WorkerServer:
    """Start the built worker's background tasks and its gRPC server; returns the running server.
    secret: the cluster's internal secret every Worker call must carry (None: no check);
    on_engine_death: called once the engine loop died and the grace period passed; tls: serve
    over TLS with these files (proto/tls.py)."""
    await worker.start()
    interceptors = [InternalSecretInterceptor(secret)] if secret else []
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)], interceptors=interceptors)
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(worker), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = add_port(server, f"{host}:{port}", tls)
    if bound == 0:
        raise OSError(f"cannot bind the worker on {host}:{port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    running = WorkerServer(worker, server, f"{host}:{bound}", health_servicer)
    running.watchdog = asyncio.create_task(_watch_engine(running, on_engine_death))
    return running


async def _watch_engine(running: WorkerServer, on_engine_death: Callable[[], None]) -> None:
    """NOT_SERVING, then exit, once the engine's step loop has died."""
    while getattr(running.worker.engine, "dead", None) is None:
        await asyncio.sleep(ENGINE_WATCH_S)
    log.error("worker %s: engine loop died (%r): NOT_SERVING, exiting in %.1f s so it is restarted",
              running.worker.config.worker_id, running.worker.engine.dead, ENGINE_DEATH_GRACE_S)
    await running.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    await asyncio.sleep(ENGINE_DEATH_GRACE_S)
    on_engine_death()
