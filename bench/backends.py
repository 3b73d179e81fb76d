"""Benchmark targets: send one request, stream its reply, time every chunk -> RequestRecord.

- ``openai``: ``POST {url}/v1/completions`` with ``stream: true`` and
  ``stream_options.include_usage`` (vLLM, SGLang, llama.cpp's server, pdserve's HTTP port), via httpx.
- ``pdserve-grpc``: pdserve's own streaming gRPC API (``bench/grpc_backend.py``), via grpc.aio.

Timing: ``time.perf_counter`` taken when the request is handed to the transport (after any
``--max-concurrency`` wait) and when each chunk carrying text is parsed.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from bench.datasets import SampleRequest
from bench.metrics import RequestRecord
from engine.errors import UserError

BACKENDS = ("openai", "pdserve-grpc")


class Backend(Protocol):
    """A target under test. ``send`` never raises for a failed request: it returns a record with
    ``success=False`` and the error; it raises only on cancellation."""

    model: str

    async def send(self, index: int, req: SampleRequest, t0: float) -> RequestRecord: ...
    async def close(self) -> None: ...


@dataclass
class StreamTimes:
    """One streamed reply as it arrives: chunk times (perf_counter seconds), text, usage."""

    st: float
    last: float = 0.0
    ttft_s: float | None = None
    first_event_s: float | None = None  # first chunk of any kind: the only timing of a text-less reply
    chunks: int = 0
    usage: dict[str, Any] | None = None
    itl_s: list[float] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)

    def on_event(self) -> None:
        if self.first_event_s is None:
            self.first_event_s = time.perf_counter() - self.st

    def on_text(self, text: str) -> None:
        now = time.perf_counter()
        if self.ttft_s is None:
            self.ttft_s = now - self.st
        else:
            self.itl_s.append(now - self.last)
        self.last = now
        self.chunks += 1
        self.parts.append(text)


def finish_record(rec: RequestRecord, s: StreamTimes) -> RequestRecord:
    """Fill a successful record from a completed stream. Output tokens: the target's usage, else
    the number of text chunks, marked "chunks" for ``count_output_tokens`` to redo after the run
    (tokenizing here would stall the event loop while other requests are being timed).

    A reply with no text at all (e.g. EOS as the first token) still completed: its TTFT is the
    arrival of its first chunk. A stream without a single chunk is a failure.
    """
    rec.e2el_s = time.perf_counter() - s.st
    if s.first_event_s is None:
        rec.error = "the stream ended without any output"
        return rec
    rec.success, rec.itl_s = True, s.itl_s
    rec.ttft_s = s.ttft_s if s.ttft_s is not None else s.first_event_s
    rec.generated_text = "".join(s.parts)
    if s.usage and s.usage.get("completion_tokens") is not None:
        rec.output_tokens, rec.output_tokens_source = int(s.usage["completion_tokens"]), "usage"
    else:
        rec.output_tokens, rec.output_tokens_source = s.chunks, "chunks"
    if rec.prompt_len is None and s.usage and s.usage.get("prompt_tokens") is not None:
        rec.prompt_len = int(s.usage["prompt_tokens"])
    return rec


class OpenAICompletionsBackend:
    """Streaming ``/v1/completions`` client (one shared httpx.AsyncClient, no connection cap,
    so that only ``--max-concurrency`` limits concurrency)."""

    def __init__(self, base_url: str, model: str, *, endpoint: str = "/v1/completions",
                 ignore_eos: bool = False, include_usage: bool = True, temperature: float = 0.0,
                 timeout_s: float = 600.0, api_key: str | None = None) -> None:
        import httpx

        self.model, self._timeout_s = model, timeout_s
        self._url = base_url.rstrip("/") + endpoint
        self._extra: dict[str, Any] = {"temperature": temperature}
        if include_usage:
            self._extra["stream_options"] = {"include_usage": True}
        if ignore_eos:
            self._extra["ignore_eos"] = True
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), headers=auth_headers(api_key),
                                         limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))

    async def send(self, index: int, req: SampleRequest, t0: float) -> RequestRecord:
        payload = {"model": self.model, "prompt": req.prompt, "max_tokens": req.expected_output_len,
                   "stream": True, **self._extra}
        rec = RequestRecord(index=index, success=False, prompt_len=req.prompt_len)
        s = StreamTimes(st=time.perf_counter())
        rec.start_s = s.st - t0
        try:
            async with asyncio.timeout(self._timeout_s), self._client.stream("POST", self._url, json=payload) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode("utf-8", "replace")
                    rec.error = f"HTTP {resp.status_code}: {body[:300]}"
                    return rec
                async for line in resp.aiter_lines():
                    if not self._on_line(line, s, rec):
                        break
        except TimeoutError:
            rec.error = f"timed out after {self._timeout_s:g} s"
            return rec
        except Exception as e:  # transport errors, bad JSON: the request failed, the run goes on
            rec.error = f"{type(e).__name__}: {e}"
            return rec
        if rec.error:
            return rec
        return finish_record(rec, s)

    @staticmethod
    def _on_line(line: str, s: StreamTimes, rec: RequestRecord) -> bool:
        """Handle one SSE line; False ends the stream ([DONE] or an error event)."""
        if not line.startswith("data:"):
            return True
        data = line[5:].strip()
        if data == "[DONE]":
            return False
        event = json.loads(data)
        if "error" in event:
            rec.error = f"stream error: {json.dumps(event['error'])[:300]}"
            return False
        if choices := event.get("choices"):
            s.on_event()
            if text := choices[0].get("text"):
                s.on_text(text)
        if event.get("usage"):
            s.usage = event["usage"]
        return True

    async def close(self) -> None:
        await self._client.aclose()


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The HTTP headers that carry ``api_key`` (none without one)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def discover_openai_model(base_url: str, timeout_s: float = 10.0, api_key: str | None = None) -> str:
    """The first model id the server lists at ``GET /v1/models``; UserError if it cannot be read."""
    import httpx

    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with httpx.AsyncClient(timeout=timeout_s, headers=auth_headers(api_key)) as c:
            resp = await c.get(url)
            resp.raise_for_status()
            return str(resp.json()["data"][0]["id"])
    except Exception as e:
        raise UserError(f"could not list models at {url} ({type(e).__name__}: {e}); pass --model NAME") from None


async def create_backend(name: str, url: str, model: str | None, *,
                         ignore_eos: bool, include_usage: bool, timeout_s: float,
                         api_key: str | None = None) -> Backend:
    """The target ``name`` ("openai" or "pdserve-grpc") at ``url``, sending ``api_key`` (if any) as a
    bearer token; raises UserError for a bad name/url."""
    if name == "openai":
        if not url.startswith(("http://", "https://")):
            raise UserError(f"--url {url!r}: the openai backend needs http://HOST:PORT")
        model = model or await discover_openai_model(url, api_key=api_key)
        return OpenAICompletionsBackend(url, model, ignore_eos=ignore_eos,
                                        include_usage=include_usage, timeout_s=timeout_s, api_key=api_key)
    if name == "pdserve-grpc":
        from bench.grpc_backend import PdserveGrpcBackend

        return await PdserveGrpcBackend.connect(url, model, ignore_eos=ignore_eos, timeout_s=timeout_s,
                                                api_key=api_key)
    raise UserError(f"unknown --backend {name!r}; choose one of {', '.join(BACKENDS)}")


def count_output_tokens(records: list[RequestRecord], tokenizer: Any) -> None:
    """After the run: re-count the output of records without usage by tokenizing their text
    (``tokenizer``: an HF tokenizer, or None to keep the one-token-per-chunk estimate)."""
    if tokenizer is None:
        return
    for r in records:
        if r.success and r.output_tokens_source == "chunks":
            r.output_tokens = len(tokenizer.encode(r.generated_text, add_special_tokens=False))
            r.output_tokens_source = "tokenizer"
