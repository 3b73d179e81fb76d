"""A minimal pdserve.v1.Generation gRPC server with the same known token schedule as
``fake_openai_server`` (and the same ``[[ttft=..]]``, ``[[itl=..]]``, ``[[fail=500]]``,
``[[fail=midstream]]`` prompt directives), for testing the ``pdserve-grpc`` benchmark target.
A real grpc.aio server on 127.0.0.1 speaking pdserve's committed wire API.
"""

import asyncio
import time

import grpc

from fake_openai_server import MODEL, Counters, Schedule
from proto.pdserve.v1 import api_pb2, api_pb2_grpc


class FakeGeneration(api_pb2_grpc.GenerationServicer):
    def __init__(self, default: Schedule) -> None:
        self.default = default
        self.counters = Counters()

    async def ListModels(self, request, context):
        return api_pb2.ListModelsResponse(models=[api_pb2.Model(id=MODEL, max_model_len=8192)])

    async def Generate(self, request, context):
        t0 = time.perf_counter()
        sched = self.default.with_overrides(request.prompt)
        if sched.fail == "500":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "injected failure")
        n = request.sampling.max_tokens or 16
        self.counters.enter()
        try:
            for i in range(n):
                await asyncio.sleep(max(0.0, t0 + (sched.ttft_ms + i * sched.itl_ms) / 1000.0 - time.perf_counter()))
                if sched.fail == "midstream" and i == 2:
                    await context.abort(grpc.StatusCode.INTERNAL, "injected mid-stream failure")
                msg = api_pb2.GenerateResponse(request_id="fake", token_ids=[100 + i], text=f" tok{i}")
                if i == 0:
                    msg.ttft_seconds = time.perf_counter() - t0
                if i == n - 1:
                    msg.finish_reason = "length"
                    msg.usage.CopyFrom(api_pb2.Usage(prompt_tokens=len(request.prompt.split()), completion_tokens=n))
                yield msg
        finally:
            self.counters.leave()


async def start(default: Schedule) -> tuple[grpc.aio.Server, int, FakeGeneration]:
    """Start the server on 127.0.0.1 (a free port) in the running event loop; returns (server, port, servicer)."""
    server = grpc.aio.server()
    servicer = FakeGeneration(default)
    api_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port, servicer
