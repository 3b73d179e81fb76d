"""The internal worker API's authentication: one secret per cluster, in every call's metadata.

The cluster's starter (deploy/cluster.py ClusterController, or `pdserve serve`) makes a random
secret (or takes $PDSERVE_INTERNAL_SECRET / --internal-secret-file) and hands it to every worker
in its WorkerConfig and to its routers in RouterConfig. A worker's gRPC server refuses every
pdserve.v1.Worker call (Reserve, Prefill, Decode, Generate, Abort, Release, Stats, ...) whose
metadata lacks ``pdserve-internal-secret: <secret>`` with UNAUTHENTICATED, so a process on the
host that does not have the secret can neither read nor free nor write anything through the
worker API. Health checking stays open. Secrets are compared in constant time (hmac).
Routers add the metadata with the client interceptors below. The KV transports' own sockets
(kv_transfer/) are not covered here.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

import grpc

METADATA_KEY = "pdserve-internal-secret"
ENV_VAR = "PDSERVE_INTERNAL_SECRET"
PROTECTED_SERVICE = "pdserve.v1.Worker"
REFUSED_MESSAGE = f"the worker API needs the cluster's internal secret (metadata {METADATA_KEY!r})"


def new_secret() -> str:
    """A fresh random secret (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def resolve_secret(path: str | None = None) -> str:
    """$PDSERVE_INTERNAL_SECRET, else the file at `path` (written with a new secret, mode 0600,
    when it does not exist, so routers started later can read it), else a new secret.
    Raises OSError for an unreadable file, ValueError for an empty one."""
    if os.environ.get(ENV_VAR):
        return os.environ[ENV_VAR]
    if path is None:
        return new_secret()
    p = Path(path)
    if not p.exists():
        secret = new_secret()
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret + "\n")
        return secret
    secret = p.read_text().strip()
    if not secret:
        raise ValueError(f"{path} is empty")
    return secret


def secret_ok(metadata, secret: str) -> bool:
    value = next((v for k, v in (metadata or ()) if k == METADATA_KEY), None)
    if isinstance(value, str):
        value = value.encode()
    return value is not None and hmac.compare_digest(value, secret.encode())


class InternalSecretInterceptor(grpc.aio.ServerInterceptor):
    """Server side: calls to pdserve.v1.Worker without the secret are refused UNAUTHENTICATED."""

    def __init__(self, secret: str) -> None:
        self._secret = secret

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        service = details.method.lstrip("/").rpartition("/")[0]
        if service != PROTECTED_SERVICE or handler is None or secret_ok(details.invocation_metadata, self._secret):
            return handler
        kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(_refuse_stream, **kw)
        return grpc.unary_unary_rpc_method_handler(_refuse, **kw)


async def _refuse(_request, context: grpc.aio.ServicerContext):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED_MESSAGE)


async def _refuse_stream(_request, context: grpc.aio.ServicerContext):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED_MESSAGE)
    yield  # pragma: no cover  (makes this an async generator, as a streaming handler must be)


def _with_secret(details: grpc.aio.ClientCallDetails, secret: str) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()), (METADATA_KEY, secret))
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, secret: str) -> None:
        self._secret = secret

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_secret(details, self._secret), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, secret: str) -> None:
        self._secret = secret

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_secret(details, self._secret), request)


def client_interceptors(secret: str | None) -> list:
    """Interceptors for a grpc.aio channel to a worker that add the secret to every call ([] = none)."""
    return [] if not secret else [_UnaryUnary(secret), _UnaryStream(secret)]


def call_metadata(secret: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata to pass by hand (sync stubs, tests)."""
    return () if not secret else ((METADATA_KEY, secret),)
