"""Optional TLS (proto/tls.py): a worker serving its API over TLS and a router's pool verifying it;
the router's public gRPC and HTTPS. A self-signed certificate for IP 127.0.0.1 made by openssl;
no model (the worker's engine is test_worker_server's stand-in)."""

from __future__ import annotations

import asyncio
import ssl
import subprocess

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc
from proto.tls import TlsFiles
from tests.test_worker_server import SECRET, FakeEngine


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> TlsFiles:
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / "key.pem"),
                    "-out", str(d / "cert.pem"), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return TlsFiles(str(d / "cert.pem"), str(d / "key.pem"))


def test_worker_api_over_tls_with_the_secret(tls):
    from types import SimpleNamespace

    from router.pool import WorkerPool
    from router.registry import StaticRegistry, WorkerEndpoint
    from worker.agg import AggWorker
    from worker.core import WorkerConfig
    from worker.server import serve

    async def go():
        config = WorkerConfig(worker_id="agg-0", role="agg", internal_secret=SECRET, tls=tls)
        worker = AggWorker(config, FakeEngine(), "/nonexistent", SimpleNamespace(max_model_len=512, eos_token_ids=[2],
                                                                                 vocab_size=100))
        running = await serve(worker, "127.0.0.1", 0, SECRET, tls=tls)
        pool = WorkerPool(StaticRegistry([WorkerEndpoint("agg-0", "agg", running.address)]), internal_secret=SECRET,
                          internal_tls=tls)
        try:
            await pool.start()
            stats = pool.get("agg-0").stats
            async with grpc.aio.insecure_channel(running.address) as ch:  # plaintext to a TLS port
                try:
                    await worker_pb2_grpc.WorkerStub(ch).Stats(worker_pb2.StatsRequest(), timeout=2)
                    plain = "served"
                except grpc.RpcError as e:
                    plain = e.code()
            return stats, plain
        finally:
            await pool.close()
            await running.stop(0)

    stats, plain = asyncio.run(go())
    assert stats.kv_blocks_total == 10 and plain == grpc.StatusCode.UNAVAILABLE


def test_router_public_grpc_and_https(tls):
    from router.app import Router, RouterConfig
    from router.registry import CallableRegistry

    async def no_workers():
        return []

    async def go():
        r = Router(CallableRegistry(no_workers), RouterConfig(port=0, http_port=0, tls=tls))
        ep = await r.start()
        try:
            async with grpc.aio.secure_channel(ep.grpc, tls.channel_credentials()) as ch:
                health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=tls.cert_file)) as c:
                https = (await c.get(f"https://{ep.http}/health", timeout=10)).status_code
            async with httpx.AsyncClient() as c:
                try:
                    await c.get(f"http://{ep.http}/health", timeout=5)
                    plain = "served"
                except httpx.HTTPError as e:
                    plain = type(e).__name__
            return health.status, https, plain
        finally:
            await r.stop()

    status, https, plain = asyncio.run(go())
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING  # answered over TLS (no workers yet)
    assert https in (200, 503) and plain != "served"
