"""AsyncEngine's step loop against a scripted stand-in for LLMEngine (pure logic, no model): the
loop's wakeups and shutdown in every state it can be in. The real-model behaviour is
tests/test_async_engine.py."""

from __future__ import annotations

import asyncio

from engine.async_engine import AsyncEngine
from engine.outputs import RequestOutput, Usage
from proto.sampling import SamplingParams


class HeldEngine:
    """Has work that never fits (last_step_ran False, as with KV held elsewhere) until aborted:
    the loop sits in its short idle-poll wait, the state where a cancel used to be lost."""

    def __init__(self) -> None:
        self.requests: set[str] = set()
        self.last_step_ran = False
        self.steps = 0

    def add_request(self, request_id, prompt, params, **_) -> None:
        self.requests.add(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        return []

    def abort(self, request_id: str) -> RequestOutput | None:
        if request_id not in self.requests:
            return None
        self.requests.discard(request_id)
        return RequestOutput(request_id, [], "", True, "abort", Usage(0, 0, 0))

    def fail_all(self) -> list[RequestOutput]:
        return [RequestOutput(r, [], "", True, "error", Usage(0, 0, 0)) for r in sorted(self.requests)]


def test_shutdown_right_after_a_wakeup_always_returns():
    """abort (a wakeup) then shutdown at once, from the idle-poll wait. Before the loop stopped on
    a flag, shutdown cancelled it there, and CPython 3.11's asyncio.wait_for can swallow a cancel
    that races with its inner wait completing: the loop idled on and shutdown never returned (CI
    hung 600 s in test_bad_requests_fail_cleanly). 200 rounds, each bounded at 10 s."""

    async def one_round(i: int) -> str | None:
        eng = AsyncEngine(HeldEngine())
        gen = eng.generate([1, 2], SamplingParams(max_tokens=4), f"r{i}")
        first = asyncio.ensure_future(gen.__anext__())
        while f"r{i}" not in eng.engine.requests:  # added (on the engine thread)
            await asyncio.sleep(0)
        for _ in range(i // 5 % 4):  # land in different places of the poll loop
            await asyncio.sleep(0.005)
        await eng.abort(f"r{i}")
        for _ in range(i % 5):  # shutdown 0-4 loop iterations after the wakeup
            await asyncio.sleep(0)
        await asyncio.wait_for(eng.shutdown(), 10)
        return (await asyncio.wait_for(first, 10)).finish_reason

    async def main() -> list[str | None]:
        return [await one_round(i) for i in range(200)]

    assert asyncio.run(main()) == ["abort"] * 200


def test_a_step_that_raises_fails_every_open_stream():
    """Any exception from the step ends every stream with "error" and refuses new requests."""

    class Broken(HeldEngine):
        def step(self):
            raise RuntimeError("injected")

    async def main():
        eng = AsyncEngine(Broken())
        outs = [o async for o in eng.generate([1], SamplingParams(max_tokens=2), "a")]
        dead = eng.dead
        await eng.shutdown()
        return outs, dead

    outs, dead = asyncio.run(main())
    assert [(o.finished, o.finish_reason) for o in outs] == [(True, "error")]
    assert isinstance(dead, RuntimeError)
