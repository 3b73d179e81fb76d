"""PNG plots of a run or a sweep, with matplotlib's Agg backend (no display needed).

Per run: TTFT CDF, ITL CDF, throughput over the run (output tokens/s by chunk arrival and
completed requests/s, in about 20 bins), latency over the run (TTFT and E2E per request, by send time).
Per sweep: SLO attainment, goodput and throughput vs request rate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from bench.metrics import RequestRecord


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return path


def _cdf(values_ms: Sequence[float], title: str, xlabel: str, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = np.sort(np.asarray(values_ms, dtype=np.float64))
    ax.step(xs, np.arange(1, len(xs) + 1) / max(len(xs), 1), where="post")
    ax.set(title=title, xlabel=xlabel, ylabel="fraction ≤ x", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_run(records: Sequence[RequestRecord], out_dir: Path, prefix: str = "") -> list[Path]:
    """Write ``{prefix}ttft_cdf.png``, ``itl_cdf.png``, ``throughput_over_time.png``,
    ``latency_over_time.png`` into ``out_dir`` (created); returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ok = [r for r in records if r.success]
    return [
        _cdf([1000 * r.ttft_s for r in ok], "TTFT CDF", "TTFT (ms)", out_dir / f"{prefix}ttft_cdf.png"),
        _cdf([1000 * g for r in ok for g in r.itl_s], "ITL CDF", "ITL (ms)", out_dir / f"{prefix}itl_cdf.png"),
        _throughput(ok, out_dir / f"{prefix}throughput_over_time.png"),
        _latency(ok, [r for r in records if not r.success], out_dir / f"{prefix}latency_over_time.png"),
    ]


def token_times(r: RequestRecord) -> tuple[np.ndarray, np.ndarray]:
    """(arrival time of each streamed chunk in s since the start, output tokens credited to it):
    a request's output tokens spread evenly over its chunks."""
    t = r.start_s + r.ttft_s + np.concatenate([[0.0], np.cumsum(r.itl_s)])
    return t, np.full(len(t), r.output_tokens / len(t))


def _throughput(ok: Sequence[RequestRecord], path: Path) -> Path:
    plt = _pyplot()
    ends = np.array([r.start_s + r.e2el_s for r in ok])
    chunks = [token_times(r) for r in ok]
    times = np.concatenate([t for t, _ in chunks]) if chunks else np.zeros(0)
    weights = np.concatenate([w for _, w in chunks]) if chunks else np.zeros(0)
    span = float(ends.max()) if len(ends) else 1.0
    width = min(max(span / 20, 0.05), 10.0)  # about 20 bins whatever the run's length
    edges = np.arange(0.0, span + width, width)
    toks, _ = np.histogram(times, bins=edges, weights=weights)
    reqs, _ = np.histogram(ends, bins=edges)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    ax1.stairs(toks / width, edges, fill=True, alpha=0.6)
    ax1.set(title=f"Throughput over the run ({width:.2g} s bins)", ylabel="output tokens/s")
    ax2.stairs(reqs / width, edges, fill=True, alpha=0.6, color="tab:orange")
    ax2.set(xlabel="time since start (s)", ylabel="completed requests/s")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    return _save(fig, path)


def _latency(ok: Sequence[RequestRecord], failed: Sequence[RequestRecord], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    starts = [r.start_s for r in ok]
    ax.scatter(starts, [1000 * r.ttft_s for r in ok], s=8, label="TTFT")
    ax.scatter(starts, [1000 * r.e2el_s for r in ok], s=8, label="E2E latency")
    if failed:  # on the time axis only: a failed request has no latency
        ax.scatter([r.start_s for r in failed], [0.0] * len(failed), marker="x", color="tab:red",
                   label=f"failed ({len(failed)})")
    ax.set(title="Latency over the run", xlabel="request sent at (s since start)", ylabel="ms")
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_sweep(runs: Sequence[dict[str, Any]], target: float, out_dir: Path) -> Path:
    """``attainment_vs_rate.png``: SLO attainment (%) and goodput and throughput (req/s) against the swept rate."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    rates = [r["request_rate"] for r in runs]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(6, 6), sharex=True)
    ax1.plot(rates, [100 * (r["slo_attainment"] or 0) for r in runs], "o-", label="SLO attainment")
    ax1.axhline(100 * target, ls="--", color="grey", label=f"{100 * target:g}% target")
    ax1.set(title="SLO attainment vs request rate", ylabel="SLO attainment (%)", ylim=(0, 102))
    ax2.plot(rates, rates, ":", color="grey", label="offered")
    ax2.plot(rates, [r.get("request_throughput") or 0 for r in runs], "o-", label="throughput")
    ax2.plot(rates, [r["request_goodput"] or 0 for r in runs], "s-", color="tab:green", label="goodput")
    ax2.set(xlabel="request rate (req/s)", ylabel="req/s", ylim=(0, None))
    for ax in (ax1, ax2):
        ax.legend(loc="best", fontsize="small")
        ax.grid(alpha=0.3)
    return _save(fig, out_dir / "attainment_vs_rate.png")
