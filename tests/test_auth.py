"""API-key authentication (router/auth.py) against a real router: real HTTP (uvicorn) and gRPC
servers on 127.0.0.1, the official openai client, grpc.aio. No workers: a request that gets
through authentication is answered 503 UNAVAILABLE (no live worker), one that does not is 401 /
UNAUTHENTICATED, so each status shows which side of the check the request landed on."""

from __future__ import annotations

import asyncio
import threading

import grpc
import httpx
import openai
import pytest
from fastapi import FastAPI, Request  # module level: FastAPI resolves the endpoint's annotations here
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.pdserve.v1 import api_pb2, api_pb2_grpc
from router.auth import bearer_ok, resolve_api_key

KEY = "sk-test-0123456789"
LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def router():
    from router.app import Router, RouterConfig
    from router.registry import CallableRegistry

    async def no_workers():
        return []

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    r = Router(CallableRegistry(no_workers), RouterConfig(port=0, http_port=0, api_key=KEY, max_body_bytes=LIMIT))
    ep = asyncio.run_coroutine_threadsafe(r.start(), loop).result(60)
    try:
        yield ep
    finally:
        asyncio.run_coroutine_threadsafe(r.stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)


def test_bearer_rule_and_env(monkeypatch):
    assert bearer_ok(f"Bearer {KEY}", KEY) and bearer_ok(f"bearer {KEY}", KEY)
    assert not bearer_ok(None, KEY) and not bearer_ok(KEY, KEY) and not bearer_ok(f"Basic {KEY}", KEY)
    assert not bearer_ok(f"Bearer {KEY}x", KEY) and not bearer_ok("Bearer ", KEY)
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    assert resolve_api_key(None) == "from-env" and resolve_api_key("flag") == "flag"
    monkeypatch.setenv("PDSERVE_API_KEY", "")
    assert resolve_api_key(None) is None


