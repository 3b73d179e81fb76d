"""Result documents (the ``--json`` file) and the tables printed on stdout. Pure formatting."""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from bench.metrics import RequestRecord

LATENCY_TITLES = (("ttft", "Time to First Token", "TTFT"), ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
                  ("itl", "Inter-token Latency", "ITL"), ("e2el", "End-to-end Latency", "E2EL"))


def rate_json(rate: float) -> float | str:
    """JSON has no infinity; ``vllm bench serve`` writes an unbounded rate as the string "inf"."""
    return "inf" if math.isinf(rate) else rate


def run_document(header: dict[str, Any], rate: float, figures: dict[str, Any],
                 records: Sequence[RequestRecord]) -> dict[str, Any]:
    """One run's JSON: the run's settings, its figures, then every per-request record."""
    return {**header, "date": datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"), "request_rate": rate_json(rate),
            **figures, "requests": [r.to_json() for r in records]}


def write_json(doc: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def run_table(doc: dict[str, Any]) -> str:
    """The ``vllm bench serve``-style result table of one run."""
    w = 50
    rows: list[str] = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="=")]

    def row(label: str, v: Any, digits: int = 2) -> None:
        rows.append(f"{label:<40}{_fmt(v, digits):>10}")

    row("Backend / model:", f"{doc.get('backend')} / {doc.get('model_id')}")
    row("Request rate (req/s):", doc.get("request_rate"))
    row("Max concurrency:", doc.get("max_concurrency"))
    row("Successful requests:", doc["completed"])
    row("Failed requests:", doc["failed"])
    row("Benchmark duration (s):", doc["duration"])
    row("Total input tokens:", doc["total_input_tokens"])
    row("Total generated tokens:", doc["total_output_tokens"])
    row("Request throughput (req/s):", doc["request_throughput"])
    row("Output token throughput (tok/s):", doc["output_throughput"])
    row("Total token throughput (tok/s):", doc["total_token_throughput"])
    if doc.get("slo"):
        row(f"Request goodput (req/s) [{_slo_text(doc['slo'])}]:", doc["request_goodput"])
        row("SLO attainment (%):", None if doc["slo_attainment"] is None else 100 * doc["slo_attainment"])
    for key, title, short in LATENCY_TITLES:
        rows.append("{s:{c}^{n}}".format(s=title, n=w, c="-"))
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            row(f"{label} {short} (ms):", doc.get(f"{stat}_{key}_ms"))
    rows.append("=" * w)
    return "\n".join(rows)


def _slo_text(slo: dict[str, float]) -> str:
    return ",".join(f"{k.removesuffix('_ms')}:{v:g}" for k, v in slo.items())


SWEEP_COLUMNS = (("rate", "request_rate", 2), ("ok", "completed", 0), ("fail", "failed", 0),
                 ("req/s", "request_throughput", 2), ("tok/s", "output_throughput", 1),
                 ("TTFT p50", "median_ttft_ms", 1), ("TTFT p99", "p99_ttft_ms", 1),
                 ("TPOT p50", "median_tpot_ms", 1), ("TPOT p99", "p99_tpot_ms", 1),
                 ("goodput", "request_goodput", 2), ("SLO %", "slo_attainment", 1))


def sweep_table(doc: dict[str, Any]) -> str:
    """One row per swept rate, then the DistServe-style goodput."""
    header = " ".join(f"{name:>9}" for name, _, _ in SWEEP_COLUMNS)
    lines = ["Rate sweep (latencies in ms)", header, "-" * len(header)]
    for run in doc["runs"]:
        cells = []
        for _, key, digits in SWEEP_COLUMNS:
            v = run.get(key)
            if key == "slo_attainment" and v is not None:
                v = 100 * v
            cells.append(f"{_fmt(v, digits):>9}")
        lines.append(" ".join(cells))
    target = 100 * doc["attainment_target"]
    lines.append(f"Goodput (highest rate with >= {target:g}% SLO attainment): "
                 f"{_fmt(doc['goodput_rate'])} req/s" + ("" if doc.get("slo") else "  [no --slo given]"))
    return "\n".join(lines)
