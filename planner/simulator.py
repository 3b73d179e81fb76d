"""A discrete-event simulation of the router and the prefill/decode pools, driven by a profile.

Answers "how many prefill and decode workers meet this SLO at this load" and "what does the
planner do over this trace" without a cluster, for fleets of thousands of workers in seconds.

The model (what each worker does, in the profile's terms):

- **Arrivals**: a list of (time, ISL, OSL) requests (a Poisson stream or a trace).
- **Prefill pool**: each worker serves its FIFO queue one prompt at a time; a prompt of ISL
  tokens takes ``ISL / prefill_tokens_per_s(ISL)`` seconds. The router sends a request to the
  worker with the least queued prompt tokens. TTFT = queueing + prefill + ``transfer_s``.
- **Decode pool**: each worker runs continuous batching as processor sharing: with ``b``
  requests running at mean context ``c``, every request gains one token per
  ``decode_itl_ms(b, c)``. The router sends a request to the worker with the fewest running
  (ties: lowest index), up to ``max_batch``; beyond that it waits in a decode queue.
- **Planner** (optional): every ``interval_s`` the SLA planner sees the interval's metrics and
  sets targets; new workers become ready after ``startup_s``; a worker removed by the planner
  drains (takes nothing new, leaves when empty) — no request is ever dropped.

Events are only arrivals, prefill completions, decode completions and planner ticks: between
two events each decode worker's requests advance linearly, so the cost is
O(events × batch), independent of how many decode steps run.
"""

from __future__ import annotations

import bisect
from collections import deque
import dataclasses
import heapq
import math
import random
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from planner.profile import WorkerProfile
from planner.sla import IntervalMetrics, LoadSample, SlaPlanner


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    isl: int
    osl: int


@dataclass
class _Req:
    spec: SimRequest
    rid: int
    first_token_s: float = math.nan
    done_s: float = math.nan
    remaining: float = 0.0      # decode tokens still to produce (after the first)


@dataclass(frozen=True)
class SimConfig:
    """transfer_s: KV handoff after prefill; max_batch: running requests per decode worker;
    startup_s: a new worker's time to ready; interval_s: the planner's SLA tick and
    load_interval_s its load-loop tick (when a planner runs). A decode worker's KV usage is
    modelled as running / max_batch."""

    num_prefill: int = 1
    num_decode: int = 1
    transfer_s: float = 0.0
    max_batch: int = 64
    startup_s: float = 60.0
    interval_s: float = 60.0
    load_interval_s: float = 10.0


@dataclass
class _DecodeWorker:
    running: dict[int, _Req] = field(default_factory=dict)
    last_s: float = 0.0
    itl_s: float = 0.0
    version: int = 0
    draining: bool = False
    ready_s: float = 0.0


@dataclass
class _PrefillWorker:
    queue_tokens: int = 0
    free_at_s: float = 0.0
    draining: bool = False
    ready_s: float = 0.0
    in_flight: int = 0


@dataclass(frozen=True)
class SimResult:
    """Per-request TTFT and mean ITL (ms), fleet size over time and worker-seconds per pool."""

    ttft_ms: list[float]
    itl_ms: list[float]
    e2e_s: list[float]
    duration_s: float
    prefill_worker_s: float
    decode_worker_s: float
    timeline: list[dict]

    def percentile(self, values: Sequence[float], q: float) -> float:
        if not values:
            return math.nan
        xs = sorted(values)
        return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]

    def attainment(self, ttft_slo_ms: float, itl_slo_ms: float) -> float:
        """Share of requests whose TTFT and mean ITL both met their SLO."""
        ok = sum(1 for t, i in zip(self.ttft_ms, self.itl_ms) if t <= ttft_slo_ms and i <= itl_slo_ms)
        return ok / len(self.ttft_ms) if self.ttft_ms else math.nan

    def summary(self) -> dict:
        p = self.percentile
        return {"requests": len(self.ttft_ms), "ttft_p50_ms": p(self.ttft_ms, 50), "ttft_p99_ms": p(self.ttft_ms, 99),
                "itl_p50_ms": p(self.itl_ms, 50), "itl_p99_ms": p(self.itl_ms, 99),
                "prefill_worker_hours": self.prefill_worker_s / 3600, "decode_worker_hours": self.decode_worker_s / 3600,
                "worker_hours": (self.prefill_worker_s + self.decode_worker_s) / 3600}


