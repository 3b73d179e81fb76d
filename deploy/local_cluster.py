"""A serving cluster driven from synchronous code: Ray workers, controller and router on a
background event loop thread. Used by the demo script, benchmarks and tests.

    with LocalServing(ClusterSpec(mode="disagg", kv_transport="tcp")) as s:
        RouterClient(s.grpc_address) ...

Ray must already be initialised (deploy.cluster.init_ray) or is started embedded.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, Coroutine

from deploy.cluster import ClusterController, ClusterSpec, init_ray
from router.app import Router, RouterConfig
from router.registry import CallableRegistry, Registry


class LocalServing:
    def __init__(self, spec: ClusterSpec, router_config: RouterConfig | None = None,
                 start_timeout_s: float = 300.0) -> None:
        self.spec = spec
        self.router_config = router_config or RouterConfig(port=0, http_port=0, mode=spec.mode)
        self._timeout = start_timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pdserve-local", daemon=True)
        self.controller: ClusterController | None = None
        self.router: Router | None = None

    def __enter__(self) -> "LocalServing":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def call(self, coro: Coroutine[Any, Any, Any], timeout_s: float | None = 120.0) -> Any:
        """Run a coroutine on the serving loop and wait for its result."""
        fut: Future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result(timeout_s)

    def start(self) -> None:
        # An embedded Ray counts the host's cores (2 here), and each worker actor asks for
        # num_cpus_per_worker of them: a third worker would wait for a CPU forever. Ray's CPUs
        # are scheduling tokens; the workers' threads are placed by their own affinity.
        init_ray(num_cpus=self.spec.ray_num_cpus())
        self._thread.start()
        self.call(self._start(), self._timeout)

    async def _start(self) -> None:
        self.controller = ClusterController(self.spec)
        await self.controller.start(self._timeout)
        if self.router_config.internal_secret is None:
            self.router_config = replace(self.router_config, internal_secret=self.controller.internal_secret)
        if self.router_config.internal_tls is None and self.spec.internal_tls is not None:
            self.router_config = replace(self.router_config, internal_tls=self.spec.internal_tls)
        self.router = Router(self.make_registry(), self.router_config)
        await self.router.start()
        for _ in range(200):  # until the router has connected to every worker
            consumer = self.router.kv_consumer  # with Redis: following the KV-event streams
            if self.router.ready() and len(self.router.pool.workers()) == len(self.spec.worker_configs()) \
                    and (consumer is None or consumer.connected):
                return
            await asyncio.sleep(0.05)
        raise TimeoutError("router did not connect to every worker")

    def make_registry(self) -> Registry:
        """The routers' registry: Redis when the spec names one, else the controller."""
        if self.spec.registry_url:
            from router.redis_registry import RedisRegistry

            return RedisRegistry(self.spec.registry_url)
        return CallableRegistry(self.controller.list_workers)

    @property
    def grpc_address(self) -> str:
        return self.router.endpoints.grpc

    @property
    def http_base_url(self) -> str:
        return f"http://{self.router.endpoints.http}/v1"

    def worker_stats(self) -> dict[str, Any]:
        """Fresh Stats of every worker the router knows, by worker id."""
        return self.call(self._stats())

    async def _stats(self) -> dict[str, Any]:
        await self.router.pool.refresh()
        return {w.id: w.stats for w in self.router.pool.workers()}

    def stop(self) -> None:
        if self._thread.is_alive():
            try:
                self.call(self._stop(), 120)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(10)

    async def _stop(self) -> None:
        if self.router is not None:
            await self.router.stop()
        if self.controller is not None:
            await self.controller.stop()
