"""The worker registry on Redis, the router's side: a watched view of the registered workers.

Records (proto/registry.py): ``pdserve:worker:<id>`` = JSON ``WorkerRegistration`` with a TTL
(default 3 s) that the worker's heartbeat (worker/registration.py) renews every TTL/3 and deletes
on drain, in the database of the URL ``redis://HOST:PORT/DB``; a worker that stops heartbeating
disappears when its key expires. ``RedisRegistry`` is the
router's (the ``router.registry.Registry`` interface): it keeps a view of every registered
worker, reloaded (SCAN + MGET) when a keyspace notification says a key was set, deleted or
expired (it turns notifications on with CONFIG SET; a server that refuses leaves only the
slow reload every ``resync_s``). ``list_workers`` always answers from the view, so while Redis
is unreachable the router keeps serving the workers it last saw (``connected`` is False, health
and metrics say so); when Redis returns, the watcher reconnects and reloads, and the workers'
heartbeats have re-registered them (Redis restarted empty) within one heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
import time

from proto.registry import KEY_PREFIX, WorkerRegistration, parse_url
from router.registry import WorkerEndpoint

log = logging.getLogger(__name__)


def _client(url: str):
    import redis.asyncio as aioredis

    return aioredis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0, health_check_interval=0)


class RedisRegistry:
    """The router's view of the registered workers, kept current by keyspace notifications."""

    def __init__(self, url: str, resync_s: float = 5.0) -> None:
        self.url = parse_url(url)
        self.resync_s = resync_s
        self.client = _client(url)
        self.db = self.client.connection_pool.connection_kwargs.get("db", 0)
        self.connected = False
        self.last_contact = 0.0  # time.time() of the last successful read
        self.reloads = 0
        self._view: dict[str, WorkerRegistration] = {}
        self._connected_since = 0.0  # time.monotonic() of the watcher's last (re)connect
        self._task: asyncio.Task | None = None
        self._loaded = asyncio.Event()

    async def start(self, timeout_s: float = 5.0) -> None:
        """Start watching; waits (up to timeout_s) for a first view, then serves from whatever it has."""
        self._task = asyncio.create_task(self._watch())
        try:
            await asyncio.wait_for(self._loaded.wait(), timeout_s)
        except TimeoutError:
            log.warning("registry %s not reachable at start; serving from an empty view", self.url)

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.client.aclose()

    async def list_workers(self) -> list[WorkerEndpoint]:
        if self._task is None:
            await self.start()
        return [WorkerEndpoint(r.id, r.role, r.address) for _, r in sorted(self._view.items())]

    def registrations(self) -> list[WorkerRegistration]:
        return [r for _, r in sorted(self._view.items())]

    async def reload(self) -> None:
        keys = [k async for k in self.client.scan_iter(match=KEY_PREFIX + "*", count=500)]
        values = await self.client.mget(keys) if keys else []
        view = {}
        for v in values:
            if v is not None:
                r = WorkerRegistration.from_json(v)
                view[r.id] = r
        # just after a (re)connect, a Redis that restarted empty has not yet heard the heartbeats: keep
        # a missing worker for its TTL from the reconnect rather than drop it (and its requests in flight)
        settling = time.monotonic() - self._connected_since
        for wid, r in self._view.items():
            if wid not in view and settling < r.ttl_s + 0.5:
                view[wid] = r
        self._view = view
        self.reloads += 1
        self.last_contact = time.time()
        self._loaded.set()

    async def _apply(self, msg: dict) -> None:
        """One keyspace notification: channel __keyspace@DB__:pdserve:worker:<id>, data = the command."""
        channel = msg["channel"].decode() if isinstance(msg["channel"], bytes) else msg["channel"]
        event = msg["data"].decode() if isinstance(msg["data"], bytes) else msg["data"]
        key = channel.split(":", 1)[1]
        wid = key[len(KEY_PREFIX):]
        if event in ("del", "expired", "evicted"):
            if self._view.pop(wid, None) is not None:
                log.info("registry: worker %s left (%s)", wid, event)
        elif event == "set":
            value = await self.client.get(key)
            if value is not None:
                r = WorkerRegistration.from_json(value)
                if self._view.get(wid) != r:
                    log.info("registry: worker %s at %s (%s)", wid, r.address, r.role)
                self._view[wid] = r
        self.last_contact = time.time()

    async def _watch(self) -> None:
        while True:
            pubsub = None
            try:
                await self._enable_notifications()
                pubsub = self.client.pubsub()
                await pubsub.psubscribe(f"__keyspace@{self.db}__:{KEY_PREFIX}*")
                if not self.connected:
                    self._connected_since = time.monotonic()
                await self.reload()
                if not self.connected:
                    log.info("registry %s: connected, %d workers", self.url, len(self._view))
                self.connected = True
                next_resync = time.monotonic() + min(self.resync_s, 1.0)  # once more when the settling ends
                while True:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True,
                                                   timeout=max(next_resync - time.monotonic(), 0.01))
                    if msg is not None:
                        await self._apply(msg)
                    if time.monotonic() >= next_resync:
                        await self.reload()
                        next_resync = time.monotonic() + self.resync_s
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if self.connected:
                    log.warning("registry %s unreachable (%s): serving from the last view of %d workers",
                                self.url, type(e).__name__, len(self._view))
                self.connected = False
                await asyncio.sleep(0.5)
            finally:
                if pubsub is not None:
                    try:
                        await pubsub.aclose()
                    except Exception:
                        pass

    async def _enable_notifications(self) -> None:
        """Keyspace events for string commands, generic commands (DEL) and expiry: K$gx."""
        try:
            flags = (await self.client.config_get("notify-keyspace-events")).get("notify-keyspace-events", "")
            flags = flags.decode() if isinstance(flags, bytes) else flags
            want = set(flags) | set("K$gx")
            if set(flags) != want:
                await self.client.config_set("notify-keyspace-events", "".join(sorted(want)))
        except Exception as e:
            if "unknown command" in str(e).lower() or "noperm" in str(e).lower():
                log.warning("registry: cannot enable keyspace notifications (%s); reloading every %.0f s",
                            e, self.resync_s)
                return
            raise
