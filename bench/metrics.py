"""Per-request records and their aggregation into the serving figures. Pure: numpy only, no I/O.

Definitions (client side, as ``vllm bench serve``):
- TTFT: request sent -> first token received.
- ITL: every gap between two consecutive streamed chunks that carry text.
- TPOT: (E2E latency - TTFT) / (output tokens - 1), per request with >= 2 output tokens.
- E2E latency (e2el): request sent -> last byte of the stream.
Failed requests count in ``failed`` and in nothing else: no latency, no tokens.
Goodput (DistServe, Zhong et al., OSDI 2024): completed requests that meet every SLO, per second;
SLO attainment: the fraction of all requests (failed included) that do.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from engine.errors import UserError

# The latency figures and their reported statistics; keys read e.g. "p99_ttft_ms".
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
STATS = ("mean", "median", "std", "p90", "p99")
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    """One request's measured outcome. Times in seconds; ``start_s`` is relative to the run's start.

    output_tokens_source: "usage" (the target's count), "tokenizer" (text re-tokenized), or
    "chunks" (one token per streamed chunk: a last resort when neither is available).
    """

    index: int
    success: bool
    start_s: float = 0.0
    prompt_len: int | None = None
    output_tokens: int = 0
    output_tokens_source: str = "usage"
    ttft_s: float | None = None
    e2el_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    generated_text: str = ""
    error: str = ""
    server_ttft_s: float | None = None  # the target's own TTFT, where it reports one (pdserve-grpc)

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None for failed or single-token requests."""
        if not self.success or self.output_tokens < 2 or self.ttft_s is None or self.e2el_s is None:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["tpot_s"] = self.tpot_s
        return d


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in milliseconds; None means no objective on that figure."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, spec: str | None) -> "SLO | None":
        """``"ttft:200,tpot:50"`` -> SLO(ttft_ms=200, tpot_ms=50). Raises UserError on a bad spec."""
        if not spec:
            return None
        values: dict[str, float] = {}
        for part in spec.split(","):
            name, _, ms = part.strip().partition(":")
            if name not in SLO_METRICS:
                raise UserError(f"--slo: unknown metric {name!r} in {spec!r}; use {', '.join(SLO_METRICS)} (e.g. ttft:200,tpot:50)")
            try:
                values[f"{name}_ms"] = float(ms)
            except ValueError:
                raise UserError(f"--slo: {part!r} needs a number of milliseconds, e.g. ttft:200") from None
            if values[f"{name}_ms"] <= 0:
                raise UserError(f"--slo: {part!r} must be positive")
        return cls(**values)

    def met_by(self, r: RequestRecord) -> bool:
        """True if ``r`` completed and meets every objective (a single-token request has no TPOT to miss)."""
        if not r.success:
            return False
        checks = ((self.ttft_ms, r.ttft_s), (self.tpot_ms, r.tpot_s), (self.e2el_ms, r.e2el_s))
        return all(limit is None or value is None or value * 1000.0 <= limit for limit, value in checks)

    def to_json(self) -> dict[str, float]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def _stats(values_s: Sequence[float], name: str) -> dict[str, float | None]:
    """mean/median/std/p90/p99 of ``values_s`` (seconds) in ms, keyed ``{stat}_{name}_ms``; None if empty."""
    if len(values_s) == 0:
        return {f"{s}_{name}_ms": None for s in STATS}
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    return {
        f"mean_{name}_ms": float(a.mean()),
        f"median_{name}_ms": float(np.median(a)),
        f"std_{name}_ms": float(a.std()),
        f"p90_{name}_ms": float(np.percentile(a, 90)),
        f"p99_{name}_ms": float(np.percentile(a, 99)),
    }


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO | None = None) -> dict[str, Any]:
    """The run's figures under ``vllm bench serve``'s JSON names, plus ``slo_attainment``.

    duration_s: wall time from the first request sent to the last one finished (warm-up excluded).
    request_goodput and slo_attainment are None when no SLO is given.
    """
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_len or 0 for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    dur = max(duration_s, 1e-9)
    out: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "request_goodput": None,
        "slo_attainment": None,
    }
    if slo is not None:
        good = sum(slo.met_by(r) for r in records)
        out["request_goodput"] = good / dur
        out["slo_attainment"] = good / len(records) if records else None
    out.update(_stats([r.ttft_s for r in ok if r.ttft_s is not None], "ttft"))
    out.update(_stats([t for r in ok if (t := r.tpot_s) is not None], "tpot"))
    out.update(_stats([g for r in ok for g in r.itl_s], "itl"))
    out.update(_stats([r.e2el_s for r in ok if r.e2el_s is not None], "e2el"))
    if server_ttfts := [r.server_ttft_s for r in ok if r.server_ttft_s is not None]:
        # Client TTFT minus this is what the network and the front end add.
        out["mean_server_ttft_ms"] = 1000.0 * float(np.mean(server_ttfts))
        out["median_server_ttft_ms"] = 1000.0 * float(np.median(server_ttfts))
    return out


def goodput_rate(points: Iterable[tuple[float, float | None]], target: float = 0.9) -> float | None:
    """DistServe-style goodput of a rate sweep: the highest request rate whose SLO attainment is
    >= ``target`` with every lower swept rate meeting it too (so one lucky point above a failing
    one does not count). ``points``: (rate req/s, attainment in [0, 1] or None). None if no rate qualifies.
    """
    best = None
    for rate, attainment in sorted(points, key=lambda p: p[0]):
        if attainment is None or attainment < target:
            break
        best = rate
    return best


def finite_or_none(x: float) -> float | None:
    """JSON has no infinity: an infinite request rate is written as null."""
    return None if math.isinf(x) else x
