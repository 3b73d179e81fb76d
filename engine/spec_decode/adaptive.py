"""Load-adaptive number of speculative tokens: each step, give each request the k (0..k_max)
that maximises the batch's expected output tokens per second. Pure Python.

Model (Leviathan et al. 2023, section 3.1, with i.i.d. acceptance): a request whose drafts are
accepted with probability alpha each emits E(k) = 1 + alpha + ... + alpha^k tokens when k drafts
are verified, so the k-th draft adds alpha^k. A forward of B batched tokens takes t(B) = a + b B
seconds (StepTimeModel, a line fitted online to the engine's measured steps). The batch's S
decode rows emit S tokens in t(B); one more draft with marginal gain g pays iff
(S + g) / t(B + 1) > S / t(B), i.e. g > S (t(B + 1) / t(B) - 1) =: the draft's cost in tokens.
Greedily adding the draft with the largest marginal alpha^(k+1) while it pays is the optimum of
this model (marginals fall with k). At low load t barely grows with B and drafts are nearly
free; once the batch saturates the machine each extra token costs ~b seconds and k falls to 0,
which is exactly the plain decode step (never slower, up to the model's error).

B counts the step's decode rows and drafts only, not its prefill tokens: over a closed loop the
prefill work is the same with or without speculation, and what speculation saves is steps (a
each per row emitted); with the c decode rows alone, k = 1 pays iff alpha > b c / (a + b c),
which is exactly when T = steps x a + b x tokens falls. Counting prefill tokens in t(B) would
make drafts look cheaper than they are (the scheduler also gives drafts only the budget the
prefill chunks leave, engine/scheduler.py, so they never displace prefill work).

A draft model adds its own forwards: a step whose deepest row drafts m tokens runs m draft
forwards (batched over the rows) before the target's, each d = ratio x t(rows) seconds
(DraftCost, the ratio learned online from the measured draft forwards). So an increment that
deepens the step (k > every other row's) also pays d, one that does not rides along for free;
at c rows a first draft pays ratio x t(c) + b: a draft costing 0.75 of a target step is refused
unless alpha is near 1 (and at any load beyond one row). n-gram proposals cost nothing (d = 0).

Hysteresis on the margin: an increment a request already had last step is kept while its gain
is at least (1 - h) of its cost, a new one needs (1 + h), so k does not flip every step on
measurement noise; a kept draft can lose at most h of one token's cost, never a share of the
whole batch's throughput. The wide margin h is for the first draft only, where a switch has a
cost of its own (a request's drafting starts: a draft model's prefill or catch-up of its
context). A deeper draft chooses between two depths of nearly equal value, where flipping costs
nothing, so its margin is narrow (h_deep): with the wide one, the int8 self-draft at c1
(acceptance 0.95, draft/target ratio 0.59, measured) never went past k = 1, its second draft
gaining 1.19x its cost against the 1.2x start margin, which left ~5% of its speed unused.
"""

from __future__ import annotations

import heapq
import statistics
from collections import deque
from dataclasses import dataclass, field


HYSTERESIS = 0.2
"""Keep a first draft while its gain is >= (1 - h) x its cost; start one only at >= (1 + h) x."""
DEEP_HYSTERESIS = 0.05
"""The same for the second and later drafts of a row (the module docstring: why narrower)."""


@dataclass
class AcceptanceRate:
    """Running estimate of the per-draft acceptance probability, with exponential forgetting.

    A verification of k drafts with a accepted observes a successes and, if a < k, one failure
    (the drafts after the first rejection are not observed). Starts at prior (weight prior_weight).
    """

    prior: float = 0.5
    prior_weight: float = 2.0
    decay: float = 0.9
    accepted: float = field(init=False)
    trials: float = field(init=False)

    def __post_init__(self) -> None:
        self.accepted, self.trials = self.prior * self.prior_weight, self.prior_weight

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts <= 0:
            return
        failures = 1 if num_accepted < num_drafts else 0
        self.accepted = self.decay * self.accepted + num_accepted
        self.trials = self.decay * self.trials + num_accepted + failures

    @property
    def value(self) -> float:
        return self.accepted / self.trials


