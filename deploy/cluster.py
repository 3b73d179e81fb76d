"""The serving cluster on Ray: worker actors, and the controller that keeps the registry.

Each worker (prefill, decode or agg) is a Ray actor (restarted by Ray when it dies) that loads
its engine and serves the worker gRPC API on 127.0.0.1 at a free port. The `ClusterController`
(in the process that starts the cluster, beside the router) supervises them: it (re)starts each
actor's server, learns its address, and answers the router's registry calls (`list_workers`).
When Ray restarts a dead actor, the controller's next supervision pass boots it again and the
router picks up the new address. With a Redis registry (``ClusterSpec.registry_url``) each worker
also registers itself there (worker/registration.py: a key with a TTL its heartbeat renews) and
pushes its KV events to its Redis Stream, and routers discover workers from Redis instead.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, replace

from engine.spec_decode.config import SpeculativeConfig
from router.registry import WorkerEndpoint
from worker.core import WorkerConfig

log = logging.getLogger(__name__)

SUPERVISE_INTERVAL_S = 0.5


@dataclass(frozen=True)
class ClusterSpec:
    """What `pdserve serve` starts. mode "agg" starts `num_decode` agg workers and no prefill worker.

    dtype: a concrete dtype for every worker (the CLI resolves "auto" once, so P and D agree).
    cpu_cores: the cores of each worker in `worker_configs()` order (prefill first), from
    engine.platform.assign_cores; None = workers are not bound (a remote Ray cluster).
    kv_cache_memory_bytes: per worker, used when num_blocks is None.
    """

    model: str = "smollm2-135m-instruct"
    num_prefill: int = 1
    num_decode: int = 1
    mode: str = "disagg"
    kv_transport: str = "tcp"
    num_blocks: int | None = 512
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    host: str = "127.0.0.1"
    metrics_port: int | None = None   # workers use metrics_port + 1, + 2, ...
    num_gpus_per_worker: float = 0.0
    num_cpus_per_worker: float = 1.0
    threads_per_worker: int = 1
    cpu_cores: tuple[tuple[int, ...], ...] | None = None
    dtype: str = "float32"
    kv_cache_memory_bytes: int | None = None
    block_size: int = 16
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    served_model_name: str | None = None
    transfer_timeout_s: float = 30.0        # a KV push not confirmed by then fails (the router retries once)
    worker_start_timeout_s: float = 300.0   # every worker loaded and serving, or `serve` fails
    supervise_interval_s: float = SUPERVISE_INTERVAL_S
    registry_url: str | None = None   # redis://HOST:PORT/DB: workers register there, routers watch it
    registry_ttl_s: float = 3.0
    # Ray custom resources each role's actors ask for, e.g. {"prefill": 1}: with nodes started as
    # `ray start --resources '{"prefill": 4}'`, a role lands only on the nodes that carry its label.
    prefill_resources: tuple[tuple[str, float], ...] = ()
    decode_resources: tuple[tuple[str, float], ...] = ()   # decode and agg workers
    speculative: SpeculativeConfig | None = None

    def role_resources(self, role: str) -> dict[str, float]:
        return dict(self.prefill_resources if role == "prefill" else self.decode_resources)

    def worker_configs(self) -> list[WorkerConfig]:
        roles = [("agg", self.num_decode)] if self.mode == "agg" else [("prefill", self.num_prefill),
                                                                     ("decode", self.num_decode)]
        base = WorkerConfig(worker_id="", role="agg", model=self.model, kv_transport=self.kv_transport,
                            num_blocks=self.num_blocks, max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens, num_threads=self.threads_per_worker,
                            device="cuda" if self.num_gpus_per_worker > 0 else "cpu", host=self.host,
                            block_size=self.block_size, max_model_len=self.max_model_len,
                            enable_prefix_caching=self.enable_prefix_caching,
                            served_model_name=self.served_model_name, transfer_timeout_s=self.transfer_timeout_s,
                            kv_cache_memory_bytes=self.kv_cache_memory_bytes, dtype=self.dtype,
                            speculative=self.speculative)
        configs = []
        for role, n in roles:
            for i in range(n):
                port = None if self.metrics_port is None else self.metrics_port + 1 + len(configs)
                cores = None if self.cpu_cores is None else self.cpu_cores[len(configs) % len(self.cpu_cores)]
                configs.append(replace(base, worker_id=f"{role}-{i}", role=role, metrics_port=port, cpu_cores=cores))
        return configs


class WorkerActor:
    """A worker process under Ray. Wrapped with ray.remote(max_restarts=-1) by `ClusterController`."""

    def __init__(self, config: WorkerConfig, registry_url: str | None = None, registry_ttl_s: float = 3.0) -> None:
        os.environ["OMP_NUM_THREADS"] = str(config.num_threads)
        if config.cpu_cores:  # bind before torch starts its thread pool (the engine binds again, all threads)
            os.sched_setaffinity(0, config.cpu_cores)
        self.config = config
        self._registry = (registry_url, registry_ttl_s)
        self._registration = None
        self._kv_sink = None
        self._server = None
        self._starting: asyncio.Task | None = None

    async def ensure_started(self) -> str:
        """Start the worker once (again after a restart); returns its gRPC address."""
        if self._server is None:
            if self._starting is None:
                self._starting = asyncio.create_task(self._start())
            await asyncio.shield(self._starting)
        return self._server.address

    async def _start(self) -> None:
        from deploy.worker_process import start_worker

        self._server = await start_worker(self.config)
        if self.config.metrics_port is not None:
            from worker.metrics import serve_worker_metrics

            serve_worker_metrics(self._server.worker, self.config.metrics_port, self.config.host)
        url, ttl = self._registry
        if url:
            import redis.asyncio as aioredis

            from worker.kv_events import RedisKvSink
            from worker.registration import RedisRegistration, registration_for

            self._kv_sink = RedisKvSink(self._server.worker.kv_events, aioredis.from_url(url, socket_timeout=1.0))
            self._kv_sink.start()
            self._registration = RedisRegistration(url, registration_for(self._server.worker, self._server.address),
                                                   ttl)
            await self._registration.start()

    def pause_heartbeat(self, paused: bool = True) -> None:
        """Fault injection (tests): stop renewing the registry key, as a hung worker would."""
        if self._registration is not None:
            self._registration.paused = paused

    def inject_kv_event_gap(self, n: int = 1) -> int:
        """Fault injection (tests): drop the next n KV-event records; returns the current seq."""
        self._server.worker.kv_events.skip_next = n
        return self._server.worker.kv_events.seq

    async def stop(self) -> None:
        if self._registration is not None:  # deregister first: routers stop sending new requests
            await self._registration.stop()
            self._registration = None
        if self._kv_sink is not None:
            await self._kv_sink.close()
            self._kv_sink = None
        if self._server is not None:
            await self._server.stop()
            self._server = None

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        """The Ray node this worker was placed on (hex id)."""
        import ray

        return ray.get_runtime_context().get_node_id()


class ClusterController:
    """Starts the worker actors, supervises them, and is the router's registry."""

    def __init__(self, spec: ClusterSpec) -> None:
        import ray

        self.spec = spec
        actor_cls = ray.remote(max_restarts=-1, max_task_retries=0)(WorkerActor)
        self._configs = spec.worker_configs()
        self._actors = {
            c.worker_id: actor_cls.options(
                name=f"pdserve-{c.worker_id}-{os.getpid()}", num_cpus=spec.num_cpus_per_worker,
                num_gpus=spec.num_gpus_per_worker, resources=spec.role_resources(c.role),
                runtime_env={"env_vars": {"OMP_NUM_THREADS": str(c.num_threads)}}).remote(
                    c, spec.registry_url, spec.registry_ttl_s)
            for c in self._configs}
        self._roles = {c.worker_id: c.role for c in self._configs}
        self._addresses: dict[str, str] = {}
        self._supervisors: list[asyncio.Task] = []

    async def start(self, timeout_s: float | None = None) -> None:
        """Boot every worker (loads the models in parallel); raises TimeoutError or the worker's error.
        timeout_s None = spec.worker_start_timeout_s."""
        async with asyncio.timeout(timeout_s or self.spec.worker_start_timeout_s):
            addresses = await asyncio.gather(*(a.ensure_started.remote() for a in self._actors.values()))
        self._addresses = dict(zip(self._actors, addresses))
        self._supervisors = [asyncio.create_task(self._supervise(wid)) for wid in self._actors]

    async def list_workers(self) -> list[WorkerEndpoint]:
        """The registry call: every worker that is up, with its current address."""
        return [WorkerEndpoint(wid, self._roles[wid], addr) for wid, addr in sorted(self._addresses.items())]

    def actor(self, worker_id: str):
        return self._actors[worker_id]

    async def worker_pid(self, worker_id: str) -> int:
        return await self._actors[worker_id].pid.remote()

    async def placement(self) -> dict[str, str]:
        """worker id -> the Ray node id it runs on."""
        ids = list(self._actors)
        nodes = await asyncio.gather(*(self._actors[w].node_id.remote() for w in ids))
        return dict(zip(ids, nodes))

    async def _supervise(self, wid: str) -> None:
        import ray

        while True:
            await asyncio.sleep(self.spec.supervise_interval_s)
            try:
                addr = await self._actors[wid].ensure_started.remote()
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                if self._addresses.pop(wid, None):
                    log.warning("worker %s is down (%s); Ray restarts it", wid, type(e).__name__)
                continue
            if self._addresses.get(wid) != addr:
                log.info("worker %s is up at %s", wid, addr)
                self._addresses[wid] = addr

    async def stop(self) -> None:
        """Stop the supervisors, then every worker (gracefully, then by force)."""
        import ray

        for t in self._supervisors:
            t.cancel()
        await asyncio.gather(*self._supervisors, return_exceptions=True)
        try:
            async with asyncio.timeout(30):
                await asyncio.gather(*(a.stop.remote() for a in self._actors.values()), return_exceptions=True)
        except TimeoutError:
            log.warning("workers did not stop in 30 s; killing them")
        for a in self._actors.values():
            ray.kill(a, no_restart=True)


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Connect to a Ray cluster (address) or start an embedded local one: dashboard off, auth off,
    temp files under RAY_TMPDIR (or the system temp dir). Run inside a loopback-only namespace."""
    import tempfile

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=False)
        return
    tmp = os.environ.get("RAY_TMPDIR") or tempfile.mkdtemp(prefix="pdserve-ray-")
    ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=tmp, log_to_driver=False,
             configure_logging=False)
