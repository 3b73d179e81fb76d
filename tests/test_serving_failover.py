"""Failover and migration on real Ray with the real model (1 prefill + 2 decode workers, fp32, tcp).

- SIGSTOP of the prefill worker with requests in flight and more arriving: every request
  completes (its prefill leg times out and the decode worker prefills it; later ones skip the
  suspect worker at once) or ends UNAVAILABLE, each within BOUND_S; after SIGCONT the prefill
  worker answers its polls and is used again; nothing leaks.
- SIGKILL of a decode worker at half load: every request completes with its full token count
  (migrated to the other decode worker) and the greedy texts equal a run without the kill.
- A decode engine wedged inside one step (worker/faults.py: its gRPC server still answers Stats,
  with four requests running, its engine_steps standing still): past the stall bound every one of
  its requests, streamed and not, over HTTP, migrates to the other decode worker with the greedy
  text of an unwedged run and ``usage.recomputed_tokens`` counting the prompt and the tokens
  already sent; the worker stays suspect while wedged and is live again once its step runs.
Each also reads the router's failover counters from a /metrics scrape (router/metrics.py).
The same logic against fake workers, with exact timings: tests/test_failover.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import httpx
import pytest

from proto.pdserve.v1 import api_pb2, api_pb2_grpc
from tests.conftest import sharegpt_prompts
from tests.test_serving import assert_idle

pytestmark = [pytest.mark.ray, pytest.mark.model]

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 16
# a leg: floor 2 s + 3 x the predicted work; a request here: at most one prefill leg timeout
# (<= 2 + 3 x ~1,500 queued tokens x the measured s/token) plus its local prefill and decode
BOUND_S = 45.0


@pytest.fixture(scope="module")
def wedge_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("wedge")


@pytest.fixture(scope="module")
def serving(ray_session, wedge_dir):
    from deploy.cluster import ClusterSpec
    from deploy.local_cluster import LocalServing
    from router.app import RouterConfig
    from router.leg_timeouts import LegTimeouts

    spec = ClusterSpec(mode="disagg", kv_transport="tcp", num_prefill=1, num_decode=2, num_blocks=256,
                       engine_wedge_file=str(wedge_dir / "{worker_id}"))
    # Stats polls keep the production deadline (2 s): a busy worker on a loaded host may take over 1 s
    # to answer, and a decode worker made suspect by that would fail or misplace requests here
    config = RouterConfig(port=0, http_port=0, mode="disagg", leg_timeouts=LegTimeouts(floor_s=2.0, slack=3.0))
    with LocalServing(spec, config) as s:
        yield s


def counter(metrics_text: str, name: str, **labels: str) -> float:
    """The sum of the samples of counter `name` (its _total) whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(metrics_text)
               for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))


def scrape(http_address: str) -> str:
    return httpx.get(f"http://{http_address}/metrics", timeout=10).text


def _prompts(n: int) -> list[str]:
    return [p[:500] for p in sharegpt_prompts(n)]