class StepTimeModel:
    """t(B) = a + b * B seconds for one step of B batched tokens, fitted by weighted least
    squares over per-B exponential moving averages of measured step times (weight: the
    observations of that B, at most 10). The sums of the fit are kept up to date per
    observation, so an observation costs O(1) however many step sizes were seen.

    Until steps of at least two different sizes were seen, the prior slope is used (its
    intercept moved to the measured mean). The slope is kept >= min_slope_fraction * a, so a
    noisy fit never makes extra tokens look free.
    """

    def __init__(self, prior_a: float = 0.015, prior_b: float = 0.0012, ema: float = 0.2,
                 min_slope_fraction: float = 0.005) -> None:
        self.a, self.b = prior_a, prior_b
        self.prior_b = prior_b
        self.ema = ema
        self.min_slope_fraction = min_slope_fraction
        self._means: dict[int, tuple[float, int]] = {}  # B -> (EMA seconds, observations)
        self._sums = [0.0] * 5  # sum of w, w x, w y, w x^2, w x y over the per-B points

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens < 1 or seconds <= 0:
            return
        mean, n = self._means.get(num_tokens, (seconds, 0))
        if n:
            self._add(num_tokens, mean, min(n, 10), -1.0)
            mean += self.ema * (seconds - mean)
        self._means[num_tokens] = (mean, n + 1)
        self._add(num_tokens, mean, min(n + 1, 10), 1.0)
        self._fit()

    def _add(self, x: float, y: float, w: float, sign: float) -> None:
        for i, v in enumerate((w, w * x, w * y, w * x * x, w * x * y)):
            self._sums[i] += sign * v

    def _fit(self) -> None:
        w, wx, wy, wxx, wxy = self._sums
        mx, my = wx / w, wy / w
        sxx = wxx - w * mx * mx
        # sxx is a difference of large sums: below ~1e-9 relative it is rounding, not spread
        b = (wxy - w * mx * my) / sxx if sxx > 1e-9 * max(wxx, 1.0) else self.prior_b
        b = max(b, self.min_slope_fraction * my)  # noise can fit a flat or falling line
        self.a, self.b = max(my - b * mx, 1e-6), b

    def predict(self, num_tokens: int) -> float:
        return self.a + self.b * max(num_tokens, 0)


class DraftCost:
    """Seconds of one draft-model forward over R rows, d(R) = ratio x t(R) with t the target's
    StepTimeModel. Each observation is one step's draft forward (seconds per forward) over the
    target's forward of the *same step*, brought to R tokens by the model's t(R) / t(B): both
    were timed under the same load, so the shared machine's load drift (3x within minutes here)
    cancels instead of landing in the ratio. ``ratio`` is the median of the last ``window``
    observations: a warm-up forward or a load spike (a draft forward of 97 ms against a 35 ms
    target step, measured) moves it by one rank, not by a fifth of its size, so one bad sample
    cannot make drafting look unprofitable forever (an idle speculator measures nothing more).
    Starts at ``prior_ratio`` (optimistic, so speculation is tried and measured)."""

    def __init__(self, prior_ratio: float = 0.5, window: int = 9) -> None:
        self.ratio, self.observations = prior_ratio, 0
        self._recent: deque[float] = deque(maxlen=window)

    def observe(self, seconds_per_forward: float, rows: int, time_model: StepTimeModel,
                step_seconds: float | None = None, step_tokens: int | None = None) -> None:
        """step_seconds / step_tokens: the same step's target forward (seconds, batched tokens);
        without them the target side is the model's t(rows)."""
        if seconds_per_forward <= 0 or rows < 1:
            return
        target = time_model.predict(rows)
        if step_seconds and step_seconds > 0 and step_tokens:
            target = step_seconds * target / time_model.predict(step_tokens)
        self._recent.append(seconds_per_forward / target)
        self.ratio = statistics.median(self._recent)
        self.observations += 1

    def predict(self, rows: int, time_model: StepTimeModel) -> float:
        return self.ratio * time_model.predict(rows)


@dataclass(frozen=True)
class Candidate:
    """A decode row that could verify drafts: up to cap tokens (the proposal's length and the
    request's room), acceptance estimate alpha, the k it had last step (for hysteresis)."""

    request_id: str
    cap: int
    alpha: float
    previous_k: int = 0


def draft_cost(step_tokens: float, seconds: float, seconds_after: float) -> float:
    """Output tokens an increment must add to keep the step's tokens per second: S (t' / t - 1)
    for a step expected to emit S tokens in t seconds, t' with the increment."""
    return step_tokens * (seconds_after / seconds - 1)


def choose_k(candidates: list[Candidate], base_tokens: int, base_rows: int, time_model: StepTimeModel,
             hysteresis: float = HYSTERESIS, draft_forward_s: float = 0.0,
             deep_hysteresis: float = DEEP_HYSTERESIS) -> dict[str, int]:
    """k per candidate maximising expected tokens per second (see the module docstring).

    base_tokens: tokens of the step without any draft (its decode rows); base_rows: decode rows
    of the step (each emits one token with k = 0); draft_forward_s: seconds of one draft-model
    forward over these rows (0 for a proposer without a model).
    """
    ks = {c.request_id: 0 for c in candidates}
    heap = [(-c.alpha, 1, i, c) for i, c in enumerate(candidates) if c.cap > 0 and c.alpha > 0]
    heapq.heapify(heap)
    tokens, batch, depth = float(max(base_rows, 1)), max(base_tokens, 1), 0
    seconds = time_model.predict(batch)
    while heap:
        neg_gain, k, i, c = heapq.heappop(heap)
        gain = -neg_gain
        h = hysteresis if k == 1 else deep_hysteresis
        margin = (1 - h) if k <= c.previous_k else (1 + h)
        after = time_model.predict(batch + 1) + max(depth, k) * draft_forward_s
        if gain <= margin * draft_cost(tokens, seconds, after):
            continue  # this row's later drafts gain even less
        tokens, batch, depth, seconds, ks[c.request_id] = tokens + gain, batch + 1, max(depth, k), after, k
        if k < c.cap:
            heapq.heappush(heap, (-gain * c.alpha, k + 1, i, c))
    return ks
