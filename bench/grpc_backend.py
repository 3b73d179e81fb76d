"""The ``pdserve-grpc`` benchmark target: pdserve's ``pdserve.v1.Generation/Generate`` stream via grpc.aio.

Each GenerateResponse with non-empty ``text`` is one streamed chunk (timed like an SSE chunk of the
OpenAI target, so the two targets' TTFT/ITL mean the same thing); token counts come from the
final message's ``usage``, else from the ``token_ids`` the stream carried; the first message's
``ttft_seconds`` (the router's own TTFT) is kept as ``server_ttft_s``. A failed RPC is a failed
request whose error is the gRPC status code and details.
"""

from __future__ import annotations

import time

from bench.backends import StreamTimes, finish_record
from bench.datasets import SampleRequest
from bench.metrics import RequestRecord
from engine.errors import UserError


class PdserveGrpcBackend:
    """Streaming client of pdserve's public gRPC API (one shared ``grpc.aio`` channel)."""

    def __init__(self, channel, model: str, *, ignore_eos: bool, timeout_s: float,
                 metadata: tuple[tuple[str, str], ...] | None = None) -> None:
        from proto.pdserve.v1 import api_pb2_grpc

        self.model, self._metadata = model, metadata
        self._channel, self._stub = channel, api_pb2_grpc.GenerationStub(channel)
        self._ignore_eos, self._timeout_s = ignore_eos, timeout_s

    @classmethod
    async def connect(cls, url: str, model: str | None, *, ignore_eos: bool = False,
                      timeout_s: float = 600.0, api_key: str | None = None) -> "PdserveGrpcBackend":
        """Open a channel to ``HOST:PORT``; without ``model``, take the first one ListModels names.
        Raises UserError if the server cannot be reached or lists no model."""
        import grpc

        from proto.pdserve.v1 import api_pb2, api_pb2_grpc

        if "://" in url:
            raise UserError(f"--url {url!r}: the pdserve-grpc backend takes HOST:PORT, without a scheme")
        channel = grpc.aio.insecure_channel(url)
        metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        if model is None:
            try:
                listed = await api_pb2_grpc.GenerationStub(channel).ListModels(api_pb2.ListModelsRequest(), timeout=10.0,
                                                                                  metadata=metadata)
            except grpc.aio.AioRpcError as e:
                await channel.close()
                raise UserError(f"ListModels at {url} failed ({e.code().name}: {e.details()}); pass --model NAME") from None
            if not listed.models:
                await channel.close()
                raise UserError(f"{url} serves no model")
            model = listed.models[0].id
        return cls(channel, model, ignore_eos=ignore_eos, timeout_s=timeout_s, metadata=metadata)

    async def send(self, index: int, req: SampleRequest, t0: float) -> RequestRecord:
        import grpc

        from proto.pdserve.v1 import api_pb2

        request = api_pb2.GenerateRequest(
            model=self.model, prompt=req.prompt,
            sampling=api_pb2.SamplingOptions(temperature=0.0, max_tokens=req.expected_output_len,
                                             ignore_eos=self._ignore_eos))
        rec = RequestRecord(index=index, success=False, prompt_len=req.prompt_len)
        s = StreamTimes(st=time.perf_counter())
        rec.start_s = s.st - t0
        num_token_ids = 0
        try:
            async for resp in self._stub.Generate(request, timeout=self._timeout_s, metadata=self._metadata):
                s.on_event()
                if resp.ttft_seconds and rec.server_ttft_s is None:
                    rec.server_ttft_s = resp.ttft_seconds
                if resp.text:
                    s.on_text(resp.text)
                num_token_ids += len(resp.token_ids)
                if resp.HasField("usage"):
                    s.usage = {"prompt_tokens": resp.usage.prompt_tokens,
                               "completion_tokens": resp.usage.completion_tokens}
        except grpc.aio.AioRpcError as e:
            rec.error = f"{e.code().name}: {e.details()}"
            return rec
        if s.usage is None and num_token_ids:
            s.usage = {"completion_tokens": num_token_ids}
        return finish_record(rec, s)

    async def close(self) -> None:
        await self._channel.close()
