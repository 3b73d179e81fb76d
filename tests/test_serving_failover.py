"""Failover and migration on real Ray with the real model (1 prefill + 2 decode workers, fp32, tcp).

- SIGSTOP of the prefill worker with requests in flight and more arriving: every request
  completes (its prefill leg times out and the decode worker prefills it; later ones skip the
  suspect worker at once) or ends UNAVAILABLE, each within BOUND_S; after SIGCONT the prefill
  worker answers its polls and is used again; nothing leaks.
- SIGKILL of a decode worker at half load: every request completes with its full token count
  (migrated to the other decode worker) and the greedy texts equal a run without the kill.
The same logic against fake workers, with exact timings: tests/test_failover.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
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
def serving(ray_session):
    from deploy.cluster import ClusterSpec
    from deploy.local_cluster import LocalServing
    from router.app import RouterConfig
    from router.leg_timeouts import LegTimeouts

    spec = ClusterSpec(mode="disagg", kv_transport="tcp", num_prefill=1, num_decode=2, num_blocks=256)
    config = RouterConfig(port=0, http_port=None, mode="disagg", leg_timeouts=LegTimeouts(floor_s=2.0, slack=3.0),
                          worker_rpc_timeout_s=1.0)
    with LocalServing(spec, config) as s:
        yield s


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
            await asyncio.sleep(1.5)
            later = [asyncio.create_task(_one(stub, p)) for p in prompts[8:16]]
            return await asyncio.gather(*first, *later), stopped

    try:
        results, stopped = s.call(storm(), 300)
    finally:
        os.kill(pid, signal.SIGCONT)
    outcomes = [r for r, _, _ in results]
    print(f"SIGSTOP: outcomes {outcomes}, slowest {max(t for *_, t in results):.1f} s, "
          f"failovers {s.router.orchestrator.prefill_failovers}")
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
    killed = s.call(run(victim), 300)
    moved = s.router.orchestrator.migrations - migrations
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
