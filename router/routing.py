"""The router's worker choice for one request, by policy, with optimistic bookings.

    policy "kv"          agg and prefill workers: lowest router/kv_router.py cost (prefix overlap
                         from the prefix index against booked and reported load); decode workers
                         in disaggregated mode: most KV headroom. Softmax at --router-temperature.
    policy "load"        the load-only choice of router/selection.py (free blocks, queue).
    policy "round-robin" the next live worker of the role, in id order (the comparison baseline).

`choose` books the request on the chosen worker at once (``Booking``): its uncached prefill
blocks until the first token, its decode blocks (its whole context, prompt + max_tokens: each
decode step reads all of them, shared prefix or not) and one request in the queue term until it
ends, so a burst sees each dispatch before any worker reports it. A worker's reported
load counts only beyond the bookings this router had when the report was taken (so a report
from while our last request ran does not outlive it). Several routers do not share bookings:
each sees the others' load through the workers' Stats, polled every ``WorkerPool`` interval
(0.2 s), so its view of their load is at most one poll interval (plus one RPC) stale.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass

import grpc

from router.errors import ServiceError
from router.kv_router import Candidate, choose_headroom, choose_kv, choose_round_robin
from router.pool import WorkerHandle, WorkerPool
from router.prefix_index import PrefixIndex, prompt_block_hashes
from router.selection import choose_decode, choose_prefill

log = logging.getLogger(__name__)

POLICIES = ("kv", "load", "round-robin")


@dataclass(frozen=True)
class RoutingConfig:
    """policy: one of POLICIES; temperature: softmax temperature of the kv cost (0 = argmin);
    overlap_weight: w of the cost (--kv-overlap-score-weight; 2: a prefill block costs two decode
    blocks, so a worker holding the prefix keeps it until about two of its requests run there,
    measured on the prefix benchmark); seed: the choice's random generator (None = from the OS)."""

    policy: str = "kv"
    temperature: float = 0.0
    overlap_weight: float = 2.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"--router-policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        # NaN compares False with everything, so `< 0` let it through (and inf: a NaN softmax / cost)
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"--router-temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 <= self.overlap_weight < math.inf:
            raise ValueError(f"--kv-overlap-score-weight must be a finite number >= 0, got {self.overlap_weight}")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Booking:
    """A request's optimistic charge on its worker; `prefilled` and `done` are idempotent."""

    worker: WorkerHandle
    prefill_blocks: int
    decode_blocks: int
    overlap_tokens: int  # prompt tokens the router expects the worker to serve from its cache
    _prefilled: bool = False
    _done: bool = False

    def __post_init__(self) -> None:
        w = self.worker
        w.inflight += 1
        w.booked_prefill_blocks += self.prefill_blocks
        w.booked_decode_blocks += self.decode_blocks

    def prefilled(self) -> None:
        if not self._prefilled:
            self._prefilled = True
            self.worker.booked_prefill_blocks -= self.prefill_blocks

    def done(self) -> None:
        self.prefilled()
        if not self._done:
            self._done = True
            self.worker.inflight -= 1
            self.worker.booked_decode_blocks -= self.decode_blocks


class Selector:
    def __init__(self, pool: WorkerPool, index: PrefixIndex, config: RoutingConfig = RoutingConfig()) -> None:
        self.pool = pool
        self.index = index
        self.config = config
        self.rng = random.Random(config.seed)
        self._rr: dict[str, int] = {}
        self.decisions: dict[str, int] = {}  # worker id -> requests routed there (tests, benchmarks)
        self.prompt_tokens: dict[str, int] = {}  # worker id -> prompt tokens routed there

    def choose(self, role: str, prompt_ids: list[int], max_tokens: int, *, by_headroom: bool = False,
               exclude: frozenset[str] = frozenset()) -> Booking:
        """Pick a live worker of ``role`` and book the request on it; raises ServiceError(UNAVAILABLE)."""
        workers = [w for w in self.pool.workers(role) if w.alive and w.id not in exclude]
        if not workers:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"no live {role} worker; retry later")
        cands = {w.id: self._candidate(w, prompt_ids) for w in workers}
        wid = self._pick(role, workers, list(cands.values()), by_headroom)
        w, c = self.pool.get(wid), cands[wid]
        bs = w.info.block_size or 16
        self.decisions[wid] = self.decisions.get(wid, 0) + 1
        self.prompt_tokens[wid] = self.prompt_tokens.get(wid, 0) + len(prompt_ids)
        log.debug("route %s -> %s (policy %s, overlap %d/%d blocks)", role, wid, self.config.policy,
                  c.overlap_blocks, c.prompt_blocks)
        # decode work: every decode step reads every block of the request's context, cached prefix or
        # not, so its decode charge is its whole context (prompt + max_tokens), not the blocks it adds
        return Booking(w, c.uncached_blocks, _cdiv(len(prompt_ids) + max_tokens, bs), c.overlap_blocks * bs)

    def _pick(self, role: str, workers: list[WorkerHandle], cands: list[Candidate], by_headroom: bool) -> str:
        policy, t = self.config.policy, self.config.temperature
        if policy == "round-robin":
            n = self._rr.get(role, 0)
            self._rr[role] = n + 1
            return choose_round_robin([w.id for w in workers], n)
        if policy == "load":
            loads = [w.load() for w in workers]
            return (choose_decode if by_headroom or role != "prefill" else choose_prefill)(loads)
        if by_headroom:
            return choose_headroom(cands, t, self.rng)
        return choose_kv(cands, t, self.rng, self.config.overlap_weight)

    def _candidate(self, w: WorkerHandle, prompt_ids: list[int]) -> Candidate:
        bs = w.info.block_size or 16
        s = w.stats
        overlap = self.index.overlap_blocks(w.id, prompt_block_hashes(prompt_ids, bs)) if self.config.policy == "kv" \
            else 0
        # our own requests count from our bookings (current); the last report adds what it shows beyond
        # the bookings we had when it was taken (other routers' requests): a report taken while our
        # last request still ran must not make the worker look busy after it finished
        others_blocks = max(s.kv_blocks_used - w.booked_at_poll, 0)
        others_queue = max(s.waiting - w.inflight_at_poll, 0)
        decode = w.booked_decode_blocks + others_blocks
        return Candidate(w.id, prompt_blocks=_cdiv(len(prompt_ids), bs), overlap_blocks=overlap,
                         booked_prefill_blocks=w.booked_prefill_blocks, decode_blocks=decode,
                         queue=w.inflight + others_queue,
                         free_blocks=s.kv_blocks_total - decode, alive=w.alive)
