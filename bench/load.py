"""Load generation: when each request is sent, how many may be in flight, warm-up.

Arrivals follow ``vllm bench serve``: inter-arrival gaps are Gamma(shape=B, scale=1/(R*B)), mean
1/R for every burstiness B; B = 1 is a Poisson process, B < 1 burstier, B > 1 more regular
(coefficient of variation 1/sqrt(B)). R = inf sends every request at t = 0.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from bench.backends import Backend
from bench.datasets import SampleRequest
from bench.metrics import RequestRecord
from engine.errors import UserError


@dataclass(frozen=True)
class LoadConfig:
    """request_rate: mean requests/s (inf: all at once). max_concurrency: None = unlimited."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 1
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise UserError("--request-rate must be > 0 (or inf)")
        if not self.burstiness > 0:
            raise UserError("--burstiness must be > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise UserError("--max-concurrency must be >= 1")
        if self.num_warmups < 0:
            raise UserError("--num-warmups must be >= 0")


def arrival_offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send times in seconds from the start, shape [n], float64, non-decreasing, the first at 0."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=max(n - 1, 0))
    return np.concatenate([[0.0], np.cumsum(gaps)])


@dataclass
class RunResult:
    """Measured records (warm-up excluded) and the wall time from the first send to the last finish."""

    records: list[RequestRecord]
    duration_s: float


async def run_load(backend: Backend, requests: Sequence[SampleRequest], cfg: LoadConfig) -> RunResult:
    """Warm up, then send ``requests`` on the arrival schedule under the concurrency cap."""
    await warm_up(backend, requests[: cfg.num_warmups])
    offsets = arrival_offsets(len(requests), cfg.request_rate, cfg.burstiness, np.random.default_rng(cfg.seed))
    limit = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    bar = _progress_bar(len(requests), cfg.progress)
    t0 = time.perf_counter()

    async def one(i: int, req: SampleRequest, at: float) -> RequestRecord:
        if (delay := t0 + at - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        if limit is None:
            rec = await backend.send(i, req, t0)
        else:
            async with limit:
                rec = await backend.send(i, req, t0)
        bar.update(1)
        return rec

    try:
        records = await asyncio.gather(*(one(i, r, float(at)) for i, (r, at) in enumerate(zip(requests, offsets))))
    finally:
        bar.close()
    return RunResult(list(records), time.perf_counter() - t0)


async def warm_up(backend: Backend, requests: Sequence[SampleRequest]) -> None:
    """Send the warm-up requests one after another; their results are discarded, but a warm-up
    that fails says the target is not serving, so it stops the run with the target's error."""
    for i, req in enumerate(requests):
        rec = await backend.send(-1 - i, req, time.perf_counter())
        if not rec.success:
            raise UserError(f"warm-up request failed: {rec.error}")


def _progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, desc="requests", unit="req", leave=False)
