"""The control plane end to end: two agg workers on real Ray with the real model, registered in
a real redis-server; KV-aware routing by the workers' KV events, the registry's TTL, an event
gap, Redis killed mid-load, and a second router. One module-scoped cluster."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from proto.pdserve.v1 import api_pb2, api_pb2_grpc
from router.routing import RoutingConfig
from tests.conftest import sharegpt_prompts
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.ray, pytest.mark.model]

MODEL = "smollm2-135m-instruct"
# the production TTL: heartbeats every 1 s, so a worker on a loaded host keeps its key through a 2 s stall
TTL_S = 3.0
# long system prompts (~130-200 tokens each), distinct from their first words
SYSTEMS = [f"Assistant profile {i}. " + " ".join(p.split()[:110]) for i, p in enumerate(sharegpt_prompts(40)[20:])
           if len(p.split()) > 110][:9]


@pytest.fixture(scope="module")
def redis_proc():
    with RedisServer() as server:  # its own: one test kills it
        yield server


@pytest.fixture(scope="module")
def cluster(ray_session, redis_proc):
    from deploy.cluster import ClusterSpec
    from deploy.local_cluster import LocalServing
    from router.app import RouterConfig

    spec = ClusterSpec(mode="agg", num_prefill=0, num_decode=2, num_blocks=192, registry_url=redis_proc.url,
                       registry_ttl_s=TTL_S)
    with LocalServing(spec, RouterConfig(port=0, http_port=None, mode="agg", routing=RoutingConfig(seed=0))) as s:
        yield s


def _request(system: str, question: str, max_tokens: int = 2) -> api_pb2.GenerateRequest:
    req = api_pb2.GenerateRequest(model=MODEL, sampling=api_pb2.SamplingOptions(temperature=0, max_tokens=max_tokens,
                                                                                ignore_eos=True))
    req.chat.messages.add(role="system", content=system)
    req.chat.messages.add(role="user", content=question)
    return req


def _generate(address: str, req: api_pb2.GenerateRequest, timeout_s: float = 120) -> api_pb2.Usage:
    with grpc.insecure_channel(address) as ch:
        last = None
        for last in api_pb2_grpc.GenerationStub(ch).Generate(req, timeout=timeout_s):
            pass
    assert last is not None and last.finish_reason == "length"
    return last.usage


def _until(pred, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not pred():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"{what}: not within {timeout_s}s")
        time.sleep(0.02)
    return time.monotonic() - start


def _indexed_blocks(cluster) -> int:
    return sum(len(cluster.router.index.hashes(w.id)) for w in cluster.router.pool.workers())


def _generate_and_index(cluster, req: api_pb2.GenerateRequest) -> None:
    """Send a request with a new prefix and wait until its BlockStored reached the router's index
    (over the Redis stream: milliseconds)."""
    before = _indexed_blocks(cluster)
    _generate(cluster.grpc_address, req)
    _until(lambda: _indexed_blocks(cluster) > before, 10.0, "the new prefix in the router's index")


def _pairs_cached_tokens(cluster, systems: list[str]) -> list[int]:
    """Each system prompt twice in a row (distinct questions): the second request's cached tokens."""
    out = []
    for i, system in enumerate(systems):
        _generate_and_index(cluster, _request(system, f"Question {i}: what is two plus two?"))
        out.append(_generate(cluster.grpc_address, _request(system, f"Now question {i}b: name a color.")).cached_tokens)
    return out


def test_shared_system_prompt_goes_to_the_worker_that_caches_it_and_round_robin_does_not(cluster):
    assert sorted(w.id for w in cluster.router.pool.workers()) == ["agg-0", "agg-1"]
    kv = _pairs_cached_tokens(cluster, SYSTEMS[:2])
    selector = cluster.router.selector
    selector.config = RoutingConfig(policy="round-robin")
    try:
        rr = _pairs_cached_tokens(cluster, SYSTEMS[3:5])
    finally:
        selector.config = RoutingConfig(seed=0)
    # kv: the second request of each pair hits the whole system prompt on the worker that cached it
    assert all(c >= 112 for c in kv), kv
    # round-robin: it lands on the other worker, which has only the chat template's first tokens (if any)
    assert all(c < 16 for c in rr), rr


def test_burst_of_identical_prefix_requests_spreads_once_the_cached_worker_is_loaded(cluster):
    system = SYSTEMS[6]
    _generate_and_index(cluster, _request(system, "Warm up."))
    before = dict(cluster.router.selector.decisions)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            _generate(cluster.grpc_address, _request(system, f"Burst question {i}?", max_tokens=4))
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    after = cluster.router.selector.decisions
    share = {w: after.get(w, 0) - before.get(w, 0) for w in ("agg-0", "agg-1")}
    assert sum(share.values()) == 16 and min(share.values()) >= 4, share  # no collapse onto the cached worker


