"""The Redis registry against a real redis-server (no Ray, no model): registration with a TTL
renewed by the heartbeat, deregistration on drain, the router's watched view, and Redis going
away and coming back."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from proto.registry import WorkerRegistration, parse_url
from router.redis_registry import RedisRegistry
from worker.registration import RedisRegistration
from tests.polling import until
from tests.redis_server import RedisServer


def _reg(i: int) -> WorkerRegistration:
    return WorkerRegistration(f"agg-{i}", "agg", f"127.0.0.1:{5000 + i}", "smollm2", "fp32/16", 256)


# 2 s: heartbeats every 0.67 s, so a loaded host must stall this process for over 1.3 s to lose a key
TTL_S = 2.0


def test_workers_register_leave_on_drain_and_expire_without_heartbeat(redis_client, redis_server):
    async def run():
        registry = RedisRegistry(redis_server.url, resync_s=60)  # only notifications can update it in time
        await registry.start()
        a, b = (RedisRegistration(redis_server.url, _reg(i), ttl_s=TTL_S) for i in range(2))
        await a.start()
        await b.start()
        await until(lambda: len(registry.registrations()) == 2, 10.0)
        assert registry.registrations()[0] == replace(_reg(0), ttl_s=TTL_S) and registry.connected
        assert 0 < redis_client.pttl("pdserve:worker:agg-0") <= TTL_S * 1000
        await asyncio.sleep(TTL_S + 0.5)  # past one TTL: the heartbeat keeps both
        assert registry.connected
        assert len(await registry.list_workers()) == 2
        b.paused = True  # stops heartbeating
        gone_after = await until(lambda: [r.id for r in registry.registrations()] == ["agg-0"], TTL_S + 10.0)
        # the TTL plus Redis's expiry cycle (10 Hz) and a loaded machine's delay (3 s of it); without the
        # expiry notification the view would hold it until the 60 s resync
        assert gone_after <= TTL_S + 3.0, gone_after
        await a.stop()  # drain: deregistered at once
        await until(lambda: registry.registrations() == [], 10.0)
        await b.stop()
        await registry.close()

    asyncio.run(run())


def test_redis_down_keeps_the_last_view_and_recovers():
    async def run(server: RedisServer):
        registry = RedisRegistry(server.url, resync_s=60)
        await registry.start()
        worker = RedisRegistration(server.url, _reg(0), ttl_s=0.6)
        await worker.start()
        await until(lambda: len(registry.registrations()) == 1, 10.0)
        server.kill()
        await until(lambda: not registry.connected, 10.0)
        await asyncio.sleep(1.0)  # past the TTL: the view must not forget the worker
        assert [w.id for w in await registry.list_workers()] == ["agg-0"]
        worker.paused = True  # so that Redis comes back without the worker's key for a while
        server.start()  # empty: no persistence
        await until(lambda: registry.connected, 15.0)
        for _ in range(10):  # the empty Redis must not empty the view before heartbeats could re-register
            assert [w.id for w in await registry.list_workers()] == ["agg-0"]
            await asyncio.sleep(0.03)
        worker.paused = False
        end = time.monotonic() + 10.0  # the next heartbeat (every 0.2 s) re-registers it
        while (registry_keys := await registry.client.keys("pdserve:worker:*")) != [b"pdserve:worker:agg-0"]:
            assert time.monotonic() < end, registry_keys
            await asyncio.sleep(0.05)
        assert [w.id for w in await registry.list_workers()] == ["agg-0"]
        await worker.stop()
        await registry.close()

    with RedisServer() as server:
        asyncio.run(run(server))


@pytest.mark.parametrize("url", ["http://x:1/0", "redis://", "redis://h:1/x"])
def test_bad_registry_url_names_the_option(url):
    with pytest.raises(ValueError, match="--registry"):
        parse_url(url)
