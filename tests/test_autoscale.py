"""Scaling a live cluster (real Ray, real model, real gRPC): workers started and drained under
load with zero failed requests, and the planner growing then shrinking both pools over a load
ramp from the router's scraped metrics. Every test ends with the workers idle (no leaked block)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from proto.pdserve.v1 import api_pb2, api_pb2_grpc

pytestmark = [pytest.mark.ray, pytest.mark.model]


@pytest.fixture(scope="module")
def serving(ray_session):
    from deploy.cluster import ClusterSpec
    from deploy.local_cluster import LocalServing
    from router.app import RouterConfig

    spec = ClusterSpec(mode="disagg", kv_transport="tcp", num_prefill=1, num_decode=1, num_blocks=256)
    with LocalServing(spec, RouterConfig(port=0, http_port=None, metrics_port=0, mode="disagg", max_waiting=64)) as s:
        yield s


class Load:
    """``clients`` threads sending short greedy chat requests in a loop until stopped."""

    def __init__(self, address: str, clients: int) -> None:
        self.ok = 0
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(address, i), daemon=True) for i in range(clients)]
        for t in self._threads:
            t.start()

    def _client(self, address: str, i: int) -> None:
        stub = api_pb2_grpc.GenerationStub(grpc.insecure_channel(address))
        n = 0
        while not self._stop.is_set():
            req = api_pb2.GenerateRequest(sampling=api_pb2.SamplingOptions(max_tokens=8, temperature=0.0))
            req.chat.messages.add(role="user", content=f"Say a word that rhymes with {'cat dog sun tree'.split()[n % 4]}.")
            n += 1
            try:
                tokens = sum(len(c.token_ids) for c in stub.Generate(req, timeout=120))
                self.ok += 1 if tokens else 0
                if not tokens:
                    self.failed.append("no tokens")
            except grpc.RpcError as e:
                self.failed.append(f"{e.code().name}: {e.details()}")

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(180)


def _replicas(serving) -> dict:
    return serving.controller.replicas()


def _wait(cond, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.25)


def _assert_idle(serving, timeout_s: float = 60.0) -> None:
    from tests.test_serving import assert_idle

    assert_idle(serving, timeout_s)


def test_manual_scale_up_and_down_under_load_fails_no_request(serving):
    load = Load(serving.grpc_address, clients=3)
    try:
        _wait(lambda: load.ok >= 3, 120, "requests before scaling")
        out = serving.call(serving.controller.scale("decode", 2))
        assert out == {"started": ["decode-1"], "draining": []}
        assert _replicas(serving)["decode"]["starting"] == 1
        _wait(lambda: _replicas(serving)["decode"] == {"ready": 2, "starting": 0, "draining": 0}, 240, "decode-1 up")
        _wait(lambda: len(serving.router.pool.workers()) == 3, 30, "the router to see decode-1")
        before = load.ok
        _wait(lambda: load.ok >= before + 4, 120, "requests on two decode workers")
        assert serving.call(serving.controller.scale("decode", 1)) == {"started": [], "draining": ["decode-1"]}
        _wait(lambda: "decode-1" in serving.controller.drained, 180, "decode-1 drained")
        before = load.ok
        _wait(lambda: load.ok >= before + 3, 120, "requests after the drain")
    finally:
        load.stop()
    assert load.failed == [], load.failed[:5]
    assert _replicas(serving) == {"decode": {"ready": 1, "starting": 0, "draining": 0},
                                  "prefill": {"ready": 1, "starting": 0, "draining": 0}}
    _assert_idle(serving)


def test_planner_grows_and_shrinks_both_pools_over_a_load_ramp(serving):
    from deploy.autoscaler import Autoscaler
    from planner.profile import DecodePoint, PrefillPoint, WorkerProfile
    from planner.sla import PlannerConfig, SlaPlanner

    # A profile far slower than this machine so that the ramp's high phase needs two of each:
    # prefill 60 prompt tokens/s per worker, decode 6 tokens/s per worker at any batch.
    profile = WorkerProfile(prefill=(PrefillPoint(16, 250, 60.0), PrefillPoint(4096, 60000, 60.0)),
                            decode=tuple(DecodePoint(b, c, 1000 * b / 6.0, 6.0) for b in (1, 8) for c in (16, 4096)))
    cfg = PlannerConfig(ttft_slo_ms=600_000, itl_slo_ms=600_000, interval_s=4.0, min_prefill=1, max_prefill=2,
                        min_decode=1, max_decode=2, predictor="constant", patience=2, cooldown_up_s=0,
                        cooldown_down_s=4.0, down_margin=0.0, utilization=1.0)
    planner = SlaPlanner(cfg, profile)
    planner.adopt(0.0, 1, 1)
    auto = Autoscaler(serving.controller, planner, f"http://{serving.router.endpoints.metrics}/metrics",
                      load_interval_s=1.0)
    serving.call(_start(auto))
    seen = {"prefill": 1, "decode": 1}

    def grown() -> bool:
        for role, r in _replicas(serving).items():
            seen[role] = max(seen[role], r["ready"])
        return seen == {"prefill": 2, "decode": 2}

    load = Load(serving.grpc_address, clients=4)
    try:
        _wait(grown, 300, f"both pools to grow (planner: {planner.last})")
    finally:
        load.stop()
    try:
        _wait(lambda: all(r == {"ready": 1, "starting": 0, "draining": 0} for r in _replicas(serving).values()),
              240, f"both pools back to 1 (planner: {planner.last})")
    finally:
        serving.call(auto.stop())
    assert load.failed == [], load.failed[:5]
    assert any(e["loop"] == "sla" and e["actions"]["decode"]["draining"] for e in auto.history)
    assert {"prefill-1", "decode-2"} <= set(serving.controller.drained)
    _assert_idle(serving)


async def _start(auto) -> None:
    auto.start()
