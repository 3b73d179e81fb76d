"""The public gRPC API (pdserve.v1.Generation) on grpc.aio, with health and reflection.

Errors are gRPC statuses from ServiceError. A client cancel or disconnect cancels the handler
task; the orchestrator's cleanup then aborts every open leg on the workers.
"""

from __future__ import annotations

from dataclasses import replace

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto.chat import ChatMessage
from proto.pdserve.v1 import api_pb2, api_pb2_grpc
from proto.sampling import InvalidRequest, from_wire
from proto.tls import TlsFiles, add_port
from router import fanout
from router.auth import ApiKeyInterceptor
from router.errors import ServiceError
from router.service import RouterService, with_defaults

SERVICE_NAME = api_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


class GenerationServicer(api_pb2_grpc.GenerationServicer):
    def __init__(self, service: RouterService, status_fn) -> None:
        self._svc = service
        self._status = status_fn

    async def Generate(self, request: api_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        """n completions (index on each message), best_of ranked by cumulative logprob, echo,
        logprobs per token; every option of the HTTP API."""
        try:
            sampling = from_wire(with_defaults(request.sampling, self._svc.generation_defaults))
            n = request.n or 1
            count = fanout.check_n(n, request.best_of or None, stream=False)
            if count > n and sampling.logprobs is None:  # ranking needs each token's logprob
                sampling = replace(sampling, logprobs=0)
            prepared = await self._svc.prepare(request.model, sampling, request_id=request.request_id, **_input(request))
            echo = self._echo(request, prepared) if request.echo else ""
            stream = fanout.stream_choices(self._svc, fanout.choices(prepared, count), context.time_remaining())
            if count > n:
                per_choice: list[list] = [[] for _ in range(count)]
                async for i, d in stream:
                    per_choice[i].append(d)
                ranked = fanout.best_n(per_choice, n)
                stream = _replay(ranked)
            started: set[int] = set()
            keep_logprobs = request.sampling.HasField("logprobs")
            async for i, d in stream:
                text = (echo if i not in started else "") + d.text
                started.add(i)
                msg = api_pb2.GenerateResponse(request_id=prepared.request_id, token_ids=d.token_ids, text=text,
                                               finish_reason=d.finish_reason or "", index=i,
                                               logprobs=d.logprobs if keep_logprobs else [])
                if d.ttft_s is not None:
                    msg.ttft_seconds = d.ttft_s
                if d.usage is not None:
                    msg.usage.CopyFrom(d.usage)
                yield msg
        except InvalidRequest as e:  # from_wire: the options break a sampling rule
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ServiceError as e:
            await context.abort(e.code, e.message)

    def _echo(self, request: api_pb2.GenerateRequest, prepared) -> str:
        if request.WhichOneof("input") == "prompt":
            return request.prompt
        return self._svc.tokenizer.decode(prepared.prompt_ids, skip_special_tokens=False)

    async def Tokenize(self, request: api_pb2.TokenizeRequest, context):
        try:
            which = request.WhichOneof("input")
            chat = _chat(request.chat) if which == "chat" else None
            text, ids = await self._svc.tokenize(request.model, request.prompt if which == "prompt" else None, chat,
                                           _add_generation_prompt(request.chat) if chat else True)
            return api_pb2.TokenizeResponse(token_ids=ids, rendered=text)
        except ServiceError as e:
            await context.abort(e.code, e.message)

    async def ListModels(self, request, context):
        try:
            return api_pb2.ListModelsResponse(models=[api_pb2.Model(id=self._svc.model_id,
                                                                    max_model_len=self._svc.max_model_len)])
        except ServiceError as e:
            await context.abort(e.code, e.message)

    async def ClusterStatus(self, request, context):
        return self._status()


async def _replay(per_choice: list[list]):
    for i, deltas in enumerate(per_choice):
        for d in deltas:
            yield i, d


def _input(request: api_pb2.GenerateRequest) -> dict:
    which = request.WhichOneof("input")
    if which == "chat":
        return {"chat": _chat(request.chat)}
    if which == "token_ids":
        return {"token_ids": list(request.token_ids.ids)}
    return {"prompt": request.prompt}


def _chat(chat: api_pb2.ChatMessages) -> list[ChatMessage]:
    return [ChatMessage(m.role, m.content) for m in chat.messages]


def _add_generation_prompt(chat: api_pb2.ChatMessages) -> bool:
    return True if not chat.HasField("add_generation_prompt") else chat.add_generation_prompt


def build_server(service: RouterService, status_fn, host: str, port: int, api_key: str | None = None,
                 tls: TlsFiles | None = None) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """The aio server with Generation, health and reflection; returns (server, health servicer, bound port).
    api_key: when set, Generation calls need metadata `authorization: Bearer KEY` (router/auth.py).
    tls: serve over TLS with these files (proto/tls.py)."""
    interceptors = [ApiKeyInterceptor(api_key, frozenset({SERVICE_NAME}))] if api_key is not None else []
    server = grpc.aio.server(interceptors=interceptors)
    api_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(service, status_fn), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = add_port(server, f"{host}:{port}", tls)
    if bound == 0:
        raise OSError(f"cannot bind gRPC on {host}:{port}")
    return server, health_servicer, bound


NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING
