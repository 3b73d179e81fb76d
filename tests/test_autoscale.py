"""Scaling a live cluster (real Ray, real model, real gRPC): a worker started and drained under
load with zero failed requests; the admin endpoint behind `pdserve scale`. Every test ends with
the workers idle (no leaked block). (The planner's decisions are tested without a cluster in
tests/test_planner.py.) A live load ramp under the autoscaler (the loop `serve --autoscale`
runs): low -> high -> low grows both pools and drains them back, failing no request."""

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
    """``clients`` threads sending short greedy chat requests in a loop until stopped, each
    waiting ``pause_s`` after every answer."""

    def __init__(self, address: str, clients: int, pause_s: float = 0.0) -> None:
        self.pause_s = pause_s
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
            self._stop.wait(self.pause_s)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(180)


def _replicas(serving) -> dict:
    return serving.controller.replicas()



def _wait(cond, timeout_s: float, what) -> None:
    """what: a string, or a function giving one (evaluated at the time-out)."""
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what() if callable(what) else what}")
        time.sleep(0.25)


def _assert_idle(serving, timeout_s: float = 60.0) -> None:
    from tests.test_serving import assert_idle

    assert_idle(serving, timeout_s)


def test_admin_endpoint_reports_replicas_and_refuses_bad_scale_requests(serving):
    """`pdserve scale`'s endpoint on the live controller: status, and a 400 naming the field."""
    from fastapi.testclient import TestClient

    from deploy.admin import build_admin_app

    client = TestClient(build_admin_app(serving.controller))
    doc = client.get("/v1/cluster").json()
    assert doc["replicas"] == {"decode": {"ready": 1, "starting": 0, "draining": 0},
                               "prefill": {"ready": 1, "starting": 0, "draining": 0}}
    assert doc["autoscale"] is False and doc["desired"] == {"decode": 1, "prefill": 1}
    for body, field in (({"decode": 0}, "decode"), ({"prefill": "two"}, "prefill"), ({"gpus": 2}, "gpus"),
                        ([1], "body")):
        r = client.post("/v1/cluster/scale", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)
    assert client.post("/v1/cluster/scale", json={"decode": 1}).json()["actions"] == {
        "decode": {"started": [], "draining": []}}
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


def test_autoscaler_grows_and_shrinks_both_pools_over_a_load_ramp(serving, tokenizer):
    """low (a trickle) -> high (4 clients back to back) -> low: the planner, on metrics scraped
    from the router and the workers, grows both pools to their bound of 2 and then drains them
    back to 1 while the trickle still runs: zero failed requests, each scale-down a drain, no
    leaked block."""
    from deploy.autoscaler import Autoscaler
    from planner.profile import DecodePoint, PrefillPoint, WorkerProfile
    from planner.sla import PlannerConfig, SlaPlanner

    # A profile scaled to this test's load, not to the machine: one worker of each role serves
    # 0.8 requests/s (prefill: 0.8 x ISL prompt tokens/s; decode: 0.8 x 8 output tokens/s at any
    # batch). The trickle sends <= 0.4 req/s, the 4 clients well above 1 req/s.
    msgs = [{"role": "user", "content": "Say a word that rhymes with tree."}]
    isl = len(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
    per_prefill, per_decode = 0.8 * isl, 0.8 * 8
    profile = WorkerProfile(prefill=(PrefillPoint(16, 1000 * 16 / per_prefill, per_prefill),
                                     PrefillPoint(4096, 1000 * 4096 / per_prefill, per_prefill)),
                            decode=tuple(DecodePoint(b, c, 1000 * b / per_decode, per_decode)
                                         for b in (1, 64) for c in (16, 4096)))
    cfg = PlannerConfig(ttft_slo_ms=10**7, itl_slo_ms=10**7, interval_s=3.0, min_prefill=1, max_prefill=2,
                        min_decode=1, max_decode=2, predictor="constant", patience=2, cooldown_up_s=0,
                        cooldown_down_s=3.0, down_margin=0.0, utilization=1.0, prefill_sizing="throughput")
    planner = SlaPlanner(cfg, profile)
    planner.adopt(0.0, 1, 1)
    auto = Autoscaler(serving.controller, planner, f"http://{serving.router.endpoints.metrics}/metrics",
                      load_interval_s=1.0)
    drained_before = list(serving.controller.drained)
    serving.call(_start(auto))
    seen = {"prefill": 1, "decode": 1}

    def grown() -> bool:
        for role, r in _replicas(serving).items():
            seen[role] = max(seen[role], r["ready"])
        return seen == {"prefill": 2, "decode": 2}

    trickle = Load(serving.grpc_address, clients=1, pause_s=2.5)
    high = None
    try:
        time.sleep(2 * cfg.interval_s)
        assert not grown() and seen == {"prefill": 1, "decode": 1}, planner.last  # low: nothing grows
        high = Load(serving.grpc_address, clients=4)
        try:
            _wait(grown, 240, lambda: f"both pools to grow (seen {seen}; planner: {planner.last}; errors: {auto.errors})")
        finally:
            high.stop()
        _wait(lambda: all(r == {"ready": 1, "starting": 0, "draining": 0} for r in _replicas(serving).values()),
              180, lambda: f"both pools back to 1 ({_replicas(serving)}; planner: {planner.last})")
    finally:
        trickle.stop()
        serving.call(auto.stop())
    assert high.failed == [] and trickle.failed == [], (high.failed[:5], trickle.failed[:5])
    assert high.ok > 0 and trickle.ok > 0
    drained = serving.controller.drained[len(drained_before):]
    assert sorted(w.split("-")[0] for w in drained) == ["decode", "prefill"], drained  # each scale-down a drain
    assert any(e["loop"] == "sla" and e["actions"]["decode"]["draining"] for e in auto.history)
    _assert_idle(serving)


async def _start(auto) -> None:
    auto.start()