def poisson_requests(rate: float, duration_s: float, isl: int, osl: int, seed: int = 0) -> list[SimRequest]:
    """A Poisson stream of fixed-length requests over [0, duration_s)."""
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        out.append(SimRequest(t, isl, osl))


def trace_requests(rates: Sequence[tuple[float, float]], isl: int, osl: int, seed: int = 0) -> list[SimRequest]:
    """Piecewise-constant Poisson: ``rates`` = [(start_s, req/s), ...] sorted; the last piece
    lasts as long as the one before it."""
    rng, out = random.Random(seed), []
    ends = [s for s, _ in rates[1:]] + [rates[-1][0] + (rates[-1][0] - rates[-2][0] if len(rates) > 1 else 3600)]
    for (start, rate), end in zip(rates, ends):
        t = start
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= end:
                break
            out.append(SimRequest(t, isl, osl))
    return out


def diurnal_rates(peak: float, trough: float, hours: float = 24.0, step_s: float = 300.0) -> list[tuple[float, float]]:
    """A day-shaped rate: trough at t=0, peak at half the period (a raised cosine), in steps."""
    n = max(2, int(hours * 3600 / step_s))
    return [(i * step_s, trough + (peak - trough) * (1 - math.cos(2 * math.pi * i / n)) / 2) for i in range(n)]