def test_a_worker_that_stops_heartbeating_leaves_the_registry_within_its_ttl(cluster):
    registry = cluster.router.registry
    actor = cluster.controller.actor("agg-1")
    import ray

    ray.get(actor.pause_heartbeat.remote(True))
    try:
        # within the TTL, plus Redis's expiry cycle (10 Hz) and the event loop's delay on a loaded machine (3 s)
        gone = _until(lambda: "agg-1" not in {r.id for r in registry.registrations()}, TTL_S + 10, "agg-1 expiry")
        assert gone <= TTL_S + 3.0, gone
        _until(lambda: "agg-1" not in {w.id for w in cluster.router.pool.workers()}, 5.0, "pool drops agg-1")
        assert cluster.router.index.position("agg-1") is None  # its index entries went with it
    finally:
        ray.get(actor.pause_heartbeat.remote(False))
    _until(lambda: len(cluster.router.pool.workers()) == 2, 10.0, "agg-1 back")
    _until(lambda: cluster.router.index.position("agg-1") is not None, 10.0, "agg-1 index resynced")


def test_an_injected_event_gap_triggers_a_resync(cluster):
    import ray

    from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc

    sync, index = cluster.router.kv_sync, cluster.router.index
    snapshots = sync.snapshots
    ray.get(cluster.controller.actor("agg-0").inject_kv_event_gap.remote(1))
    worker = cluster.router.pool.get("agg-0")
    ids = [cluster.router.service.tokenizer.encode(f"Variant {i}. " + SYSTEMS[7]) for i in range(2)]

    async def direct() -> None:  # straight to the worker: two new prefixes, the first one's event is lost
        for i, prompt in enumerate(ids):
            req = worker_pb2.WorkerGenerateRequest(request_id=f"gap-{i}", prompt_token_ids=prompt,
                                                   sampling=api_pb2.SamplingOptions(temperature=0, max_tokens=1))
            async for _ in worker.stub.Generate(req, timeout=60):
                pass

    cluster.call(direct())
    _until(lambda: sync.snapshots > snapshots, 10.0, "resync after the gap")

    async def truth() -> set[int]:
        stub = worker_pb2_grpc.WorkerStub(worker.channel)
        return set((await stub.KvEvents(worker_pb2.KvEventsRequest(snapshot=True))).block_hashes)

    _until(lambda: index.hashes("agg-0") == cluster.call(truth()), 10.0, "index equals the worker's cache")
    from router.prefix_index import prompt_block_hashes

    assert index.overlap_blocks("agg-0", prompt_block_hashes(ids[0], 16)) >= 8  # the lost event's blocks are back


def test_redis_killed_and_restarted_mid_load_fails_no_request(cluster, redis_proc):
    registry = cluster.router.registry
    errors: list[BaseException] = []
    done = []

    def one(i: int) -> None:
        try:
            _generate(cluster.grpc_address, _request(SYSTEMS[i % 3], f"Under load {i}?", max_tokens=4), 300)
            done.append(i)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads[:4]:
        t.start()
    time.sleep(0.3)
    redis_proc.kill()
    _until(lambda: not registry.connected, 10.0, "router notices Redis is down")
    assert cluster.router.health_details()["registry"].startswith("disconnected")
    for t in threads[4:]:
        t.start()  # served from the last view
    time.sleep(TTL_S)  # longer than the TTL: nothing may expire from the router's view meanwhile
    redis_proc.start()  # empty (no persistence)
    for t in threads:
        t.join(300)
    assert not errors and len(done) == 8, (errors, done)
    _until(lambda: registry.connected, 10.0, "registry reconnects")
    _until(lambda: {r.id for r in registry.registrations()} == {"agg-0", "agg-1"}, 10.0, "workers re-register")
    _until(lambda: cluster.router.kv_consumer.connected, 10.0, "KV streams followed again")
    usage = _generate(cluster.grpc_address, _request(SYSTEMS[0], "After the outage?"))
    assert usage.cached_tokens >= 112  # the index still routes to the cached worker


def test_two_routers_serve_the_same_cluster_and_one_survives_the_other(cluster):
    from router.app import Router, RouterConfig
    from router.redis_registry import RedisRegistry

    async def start_second() -> Router:
        r = Router(RedisRegistry(cluster.spec.registry_url), RouterConfig(
            port=0, http_port=None, mode="agg", internal_secret=cluster.controller.internal_secret))
        await r.start()
        for _ in range(600):  # 30 s: Info and the model's files from a worker busy on a loaded host
            if r.ready() and len(r.pool.workers()) == 2:
                return r
            await asyncio.sleep(0.05)
        raise TimeoutError("second router did not see both workers")

    second = cluster.call(start_second())
    try:
        _until(lambda: second.index.position("agg-0") is not None, 10.0, "second router's index")
        usage = _generate(second.endpoints.grpc, _request(SYSTEMS[1], "From the second router?"))
        assert usage.cached_tokens >= 112  # its index learned the cache from the streams / snapshots
        assert _generate(cluster.grpc_address, _request(SYSTEMS[2], "From the first?")).cached_tokens >= 112
    finally:
        cluster.call(second.stop())
    _generate(cluster.grpc_address, _request(SYSTEMS[2], "Still here?"))  # the first serves on
