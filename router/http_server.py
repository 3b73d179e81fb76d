"""The OpenAI-compatible HTTP API on FastAPI (vLLM's routes).

    POST /v1/completions, /v1/chat/completions     (router/openai_protocol.py: fields and shapes)
    GET  /v1/models, /health, /version, /metrics   (/metrics: the router's Prometheus series)
    POST /tokenize, /detokenize

Same service as the gRPC API. Errors are OpenAI-style JSON bodies with the HTTP equivalent of the
gRPC status (400 naming the field, 429, 503, 504); an unknown field is a 400 naming it. Streaming
uses server-sent events ending with `data: [DONE]`; with stream_options.include_usage one last
chunk carries the usage of all n choices. A client that disconnects cancels its request, which
aborts every open leg on the workers.
"""

from __future__ import annotations

import asyncio
import json
from importlib import metadata
from typing import AsyncIterator, Literal

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from proto.sampling import InvalidRequest
from router import auth, fanout
from router.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimit
from router.errors import ServiceError
from router.openai_protocol import (ChatCompletionRequest, CompletionRequest, DecodeTokensRequest, Shape,
                                    TokenizeRequest, _SamplingFields, describe_validation_error, invalid)
from router.service import Delta, Prepared, RouterService


def build_app(service: RouterService, metrics_registry=None, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """api_key: when set, every route but /health and /metrics needs `Authorization: Bearer KEY` (router/auth.py).
    max_body_bytes: a larger request body is a 413 (router/body_limit.py)."""
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    if api_key is not None:
        app.add_middleware(auth.ApiKeyMiddleware, api_key=api_key)

    @app.exception_handler(ServiceError)
    async def _service_error(_: Request, e: ServiceError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(InvalidRequest)
    async def _invalid_request(_: Request, e: InvalidRequest) -> JSONResponse:
        return _error(ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(e)), param=e.field)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own 400 for a body that is not JSON or not UTF-8, 404, 405: OpenAI-style too
        return JSONResponse({"error": {"message": str(e.detail), "type": "invalid_request_error", "param": None,
                                       "code": e.status_code}}, status_code=e.status_code, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        field, msg = describe_validation_error(list(e.errors()))
        if field == "body" and first.get("type") in ("model_attributes_type", "dict_type", "model_type"):
            # what curl -d sends without -H 'Content-Type: application/json' (a form) lands here too
            msg = "the request body must be a JSON object, sent with Content-Type: application/json"
        return _error(ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {msg}"), param=field)

    @app.get("/health")
    async def health() -> dict:
        service.model_id  # raises UNAVAILABLE without a live worker
        return {"status": "ok", **getattr(service, "health_details", dict)()}

    @app.get("/version")
    async def version() -> dict:
        return {"version": _version()}

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        body = generate_latest(metrics_registry) if metrics_registry is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": service.model_id, "object": "model", "created": 0,
                                            "owned_by": "pdserve", "max_model_len": service.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        if (body.prompt is None) == (body.messages is None):
            raise invalid("prompt", "give exactly one of prompt or messages")
        chat = None
        if body.messages is not None:
            chat = ChatCompletionRequest(messages=body.messages).chat()
        _, ids = await service.tokenize(body.model, body.prompt, chat, body.add_generation_prompt)
        return {"count": len(ids), "max_model_len": service.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DecodeTokensRequest) -> dict:
        return {"prompt": await service.detokenize(body.model, body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        inputs = _prompt_input(body.prompt)
        prepared = await _prepare(service, body, body.max_tokens, body.engine_logprobs(), **inputs)
        echo = ""
        if body.echo:
            echo = inputs.get("prompt") or service.tokenizer.decode(prepared.prompt_ids, skip_special_tokens=False)
        return await _respond(service, body, prepared, request, chat=False, echo=echo,
                              want_logprobs=body.logprobs is not None, best_of=body.best_of)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        prepared = await _prepare(service, body, max_tokens, body.engine_logprobs(), chat=body.chat(),
                            add_generation_prompt=body.add_generation_prompt)
        return await _respond(service, body, prepared, request, chat=True, want_logprobs=body.logprobs)

    return app


def _version() -> str:
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def _prompt_input(prompt: str | list) -> dict:
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if prompt and all(isinstance(p, int) for p in prompt):
        return {"token_ids": list(prompt)}
    if len(prompt) != 1:
        raise invalid("prompt", "exactly one prompt per request (use n for several completions)")
    return {"prompt": prompt[0]}


async def _prepare(service: RouterService, body: _SamplingFields, max_tokens: int | None, logprobs: int | None,
                   **inputs) -> Prepared:
    return await service.prepare(body.model, body.sampling(max_tokens, service.generation_defaults, logprobs), **inputs)


async def _respond(service: RouterService, body: _SamplingFields, prepared: Prepared, request: Request, chat: bool,
                   want_logprobs: bool, echo: str = "", best_of: int | None = None):
    count = fanout.check_n(body.n, best_of, body.stream)
    reqs = fanout.choices(prepared, count)
    if count > body.n and prepared.sampling.logprobs is None:  # ranking needs each token's logprob
        from dataclasses import replace

        reqs = [replace(r, sampling=replace(r.sampling, logprobs=0)) for r in reqs]
    shape = Shape(prepared.request_id.replace("req-", "chatcmpl-" if chat else "cmpl-"), service.model_id, chat,
                  service.token_text, echo)
    stream = fanout.stream_choices(service, reqs, body.timeout)
    if body.stream:
        # Wait for the first delta before sending headers, so that admission errors (429, 503) and
        # failures before the first token keep their HTTP status.
        first = await _first_unless_gone(stream, request)
        if first is _GONE:
            return Response(status_code=499)  # nobody reads it; the request is already aborted
        return StreamingResponse(_sse(first, stream, shape, body.include_usage, want_logprobs, count),
                                 media_type="text/event-stream")
    per_choice = await _collect(stream, count, request)
    if count > body.n:
        per_choice = fanout.best_n(per_choice, body.n)
    return JSONResponse(shape.full(per_choice, want_logprobs))


async def _collect(stream: AsyncIterator[tuple[int, Delta]], count: int, request: Request) -> list[list[Delta]]:
    """Every choice's deltas; a client disconnect cancels them (and so aborts the workers' legs)."""
    async def run() -> list[list[Delta]]:
        per_choice: list[list[Delta]] = [[] for _ in range(count)]
        async for i, d in stream:
            per_choice[i].append(d)
        return per_choice

    task = asyncio.create_task(run())
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if not done and await request.is_disconnected():
            task.cancel()
    return task.result()


_GONE = object()


async def _first_unless_gone(stream: AsyncIterator[tuple[int, Delta]], request: Request):
    """The stream's first item (None if it is empty), or _GONE when the client disconnects first:
    the stream is then cancelled, which aborts the workers' legs. Before this, a streaming client
    that gave up while its request waited or prefilled was noticed only at the first token (the
    headers wait for it), so every abandoned request still took its whole prefill."""
    async def first():
        try:
            return await anext(stream)
        except StopAsyncIteration:
            return None

    task = asyncio.create_task(first())
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if not done and await request.is_disconnected():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            return _GONE
    return task.result()


async def _sse(first: tuple[int, Delta] | None, stream: AsyncIterator[tuple[int, Delta]], shape: Shape,
               include_usage: bool, want_logprobs: bool, count: int) -> AsyncIterator[str]:
    started: set[int] = set()
    usages = []
    try:
        async for i, d in _chain(first, stream, count):
            yield _event(shape.chunk(i, d, i not in started, want_logprobs))
            started.add(i)
            if d.finish_reason and d.usage is not None:
                usages.append(d.usage)
        if include_usage:
            yield _event(shape.usage_chunk(usages))
    except ServiceError as e:  # headers are sent: report the error in the stream, never a fake success
        yield _event(_error_body(e))
    yield "data: [DONE]\n\n"


async def _chain(first, rest: AsyncIterator, count: int) -> AsyncIterator:
    if first is None:
        return
    yield first
    if count == 1 and first[1].finish_reason:
        return
    async for item in rest:
        yield item


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _error_body(e: ServiceError, param: str | None = None) -> dict:
    kind: Literal["invalid_request_error", "rate_limit_error", "server_error"] = (
        "invalid_request_error" if e.http_status == 400 else "rate_limit_error" if e.http_status == 429
        else "server_error")
    if param is None and e.code == grpc.StatusCode.INVALID_ARGUMENT:
        param = e.message.split(":", 1)[0]
    return {"error": {"message": _printable(e.message), "type": kind, "param": _printable(param),
                      "code": e.code.name}}


def _printable(text: str | None) -> str | None:
    """`text` without lone surrogates (a field name or value echoed from a hostile body), which
    JSON encoding to UTF-8 cannot write: they become \\udXXX escapes instead of a 500."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def _error(e: ServiceError, param: str | None = None) -> JSONResponse:
    return JSONResponse(_error_body(e, param), status_code=e.http_status)
