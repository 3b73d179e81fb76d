"""How long one leg of a request may take on its worker before the router gives up on that worker.

A leg's timeout comes from the work it is doing, not from the request's deadline (600 s by
default), so a stopped or wedged worker is noticed in seconds:

    prefill (P.Prefill, or the first chunk of a local D.Generate):
        floor_s + slack * queued_tokens * s_per_token
      queued_tokens: the prompt tokens the router has booked on that worker before their first
      token (its queue, this request included); s_per_token: that worker's measured seconds per
      queued prompt token (an EWMA over its finished prefills: elapsed / queued_tokens at dispatch,
      so batching and queueing are in the figure), `default_s_per_token` until one finished.
    decode (the wait for each following chunk of a Decode or Generate stream):
        floor_s + slack * chunk_gap_s
      chunk_gap_s: that worker's measured gap between chunks (EWMA), `default_gap_s` before any.

A leg past its timeout is treated as a lost worker: a prefill is aborted and tried elsewhere, a
decode stream is migrated (router/orchestrator.py) — unless the worker answers its Stats polls
with other requests running or waiting (ours is queued behind them) and its engine is making
progress. Progress is its Stats' ``engine_steps`` counter; a busy worker whose counter has not
moved for the stall bound is wedged inside a step and counts as lost:
    stall (the longest one engine step may take):
        floor_s + slack * max_step_tokens * s_per_token
      max_step_tokens: the most tokens one step of that worker computes (WorkerInfo: its
      --max-num-batched-tokens, or the idle budget when larger); s_per_token as for prefill (it
      includes queueing, so the bound errs long). Serve defaults, unmeasured: 5 + 4 x 2048 x
      0.005 = 46 s; measured at ~400 prompt tokens/s (fp32, one thread): 5 + 4 x 2048 / 400 = 25 s.
The request's own deadline still bounds every leg. Pure: no I/O, no clock; the orchestrator
measures and passes seconds in.
"""

from __future__ import annotations

from dataclasses import dataclass


DEFAULT_STEP_TOKENS = 2048  # a worker that does not report its step budget: serve's idle budget


@dataclass(frozen=True)
class LegTimeouts:
    """floor_s: the least any leg gets (an RPC, one slow step on a loaded host); slack: the
    multiple of the predicted time a leg may take; default_*: the predictions before a worker
    has been measured (200 prompt tokens/s, 0.5 s between chunks: slow for this CPU model)."""

    floor_s: float = 5.0
    slack: float = 4.0
    default_s_per_token: float = 0.005
    default_gap_s: float = 0.5

    def __post_init__(self) -> None:
        for name in ("floor_s", "slack", "default_s_per_token", "default_gap_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    def prefill_s(self, rate: "WorkRate", queued_tokens: int) -> float:
        """Seconds a prefill of a worker with `queued_tokens` booked (ours included) may take."""
        spt = rate.s_per_token if rate.s_per_token is not None else self.default_s_per_token
        return self.floor_s + self.slack * max(queued_tokens, 1) * spt

    def stall_s(self, rate: "WorkRate", max_step_tokens: int) -> float:
        """Seconds a busy worker's engine may go without completing a step (one step of
        `max_step_tokens`, at its measured prefill speed, with slack); 0 tokens (not reported)
        counts as DEFAULT_STEP_TOKENS."""
        return self.prefill_s(rate, max_step_tokens or DEFAULT_STEP_TOKENS)

    def chunk_s(self, rate: "WorkRate") -> float:
        """Seconds to wait for the next chunk of a decode stream."""
        gap = rate.chunk_gap_s if rate.chunk_gap_s is not None else self.default_gap_s
        return self.floor_s + self.slack * gap


@dataclass
class WorkRate:
    """One worker's measured speed, as exponentially weighted moving averages (weight `alpha`
    for the newest sample)."""

    s_per_token: float | None = None   # prefill: seconds per queued prompt token
    chunk_gap_s: float | None = None   # decode: seconds between stream chunks
    alpha: float = 0.2

    def observe_prefill(self, queued_tokens: int, seconds: float) -> None:
        self.s_per_token = self._mix(self.s_per_token, seconds / max(queued_tokens, 1))

    def observe_gap(self, seconds: float) -> None:
        self.chunk_gap_s = self._mix(self.chunk_gap_s, seconds)

    def _mix(self, old: float | None, sample: float) -> float:
        return sample if old is None else (1 - self.alpha) * old + self.alpha * sample
