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
                    # refused at the handshake (UNAVAILABLE) at once: the deadline is only headroom
                    await worker_pb2_grpc.WorkerStub(ch).Stats(worker_pb2.StatsRequest(), timeout=10)
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


def test_status_and_router_client_over_tls(tls, capsys):
    """`pdserve status --tls-ca` (RouterClient over TLS, with the router's --api-key) against a
    router serving TLS: the worker's row; without --tls-ca, or without the key, a one-line error
    naming what is missing (exit 2); an unreadable --tls-ca is refused naming the flag."""
    import json
    from types import SimpleNamespace

    from deploy import cli
    from router.app import Router, RouterConfig
    from router.registry import StaticRegistry, WorkerEndpoint
    from worker.agg import AggWorker
    from worker.core import WorkerConfig
    from worker.server import serve

    def status(*args: str) -> tuple[int, str, str]:
        try:
            cli.main(["status", *args])
            code = 0
        except SystemExit as e:
            code = e.code
        out = capsys.readouterr()
        return code, out.out, out.err

    async def go():
        worker = AggWorker(WorkerConfig(worker_id="agg-0", role="agg", internal_secret=SECRET), FakeEngine(),
                           "/nonexistent", SimpleNamespace(max_model_len=512, eos_token_ids=[2], vocab_size=100))
        running = await serve(worker, "127.0.0.1", 0, SECRET)
        r = Router(StaticRegistry([WorkerEndpoint("agg-0", "agg", running.address)]),
                   RouterConfig(port=0, http_port=None, mode="agg", tls=tls, api_key="k3y", internal_secret=SECRET))
        ep = await r.start()
        try:
            return [await asyncio.to_thread(status, *args) for args in (
                ("--url", ep.grpc, "--tls-ca", tls.cert_file, "--api-key", "k3y", "--json"),
                ("--url", ep.grpc, "--api-key", "k3y", "--timeout", "10"),  # refused at once: headroom only
                ("--url", ep.grpc, "--tls-ca", tls.cert_file),
                ("--url", ep.grpc, "--tls-ca", "/nonexistent/ca.pem"))]
        finally:
            await r.stop()
            await running.stop(0)

    ok, plain, no_key, bad_ca = asyncio.run(go())
    assert ok[0] == 0 and [w["id"] for w in json.loads(ok[1])["workers"]] == ["agg-0"], ok
    assert plain[0] == 2 and "UNAVAILABLE" in plain[2] and "--tls-ca" in plain[2], plain
    assert no_key[0] == 2 and "UNAUTHENTICATED" in no_key[2] and "--api-key" in no_key[2], no_key
    assert bad_ca[0] == 2 and bad_ca[2].startswith("pdserve: error: --tls-ca: cannot read"), bad_ca
