"""A minimal streaming OpenAI-compatible server with a known token schedule, for the benchmark tests.

A real HTTP server (FastAPI + uvicorn on 127.0.0.1) that answers ``POST /v1/completions`` with
``stream: true``: the first token ``ttft_ms`` after the request arrives, then one token every
``itl_ms`` (on an absolute schedule, so delays do not accumulate), ``max_tokens`` tokens in all,
then a usage chunk (when ``stream_options.include_usage``) and ``data: [DONE]``.

Per-request overrides inside the prompt: ``[[ttft=200]]``, ``[[itl=30]]``, ``[[fail=500]]``
(answer HTTP 500), ``[[fail=midstream]]`` (two tokens, then an error event), ``[[fail=eos]]``
(a normal reply whose only token is EOS: one chunk with empty text), ``[[fail=empty]]`` (no chunk
at all, just ``[DONE]``).
``GET /stats`` reports requests seen, in flight now, the most ever in flight at once, and the
``Authorization`` header of the last completion request (None without one);
``POST /reset`` zeroes them.

Run: ``python tests/fake_openai_server.py --ttft-ms 50 --itl-ms 10`` prints ``PORT <n>`` once listening.
"""

import argparse
import asyncio
import json
import re
import socket
import sys
import time
from dataclasses import dataclass

MODEL = "fake-model"
_DIRECTIVE = re.compile(r"\[\[(\w+)=(\w+)\]\]")


@dataclass
class Schedule:
    ttft_ms: float
    itl_ms: float
    fail: str | None = None

    def with_overrides(self, prompt: str) -> "Schedule":
        d = dict(_DIRECTIVE.findall(prompt))
        return Schedule(float(d.get("ttft", self.ttft_ms)), float(d.get("itl", self.itl_ms)), d.get("fail"))


@dataclass
class Counters:
    requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    last_authorization: str | None = None

    def enter(self) -> None:
        self.requests += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def leave(self) -> None:
        self.in_flight -= 1


def _chunk(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def create_app(default: Schedule):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    counters = Counters()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.get("/stats")
    async def stats() -> dict:
        return {"requests": counters.requests, "in_flight": counters.in_flight, "max_in_flight": counters.max_in_flight,
                "last_authorization": counters.last_authorization}

    @app.post("/reset")
    async def reset() -> dict:
        counters.requests = counters.max_in_flight = 0
        counters.last_authorization = None
        return {}

    @app.post("/v1/completions")
    async def completions(request: Request):
        t_arrival = time.perf_counter()
        body = await request.json()
        counters.last_authorization = request.headers.get("authorization")
        sched = default.with_overrides(body["prompt"])
        if sched.fail == "500":
            return JSONResponse({"error": {"message": "injected failure", "type": "server_error"}}, status_code=500)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        counters.enter()
        return StreamingResponse(_stream(body, sched, t_arrival, include_usage, counters), media_type="text/event-stream")

    return app


async def _stream(body: dict, sched: Schedule, t0: float, include_usage: bool, counters: Counters):
    n = int(body.get("max_tokens") or 16)
    if sched.fail == "eos":  # EOS as the first token: one chunk, no text
        n = 1
    try:
        for i in range(n if sched.fail != "empty" else 0):
            due = t0 + (sched.ttft_ms + i * sched.itl_ms) / 1000.0
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            if sched.fail == "midstream" and i == 2:
                yield _chunk({"error": {"message": "injected mid-stream failure", "code": 500}})
                return  # no [DONE]: the stream just ends
            text, finish = ("", "stop") if sched.fail == "eos" else (f" tok{i}", "length" if i == n - 1 else None)
            yield _chunk({"id": "cmpl-fake", "object": "text_completion", "model": MODEL,
                          "choices": [{"index": 0, "text": text, "finish_reason": finish}]})
        if include_usage:
            usage = {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": n,
                     "total_tokens": len(body["prompt"].split()) + n}
            yield _chunk({"id": "cmpl-fake", "object": "text_completion", "model": MODEL, "choices": [], "usage": usage})
    finally:
        counters.leave()  # before [DONE] goes out: a client may start its next request as soon as it reads it
    yield b"data: [DONE]\n\n"


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ttft-ms", type=float, default=50.0)
    p.add_argument("--itl-ms", type=float, default=10.0)
    args = p.parse_args()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(create_app(Schedule(args.ttft_ms, args.itl_ms)), log_level="warning",
                            timeout_keep_alive=30, backlog=2048)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())