def test_http_needs_the_key_but_health_and_metrics_stay_open(router):
    base = f"http://{router.http}"
    body = {"model": "m", "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(f"{base}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key" and "API key" in r.json()["error"]["message"]
        assert r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(f"{base}/v1/models", headers=headers).status_code == 401
    ok = httpx.post(f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 503, ok.text  # past authentication; no worker yet
    assert httpx.get(f"{base}/metrics").status_code == 200
    assert httpx.get(f"{base}/health").status_code == 503  # open (no 401), unhealthy without workers


def test_openai_client_wrong_key_is_authentication_error(router):
    wrong = openai.OpenAI(base_url=f"http://{router.http}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        wrong.models.list()
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    right = openai.OpenAI(base_url=f"http://{router.http}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.APIStatusError) as e:  # through authentication, then no worker
        right.models.list()
    assert e.value.status_code == 503


def test_grpc_needs_the_key_but_health_stays_open(router):
    async def run():
        async with grpc.aio.insecure_channel(router.grpc) as ch:
            stub = api_pb2_grpc.GenerationStub(ch)
            req = api_pb2.GenerateRequest(model="m", prompt="hi", sampling=api_pb2.SamplingOptions(max_tokens=1))
            codes = []
            for md in ((), (("authorization", "Bearer wrong"),), (("authorization", f"Bearer {KEY}"),)):
                for call in (lambda: stub.ListModels(api_pb2.ListModelsRequest(), metadata=md, timeout=10),
                             lambda: _drain(stub.Generate(req, metadata=md, timeout=10))):
                    try:
                        await call()
                        codes.append(grpc.StatusCode.OK)
                    except grpc.aio.AioRpcError as e:
                        codes.append(e.code())
            health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            return codes, health

    codes, health = asyncio.run(run())
    assert codes[:4] == [grpc.StatusCode.UNAUTHENTICATED] * 4, codes
    assert codes[4:] == [grpc.StatusCode.UNAVAILABLE] * 2, codes  # past authentication; no worker
    assert health.status in (health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING)


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def test_body_over_the_limit_is_413_declared_or_chunked(router):
    """router/body_limit.py on the same router: checked after authentication, before parsing."""
    base = f"http://{router.http}"
    big = b'{"prompt": "' + b"x" * LIMIT + b'"}'
    auth = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    r = httpx.post(f"{base}/v1/completions", content=big, headers=auth)
    assert r.status_code == 413 and str(LIMIT) in r.json()["error"]["message"], r.text
    chunked = httpx.post(f"{base}/v1/completions", content=iter([big[:1000], big[1000:]]), headers=auth)
    assert chunked.status_code == 413, chunked.text
    assert httpx.post(f"{base}/v1/completions", content=big, headers={}).status_code == 401
    small = httpx.post(f"{base}/v1/completions", content=iter([b'{"prompt": "hi",', b' "max_tokens": 1}']),
                       headers=auth)
    assert small.status_code == 503, small.text  # under the limit (chunked, replayed): through to the service


def test_a_client_that_leaves_is_seen_through_the_key_check():
    """Behind the API-key check the endpoint still sees the client disconnect (the non-streaming
    path polls request.is_disconnected() to abort its workers' legs); Starlette's
    BaseHTTPMiddleware hid it, and requests whose clients had gone kept decoding."""
    import asyncio

    from router.auth import ApiKeyMiddleware

    seen = []
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        for _ in range(100):
            if await request.is_disconnected():
                seen.append("disconnected")
                break
            await asyncio.sleep(0.01)
        return {}

    app.add_middleware(ApiKeyMiddleware, api_key=KEY)

    async def call() -> list[dict]:
        messages = [{"type": "http.request", "body": b"{}", "more_body": False}, {"type": "http.disconnect"}]
        sent: list[dict] = []

        async def receive():
            return messages.pop(0) if messages else await asyncio.sleep(3600)

        async def send(m):
            sent.append(m)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "root_path": "", "scheme": "http", "server": ("127.0.0.1", 1),
                 "client": ("127.0.0.1", 2), "http_version": "1.1", "asgi": {"version": "3.0"},
                 "headers": [(b"authorization", f"Bearer {KEY}".encode()), (b"content-type", b"application/json")]}
        await asyncio.wait_for(app(scope, receive, send), 10)
        return sent

    sent = asyncio.run(call())
    assert sent[0]["status"] == 200 and seen == ["disconnected"], sent


class _Replicas:
    """The two methods and the attribute of deploy.cluster.ClusterController the admin app reads."""

    drained: list = []

    def replicas(self):
        return {"agg": {"ready": 1, "starting": 0, "draining": 0}}

    async def scale(self, role, n):
        return {"started": [], "draining": []}


def test_admin_endpoint_needs_the_key_too():
    """With --api-key the admin endpoint (it starts and drains workers) refuses calls without the
    key, over real HTTP (uvicorn on 127.0.0.1); `pdserve scale --api-key` sends it, and without
    it says which option is missing. /metrics stays open, as on the public port."""
    from deploy import scale_cmd
    from deploy.admin import build_admin_app, serve_admin
    from engine.errors import UserError

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    server, task = asyncio.run_coroutine_threadsafe(
        serve_admin(build_admin_app(_Replicas(), api_key=KEY), "127.0.0.1", 0), loop).result(30)
    try:
        port = server.servers[0].sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/v1/cluster").status_code == 401
        assert httpx.post(f"{url}/v1/cluster/scale", json={"decode": 2}).status_code == 401
        assert httpx.get(f"{url}/metrics").status_code == 200
        ok = httpx.get(f"{url}/v1/cluster", headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200 and ok.json()["replicas"]["agg"]["ready"] == 1
        scale_cmd.command(prefill=None, decode=None, admin_url=url, as_json=True, api_key=KEY)
        with pytest.raises(UserError, match="--api-key"):
            scale_cmd.command(prefill=None, decode=2, admin_url=url, as_json=True, api_key="wrong")
    finally:
        server.should_exit = True
        asyncio.run_coroutine_threadsafe(asyncio.wait_for(asyncio.shield(task), 30), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
