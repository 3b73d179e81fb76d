"""Load predictors for the SLA planner: a value ``ahead`` intervals past the last one seen (1 =
the next interval's), from the last ones. Pure."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class ConstantPredictor:
    """The next value is the last one seen (0 before any)."""

    last: float = 0.0

    def add(self, value: float) -> None:
        self.last = float(value)

    def predict(self, ahead: float = 1.0) -> float:
        return self.last


@dataclass
class _Window:
    """The last ``window`` values seen."""

    window: int = 3
    values: deque = field(default_factory=deque)

    def add(self, value: float) -> None:
        self.values.append(float(value))
        while len(self.values) > self.window:
            self.values.popleft()


@dataclass
class MovingAveragePredictor(_Window):
    """The mean of the last ``window`` values (0 before any)."""

    def predict(self, ahead: float = 1.0) -> float:
        return sum(self.values) / len(self.values) if self.values else 0.0


@dataclass
class LinearTrendPredictor(_Window):
    """A least-squares line through the last ``window`` values, extrapolated ``ahead`` intervals
    past the last one (never below 0): follows a ramp instead of lagging it."""

    window: int = 4

    def predict(self, ahead: float = 1.0) -> float:
        n = len(self.values)
        if n < 2:
            return self.values[0] if n else 0.0
        xs = range(n)
        mx, my = (n - 1) / 2, sum(self.values) / n
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, self.values)) / sum((x - mx) ** 2 for x in xs)
        return max(0.0, my + slope * (n - 1 + ahead - mx))


PREDICTORS = {"constant": ConstantPredictor, "moving-average": MovingAveragePredictor,
              "linear": LinearTrendPredictor}


def make_predictor(name: str):
    """A fresh predictor; ValueError naming the allowed names for an unknown one."""
    if name not in PREDICTORS:
        raise ValueError(f"unknown predictor {name!r}: choose one of {', '.join(PREDICTORS)}")
    return PREDICTORS[name]()