async def _one(stub, prompt: str, streamed: list[int] | None = None) -> tuple[str, list[int], float]:
    """(outcome, token ids, seconds); streamed[0] counts the tokens received so far."""
    req = api_pb2.GenerateRequest(model=MODEL, prompt=prompt, sampling=api_pb2.SamplingOptions(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    start, ids = time.monotonic(), []
    try:
        async for m in stub.Generate(req, timeout=120):
            ids += m.token_ids
            if streamed is not None:
                streamed[0] += len(m.token_ids)
        return "ok", ids, time.monotonic() - start
    except grpc.RpcError as e:
        return e.code().name, ids, time.monotonic() - start


def test_prefill_worker_sigstop_fails_over_and_is_used_again(serving):
    s = serving
    prompts = _prompts(16)
    pid = s.call(s.controller.worker_pid("prefill-0"))

    async def storm():
        async with grpc.aio.insecure_channel(s.grpc_address) as ch:
            stub = api_pb2_grpc.GenerationStub(ch)
            await asyncio.gather(*(_one(stub, p) for p in prompts[:2]))  # warm: the prefill rate is measured
            first = [asyncio.create_task(_one(stub, p)) for p in prompts[:8]]
            await asyncio.sleep(0.3)
            os.kill(pid, signal.SIGSTOP)
            stopped = time.monotonic()
            end = stopped + 60  # its polls miss their 2 s deadline, or a leg times out: suspect
            while s.router.pool.get("prefill-0").alive:
                assert time.monotonic() < end, "prefill-0 not suspect after SIGSTOP"
                await asyncio.sleep(0.05)
            later = [asyncio.create_task(_one(stub, p)) for p in prompts[8:16]]  # sent while it is suspect
            return await asyncio.gather(*first, *later), stopped

    failovers = s.router.orchestrator.prefill_failovers
    try:
        results, stopped = s.call(storm(), 300)
    finally:
        os.kill(pid, signal.SIGCONT)
    outcomes = [r for r, _, _ in results]
    metrics = scrape(s.router.endpoints.http)
    print(f"SIGSTOP: outcomes {outcomes}, slowest {max(t for *_, t in results):.1f} s, "
          f"failovers {s.router.orchestrator.prefill_failovers - failovers}")
    # every failover counted, by reason: legs late past their timeout, then prefilled on D
    assert counter(metrics, "pdserve:prefill_failovers_total") == s.router.orchestrator.prefill_failovers
    assert counter(metrics, "pdserve:prefill_failovers_total", reason="leg_timeout") >= 1
    assert counter(metrics, "pdserve:worker_suspect_total", role="prefill") >= 1
    assert all(r in ("ok", "UNAVAILABLE") for r in outcomes), results
    assert all(t <= BOUND_S for *_, t in results), results
    assert all(len(ids) == MAX_TOKENS for r, ids, _ in results if r == "ok"), results
    assert outcomes.count("ok") >= 12, outcomes

    # after SIGCONT it answers its polls, is live again and gets prefills
    end = time.monotonic() + 60
    while not s.router.pool.get("prefill-0").alive:
        assert time.monotonic() < end, "prefill-0 not live again after SIGCONT"
        time.sleep(0.2)
    before = s.router.selector.decisions.get("prefill-0", 0)

    async def after():
        async with grpc.aio.insecure_channel(s.grpc_address) as ch:
            stub = api_pb2_grpc.GenerationStub(ch)
            return await asyncio.gather(*(_one(stub, p) for p in prompts[:4]))

    assert [r for r, _, _ in s.call(after(), 180)] == ["ok"] * 4
    assert s.router.selector.decisions.get("prefill-0", 0) >= before + 4
    s.call(s.router.orchestrator.drain(), 120)
    assert_idle(s, 60)


WEDGE_TOKENS = 48


def test_decode_engine_wedged_inside_a_step_is_migrated_past_the_stall_bound(serving, wedge_dir):
    """A second router sees only decode-0 at first, so all four requests (two streamed, two not,
    over HTTP) decode there; decode-0's engine then wedges inside a step while its gRPC server
    answers Stats (four running, engine_steps still), and decode-1 joins the router's registry.
    Past the stall bound (2 + 3 x 512 step tokens x 0.002 s/token unmeasured = 5.1 s), checked
    at each leg timeout, every request migrates to decode-1: the greedy texts of an unwedged run,
    recomputed_tokens = prompt + the tokens sent before the move, counted on /metrics as
    no_progress; decode-0 stays suspect while it answers without progress, live once unwedged."""
    from router.leg_timeouts import LegTimeouts
    from tests.test_serving import _side_router

    s = serving
    prompts = _prompts(4)
    show = {"decode-1": False}

    async def visible():
        return [w for w in await s.controller.list_workers() if w.id != "decode-1" or show["decode-1"]]

    async def one(c: httpx.AsyncClient, base: str, prompt: str, stream: bool, streamed: list[int]):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": WEDGE_TOKENS, "temperature": 0, "ignore_eos": True,
                "stream": stream}
        if not stream:
            r = await c.post(f"{base}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"], r.json()["usage"]
        text, usage = [], None
        body["stream_options"] = {"include_usage": True}
        async with c.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    import json

                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    if chunk["choices"]:
                        text.append(chunk["choices"][0]["text"])
                        streamed[0] += 1
                    usage = chunk.get("usage") or usage
        return "".join(text), usage

    async def run():
        router, ep = await _side_router(s, visible, http_port=0, leg_timeouts=LegTimeouts(
            floor_s=2.0, slack=3.0, default_s_per_token=0.002))
        base, d0 = f"http://{ep.http}", router.pool.get("decode-0")
        try:
            async with httpx.AsyncClient() as c:
                def all_four(streamed):
                    return [asyncio.create_task(one(c, base, p, i % 2 == 0, streamed)) for i, p in enumerate(prompts)]

                baseline = await asyncio.gather(*all_four([0]))
                streamed = [0]
                tasks = all_four(streamed)
                end = time.monotonic() + 60
                while d0.stats.running < 4 or streamed[0] < 4:  # all four decoding on decode-0
                    assert time.monotonic() < end and not any(t.done() for t in tasks), (d0.stats, streamed)
                    await asyncio.sleep(0.01)
                (wedge_dir / "decode-0").touch()
                wedged_at, show["decode-1"] = time.monotonic(), True
                wedged = await asyncio.gather(*tasks)
                took = time.monotonic() - wedged_at
                await asyncio.sleep(1.0)  # ~5 polls answered without progress
                held = d0.alive
                metrics = (await c.get(f"{base}/metrics", timeout=10)).text  # this loop serves it: no sync call
        finally:
            (wedge_dir / "decode-0").unlink(missing_ok=True)
        end = time.monotonic() + 60
        while not d0.alive:
            assert time.monotonic() < end, "decode-0 not live again after its step ran"
            await asyncio.sleep(0.1)
        await router.orchestrator.drain()
        await router.stop()
        return baseline, wedged, took, held, metrics, router.orchestrator.migrations

    baseline, wedged, took, held, metrics, migrations = s.call(run(), 300)
    print(f"wedged decode engine: 4 requests migrated {took:.1f} s after the wedge; recomputed "
          f"{[u['recomputed_tokens'] for _, u in wedged]} of prompts {[u['prompt_tokens'] for _, u in wedged]}")
    assert [t for t, _ in wedged] == [t for t, _ in baseline] and all(t for t, _ in baseline)
    for (_, u), (_, b) in zip(wedged, baseline):
        assert u["completion_tokens"] == WEDGE_TOKENS and b["recomputed_tokens"] == 0
        assert u["prompt_tokens"] < u["recomputed_tokens"] < u["prompt_tokens"] + WEDGE_TOKENS, u
    assert migrations == 4 and 4.5 < took < 60, took  # the bound, less a poll interval and a step
    assert counter(metrics, "pdserve:request_migrations_total", reason="no_progress") == 4
    assert counter(metrics, "pdserve:worker_suspect_total", role="decode", reason="no_progress") == 1
    assert held is False
    assert_idle(s, 60)


def test_decode_worker_sigkill_at_half_load_migrates_with_equal_texts(serving):
    s = serving
    prompts = _prompts(8)

    async def run(kill_pid: int | None):
        async with grpc.aio.insecure_channel(s.grpc_address) as ch:
            stub = api_pb2_grpc.GenerationStub(ch)
            streamed = [0]
            tasks = [asyncio.create_task(_one(stub, p, streamed)) for p in prompts]
            if kill_pid is not None:  # at half load: half of all tokens streamed
                while streamed[0] < len(prompts) * MAX_TOKENS // 2 and not all(t.done() for t in tasks):
                    await asyncio.sleep(0.01)
                os.kill(kill_pid, signal.SIGKILL)
            return await asyncio.gather(*tasks)

    baseline = s.call(run(None), 300)
    assert all(r == "ok" for r, _, _ in baseline), baseline
    migrations = s.router.orchestrator.migrations
    victim = s.call(s.controller.worker_pid("decode-1"))
    before = counter(scrape(s.router.endpoints.http), "pdserve:request_migrations_total")
    killed = s.call(run(victim), 300)
    moved = s.router.orchestrator.migrations - migrations
    metrics = scrape(s.router.endpoints.http)
    # a killed worker's streams fail UNAVAILABLE or end unfinished
    assert counter(metrics, "pdserve:request_migrations_total") - before == moved
    assert counter(metrics, "pdserve:request_migrations_total", reason="worker_error") + \
        counter(metrics, "pdserve:request_migrations_total", reason="stream_ended") >= moved
    print(f"SIGKILL: outcomes {[r for r, _, _ in killed]}, migrated {moved}, "
          f"slowest {max(t for *_, t in killed):.1f} s (baseline {max(t for *_, t in baseline):.1f} s)")
    assert all(r == "ok" and len(ids) == MAX_TOKENS for r, ids, _ in killed), killed
    assert [ids for _, ids, _ in killed] == [ids for _, ids, _ in baseline]
    assert moved >= 1
    s.call(s.router.orchestrator.drain(), 120)
    assert_idle(s, 60)



def test_worker_api_without_the_cluster_secret_is_refused(serving):
    """A process on the host that does not have the cluster's secret cannot Reserve, Prefill or
    Abort on a real worker (UNAUTHENTICATED); the router, which has it, is served."""
    from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc

    sampling = api_pb2.SamplingOptions(max_tokens=2)
    by_role = {w.endpoint.role: w.endpoint.address for w in serving.router.pool.workers()}
    decode = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(by_role["decode"]))
    prefill = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(by_role["prefill"]))
    calls = [lambda: decode.Reserve(worker_pb2.ReserveRequest(request_id="intruder", prompt_token_ids=[1, 2, 3],
                                                              sampling=sampling, lease_seconds=5), timeout=10),
             lambda: prefill.Prefill(worker_pb2.PrefillRequest(request_id="intruder", prompt_token_ids=[1, 2, 3],
                                                               sampling=sampling), timeout=10),
             lambda: decode.Abort(worker_pb2.AbortRequest(request_id="intruder"), timeout=10)]
    for call in calls:
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert_idle(serving)
