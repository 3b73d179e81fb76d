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
import math
import os
from dataclasses import dataclass, field, replace
from typing import Mapping

from engine.errors import UserError
from engine.spec_decode.config import SpeculativeConfig
from proto.tls import TlsFiles
from router.registry import WorkerEndpoint
from worker.core import WorkerConfig

log = logging.getLogger(__name__)

SUPERVISE_INTERVAL_S = 0.5
DRAIN_SETTLE_S = 1.0   # > the router's worker poll interval: no request is routed to a drained worker after it
DRAIN_POLL_S = 0.25


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
    idle_max_num_batched_tokens: int | None = None
    prefill_max_num_batched_tokens: int | None = None   # a prefill worker's budget; None = max_num_batched_tokens
    prefill_first_ratio: float | None = None
    host: str = "127.0.0.1"
    metrics_port: int | None = None   # workers use metrics_port + 1, + 2, ...
    num_gpus_per_worker: float = 0.0
    num_cpus_per_worker: float = 1.0
    threads_per_worker: int = 1
    cpu_cores: tuple[tuple[int, ...], ...] | None = None
    dtype: str = "float32"
    quantization: str = "none"          # every worker alike (engine/quantization)
    kv_cache_dtype: str = "auto"        # every worker alike: the KV format is in the compat key
    kv_cache_memory_bytes: int | None = None
    prefill_kv_cache_memory_bytes: int | None = None   # a prefill worker's, by memory; None = kv_cache_memory_bytes
    block_size: int = 16
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    batching: str = "continuous"        # every worker alike (engine/config.py SchedulerConfig.batching)
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
    # every worker API call must carry it (proto/internal_auth.py); None: the controller makes one
    internal_secret: str | None = field(default=None, repr=False)
    internal_tls: TlsFiles | None = None   # every worker serves its API over TLS (proto/tls.py)
    kv_checksum: bool = False   # --kv-checksum (debug)
    kv_faults: str = ""         # --kv-fault-injection (debug, kv_transfer/faults.py)
    engine_wedge_file: str = ""  # tests: each worker's engine step waits while this file exists (worker/faults.py)

    def role_batched_tokens(self, role: str) -> int:
        """The step budget of a worker of ``role``: a prefill worker's own, else max_num_batched_tokens."""
        if role == "prefill" and self.prefill_max_num_batched_tokens:
            return self.prefill_max_num_batched_tokens
        return self.max_num_batched_tokens

    def role_kv_cache_memory_bytes(self, role: str) -> int | None:
        """The KV cache (bytes) of a worker of ``role`` when sized by memory: a prefill worker's own, if set."""
        if role == "prefill" and self.prefill_kv_cache_memory_bytes:
            return self.prefill_kv_cache_memory_bytes
        return self.kv_cache_memory_bytes

    def role_resources(self, role: str) -> dict[str, float]:
        return dict(self.prefill_resources if role == "prefill" else self.decode_resources)

    def ray_num_cpus(self, max_workers: int = 0) -> int:
        """Logical CPUs an embedded Ray needs so every worker (up to max_workers when scaling)
        can be placed at num_cpus_per_worker each; at least 2."""
        n = max(len(self.worker_configs()), max_workers)
        return max(2, math.ceil(n * self.num_cpus_per_worker))

    def worker_configs(self) -> list[WorkerConfig]:
        roles = [("agg", self.num_decode)] if self.mode == "agg" else [("prefill", self.num_prefill),
                                                                     ("decode", self.num_decode)]
        base = WorkerConfig(worker_id="", role="agg", model=self.model, kv_transport=self.kv_transport,
                            num_blocks=self.num_blocks, max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens,
                            idle_max_num_batched_tokens=self.idle_max_num_batched_tokens,
                            prefill_first_ratio=self.prefill_first_ratio, num_threads=self.threads_per_worker,
                            device="cuda" if self.num_gpus_per_worker > 0 else "cpu", host=self.host,
                            block_size=self.block_size, max_model_len=self.max_model_len,
                            enable_prefix_caching=self.enable_prefix_caching, batching=self.batching,
                            served_model_name=self.served_model_name, transfer_timeout_s=self.transfer_timeout_s,
                            kv_cache_memory_bytes=self.kv_cache_memory_bytes, dtype=self.dtype,
                            quantization=self.quantization, kv_cache_dtype=self.kv_cache_dtype,
                            speculative=self.speculative, internal_secret=self.internal_secret,
                            tls=self.internal_tls, kv_checksum=self.kv_checksum, kv_faults=self.kv_faults,
                            engine_wedge_file=self.engine_wedge_file)
        configs = []
        for role, n in roles:
            for i in range(n):
                port = None if self.metrics_port is None else self.metrics_port + 1 + len(configs)
                cores = None if self.cpu_cores is None else self.cpu_cores[len(configs) % len(self.cpu_cores)]
                configs.append(replace(base, worker_id=f"{role}-{i}", role=role, metrics_port=port, cpu_cores=cores,
                                       max_num_batched_tokens=self.role_batched_tokens(role),
                                       kv_cache_memory_bytes=self.role_kv_cache_memory_bytes(role)))
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

    async def deregister(self) -> None:
        """Leave the registry (drain's first step): routers stop choosing this worker; it keeps serving."""
        if self._registration is not None:
            await self._registration.stop()
            self._registration = None

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

    def is_idle(self) -> bool:
        """Nothing in flight: no running, waiting, reserved (KV incoming) or held (KV outgoing) request."""
        if self._server is None:
            return True
        s = self._server.worker.engine.stats()
        leases = getattr(self._server.worker.worker_stats(), "leases", 0)
        return not (s.running or s.waiting or s.waiting_for_remote_kv or s.held_kv or leases)

    def node_id(self) -> str:
        """The Ray node this worker was placed on (hex id)."""
        import ray

        return ray.get_runtime_context().get_node_id()


