"""pdserve plan: size a prefill/decode fleet, or replay the planner over a load trace, in simulation.

    pdserve plan --profile PROFILE.json --rate 20 --isl 1024 --osl 128 --slo ttft:1000,itl:50
    pdserve plan --profile roofline:h200-llama3-8b --diurnal 400:40:24 --isl 1024 --osl 128 \
        --slo ttft:1000,itl:50 --json plan.json

With ``--rate``: the fewest prefill and decode workers whose simulated SLO attainment reaches
``--attainment``. With ``--trace FILE`` (JSON lines ``{"t": seconds, "rate": req/s}``) or
``--diurnal PEAK:TROUGH:HOURS``: the SLA planner's fleet over the trace against a fixed fleet
sized for the trace's peak rate — SLO attainment and worker-hours of each.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from engine.errors import UserError


def command(
    profile: Annotated[str, typer.Option(help="Profile JSON from `pdserve profile`, or roofline:h200-llama3-8b.")],
    isl: Annotated[int, typer.Option(help="Prompt tokens per request.")] = 1024,
    osl: Annotated[int, typer.Option(help="Output tokens per request.")] = 128,
    slo: Annotated[str, typer.Option(help="ttft:MS,itl:MS")] = "ttft:1000,itl:50",
    rate: Annotated[Optional[float], typer.Option(help="Constant Poisson rate (req/s): size the fleet.")] = None,
    trace: Annotated[Optional[Path], typer.Option(help="JSON lines {t, rate}: replay the planner.")] = None,
    diurnal: Annotated[Optional[str], typer.Option(help="PEAK:TROUGH:HOURS, a day-shaped trace.")] = None,
    attainment: Annotated[float, typer.Option(help="Share of requests that must meet both SLOs.")] = 0.95,
    duration: Annotated[float, typer.Option(help="--rate: simulated seconds.")] = 600.0,
    planner_interval: Annotated[float, typer.Option(help="SLA planner interval (s).")] = 60.0,
    startup: Annotated[float, typer.Option(help="A new worker's time to ready (s).")] = 60.0,
    max_batch: Annotated[int, typer.Option(help="Running requests per decode worker.")] = 256,
    min_prefill: Annotated[int, typer.Option()] = 1,
    max_prefill: Annotated[int, typer.Option()] = 4096,
    min_decode: Annotated[int, typer.Option()] = 1,
    max_decode: Annotated[int, typer.Option()] = 4096,
    predictor: Annotated[str, typer.Option(help="constant | moving-average | linear")] = "linear",
    seed: Annotated[int, typer.Option()] = 0,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the result here.")] = None,
) -> None:
    """Fleet sizing and planner replay in a discrete-event simulation driven by a profile."""
    from planner.simulator import SimConfig

    prof = load_profile(profile)
    ttft_slo, itl_slo = parse_slo(slo)
    if sum(x is not None for x in (rate, trace, diurnal)) != 1:
        raise UserError("give exactly one of --rate, --trace, --diurnal")
    if isl < 1 or osl < 1 or max_batch < 1:
        raise UserError("--isl, --osl and --max-batch must be >= 1")
    if not 0 < attainment <= 1:
        raise UserError("--attainment must be in (0, 1]")
    sim = SimConfig(max_batch=max_batch, startup_s=startup, interval_s=planner_interval)
    started = time.monotonic()
    if rate is not None:
        if not rate > 0:
            raise UserError("--rate must be > 0")
        doc = size(prof, rate, isl, osl, ttft_slo, itl_slo, attainment, duration, sim, seed)
    else:
        rates = parse_trace(trace) if trace else parse_diurnal(diurnal)
        bounds = dict(min_prefill=min_prefill, max_prefill=max_prefill, min_decode=min_decode, max_decode=max_decode)
        doc = replay(prof, rates, isl, osl, ttft_slo, itl_slo, attainment, sim, predictor, bounds, seed)
    doc["simulated_in_s"] = time.monotonic() - started
    doc["profile"] = prof.meta
    print(table(doc))
    if json_out:
        json_out.write_text(json.dumps(doc, indent=2, default=str))
        print(f"wrote {json_out}", file=sys.stderr)


def load_profile(spec: str):
    from planner.profile import WorkerProfile
    from planner.roofline import roofline_profile

    if spec == "roofline:h200-llama3-8b":
        return roofline_profile()
    path = Path(spec)
    if not path.is_file():
        raise UserError(f"--profile {spec!r}: no such file (or use roofline:h200-llama3-8b)")
    try:
        return WorkerProfile.load(path)
    except (ValueError, json.JSONDecodeError) as e:
        raise UserError(f"--profile {spec}: {e}") from None


def parse_slo(text: str) -> tuple[float, float]:
    """``ttft:MS,itl:MS`` -> (ttft_ms, itl_ms); UserError naming --slo otherwise."""
    parts = dict(p.split(":", 1) for p in text.split(",") if ":" in p)
    try:
        ttft, itl = float(parts["ttft"]), float(parts["itl"])
    except (KeyError, ValueError):
        raise UserError(f"--slo {text!r}: expected ttft:MS,itl:MS, e.g. ttft:1000,itl:50") from None
    if ttft <= 0 or itl <= 0:
        raise UserError("--slo: both SLOs must be > 0 ms")
    return ttft, itl


def parse_diurnal(text: str) -> list[tuple[float, float]]:
    from planner.simulator import diurnal_rates

    try:
        peak, trough, hours = (float(x) for x in text.split(":"))
    except ValueError:
        raise UserError(f"--diurnal {text!r}: expected PEAK:TROUGH:HOURS, e.g. 400:40:24") from None
    if not peak >= trough >= 0 or peak <= 0 or hours <= 0:
        raise UserError("--diurnal: need PEAK >= TROUGH >= 0, PEAK > 0 and HOURS > 0")
    return diurnal_rates(peak, trough, hours)


def parse_trace(path: Path) -> list[tuple[float, float]]:
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        rates = sorted((float(r["t"]), float(r["rate"])) for r in rows)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--trace {path}: expected JSON lines {{\"t\": s, \"rate\": req/s}} ({e})") from None
    if len(rates) < 2 or any(r < 0 for _, r in rates):
        raise UserError(f"--trace {path}: need at least two points with rates >= 0")
    return rates


def size(prof, rate, isl, osl, ttft_slo, itl_slo, attainment, duration, sim, seed) -> dict[str, Any]:
    from planner.simulator import size_fleet

    out = size_fleet(prof, rate, isl, osl, ttft_slo, itl_slo, attainment=attainment, duration_s=duration,
                     config=sim, seed=seed)
    return {"mode": "size", "rate": rate, "isl": isl, "osl": osl, "ttft_slo_ms": ttft_slo, "itl_slo_ms": itl_slo,
            "attainment_target": attainment, **out}


def replay(prof, rates, isl, osl, ttft_slo, itl_slo, attainment, sim, predictor, bounds, seed) -> dict[str, Any]:
    import dataclasses

    from planner.simulator import Simulation, size_fleet, trace_requests
    from planner.sla import PlannerConfig, SlaPlanner

    reqs = trace_requests(rates, isl, osl, seed)
    peak_rate = max(r for _, r in rates)
    peak = size_fleet(prof, peak_rate, isl, osl, ttft_slo, itl_slo, attainment=attainment, duration_s=300,
                      config=sim, seed=seed)
    if peak["decode"] is None:
        raise UserError(f"no fixed fleet meets the SLO at the peak rate {peak_rate:g}: {peak['reason']}")
    fixed = Simulation(prof, dataclasses.replace(sim, num_prefill=peak["prefill"], num_decode=peak["decode"])).run(reqs)
    cfg = PlannerConfig(ttft_slo_ms=ttft_slo, itl_slo_ms=itl_slo, interval_s=sim.interval_s, predictor=predictor,
                        startup_s=sim.startup_s, **bounds)
    planner = SlaPlanner(cfg, prof)
    start = dataclasses.replace(sim, num_prefill=max(1, bounds["min_prefill"]), num_decode=bounds["min_decode"])
    planned = Simulation(prof, start, planner).run(reqs)
    rows = {}
    for name, r in (("fixed (peak-sized)", fixed), ("planner", planned)):
        rows[name] = {**r.summary(), "attainment": r.attainment(ttft_slo, itl_slo)}
    rows["fixed (peak-sized)"].update(prefill=peak["prefill"], decode=peak["decode"])
    saved = 1 - rows["planner"]["worker_hours"] / rows["fixed (peak-sized)"]["worker_hours"]
    return {"mode": "replay", "isl": isl, "osl": osl, "ttft_slo_ms": ttft_slo, "itl_slo_ms": itl_slo,
            "peak_rate": peak_rate, "requests": len(reqs), "fleets": rows, "worker_hours_saved": saved,
            "timeline": planned.timeline}


def table(doc: dict[str, Any]) -> str:
    if doc["mode"] == "size":
        if doc.get("decode") is None:
            return f"no fleet found: {doc.get('reason')}"
        return (f"rate {doc['rate']:g} req/s, ISL {doc['isl']}, OSL {doc['osl']}, SLO TTFT {doc['ttft_slo_ms']:g} ms / "
                f"ITL {doc['itl_slo_ms']:g} ms:\n  prefill {doc['prefill']}, decode {doc['decode']} workers -> "
                f"attainment {100 * doc['attainment']:.1f}%, TTFT p50/p99 {doc['ttft_p50_ms']:.0f}/{doc['ttft_p99_ms']:.0f} ms, "
                f"ITL p50/p99 {doc['itl_p50_ms']:.1f}/{doc['itl_p99_ms']:.1f} ms")
    head = f"{'fleet':<20}{'attainment':>11}{'worker-h':>10}{'TTFT p50/p99 ms':>18}{'ITL p50/p99 ms':>17}"
    lines = [f"{doc['requests']} requests, peak {doc['peak_rate']:g} req/s", head, "-" * len(head)]
    for name, r in doc["fleets"].items():
        lines.append(f"{name:<20}{100 * r['attainment']:>10.1f}%{r['worker_hours']:>10.1f}"
                     f"{r['ttft_p50_ms']:>9.0f}/{r['ttft_p99_ms']:<8.0f}{r['itl_p50_ms']:>8.1f}/{r['itl_p99_ms']:<8.1f}")
    lines.append(f"worker-hours saved by the planner: {100 * doc['worker_hours_saved']:.1f}%")
    return "\n".join(lines)
