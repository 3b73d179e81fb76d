"""A measured worker profile and the interpolations the planner and the simulator read from it.

Written by ``pdserve profile`` (one prefill worker and one decode worker of the model, on the
machine and device they ran on) or by hand from published figures. Pure Python.

- prefill: per input length (ISL, tokens), the time to first token of one request alone
  (ms) and the prefill throughput of one worker (prompt tokens/s).
- decode: per (batch size, context length), the inter-token latency (ms per decode step) and
  the output throughput of one worker (tokens/s = batch / ITL).

Interpolation is piecewise linear (clamped at the ends), in ISL for prefill and bilinear in
(batch, context) for decode — the method of NVIDIA Dynamo's SLA planner, which reads the same
two tables.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence


@dataclass(frozen=True)
class PrefillPoint:
    isl: int               # prompt tokens
    ttft_ms: float         # one request alone
    tokens_per_s: float    # prompt tokens per second of one worker at this ISL


@dataclass(frozen=True)
class DecodePoint:
    batch: int             # running requests
    context: int           # tokens in each request's context
    itl_ms: float          # one decode step
    tokens_per_s: float    # output tokens per second of one worker (batch / ITL)


@dataclass(frozen=True)
class WorkerProfile:
    """Prefill and decode tables of one worker. Raises ValueError on an empty or unsorted table."""

    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("a profile needs at least one prefill and one decode point")
        object.__setattr__(self, "prefill", tuple(sorted(self.prefill, key=lambda p: p.isl)))
        object.__setattr__(self, "decode", tuple(sorted(self.decode, key=lambda p: (p.context, p.batch))))
        for p in self.prefill:
            if p.isl < 1 or p.ttft_ms <= 0 or p.tokens_per_s <= 0:
                raise ValueError(f"prefill point {p}: isl >= 1 and positive ttft/throughput required")
        for d in self.decode:
            if d.batch < 1 or d.context < 1 or d.itl_ms <= 0:
                raise ValueError(f"decode point {d}: batch, context >= 1 and positive ITL required")

    # -- prefill ---------------------------------------------------------------------------------
    def prefill_ttft_ms(self, isl: float) -> float:
        return _interp(isl, [p.isl for p in self.prefill], [p.ttft_ms for p in self.prefill])

    def prefill_tokens_per_s(self, isl: float) -> float:
        return _interp(isl, [p.isl for p in self.prefill], [p.tokens_per_s for p in self.prefill])

    # -- decode ----------------------------------------------------------------------------------
    @property
    def contexts(self) -> list[int]:
        return sorted({d.context for d in self.decode})

    def _row(self, context: int) -> list[DecodePoint]:
        return sorted((d for d in self.decode if d.context == context), key=lambda d: d.batch)

    def decode_itl_ms(self, batch: float, context: float) -> float:
        """ITL at ``batch`` running requests of ``context`` tokens (bilinear, clamped)."""
        return self._bilinear(batch, context, lambda row, b: _interp(b, [d.batch for d in row],
                                                                      [d.itl_ms for d in row]))

    def max_decode_batch(self, itl_ms: float, context: float) -> float:
        """Largest batch whose ITL stays within ``itl_ms`` at ``context`` (0 if even batch 1 misses)."""
        return self._bilinear(1, context, lambda row, _: _max_batch_within(row, itl_ms))

    def best_decode_tokens_per_s(self, itl_ms: float, context: float) -> float:
        """Most output tokens/s one worker gives with ITL within ``itl_ms`` at ``context``
        (0 when no batch meets it): Dynamo's decode sizing reads this."""
        return self._bilinear(1, context, lambda row, _: _best_within(row, itl_ms))

    def _bilinear(self, batch: float, context: float, along_batch) -> float:
        ctxs = self.contexts
        if context <= ctxs[0]:
            return along_batch(self._row(ctxs[0]), batch)
        if context >= ctxs[-1]:
            return along_batch(self._row(ctxs[-1]), batch)
        i = bisect.bisect_right(ctxs, context)
        lo, hi = ctxs[i - 1], ctxs[i]
        w = (context - lo) / (hi - lo)
        return (1 - w) * along_batch(self._row(lo), batch) + w * along_batch(self._row(hi), batch)

    # -- files -----------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"prefill": [asdict(p) for p in self.prefill], "decode": [asdict(d) for d in self.decode],
                "meta": self.meta}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> "WorkerProfile":
        """Raises ValueError naming what is missing or malformed."""
        try:
            prefill = tuple(PrefillPoint(int(p["isl"]), float(p["ttft_ms"]), float(p["tokens_per_s"]))
                            for p in doc["prefill"])
            decode = tuple(DecodePoint(int(d["batch"]), int(d["context"]), float(d["itl_ms"]),
                                       float(d["tokens_per_s"])) for d in doc["decode"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed profile: {type(e).__name__}: {e}") from None
        return cls(prefill, decode, dict(doc.get("meta", {})))

    @classmethod
    def load(cls, path: str | Path) -> "WorkerProfile":
        return cls.from_json(json.loads(Path(path).read_text()))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2))


def _interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Piecewise-linear y(x) through sorted xs, clamped outside [xs[0], xs[-1]]."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ys[i - 1] + w * (ys[i] - ys[i - 1])


def _max_batch_within(row: list[DecodePoint], itl_ms: float) -> float:
    """Largest batch (interpolated between measured batches) whose ITL is within itl_ms."""
    if row[0].itl_ms > itl_ms:
        return 0.0
    best = float(row[0].batch)
    for a, b in zip(row, row[1:]):
        if b.itl_ms <= itl_ms:
            best = float(b.batch)
            continue
        if a.itl_ms <= itl_ms < b.itl_ms:  # ITL grows with batch: the crossing lies between a and b
            best = a.batch + (itl_ms - a.itl_ms) / (b.itl_ms - a.itl_ms) * (b.batch - a.batch)
        break
    return best


def _best_within(row: list[DecodePoint], itl_ms: float) -> float:
    batch = _max_batch_within(row, itl_ms)
    if batch <= 0:
        return 0.0
    itl = _interp(batch, [d.batch for d in row], [d.itl_ms for d in row])
    return batch / (itl / 1000.0)
