"""The conclusions of `pdserve bench ablate`, computed from its rows only (pure, no I/O).

Every claim the report makes is one of these figures, so it is in the JSON too:
- ladder steps: per tier, each rung's output tok/s over the previous rung's (``gain`` = ratio - 1);
  the rung with the largest gain at each tier;
- isolation vs leave-one-out: per technique and tier, ``isolated_gain`` = tok/s(baseline + T) /
  tok/s(baseline + what T needs) - 1 and ``loo_gain`` = tok/s(full) / tok/s(full - T) - 1; a
  technique is flagged ``interacts`` where the two differ in sign or by more than the threshold
  (absolute, in units of gain: 0.15 = 15 percentage points);
- quality gates: a configuration fails if its perplexity rose more than the sum of its lossy
  techniques' allowances (lossless ones allow 0), or if it has no lossy technique and its
  greedy agreement with the baseline is below the agreement gate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

Row = dict[str, Any]


@dataclass(frozen=True)
class Gates:
    """Allowed perplexity increase per lossy technique (fractions: 0.02 = +2 %), and the least
    greedy agreement of a configuration without a lossy technique. Defaults: issue 12's goals."""

    fp8: float = 0.02
    int8: float = 0.01
    fp8_kv: float = 0.01
    greedy_agreement: float = 0.75

    def allowance(self, gate_keys: Sequence[str]) -> float:
        return sum(getattr(self, k) for k in gate_keys)


def quality_verdict(ppl_delta: float | None, agreement: float | None, gate_keys: Sequence[str],
                    gates: Gates) -> tuple[bool | None, list[str]]:
    """(quality_ok, reasons it failed). None when nothing was measured."""
    if ppl_delta is None and agreement is None:
        return None, []
    reasons = []
    allowed = gates.allowance(gate_keys)
    if ppl_delta is not None and ppl_delta > allowed + 1e-12:
        reasons.append(f"perplexity {ppl_delta * 100:+.3g}% > allowed {allowed * 100:+.2f}%")
    if not gate_keys and agreement is not None and agreement < gates.greedy_agreement:
        reasons.append(f"greedy agreement {agreement:.2f} < {gates.greedy_agreement:.2f} (a lossless configuration)")
    return not reasons, reasons


def _index(rows: Sequence[Row]) -> dict[tuple[str, int], Row]:
    return {(r["name"], r["concurrency"]): r for r in rows if r.get("output_throughput") is not None}


def _gain(new: Row | None, old: Row | None, key: str = "output_throughput") -> float | None:
    if new is None or old is None or not old.get(key):
        return None
    return new[key] / old[key] - 1.0


def ladder_steps(rows: Sequence[Row], ladder_names: Sequence[str], ladder: Sequence[str],
                 tiers: Sequence[int]) -> list[Row]:
    """One entry per (rung >= 1, tier): the technique added and its throughput and p99 TTFT change."""
    idx, out = _index(rows), []
    for i in range(1, len(ladder_names)):
        for c in tiers:
            new, old = idx.get((ladder_names[i], c)), idx.get((ladder_names[i - 1], c))
            out.append({"rung": i, "technique": ladder[i - 1], "name": ladder_names[i], "previous": ladder_names[i - 1],
                        "concurrency": c,
                        "output_throughput": None if new is None else new["output_throughput"],
                        "previous_output_throughput": None if old is None else old["output_throughput"],
                        "gain": _gain(new, old), "p99_ttft_change": _gain(new, old, "p99_ttft_ms"),
                        "goodput_change": _gain(new, old, "request_goodput")})
    return out


def best_rungs(steps: Sequence[Row], tiers: Sequence[int]) -> list[Row]:
    """Per tier, the ladder step with the largest throughput gain (None where nothing was measured)."""
    out = []
    for c in tiers:
        measured = [s for s in steps if s["concurrency"] == c and s["gain"] is not None]
        best = max(measured, key=lambda s: s["gain"]) if measured else None
        worst = min(measured, key=lambda s: s["gain"]) if measured else None
        out.append({"concurrency": c, "best": best, "worst": worst})
    return out


def interactions(rows: Sequence[Row], names: dict[str, dict[str, str]], tiers: Sequence[int],
                 threshold: float) -> list[Row]:
    """Per technique with both an isolation and a leave-one-out configuration, and tier.

    names[T]: {"isolation", "isolation-reference", "leave-one-out", "full"} -> configuration names."""
    idx, out = _index(rows), []
    for t, n in names.items():
        if "leave-one-out" not in n and "isolation" not in n:
            continue
        for c in tiers:
            iso = _gain(idx.get((n.get("isolation"), c)), idx.get((n.get("isolation-reference"), c)))
            loo = _gain(idx.get((n.get("full"), c)), idx.get((n.get("leave-one-out"), c)))
            flag = None
            if iso is not None and loo is not None:
                flag = (iso > 0) != (loo > 0) or abs(iso - loo) > threshold
            out.append({"technique": t, "concurrency": c, "isolated_gain": iso, "loo_gain": loo, "interacts": flag})
    return out


def role_names(plans: Sequence[Any]) -> tuple[list[str], dict[str, dict[str, str]]]:
    """From the plans' roles: the ladder's configuration names in rung order, and per technique
    the names of its isolation, isolation-reference and leave-one-out configurations (+ the full stack)."""
    ladder: dict[int, str] = {}
    per: dict[str, dict[str, str]] = {}
    for p in plans:
        for role in p.roles:
            kind, _, arg = role.partition(":")
            if kind == "ladder":
                ladder[int(arg)] = p.name
            else:
                per.setdefault(arg, {})[kind] = p.name
    names = [ladder[i] for i in sorted(ladder)]
    for n in per.values():
        n["full"] = names[-1]
    return names, per
