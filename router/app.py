"""The router process: worker pool, orchestrator, gRPC and HTTP front ends, metrics, health.

    router = Router(registry, RouterConfig(...)); await router.start(); ...; await router.stop()

`stop` drains: health goes NOT_SERVING, new requests are refused, in-flight ones finish (up to the
grace period), then the servers close.

With a Redis registry (router/redis_registry.py) the router also follows the workers' KV-event
streams (router/kv_sync.py); while Redis is unreachable it serves from its last view of the
workers, pulls KV events over gRPC instead, and says so in /health ("registry": "disconnected")
and in the pdserve:registry_connected gauge.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import uvicorn

from proto.pdserve.v1 import api_pb2
from router.grpc_server import NOT_SERVING, SERVICE_NAME, SERVING, build_server
from router import auth
from router.body_limit import DEFAULT_MAX_BODY_BYTES
from router.http_server import build_app
from router.kv_sync import KvEventSync
from proto.tls import TlsFiles
from router.leg_timeouts import LegTimeouts
from router.metrics import RouterMetrics, serve_metrics
from router.orchestrator import FlowConfig, Orchestrator
from router.pool import RPC_TIMEOUT_S, WorkerPool
from router.prefix_index import PrefixIndex
from router.registry import Registry
from router.routing import RoutingConfig, Selector
from router.service import DEFAULT_DEADLINE_S, RouterService, ServiceConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterConfig:
    """Every router setting; `pdserve serve` has a flag for each (deploy/serve_cmd.py).

    served_model_name: the id clients send and see (None = the workers' model id).
    chat_template: a Jinja file replacing the model's chat template (None = the model's).
    generation_config: "auto" (default sampling values from the model's generation_config.json),
        "vllm" (none), or a directory holding a generation_config.json.
    """

    host: str = "127.0.0.1"
    port: int = 50051              # gRPC; 0 = any free port
    http_port: int | None = 8000   # None = no HTTP server; 0 = any free port
    metrics_port: int | None = None
    mode: str = "disagg"
    local_prefill_threshold: int = 0
    max_waiting: int = 256
    drain_grace_s: float = 30.0
    served_model_name: str | None = None
    chat_template: str | None = None
    generation_config: str = "auto"
    request_timeout_s: float = DEFAULT_DEADLINE_S
    reservation_lease_s: float = FlowConfig.reservation_lease_s
    hold_lease_s: float = FlowConfig.hold_lease_s
    prefill_attempts: int = FlowConfig.prefill_attempts
    abort_timeout_s: float = FlowConfig.abort_timeout_s
    migration_limit: int = FlowConfig.migration_limit   # --migration-limit
    leg_timeouts: LegTimeouts = LegTimeouts()           # per-leg timeouts from the work (router/leg_timeouts.py)
    worker_poll_interval_s: float = 0.2
    worker_rpc_timeout_s: float = RPC_TIMEOUT_S
    routing: RoutingConfig = RoutingConfig()   # --router-policy, --router-temperature
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # --max-body-bytes: a larger HTTP body is a 413
    internal_secret: str | None = field(default=None, repr=False)  # the workers' API secret (proto/internal_auth.py)
    tls: TlsFiles | None = None           # --tls-cert/--tls-key: public gRPC and HTTPS (proto/tls.py)
    internal_tls: TlsFiles | None = None  # the workers serve TLS; verified against its CA
    api_key: str | None = field(default=None, repr=False)  # --api-key / $PDSERVE_API_KEY: public HTTP and gRPC need it (router/auth.py)

    def __post_init__(self) -> None:
        if self.api_key is not None:
            auth.check_api_key(self.api_key)   # ValueError: "" would mean no authentication

    def flow(self) -> FlowConfig:
        return FlowConfig(self.mode, self.local_prefill_threshold, self.reservation_lease_s, self.hold_lease_s,
                          self.prefill_attempts, self.abort_timeout_s, self.migration_limit, self.leg_timeouts)

    def service(self) -> ServiceConfig:
        return ServiceConfig(self.max_waiting, self.served_model_name, self.chat_template, self.generation_config,
                             self.request_timeout_s)


@dataclass
class Endpoints:
    grpc: str
    http: str | None
    metrics: str | None


class Router:
    def __init__(self, registry: Registry, config: RouterConfig) -> None:
        self.config = config
        self.registry = registry
        self.index = PrefixIndex()
        self.kv_sync = KvEventSync(self.index)
        self.metrics = RouterMetrics()
        # failover counted by the served model's name, which the service learns from the workers
        events = self.metrics.failover_events(lambda: self.service.model_name)
        self.pool = WorkerPool(registry, config.worker_poll_interval_s, config.worker_rpc_timeout_s,
                               kv_sync=self.kv_sync, internal_secret=config.internal_secret,
                               internal_tls=config.internal_tls, events=events)
        self.kv_consumer = None
        if hasattr(registry, "client") and hasattr(registry, "connected"):  # a RedisRegistry
            from router.kv_sync import RedisKvConsumer

            self.kv_consumer = RedisKvConsumer(self.kv_sync, self.pool, registry.client)
            self.pool.kv_events_pushed = lambda: self.kv_consumer.connected
        self.selector = Selector(self.pool, self.index, config.routing)
        self.orchestrator = Orchestrator(self.pool, config.flow(), self.selector)
        self.service = RouterService(self.pool, self.orchestrator, self.metrics, config.service())
        self.service.health_details = self.health_details
        self._grpc = None
        self._health = None
        self._uvicorn: uvicorn.Server | None = None
        self._http_task: asyncio.Task | None = None
        self._health_task: asyncio.Task | None = None
        self.endpoints: Endpoints | None = None

    async def start(self) -> Endpoints:
        c = self.config
        if hasattr(self.registry, "start"):
            await self.registry.start()
        await self.pool.start()
        if self.kv_consumer is not None:
            self.kv_consumer.start()
        self._grpc, self._health, grpc_port = build_server(self.service, self.cluster_status, c.host, c.port,
                                                           c.api_key, c.tls)
        await self._grpc.start()
        http = await self._start_http() if c.http_port is not None else None
        metrics = f"{c.host}:{serve_metrics(self.metrics.registry, c.metrics_port, c.host)}" \
            if c.metrics_port is not None else None
        self._health_task = asyncio.create_task(self._health_loop())
        self.endpoints = Endpoints(f"{c.host}:{grpc_port}", http, metrics)
        return self.endpoints

    async def _start_http(self) -> str:
        config = uvicorn.Config(build_app(self.service, self.metrics.registry, self.config.api_key,
                                          self.config.max_body_bytes), host=self.config.host, port=self.config.http_port,
                                log_level="warning", lifespan="off",
                                ssl_certfile=self.config.tls.cert_file if self.config.tls else None,
                                ssl_keyfile=self.config.tls.key_file if self.config.tls else None)
        self._uvicorn = uvicorn.Server(config)
        self._http_task = asyncio.create_task(self._uvicorn.serve())
        while not self._uvicorn.started:
            if self._http_task.done():
                self._http_task.result()  # raises the bind error
                raise OSError("HTTP server stopped at start")
            await asyncio.sleep(0.02)
        port = self._uvicorn.servers[0].sockets[0].getsockname()[1]
        return f"{self.config.host}:{port}"

    def ready(self) -> bool:
        """Serving needs a live decode (or agg) worker, and a prefill worker in disagg mode."""
        roles = {w.endpoint.role for w in self.pool.workers() if w.alive}
        if self.config.mode == "agg":
            return "agg" in roles
        return {"prefill", "decode"} <= roles

    def health_details(self) -> dict:
        """What /health adds: the registry's state and the routing policy."""
        connected = getattr(self.registry, "connected", None)
        out = {"router_policy": self.config.routing.policy}
        if connected is not None:
            out["registry"] = "connected" if connected else "disconnected (serving from the last view)"
        return out

    async def _health_loop(self) -> None:
        while True:
            connected = getattr(self.registry, "connected", True)
            self.metrics.registry_connected.set(1 if connected else 0)
            status = SERVING if self.ready() else NOT_SERVING
            await self._health.set("", status)
            await self._health.set(SERVICE_NAME, status)
            await asyncio.sleep(0.2)

    def cluster_status(self) -> api_pb2.ClusterStatusResponse:
        out = api_pb2.ClusterStatusResponse()
        for w in sorted(self.pool.workers(), key=lambda w: w.id):
            s = w.stats
            out.workers.add(id=w.id, role=w.endpoint.role, address=w.endpoint.address, alive=w.alive,
                            kv_blocks_used=s.kv_blocks_used, kv_blocks_total=s.kv_blocks_total,
                            kv_blocks_held=s.kv_blocks_held, running=s.running, waiting=s.waiting,
                            spec_draft_tokens=s.spec_draft_tokens, spec_accepted_tokens=s.spec_accepted_tokens)
        return out

    async def stop(self) -> None:
        """Drain in-flight requests (up to drain_grace_s), then close everything."""
        if self._health_task:
            self._health_task.cancel()
        if self._health:
            await self._health.enter_graceful_shutdown()
        if self._uvicorn:
            self._uvicorn.should_exit = True
        if self._grpc:
            await self._grpc.stop(self.config.drain_grace_s)
        if self._http_task:
            await asyncio.gather(self._http_task, return_exceptions=True)
        await self.orchestrator.drain()
        if self.kv_consumer is not None:
            await self.kv_consumer.close()
        await self.pool.close()
        if hasattr(self.registry, "close"):
            await self.registry.close()
