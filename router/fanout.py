"""n and best_of: one client request as several worker requests, merged back. No torch.

OpenAI's ``n`` returns n completions of one prompt; ``best_of`` (completions) generates best_of of
them and returns the n with the highest cumulative logprob (the sum of the sampled tokens'
logprobs, as vLLM and OpenAI rank them). Each completion is its own request on the workers
(request id ``<id>-<i>``), so they batch with everything else; with a seed, completion i uses
``seed + i`` so the n completions differ and the whole answer is reproducible. A failure of any
completion fails the request (the others are cancelled, which aborts their legs).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from typing import AsyncIterator

import grpc

from router.errors import ServiceError
from router.service import Delta, Prepared, RouterService

MAX_N = 16


def check_n(n: int, best_of: int | None, stream: bool) -> int:
    """The number of completions to generate; raises ServiceError(INVALID_ARGUMENT) naming the field."""
    if not 1 <= n <= MAX_N:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"n: must be in [1, {MAX_N}], got {n}")
    if best_of is None:
        return n
    if not n <= best_of <= MAX_N:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"best_of: must be in [n={n}, {MAX_N}], got {best_of}")
    if stream and best_of > n:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "best_of: cannot stream when best_of > n")
    return best_of


def choices(req: Prepared, count: int) -> list[Prepared]:
    """The per-completion requests: ids <id>-<i>, seeds seed + i mod 2**64
    (the wire's uint64; unseeded stay unseeded)."""
    if count == 1:
        return [req]
    s = req.sampling
    return [replace(req, request_id=f"{req.request_id}-{i}", flow_id=f"{req.flow_id}-{i}" if req.flow_id else "",
                    sampling=s if s.seed is None else replace(s, seed=(s.seed + i) % 2**64)) for i in range(count)]


async def stream_choices(service: RouterService, reqs: list[Prepared], timeout_s: float | None
                         ) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) as each completion's deltas come; raises the first ServiceError."""
    if len(reqs) == 1:
        async for d in service.stream(reqs[0], timeout_s):
            yield 0, d
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, req: Prepared) -> None:
        try:
            async for d in service.stream(req, timeout_s):
                await queue.put((i, d, None))
        except Exception as e:  # delivered to the consumer, which cancels the rest
            await queue.put((i, None, e))
            return
        await queue.put((i, None, None))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
    open_ = len(tasks)
    try:
        while open_:
            i, d, error = await queue.get()
            if error is not None:
                raise error
            if d is None:
                open_ -= 1
                continue
            yield i, d
    finally:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks, return_exceptions=True)


def cumulative_logprob(deltas: list[Delta]) -> float:
    return sum(lp.logprob for d in deltas for lp in d.logprobs)


def best_n(per_choice: list[list[Delta]], n: int) -> list[list[Delta]]:
    """The n completions with the highest cumulative logprob, best first (ties: lower index first)."""
    order = sorted(range(len(per_choice)), key=lambda i: (-cumulative_logprob(per_choice[i]), i))
    return [per_choice[i] for i in order[:n]]
