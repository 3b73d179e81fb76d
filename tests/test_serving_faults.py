"""Fault injection on real Ray: a prefill worker SIGKILLed while requests are in flight.

Every affected request either completes (retried on the other prefill worker) or ends with
UNAVAILABLE within its deadline; none hangs; Ray restarts the worker, the router learns its new
address, and new requests succeed; nothing leaks on the surviving workers.
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
DEADLINE_S = 60.0


def test_prefill_worker_sigkill_in_flight(ray_session):
    from deploy.cluster import ClusterSpec
    from deploy.local_cluster import LocalServing
    from router.app import RouterConfig

    spec = ClusterSpec(mode="disagg", kv_transport="tcp", num_prefill=2, num_decode=1, num_blocks=512)
    prompts = [p[:3000] for p in sharegpt_prompts(24)]
    with LocalServing(spec, RouterConfig(port=0, http_port=None, mode="disagg")) as s:
        victim_pid = s.call(s.controller.worker_pid("prefill-0"))
        old_address = {w.id: w.address for w in s.call(s.controller.list_workers())}["prefill-0"]

        async def one(stub, prompt: str):
            req = api_pb2.GenerateRequest(model=MODEL, prompt=prompt,
                                          sampling=api_pb2.SamplingOptions(temperature=0, max_tokens=8))
            start = time.monotonic()
            try:
                msgs = [m async for m in stub.Generate(req, timeout=DEADLINE_S)]
                return "ok" if msgs and msgs[-1].finish_reason else "unfinished", time.monotonic() - start
            except grpc.RpcError as e:
                return e.code().name, time.monotonic() - start

        async def storm():
            async with grpc.aio.insecure_channel(s.grpc_address) as ch:
                stub = api_pb2_grpc.GenerationStub(ch)
                tasks = [asyncio.create_task(one(stub, p)) for p in prompts[:12]]
                await asyncio.sleep(0.5)  # both prefill workers are busy now
                os.kill(victim_pid, signal.SIGKILL)
                return await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S + 10)  # none hangs

        results = s.call(storm(), DEADLINE_S + 30)
        assert all(r in ("ok", "UNAVAILABLE") for r, _ in results), results
        assert sum(r == "ok" for r, _ in results) >= len(results) // 2, results
        assert all(t <= DEADLINE_S + 1 for _, t in results), results

        # Ray restarts the worker; the controller and the router pick up its new server
        end = time.monotonic() + 180
        while True:
            addresses = {w.id: w.address for w in s.call(s.controller.list_workers())}
            pool = {w.id: w for w in s.router.pool.workers()}
            back = "prefill-0" in addresses and "prefill-0" in pool and pool["prefill-0"].alive and \
                s.call(s.controller.worker_pid("prefill-0")) != victim_pid
            if back:
                break
            assert time.monotonic() < end, f"prefill-0 not back: {addresses}"
            time.sleep(0.5)

        async def after():
            async with grpc.aio.insecure_channel(s.grpc_address) as ch:
                stub = api_pb2_grpc.GenerationStub(ch)
                return await asyncio.gather(*(one(stub, p) for p in prompts[12:20]))

        results = s.call(after(), 300)
        assert all(r == "ok" for r, _ in results), results
        stats = s.worker_stats()
        assert stats["prefill-0"].kv_blocks_total > 0  # the restarted worker answers
        assert_idle(s)
        del old_address