class Simulation:
    """One run over ``requests``; with ``planner`` the pools follow its targets."""

    def __init__(self, profile: WorkerProfile, config: SimConfig, planner: SlaPlanner | None = None) -> None:
        self.profile, self.config, self.planner = profile, config, planner
        self.prefill = [_PrefillWorker() for _ in range(config.num_prefill)]
        self.decode = [_DecodeWorker() for _ in range(config.num_decode)]
        self.events: list[tuple[float, int, str, tuple]] = []
        self._seq = 0
        self.decode_queue: deque[_Req] = deque()
        self.done: list[_Req] = []
        self.timeline: list[dict] = []
        self.arrivals: list[float] = []   # arrival times seen so far (ascending)
        self._worker_s = {"prefill": 0.0, "decode": 0.0}
        self._last_account = 0.0

    # -- events ----------------------------------------------------------------------------------
    def _push(self, t: float, kind: str, *args) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, args))

    def run(self, requests: Iterable[SimRequest]) -> SimResult:
        reqs = [_Req(r, i) for i, r in enumerate(sorted(requests, key=lambda r: r.arrival_s))]
        for r in reqs:
            self._push(r.spec.arrival_s, "arrive", r)
        end = reqs[-1].spec.arrival_s if reqs else 0.0
        if self.planner is not None:
            self._push(self.config.interval_s, "tick", 0.0)
            self._push(self.config.load_interval_s, "load_tick")
        now = 0.0
        while self.events:
            now, _, kind, args = heapq.heappop(self.events)
            self._account(now)
            if kind in ("tick", "load_tick") and now > end and not self._busy():
                break
            getattr(self, f"_on_{kind}")(now, *args)
        done = sorted(self.done, key=lambda r: r.rid)
        return SimResult([1000 * (r.first_token_s - r.spec.arrival_s) for r in done],
                         [1000 * (r.done_s - r.first_token_s) / max(1, r.spec.osl - 1) for r in done],
                         [r.done_s - r.spec.arrival_s for r in done], now,
                         self._worker_s["prefill"], self._worker_s["decode"], self.timeline)

    def _busy(self) -> bool:
        return bool(self.decode_queue) or any(w.running for w in self.decode) or any(w.in_flight for w in self.prefill)

    def _account(self, now: float) -> None:
        dt = now - self._last_account
        self._worker_s["prefill"] += dt * len(self.prefill)
        self._worker_s["decode"] += dt * len(self.decode)
        self._last_account = now

    # -- prefill ---------------------------------------------------------------------------------
    def _on_arrive(self, now: float, r: _Req) -> None:
        self.arrivals.append(now)
        ready = [w for w in self.prefill if not w.draining and w.ready_s <= now]
        if not ready:  # no prefill worker: the decode worker prefills (conditional disaggregation)
            self._to_decode(now, r, now + r.spec.isl / self.profile.prefill_tokens_per_s(r.spec.isl))
            return
        w = min(ready, key=lambda w: (w.queue_tokens, w.free_at_s))
        service = r.spec.isl / self.profile.prefill_tokens_per_s(r.spec.isl)
        start = max(now, w.free_at_s)
        w.free_at_s = start + service
        w.queue_tokens += r.spec.isl
        w.in_flight += 1
        self._push(w.free_at_s, "prefilled", r, w)

    def _on_prefilled(self, now: float, r: _Req, w: _PrefillWorker) -> None:
        w.queue_tokens -= r.spec.isl
        w.in_flight -= 1
        if w.draining and not w.in_flight and w in self.prefill:
            self.prefill.remove(w)
        self._to_decode(now, r, now + self.config.transfer_s)

    # -- decode ----------------------------------------------------------------------------------
    def _to_decode(self, now: float, r: _Req, first_token_s: float) -> None:
        r.first_token_s = first_token_s
        r.remaining = max(0, r.spec.osl - 1)
        if r.remaining == 0:
            r.done_s = first_token_s
            self.done.append(r)
            return
        self._push(first_token_s, "admit", r)

    def _on_admit(self, now: float, r: _Req) -> None:
        w = self._pick_decode(now)
        if w is None:
            self.decode_queue.append(r)
            return
        self._advance(w, now)
        w.running[r.rid] = r
        self._reschedule(w, now)

    def _pick_decode(self, now: float) -> _DecodeWorker | None:
        ready = [w for w in self.decode if not w.draining and w.ready_s <= now and len(w.running) < self.config.max_batch]
        return min(ready, key=lambda w: len(w.running)) if ready else None

    def _advance(self, w: _DecodeWorker, now: float) -> None:
        if w.running and w.itl_s > 0:
            tokens = (now - w.last_s) / w.itl_s
            for r in w.running.values():
                r.remaining -= tokens
        w.last_s = now

    def _reschedule(self, w: _DecodeWorker, now: float) -> None:
        w.version += 1
        if not w.running:
            w.itl_s = 0.0
            return
        ctx = sum(r.spec.isl + r.spec.osl - r.remaining for r in w.running.values()) / len(w.running)
        w.itl_s = self.profile.decode_itl_ms(len(w.running), ctx) / 1000.0
        soonest = min(r.remaining for r in w.running.values())
        self._push(now + max(0.0, soonest) * w.itl_s, "decoded", w, w.version)

    def _on_decoded(self, now: float, w: _DecodeWorker, version: int) -> None:
        if version != w.version:
            return  # superseded by a later admission or finish
        self._advance(w, now)
        for rid in [rid for rid, r in w.running.items() if r.remaining <= 1e-9]:
            r = w.running.pop(rid)
            r.done_s = now
            self.done.append(r)
        if not w.draining:
            self._take_queued(w)
        if w.draining and not w.running and w in self.decode:
            self.decode.remove(w)
        self._reschedule(w, now)
        if self.decode_queue:
            for other in self.decode:
                if other is not w and not other.draining and other.ready_s <= now:
                    self._fill(other, now)

    def _fill(self, w: _DecodeWorker, now: float) -> None:
        if not self.decode_queue or len(w.running) >= self.config.max_batch:
            return
        self._advance(w, now)
        self._take_queued(w)
        self._reschedule(w, now)

    def _take_queued(self, w: _DecodeWorker) -> None:
        """Admit waiting requests, oldest first, while ``w`` has room in its batch."""
        while self.decode_queue and len(w.running) < self.config.max_batch:
            r = self.decode_queue.popleft()
            w.running[r.rid] = r

    # -- the planner -----------------------------------------------------------------------------
    def _on_tick(self, now: float, since: float) -> None:
        window = [r for r in self.done if since <= r.done_s < now]
        running = [len(w.running) for w in self.decode if w.ready_s <= now]
        m = IntervalMetrics(
            duration_s=now - since,
            num_requests=bisect.bisect_left(self.arrivals, now) - bisect.bisect_left(self.arrivals, since),
            mean_isl=_mean([r.spec.isl for r in window]) or 1.0, mean_osl=_mean([r.spec.osl for r in window]) or 1.0,
            ttft_ms=_mean([1000 * (r.first_token_s - r.spec.arrival_s) for r in window]),
            itl_ms=_mean([1000 * (r.done_s - r.first_token_s) / max(1, r.spec.osl - 1) for r in window]),
            decode_batch=_mean(running) or None)
        d = self.planner.decide_sla(now, m)
        self._resize(self.prefill, d.prefill, now, _PrefillWorker)
        self._resize(self.decode, d.decode, now, _DecodeWorker)
        self.timeline.append({"t": now, "prefill": len([w for w in self.prefill if not w.draining]),
                              "decode": len([w for w in self.decode if not w.draining]),
                              "rate": d.predicted_rate, "reason": d.reason})
        self._push(now + self.config.interval_s, "tick", now)

    def _on_load_tick(self, now: float) -> None:
        decode = [w for w in self.decode if not w.draining and w.ready_s <= now]
        prefill = [w for w in self.prefill if not w.draining and w.ready_s <= now]
        usage = _mean([len(w.running) / self.config.max_batch for w in decode]) or 0.0
        if self.decode_queue:
            usage = 1.0
        queue = sum(w.in_flight for w in prefill) / len(prefill) if prefill else 0.0
        d = self.planner.decide_load(now, LoadSample(usage, queue))
        if d is not None:
            self._resize(self.prefill, d.prefill, now, _PrefillWorker)
            self._resize(self.decode, d.decode, now, _DecodeWorker)
        self._push(now + self.config.load_interval_s, "load_tick")

    def _resize(self, pool: list, target: int, now: float, make) -> None:
        active = [w for w in pool if not w.draining]
        for _ in range(target - len(active)):
            w = make()
            w.ready_s = now + self.config.startup_s
            pool.append(w)
        for w in sorted(active, key=lambda w: -w.ready_s)[:max(0, len(active) - target)]:
            w.draining = True
            busy = w.running if isinstance(w, _DecodeWorker) else w.in_flight
            if not busy:
                pool.remove(w)


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def size_fleet(profile: WorkerProfile, rate: float, isl: int, osl: int, ttft_slo_ms: float, itl_slo_ms: float,
               *, attainment: float = 0.95, duration_s: float = 600.0, max_workers: int = 4096,
               config: SimConfig = SimConfig(), seed: int = 0) -> dict:
    """Fewest prefill, then fewest decode workers whose simulated SLO attainment reaches
    ``attainment`` at a Poisson ``rate``; each pool found by doubling then bisection with the
    other pool oversized so it never limits. Returns the sizes and the final run's summary."""
    reqs = poisson_requests(rate, duration_s, isl, osl, seed)

    def run(p: int, d: int) -> SimResult:
        cfg = dataclasses.replace(config, num_prefill=p, num_decode=d)
        return Simulation(profile, cfg).run(reqs)

    def smallest(ok) -> int | None:
        lo, hi = 0, 1
        while not ok(hi):
            lo, hi = hi, hi * 2
            if hi > max_workers:
                return None
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ok(mid) else (mid, hi)
        return hi

    big_d = max(1, math.ceil(rate * osl * profile.decode_itl_ms(config.max_batch, isl + osl) / 1000 / config.max_batch) * 2 + 1)
    p = smallest(lambda p: _ttft_ok(run(p, big_d), ttft_slo_ms, attainment))
    if p is None:
        return {"prefill": None, "decode": None, "reason": f"no fleet of <= {max_workers} prefill workers meets TTFT"}
    d = smallest(lambda d: run(p, d).attainment(ttft_slo_ms, itl_slo_ms) >= attainment)
    if d is None:
        return {"prefill": p, "decode": None, "reason": f"no fleet of <= {max_workers} decode workers meets ITL"}
    final = run(p, d)
    return {"prefill": p, "decode": d, "attainment": final.attainment(ttft_slo_ms, itl_slo_ms), **final.summary()}


def _ttft_ok(result: SimResult, ttft_slo_ms: float, attainment: float) -> bool:
    ok = sum(1 for t in result.ttft_ms if t <= ttft_slo_ms)
    return bool(result.ttft_ms) and ok / len(result.ttft_ms) >= attainment