class ClusterController:
    """Starts the worker actors, supervises them, and is the router's registry."""

    def __init__(self, spec: ClusterSpec) -> None:
        import ray

        from proto.internal_auth import new_secret

        if spec.internal_secret is None:
            spec = replace(spec, internal_secret=new_secret())
        self.spec = spec
        self.internal_secret: str = spec.internal_secret  # hand it to the routers (RouterConfig.internal_secret)
        self._actor_cls = ray.remote(max_restarts=-1, max_task_retries=0)(WorkerActor)
        self._configs = spec.worker_configs()
        self._actors = {c.worker_id: self._spawn(c) for c in self._configs}
        self._roles = {c.worker_id: c.role for c in self._configs}
        self._addresses: dict[str, str] = {}
        self._supervisors: dict[str, asyncio.Task] = {}
        self._starting: set[str] = set()      # scaled up, still loading
        self._draining: dict[str, asyncio.Task] = {}
        self._next_index = {role: sum(1 for c in self._configs if c.role == role) for role in ("prefill", "decode", "agg")}
        self.drained: list[str] = []           # worker ids drained and stopped, in order

    def _spawn(self, c: WorkerConfig):
        return self._actor_cls.options(
            name=f"pdserve-{c.worker_id}-{os.getpid()}", num_cpus=self.spec.num_cpus_per_worker,
            num_gpus=self.spec.num_gpus_per_worker, resources=self.spec.role_resources(c.role),
            runtime_env={"env_vars": worker_env(c.num_threads)}).remote(
                c, self.spec.registry_url, self.spec.registry_ttl_s)

    async def start(self, timeout_s: float | None = None) -> None:
        """Boot every worker (loads the models in parallel); raises TimeoutError or the worker's error.
        timeout_s None = spec.worker_start_timeout_s."""
        try:
            async with asyncio.timeout(timeout_s or self.spec.worker_start_timeout_s):
                addresses = await asyncio.gather(*(a.ensure_started.remote() for a in self._actors.values()))
        except UserError as e:
            # A worker's configuration error (a malformed KV scales file, ...) reaches the driver as
            # Ray's task error, which is also a UserError but whose text is the actor's traceback:
            # the user gets the worker's one-line message.
            cause = getattr(e, "cause", None)
            raise (cause if isinstance(cause, UserError) else e) from None
        self._addresses = dict(zip(self._actors, addresses))
        self._supervisors = {wid: asyncio.create_task(self._supervise(wid)) for wid in self._actors}

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

    # -- scaling ---------------------------------------------------------------------------------
    def replicas(self) -> dict[str, dict[str, int]]:
        """Per role: ready (serving, in the registry), starting (loading) and draining workers."""
        out = {}
        for role in sorted(set(self._roles.values())):
            ids = [w for w, r in self._roles.items() if r == role]
            out[role] = {"ready": sum(1 for w in ids if w in self._addresses and w not in self._draining),
                         "starting": sum(1 for w in ids if w in self._starting),
                         "draining": sum(1 for w in ids if w in self._draining)}
        return out

    def metrics_targets(self) -> dict[str, tuple[str, str]]:
        """worker id -> (role, its /metrics URL), for serving workers that export metrics."""
        return {c.worker_id: (c.role, f"http://{c.host}:{c.metrics_port}/metrics") for c in self._configs
                if c.metrics_port is not None and c.worker_id in self._addresses and c.worker_id not in self._draining}

    def _active(self, role: str) -> list[str]:
        """Workers of a role that count toward its size: up or starting, not draining (oldest first)."""
        ids = [w for w, r in self._roles.items() if r == role and w not in self._draining]
        return sorted(ids, key=lambda w: int(w.rsplit("-", 1)[1]))

    async def scale(self, role: str, target: int) -> dict[str, list[str]]:
        """Grow or shrink ``role`` to ``target`` workers (starting ones count, draining ones do not).

        Growing starts actors in the background (they join the registry when they serve);
        shrinking drains the newest: out of the registry at once (routers stop choosing them),
        then stopped once idle (no running, waiting, reserved or held request). A drain never
        fails a request. Returns the ids started and the ids set draining. ValueError for an
        unknown role or a negative target.
        """
        if role not in set(self._roles.values()) | {"prefill", "decode", "agg"}:
            raise ValueError(f"unknown role {role!r}")
        if target < 0 or (role != "prefill" and target < 1):
            raise ValueError(f"{role} target must be >= {0 if role == 'prefill' else 1}, got {target}")
        active = self._active(role)
        started, drained = [], []
        for _ in range(target - len(active)):
            started.append(self._grow(role))
        for wid in active[target:][::-1]:
            drained.append(wid)
            self._draining[wid] = asyncio.create_task(self._drain(wid))
        return {"started": started, "draining": drained}

    def _grow(self, role: str) -> str:
        template = next((c for c in self._configs if c.role == role), None) or replace(
            self._configs[0], role=role, max_num_batched_tokens=self.spec.role_batched_tokens(role),
            kv_cache_memory_bytes=self.spec.role_kv_cache_memory_bytes(role))
        wid = f"{role}-{self._next_index.get(role, 0)}"
        self._next_index[role] = self._next_index.get(role, 0) + 1
        port = None if self.spec.metrics_port is None else self.spec.metrics_port + 1 + len(self._roles)
        config = replace(template, worker_id=wid, metrics_port=port)
        self._configs.append(config)
        self._roles[wid] = role
        self._actors[wid] = self._spawn(config)
        self._starting.add(wid)
        self._supervisors[wid] = asyncio.create_task(self._boot_then_supervise(wid))
        return wid

    async def _boot_then_supervise(self, wid: str) -> None:
        try:
            async with asyncio.timeout(self.spec.worker_start_timeout_s):
                self._addresses[wid] = await self._actors[wid].ensure_started.remote()
            log.info("worker %s started at %s", wid, self._addresses[wid])
        except Exception as e:  # noqa: BLE001 - a failed start is logged; supervision keeps retrying
            log.warning("worker %s failed to start: %s", wid, e)
        finally:
            self._starting.discard(wid)
        await self._supervise(wid)

    async def _drain(self, wid: str) -> None:
        """Deregister, wait until nothing is in flight on the worker, then stop it."""
        import ray

        self._addresses.pop(wid, None)
        sup = self._supervisors.pop(wid, None)
        if sup is not None:
            sup.cancel()
        try:
            await self._actors[wid].deregister.remote()
        except Exception as e:  # noqa: BLE001 - a dead worker has nothing to drain
            log.info("worker %s: deregister failed (%s)", wid, type(e).__name__)
        # Routers refresh their view every poll interval: one they chose us in just before still lands.
        await asyncio.sleep(DRAIN_SETTLE_S)
        actor = self._actors[wid]
        while True:
            try:
                if await actor.is_idle.remote():
                    break
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                break
            await asyncio.sleep(DRAIN_POLL_S)
        try:
            async with asyncio.timeout(30):
                await actor.stop.remote()
        except Exception as e:  # noqa: BLE001 - it is killed below either way
            log.warning("worker %s did not stop cleanly: %s", wid, e)
        ray.kill(actor, no_restart=True)
        for table in (self._actors, self._roles):
            table.pop(wid, None)
        self._configs = [c for c in self._configs if c.worker_id != wid]
        self._draining.pop(wid, None)
        self.drained.append(wid)
        log.info("worker %s drained and stopped", wid)

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
            if wid in self._draining:
                return
            if self._addresses.get(wid) != addr:
                log.info("worker %s is up at %s", wid, addr)
                self._addresses[wid] = addr

    async def stop(self) -> None:
        """Stop the supervisors, then every worker (gracefully, then by force)."""
        import ray

        tasks = [*self._supervisors.values(), *self._draining.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            async with asyncio.timeout(30):
                await asyncio.gather(*(a.stop.remote() for a in self._actors.values()), return_exceptions=True)
        except TimeoutError:
            log.warning("workers did not stop in 30 s; killing them")
        for a in self._actors.values():
            ray.kill(a, no_restart=True)


# GNU OpenMP's wait settings, read once when torch loads libgomp, so they must be in the actor's
# environment from its start. Unset, libgomp spins ~300k rounds at each barrier before it sleeps.
# Measured 2026-12-02 (agg defaults, bench peers' workload: 32 ShareGPT prompts, 64 tokens, c16):
# quiet host (load 2-3 decaying): default 493 tok/s, GOMP_SPINCOUNT=1000 434, OMP_WAIT_POLICY=PASSIVE
# 364 (decode step b16 p50 17.9 / 20.6 / 25.9 ms); host loaded by other jobs (load 3.4-4.3, two
# rounds each): default 82 / 64, GOMP_SPINCOUNT=10000 108 / 112, PASSIVE 293 / 294. So the default
# stays libgomp's, and a user on a shared host sets OMP_WAIT_POLICY=PASSIVE for `pdserve serve`.
OPENMP_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
NUMERICS_VARS = ("PDSERVE_INT8_DOWN_ACT",)
"""Driver variables that change what a worker computes (engine/quantization/apply.py
INT8_DOWN_ACT_ENV): every worker must get the same, or the KV compat key refuses their pairing."""


def worker_env(num_threads: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The env_vars of a worker actor's runtime_env: OMP_NUM_THREADS = num_threads, and from
    ``environ`` (default: this process's) the OpenMP wait settings the user set (OPENMP_WAIT_VARS),
    the numerics overrides (NUMERICS_VARS) and the PDSERVE_DEBUG_* hooks. Passed explicitly because the actors of a joined Ray cluster
    (--ray-address) do not inherit the driver's environment."""
    environ = os.environ if environ is None else environ
    env = {"OMP_NUM_THREADS": str(num_threads)}
    env.update({k: environ[k] for k in OPENMP_WAIT_VARS + NUMERICS_VARS if environ.get(k)})
    env.update(_debug_env(environ))
    return env


def _debug_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The driver's PDSERVE_DEBUG_* variables (debug hooks such as a corrupted FP8 scale), for the
    actors: a joined Ray cluster's workers do not inherit the driver's environment."""
    return {k: v for k, v in (os.environ if environ is None else environ).items() if k.startswith("PDSERVE_DEBUG_")}


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
    # No prestarted workers: Ray starts one idle Python worker per CPU for the driver's first
    # tasks, but pdserve runs only actors, each in a process of its own (their runtime_env differs),
    # so the prestarted ones idled all along (2 x ~80 MiB here, and their start-up's CPU).
    ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=tmp, log_to_driver=False,
             configure_logging=False,
             _system_config={"prestart_worker_first_driver": False, "enable_worker_prestart": False})
