"""Load-adaptive number of speculative tokens: each step, give each request the k (0..k_max)
that maximises the batch's expected output tokens per second. Pure Python.

Model (Leviathan et al. 2023, section 3.1, with i.i.d. acceptance): a request whose drafts are
accepted with probability alpha each emits E(k) = 1 + alpha + ... + alpha^k tokens when k drafts
are verified, so the k-th draft adds alpha^k. A forward of B batched tokens takes t(B) seconds
(StepTimeModel, a line fitted online to the engine's measured steps). The batch emits S tokens
in t(B): greedily add the draft with the largest marginal alpha^(k+1) while
(S + alpha^(k+1)) / t(B + 1) beats S / t(B). Marginals fall with k, so the greedy choice is the
optimum of this model. At low load t barely grows with B and drafts are nearly free; once the
batch saturates the machine each extra token costs ~b seconds and k falls to 0, which is
exactly the plain decode step (never slower, up to the model's error).

Hysteresis: an increment a request already had last step needs only (1 - h) of the gain to be
kept, a new one (1 + h), so k does not flip every step on measurement noise.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


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
    squares over per-B exponential moving averages of measured step times.

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

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens < 1 or seconds <= 0:
            return
        mean, n = self._means.get(num_tokens, (seconds, 0))
        self._means[num_tokens] = (mean + self.ema * (seconds - mean) if n else seconds, n + 1)
        self._fit()

    def _fit(self) -> None:
        pts = [(x, y, min(n, 10)) for x, (y, n) in self._means.items()]
        w = sum(p[2] for p in pts)
        mx = sum(x * n for x, _, n in pts) / w
        my = sum(y * n for _, y, n in pts) / w
        sxx = sum(n * (x - mx) ** 2 for x, _, n in pts)
        b = sum(n * (x - mx) * (y - my) for x, y, n in pts) / sxx if sxx > 0 else self.prior_b
        b = max(b, self.min_slope_fraction * my)  # noise can fit a flat or falling line
        self.a, self.b = max(my - b * mx, 1e-6), b

    def predict(self, num_tokens: int) -> float:
        return self.a + self.b * max(num_tokens, 0)


@dataclass(frozen=True)
class Candidate:
    """A decode row that could verify drafts: up to cap tokens (the proposal's length and the
    request's room), acceptance estimate alpha, the k it had last step (for hysteresis)."""

    request_id: str
    cap: int
    alpha: float
    previous_k: int = 0


def choose_k(candidates: list[Candidate], base_tokens: int, base_rows: int, time_model: StepTimeModel,
             hysteresis: float = 0.05) -> dict[str, int]:
    """k per candidate maximising expected tokens per second (see the module docstring).

    base_tokens: tokens of the step without any draft (every decode row + prefill chunks);
    base_rows: decode rows of the step (each emits one token with k = 0).
    """
    ks = {c.request_id: 0 for c in candidates}
    heap = [(-c.alpha, 1, i, c) for i, c in enumerate(candidates) if c.cap > 0 and c.alpha > 0]
    heapq.heapify(heap)
    tokens, batch = float(max(base_rows, 1)), max(base_tokens, 1)
    while heap:
        neg_gain, k, i, c = heapq.heappop(heap)
        gain = -neg_gain
        margin = (1 - hysteresis) if k <= c.previous_k else (1 + hysteresis)
        if (tokens + gain) / time_model.predict(batch + 1) <= margin * tokens / time_model.predict(batch):
            continue  # this row's later drafts gain even less
        tokens, batch, ks[c.request_id] = tokens + gain, batch + 1, k
        if k < c.cap:
            heapq.heappush(heap, (-gain * c.alpha, k + 1, i, c))
    return ks
