"""KV-aware worker choice: a pure, seeded cost function over the router's view of each worker.

After NVIDIA Dynamo's KV router (cost = overlap weight x prefill blocks + decode blocks, softmax
with a temperature) with the queue added:

    cost(worker) = w * (uncached prefill blocks: this request's + those booked and not yet prefilled)
                 + in-flight decode blocks (max of the worker's last report and the router's bookings)
                 + queue (requests the router has there, plus others' waiting ones it reports)

Units: blocks (of the worker's block size), requests for the queue. The router books a request on
the chosen worker at once (``Booking``), before the worker reports it, so a burst of requests that
all prefer one worker sees that worker's cost rise with each one and spreads.

Choice: temperature 0 = the lowest cost, ties broken at random (seeded ``random.Random``); T > 0 =
softmax over -cost normalised to [0, 1] by the spread of costs, p_i ~ exp(-(c_i - min) / (range * T)),
so T is scale-free (T = 1: a worker one full cost-range worse is e times less likely).
Pure Python, no I/O; every decision is a function of its inputs and the generator.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Candidate:
    """One worker as the cost sees it.

    prompt_blocks: blocks of this request's prompt; overlap_blocks: how many of them the worker has
    cached (router prefix index); booked_prefill_blocks: uncached blocks of requests the router sent
    that have not had their first token; decode_blocks: KV blocks the worker's requests hold (the
    router's bookings plus what its report shows beyond them); queue: requests there (the router's
    plus others' waiting); free_blocks: unused KV blocks.
    """

    id: str
    prompt_blocks: int = 0
    overlap_blocks: int = 0
    booked_prefill_blocks: int = 0
    decode_blocks: int = 0
    queue: int = 0
    free_blocks: int = 0
    alive: bool = True

    @property
    def uncached_blocks(self) -> int:
        return max(self.prompt_blocks - self.overlap_blocks, 0)


def kv_cost(c: Candidate, overlap_weight: float = 1.0) -> float:
    """The cost above, in blocks (+ queued requests)."""
    return overlap_weight * (c.uncached_blocks + c.booked_prefill_blocks) + c.decode_blocks + c.queue


def headroom_cost(c: Candidate) -> float:
    """Decode workers in disaggregated mode: fewer free KV blocks = higher cost, then the queue."""
    return -c.free_blocks + c.queue


def sample(costs: dict[str, float], temperature: float, rng: random.Random) -> str | None:
    """The chosen id: argmin with random ties at temperature 0, else softmax over normalised cost."""
    if not costs:
        return None
    ids = sorted(costs)  # the order of the dict must not change a seeded decision
    lo, hi = min(costs.values()), max(costs.values())
    if temperature <= 0 or hi == lo:
        return rng.choice([i for i in ids if costs[i] == lo])
    scale = (hi - lo) * temperature
    weights = [math.exp(-(costs[i] - lo) / scale) for i in ids]
    return rng.choices(ids, weights=weights)[0]


def choose_kv(cands: Sequence[Candidate], temperature: float, rng: random.Random, overlap_weight: float = 1.0,
              exclude: frozenset[str] = frozenset()) -> str | None:
    """Agg and prefill workers: the lowest ``kv_cost`` (prefix overlap against load); None if none alive."""
    return sample({c.id: kv_cost(c, overlap_weight) for c in cands if c.alive and c.id not in exclude},
                  temperature, rng)


def choose_headroom(cands: Sequence[Candidate], temperature: float, rng: random.Random,
                    exclude: frozenset[str] = frozenset()) -> str | None:
    """Decode workers: the most KV headroom (free blocks), then the shortest queue."""
    return sample({c.id: headroom_cost(c) for c in cands if c.alive and c.id not in exclude}, temperature, rng)


def choose_round_robin(ids: Sequence[str], counter: int, exclude: frozenset[str] = frozenset()) -> str | None:
    """The counter-th live id in sorted order (the comparison baseline)."""
    live = sorted(i for i in ids if i not in exclude)
    return live[counter % len(live)] if live else None
