"""API-key authentication of the public APIs (`pdserve serve --api-key KEY` / env PDSERVE_API_KEY).

HTTP: every route but /health and /metrics needs `Authorization: Bearer KEY` (the OpenAI clients
send it from `api_key=`); otherwise 401 with an OpenAI-style JSON error. gRPC: every
pdserve.v1.Generation call needs metadata `authorization: Bearer KEY`; otherwise UNAUTHENTICATED.
Health checking and reflection stay open (load balancers and grpcurl probe them without a key).
Keys are compared in constant time (hmac.compare_digest) so timing does not reveal a prefix.
The internal worker API is not covered here.
"""

from __future__ import annotations

import hmac
import os

import grpc

from router.asgi import send_json

ENV_VAR = "PDSERVE_API_KEY"
OPEN_HTTP_PATHS = frozenset({"/health", "/metrics"})
UNAUTHORIZED_MESSAGE = "invalid or missing API key: send the header 'Authorization: Bearer <key>'"


def resolve_api_key(flag: str | None) -> str | None:
    """The flag's key, else $PDSERVE_API_KEY, else None (no authentication). An empty string is None."""
    key = flag if flag is not None else os.environ.get(ENV_VAR)
    return key or None


def check_api_key(key: str) -> str:
    """The key a server requires, unchanged; ValueError when it would not protect anything: empty
    (a key that expanded to nothing, `--api-key "$UNSET"`, used to leave the API open without a word)
    or with whitespace at either end (no client can send it: the header's token is stripped)."""
    if not key.strip():
        raise ValueError("the key is empty, which would leave the API open; give a key, or leave the option "
                         f"out (and unset ${ENV_VAR}) to serve without one")
    if key != key.strip():
        raise ValueError("the key starts or ends with whitespace, which no Authorization header can carry")
    return key


def bearer_ok(header: str | None, api_key: str) -> bool:
    """True when `header` is 'Bearer <api_key>' (scheme case-insensitive, as RFC 6750 allows)."""
    if not header:
        return False
    scheme, _, token = header.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def unauthorized_body() -> dict:
    return {"error": {"message": UNAUTHORIZED_MESSAGE, "type": "invalid_request_error", "param": None,
                      "code": "invalid_api_key"}}


class ApiKeyMiddleware:
    """The HTTP check as a pure ASGI middleware. Not Starlette's @app.middleware("http")
    (BaseHTTPMiddleware): behind that, the endpoint's `request.is_disconnected()` never sees
    the client leave, so a non-streaming request whose client gave up kept decoding to its
    max_tokens and holding its KV blocks (6 timed-out clients: 84 blocks still used after 57 s)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self._key = api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_HTTP_PATHS:
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or ()).get(b"authorization")
        if bearer_ok(None if header is None else header.decode("latin-1"), self._key):
            return await self.app(scope, receive, send)
        await send_json(send, 401, unauthorized_body(), headers=((b"www-authenticate", b"Bearer"),))


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to the services in `protected` (full names, e.g. 'pdserve.v1.Generation')
    whose metadata lacks `authorization: Bearer KEY`, with UNAUTHENTICATED."""

    def __init__(self, api_key: str, protected: frozenset[str]) -> None:
        self._key = api_key
        self._protected = protected

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        service = details.method.lstrip("/").rpartition("/")[0]
        if service not in self._protected:
            return await continuation(details)
        header = next((v for k, v in (details.invocation_metadata or ()) if k == "authorization"), None)
        if isinstance(header, bytes):
            header = header.decode("latin-1")
        if bearer_ok(header, self._key):
            return await continuation(details)
        handler = await continuation(details)
        return _refusing(handler)


async def _refuse(_request, context: grpc.aio.ServicerContext):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHORIZED_MESSAGE.replace("header", "metadata"))


def _refusing(handler: grpc.RpcMethodHandler | None):
    """A handler of the same kind (unary/streaming) as `handler` that aborts UNAUTHENTICATED."""
    if handler is None:
        return None
    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_refuse, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_refuse, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_refuse, **kw)
    return grpc.unary_unary_rpc_method_handler(_refuse, **kw)
