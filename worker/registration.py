"""A worker's presence in the Redis registry: register with a TTL, heartbeat, deregister on drain.

Records: proto/registry.py. Redis errors are logged and retried; the worker keeps serving without
Redis, and its next heartbeat after Redis returns registers it again (a restarted Redis is empty).
"""

from __future__ import annotations

import asyncio
import logging

from proto.registry import DEFAULT_TTL_S, KEY_PREFIX, WorkerRegistration

log = logging.getLogger(__name__)


def _client(url: str):
    import redis.asyncio as aioredis

    return aioredis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0, health_check_interval=0)


class RedisRegistration:
    """A worker's registration: SET key EX ttl now and every ttl/3; DEL on stop.

    Redis errors are logged and retried; the worker keeps serving without Redis."""

    def __init__(self, url: str, reg: WorkerRegistration, ttl_s: float = DEFAULT_TTL_S) -> None:
        from dataclasses import replace

        self.url = url
        self.reg = replace(reg, ttl_s=ttl_s)
        self.ttl_s = ttl_s
        self.client = _client(url)
        self.paused = False  # fault injection (tests): stop heartbeating, as a hung worker would
        self._task: asyncio.Task | None = None

    @property
    def key(self) -> str:
        return KEY_PREFIX + self.reg.id

    async def start(self) -> None:
        await self._beat()
        self._task = asyncio.create_task(self._loop())

    async def _beat(self) -> bool:
        try:
            await self.client.set(self.key, self.reg.to_json(), px=int(self.ttl_s * 1000))
            return True
        except Exception as e:
            log.warning("registry heartbeat of %s failed: %s", self.reg.id, type(e).__name__)
            return False

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            if not self.paused:
                await self._beat()

    async def stop(self) -> None:
        """Deregister (drain): the key goes at once, routers drop the worker on the notification."""
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            await self.client.delete(self.key)
        except Exception as e:
            log.warning("deregistering %s failed: %s (its key expires)", self.reg.id, type(e).__name__)
        await self.client.aclose()


def registration_for(worker, address: str) -> WorkerRegistration:
    """The registration of a built worker (worker.core.WorkerCore) serving at address."""
    kv_format, capacity = "", 0
    engine = getattr(worker.engine, "engine", None)
    runner = getattr(engine, "runner", None)
    spec = getattr(getattr(runner, "kv_cache", None), "spec", None)
    if spec is not None:
        from kv_transfer.base import CompatKey

        key = CompatKey.from_spec(spec, worker.model_id)
        kv_format = f"{key.kv_dtype}/{key.layout}/bs{key.block_size}/kv{key.num_kv_heads}x{key.head_dim}"
    if engine is not None:
        capacity = engine.block_manager.num_blocks
    c = worker.config
    return WorkerRegistration(c.worker_id, c.role, address, worker.model_id, kv_format, capacity)
