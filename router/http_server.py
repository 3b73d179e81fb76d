"""The OpenAI-compatible HTTP API on FastAPI: /v1/completions, /v1/chat/completions, /v1/models.

Same service as the gRPC API. Errors are OpenAI-style JSON bodies with the HTTP equivalent of the
gRPC status (400 naming the field, 429, 503, 504). Streaming uses server-sent events ending with
`data: [DONE]`; with stream_options.include_usage a last chunk carries the usage. A client that
disconnects cancels its request, which aborts every open leg on the workers.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator, Literal

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from proto.sampling import DEFAULT_MAX_TOKENS, InvalidRequest, SamplingParams
from router.errors import ServiceError
from router.service import Delta, Prepared, RouterService
from router.tokenizer import ChatMessage


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = ""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    top_k: int | None = Field(default=None, description="vLLM extension: keep the k most likely tokens (0 = all)")
    ignore_eos: bool = Field(default=False, description="vLLM extension: generate past EOS until max_tokens")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    timeout: float | None = Field(default=None, description="pdserve extension: deadline in seconds")

    def sampling(self, max_tokens: int | None, defaults: dict) -> SamplingParams:
        """Validated params; raises InvalidRequest naming the field (answered as a 400).
        defaults: values for unset fields (--generation-config), else the OpenAI defaults."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

        def pick(name: str, value, fallback):
            return value if value is not None else defaults.get(name, fallback)

        return SamplingParams(temperature=pick("temperature", self.temperature, 1.0),
                              top_p=pick("top_p", self.top_p, 1.0), top_k=pick("top_k", self.top_k, 0), seed=self.seed,
                              max_tokens=pick("max_tokens", max_tokens, DEFAULT_MAX_TOKENS), stop=stop,
                              ignore_eos=self.ignore_eos)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int]


class ChatMessageIn(BaseModel):
    role: str
    content: str


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessageIn]
    max_completion_tokens: int | None = None


def build_app(service: RouterService) -> FastAPI:
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)

    @app.exception_handler(ServiceError)
    async def _service_error(_: Request, e: ServiceError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(InvalidRequest)
    async def _invalid_request(_: Request, e: InvalidRequest) -> JSONResponse:
        return _error(ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(e)), param=e.field)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        field = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or "body"
        return _error(ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {first.get('msg', 'invalid')}"),
                      param=field)

    @app.get("/health")
    async def health() -> dict:
        service.model_id  # raises UNAVAILABLE without a live worker
        return {"status": "ok", **getattr(service, "health_details", dict)()}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": service.model_id, "object": "model", "created": 0,
                                            "owned_by": "pdserve", "max_model_len": service.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prepared = _prepare(service, body, body.max_tokens, **_prompt_input(body.prompt))
        return await _respond(service, body, prepared, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        chat = [ChatMessage(m.role, m.content) for m in body.messages]
        if not chat:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "messages: must not be empty")
        prepared = _prepare(service, body, max_tokens, chat=chat)
        return await _respond(service, body, prepared, request, chat=True)

    return app


def _prompt_input(prompt: str | list) -> dict:
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if prompt and all(isinstance(p, int) for p in prompt):
        return {"token_ids": list(prompt)}
    if len(prompt) != 1:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "prompt: exactly one prompt per request (n=1)")
    return {"prompt": prompt[0]}


def _prepare(service: RouterService, body: _SamplingFields, max_tokens: int | None, **inputs) -> Prepared:
    if body.n != 1:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"n: only n=1 is supported, got {body.n}")
    return service.prepare(body.model, body.sampling(max_tokens, service.generation_defaults), **inputs)


async def _respond(service: RouterService, body: _SamplingFields, prepared: Prepared, request: Request, chat: bool):
    shape = _Shape(prepared.request_id.replace("req-", "chatcmpl-" if chat else "cmpl-"), service.model_id, chat)
    stream = service.stream(prepared, body.timeout)
    if body.stream:
        # Wait for the first delta before sending headers, so that admission errors (429, 503) and
        # failures before the first token keep their HTTP status.
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            first = None
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_sse(first, stream, shape, include_usage), media_type="text/event-stream")
    return JSONResponse(await _collect(stream, shape, request))


async def _collect(stream: AsyncIterator[Delta], shape: "_Shape", request: Request) -> dict:
    """The whole completion; a client disconnect cancels it (and so aborts the workers' legs)."""
    async def run() -> dict:
        text, last = [], None
        async for d in stream:
            text.append(d.text)
            last = d
        return shape.full("".join(text), last)

    task = asyncio.create_task(run())
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if not done and await request.is_disconnected():
            task.cancel()
    return task.result()


async def _sse(first: Delta | None, stream: AsyncIterator[Delta], shape: "_Shape", include_usage: bool
               ) -> AsyncIterator[str]:
    try:
        async for d in _chain(first, stream):
            yield _event(shape.chunk(d, d is first))
            if d.finish_reason and include_usage:
                yield _event(shape.usage_chunk(d))
    except ServiceError as e:  # headers are sent: report the error in the stream, never a fake success
        yield _event(_error_body(e))
    yield "data: [DONE]\n\n"


async def _chain(first: Delta | None, rest: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    if first is None:
        return
    yield first
    if not first.finish_reason:
        async for d in rest:
            yield d


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Shape:
    """OpenAI response objects for one request."""

    def __init__(self, rid: str, model: str, chat: bool) -> None:
        self.id, self.model, self.chat, self.created = rid, model, chat, int(time.time())

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, last: Delta | None) -> dict:
        finish = last.finish_reason if last else None
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
            out = self._base("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            out = self._base("text_completion")
        return out | {"choices": [choice], "usage": _usage(last)}

    def chunk(self, d: Delta, first: bool) -> dict:
        if self.chat:
            delta: dict[str, Any] = {"content": d.text}
            if first:
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta, "finish_reason": d.finish_reason}
            return self._base("chat.completion.chunk") | {"choices": [choice]}
        choice = {"index": 0, "text": d.text, "logprobs": None, "finish_reason": d.finish_reason}
        return self._base("text_completion") | {"choices": [choice]}

    def usage_chunk(self, d: Delta) -> dict:
        return self._base("chat.completion.chunk" if self.chat else "text_completion") | {
            "choices": [], "usage": _usage(d)}


def _usage(d: Delta | None) -> dict | None:
    if d is None or d.usage is None:
        return None
    u = d.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def _error_body(e: ServiceError, param: str | None = None) -> dict:
    kind: Literal["invalid_request_error", "rate_limit_error", "server_error"] = (
        "invalid_request_error" if e.http_status == 400 else "rate_limit_error" if e.http_status == 429
        else "server_error")
    if param is None and e.code == grpc.StatusCode.INVALID_ARGUMENT:
        param = e.message.split(":", 1)[0]
    return {"error": {"message": e.message, "type": kind, "param": param, "code": e.code.name}}


def _error(e: ServiceError, param: str | None = None) -> JSONResponse:
    return JSONResponse(_error_body(e, param), status_code=e.http_status)
