"""The SLA planner: how many prefill and decode workers, decided from a profile and metrics.

Pure decision logic (no Ray, no Prometheus, no clock of its own): actuation lives in
``deploy/`` and calls ``decide_sla`` every ``interval_s`` and ``decide_load`` more often.

Two loops, after NVIDIA Dynamo's SLA planner:

1. **SLA loop** (every interval). Predict the next interval's request rate, ISL and OSL (a
   load predictor: constant or moving average), correct the profile by what was observed, and
   size each pool::

       p_corr   = observed TTFT / profiled TTFT(ISL)
       d_corr   = observed ITL  / profiled ITL(observed batch, context)
       prefill  = ceil(rate × ISL × min(1, p_corr) / (u × profiled prefill tokens/s per worker at ISL))
       decode   = ceil(rate × OSL / best profiled decode tokens/s per worker whose ITL meets
                       u × ITL_SLO / d_corr at context ISL + OSL / 2)

    with ``u`` the planned utilization (1 = Dynamo's formulas exactly): ``prefill_sizing =
    "throughput"``. The default, ``"queueing"``, sizes the prefill pool by the wait its TTFT SLO
    allows instead of a fixed ``u``: the fewest workers whose Erlang-C waiting time stays within
    ``TTFT_SLO - profiled TTFT(ISL)`` for all but ``ttft_tail`` of the requests at the offered
    load ``rate × ISL × min(1, p_corr) / tokens/s per worker`` (planner/queueing.py). A fixed
    ``u`` = 0.85 wastes a worker in seven on a large pool, whose Poisson bursts are relatively
    small, and is too little on a small one.

   The rate sized for is the larger of the next interval's prediction and the prediction
   ``1 + startup_s / interval_s`` intervals ahead: a replica asked for now is ready only after
   ``startup_s``, and must carry the load until the next decision's replicas are ready.

2. **Load loop** (fast, up only). Decode KV-cache usage and prefill queue depth per worker
   against high water marks: one more worker when a mark is crossed for ``patience`` samples in
   a row, with a cooldown. It never shrinks a pool: low KV usage says nothing about throughput
   (a pool of short requests is busy at 5% usage), so scale-down is the SLA loop's, with its
   hysteresis. (The low marks are kept for the simulator's and operators' views.)

Targets are absolute replica counts: replicas that are still starting count toward them (the
actuator adds ``target - (ready + starting)``), so a pending start is never asked for twice and
the planner keeps deciding while replicas are pending. Scale-down waits for ``patience``
consecutive intervals below the current size and a cooldown, and shrinks only to the size that
serves the predicted load times (1 + margin) (hysteresis: a noisy constant load never flaps).
The margin is ``down_margin`` when set; by default it is measured: ``MARGIN_Z`` standard
deviations of the rate predictor's relative error over its last ``ERROR_WINDOW`` intervals (how
far the load really strays from what was predicted, noise and lag together), estimated robustly
as 1.4826 × the median absolute error, so that one surprise (a step in the load) does not hold
the band open; ``DEFAULT_MARGIN`` until ``MIN_ERRORS`` intervals were seen. A fixed 20% held a worker or two too many through a whole
smooth descent, and is too little for a load noisier than that. A manual change (``adopt``) becomes the new baseline: the planner holds it for a
cooldown instead of fighting it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from collections import deque

from planner.predictor import make_predictor
from planner.profile import WorkerProfile
from planner.queueing import servers_for_wait

MAX_CORRECTION = 2.0
MARGIN_Z = 2.0          # the measured margin covers about 97.7% of one-sided prediction errors
ERROR_WINDOW = 8        # intervals of prediction error it is measured over
MIN_ERRORS = 3          # fewer measured errors: DEFAULT_MARGIN
DEFAULT_MARGIN = 0.2
PREFILL_SIZINGS = ("queueing", "throughput")


@dataclass(frozen=True)
class PlannerConfig:
    """SLOs in ms; bounds on each pool; the load loop's water marks (KV usage 0..1, waiting
    prefill requests per prefill worker); cooldowns in seconds; patience in samples/intervals;
    down_margin: a pool shrinks only to the size that would still serve (1 + down_margin) × the
    predicted load (a dead band between the scale-up and scale-down sizes); None = measured from
    the predictor's recent errors (see the module doc); utilization: the share of a worker's
    profiled capacity the sizing plans to use (the ITL target as a share of the SLO; prefill
    tokens/s too with prefill_sizing "throughput"), headroom for bursts within an interval;
    prefill_sizing: "queueing" (the TTFT SLO's wait budget, Erlang C) or "throughput"
    (Dynamo's formula with utilization); ttft_tail: the share of requests whose queueing for a
    prefill may exceed the wait budget at the predicted rate; startup_s: a new replica's time to
    ready (seconds), how far ahead the pool is sized."""

    ttft_slo_ms: float
    itl_slo_ms: float
    interval_s: float = 60.0
    min_prefill: int = 1
    max_prefill: int = 8
    min_decode: int = 1
    max_decode: int = 8
    predictor: str = "moving-average"
    kv_high: float = 0.85
    kv_low: float = 0.30
    queue_high: float = 4.0
    queue_low: float = 0.5
    patience: int = 2
    cooldown_up_s: float = 30.0
    cooldown_down_s: float = 120.0
    down_margin: float | None = None
    utilization: float = 0.85
    prefill_sizing: str = "queueing"
    ttft_tail: float = 0.01
    startup_s: float = 0.0

    def __post_init__(self) -> None:
        if self.ttft_slo_ms <= 0 or self.itl_slo_ms <= 0:
            raise ValueError("SLOs must be > 0 ms")
        if not 0 <= self.min_prefill <= self.max_prefill or not 1 <= self.min_decode <= self.max_decode:
            raise ValueError("bounds: need 0 <= min_prefill <= max_prefill and 1 <= min_decode <= max_decode")
        if not 0 <= self.kv_low < self.kv_high <= 1 or not 0 <= self.queue_low < self.queue_high:
            raise ValueError("water marks: low must be below high (KV usage within [0, 1])")
        if not 0 < self.utilization <= 1:
            raise ValueError("utilization must be in (0, 1]")
        if self.interval_s <= 0 or self.patience < 1:
            raise ValueError("interval_s must be > 0 and patience >= 1")
        if self.prefill_sizing not in PREFILL_SIZINGS:
            raise ValueError(f"prefill_sizing must be one of {', '.join(PREFILL_SIZINGS)}, got {self.prefill_sizing!r}")
        if not 0 < self.ttft_tail < 1 or self.startup_s < 0 or (self.down_margin is not None and self.down_margin < 0):
            raise ValueError("need 0 < ttft_tail < 1, startup_s >= 0 and down_margin >= 0 (or None)")


@dataclass(frozen=True)
class IntervalMetrics:
    """What one SLA interval observed (from the router's and workers' Prometheus series).

    num_requests: requests that arrived; mean_isl / mean_osl: their prompt and output tokens;
    ttft_ms / itl_ms: observed means (None when nothing finished); decode_batch: mean running
    requests per decode worker (None = unknown: ITL correction off)."""

    duration_s: float
    num_requests: int
    mean_isl: float
    mean_osl: float
    ttft_ms: float | None = None
    itl_ms: float | None = None
    decode_batch: float | None = None


@dataclass(frozen=True)
class LoadSample:
    """decode_kv_usage: mean KV-cache usage of the decode pool (0..1); prefill_queue: waiting
    prefill requests per prefill worker."""

    decode_kv_usage: float
    prefill_queue: float


@dataclass(frozen=True)
class Replicas:
    ready: int
    starting: int = 0

    @property
    def counted(self) -> int:
        """What counts toward a target: ready and starting replicas (draining ones do not)."""
        return self.ready + self.starting


@dataclass(frozen=True)
class Decision:
    """Target replica counts and why; ``loop`` is "sla", "load", "manual" or "hold"."""

    prefill: int
    decode: int
    loop: str
    reason: str
    p_corr: float = 1.0
    d_corr: float = 1.0
    predicted_rate: float = 0.0


@dataclass
class _PoolState:
    target: int
    last_up: float = -math.inf
    last_down: float = -math.inf
    below_sla: int = 0        # consecutive SLA intervals whose target was below the current one
    high: int = 0             # consecutive load samples over the high mark
    low: int = 0              # ... under the low mark


@dataclass
class SlaPlanner:
    """Holds the predictors and each pool's target; every method takes ``now`` (seconds)."""

    config: PlannerConfig
    profile: WorkerProfile
    prefill: _PoolState = field(init=False)
    decode: _PoolState = field(init=False)
    last: Decision | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        c = self.config
        self.prefill = _PoolState(c.min_prefill)
        self.decode = _PoolState(c.min_decode)
        self._rate, self._isl, self._osl = (make_predictor(c.predictor) for _ in range(3))
        self._expected: float | None = None     # the rate predicted for the interval now observed
        self._errors: deque[float] = deque(maxlen=ERROR_WINDOW)  # its relative errors

    # -- the SLA loop ----------------------------------------------------------------------------
    def decide_sla(self, now: float, m: IntervalMetrics) -> Decision:
        """Size both pools for the next interval from this one's metrics."""
        c, prof = self.config, self.profile
        observed = m.num_requests / m.duration_s
        if self._expected:
            self._errors.append((observed - self._expected) / self._expected)
        self._rate.add(observed)
        if m.num_requests > 0:
            self._isl.add(m.mean_isl)
            self._osl.add(m.mean_osl)
        self._expected = self._rate.predict(1.0)
        rate = max(self._expected, self._rate.predict(1.0 + c.startup_s / c.interval_s))
        isl, osl = self._isl.predict() or 1.0, self._osl.predict() or 1.0
        margin = self.margin()
        p_corr = m.ttft_ms / prof.prefill_ttft_ms(isl) if m.ttft_ms else 1.0
        d_corr = 1.0
        if m.itl_ms and m.decode_batch:
            d_corr = m.itl_ms / prof.decode_itl_ms(m.decode_batch, isl + osl / 2)
        # One interval's queueing (a burst handed over by a prefill pool that just grew) can
        # inflate the observed ITL many-fold; clamped, a correction moves a pool by at most 2x.
        d_corr = min(MAX_CORRECTION, max(1 / MAX_CORRECTION, d_corr))
        want_p = self._prefill_workers(rate * isl * min(1.0, p_corr), isl)
        keep_p = self._prefill_workers(rate * isl * min(1.0, p_corr) * (1 + margin), isl)
        itl_target = c.itl_slo_ms * c.utilization
        per_decode = prof.best_decode_tokens_per_s(itl_target / d_corr, isl + osl / 2)
        notes = []
        if per_decode <= 0 < prof.best_decode_tokens_per_s(itl_target, isl + osl / 2):
            # Observed ITL far above the profile (queueing behind an overloaded pool, a noisy
            # neighbour): a correction that makes the SLO unreachable would ask for the maximum
            # pool at once; size for the uncorrected SLO instead and say so.
            per_decode = prof.best_decode_tokens_per_s(itl_target, isl + osl / 2)
            notes.append(f"d_corr {d_corr:.2f} makes the ITL SLO unreachable: sized on the uncorrected SLO")
        if per_decode <= 0:
            want_d = keep_d = c.max_decode
            notes.append(f"ITL SLO {c.itl_slo_ms:g} ms (corrected {c.itl_slo_ms / d_corr:.1f}) is below the "
                         f"profile's batch-1 ITL: decode at its maximum")
        else:
            want_d = math.ceil(rate * osl / per_decode)
            keep_d = math.ceil(rate * osl * (1 + margin) / per_decode)
        if prof.prefill_ttft_ms(isl) > c.ttft_slo_ms:
            notes.append(f"TTFT SLO {c.ttft_slo_ms:g} ms is below one request's prefill "
                         f"({prof.prefill_ttft_ms(isl):.0f} ms at ISL {isl:.0f}): no pool size meets it")
        p = self._sla_step(self.prefill, want_p, keep_p, c.min_prefill, c.max_prefill, now)
        d = self._sla_step(self.decode, want_d, keep_d, c.min_decode, c.max_decode, now)
        reason = (f"rate {rate:.2f} req/s, ISL {isl:.0f}, OSL {osl:.0f}, p_corr {p_corr:.2f}, d_corr {d_corr:.2f}, "
                  f"margin {100 * margin:.0f}%: "
                  f"needs prefill {want_p}, decode {want_d}" + "".join(f"; {n}" for n in notes))
        self.last = Decision(p, d, "sla", reason, p_corr, d_corr, rate)
        return self.last

    def margin(self) -> float:
        """The scale-down dead band: down_margin, or MARGIN_Z × the relative prediction error's
        robust standard deviation (1.4826 × median absolute error: exact for normal errors)."""
        if self.config.down_margin is not None:
            return self.config.down_margin
        if len(self._errors) < MIN_ERRORS:
            return DEFAULT_MARGIN
        return MARGIN_Z * 1.4826 * statistics.median(abs(e) for e in self._errors)

    def _prefill_workers(self, tokens_per_s: float, isl: float) -> int:
        """Prefill workers for ``tokens_per_s`` prompt tokens/s of prompts of ``isl`` tokens."""
        c, prof = self.config, self.profile
        per_worker = prof.prefill_tokens_per_s(isl)
        budget_s = (c.ttft_slo_ms - prof.prefill_ttft_ms(isl)) / 1000
        if tokens_per_s <= 0:
            return 0
        if c.prefill_sizing == "throughput" or budget_s <= 0:  # no wait fits the SLO: the formula's size
            return math.ceil(tokens_per_s / (per_worker * c.utilization))
        return servers_for_wait(tokens_per_s / per_worker, isl / per_worker, budget_s, c.ttft_tail)

    def _sla_step(self, pool: _PoolState, want: int, keep: int, lo: int, hi: int, now: float) -> int:
        """Grow to ``want`` at once; shrink to ``keep`` (the size with the margin) only after
        ``patience`` intervals below and the cooldown."""
        want, keep = min(hi, max(lo, want)), min(hi, max(lo, keep))
        if want > pool.target:
            pool.target, pool.last_up, pool.below_sla = want, now, 0
        elif keep < pool.target:
            pool.below_sla += 1
            if pool.below_sla >= self.config.patience and now - pool.last_down >= self.config.cooldown_down_s \
                    and now - pool.last_up >= self.config.cooldown_down_s:
                pool.target, pool.last_down, pool.below_sla = keep, now, 0
        else:
            pool.below_sla = 0
        return pool.target

    # -- the load loop ---------------------------------------------------------------------------
    def decide_load(self, now: float, s: LoadSample) -> Decision | None:
        """One step up on a crossed high water mark; None when nothing changes."""
        c = self.config
        moved = []
        for name, pool, value, high, low, lo, hi in (
                ("decode", self.decode, s.decode_kv_usage, c.kv_high, c.kv_low, c.min_decode, c.max_decode),
                ("prefill", self.prefill, s.prefill_queue, c.queue_high, c.queue_low, c.min_prefill, c.max_prefill)):
            step = self._load_step(pool, value, high, low, lo, hi, now)
            if step:
                moved.append(f"{name} {'+' if step > 0 else '-'}1 ({value:.2f} vs marks {low:g}/{high:g})")
        if not moved:
            return None
        self.last = Decision(self.prefill.target, self.decode.target, "load", ", ".join(moved))
        return self.last

    def _load_step(self, pool: _PoolState, value: float, high: float, low: float, lo: int, hi: int,
                   now: float) -> int:
        c = self.config
        pool.high = pool.high + 1 if value > high else 0
        pool.low = pool.low + 1 if value < low else 0
        if pool.high >= c.patience and pool.target < hi and now - pool.last_up >= c.cooldown_up_s:
            pool.target, pool.last_up, pool.high = pool.target + 1, now, 0
            return 1
        return 0

    # -- manual operations -----------------------------------------------------------------------
    def adopt(self, now: float, prefill: int, decode: int) -> Decision:
        """An operator set the pools by hand (``pdserve scale``): that is the new baseline, held
        for the scale-down cooldown before the planner shrinks it."""
        c = self.config
        for pool, n in ((self.prefill, prefill), (self.decode, decode)):
            pool.target, pool.last_up, pool.last_down = n, now, now
            pool.below_sla = pool.high = pool.low = 0
        self.last = Decision(prefill, decode, "manual",
                             f"adopted manual prefill {prefill}, decode {decode} (bounds "
                             f"{c.min_prefill}-{c.max_prefill}, {c.min_decode}-{c.max_decode})")
        return self.last

    @staticmethod
    def to_add(target: int, replicas: Replicas) -> int:
        """Replicas to start (> 0) or drain (< 0) to reach ``target``: starting ones already count."""
        return target - replicas.counted
