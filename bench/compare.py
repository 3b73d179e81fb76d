"""pdserve bench compare: benchmark JSON files side by side, with each figure's ratio to the first file's.

Reads ``pdserve bench serve --json`` files (one run or a sweep) and ``vllm bench serve`` result
files, which use the same names. Sweep files contribute their goodput rate and, for each swept
rate, ``figure@rate`` rows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Sequence

import typer

from engine.errors import UserError

RUN_FIGURES = (
    "completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
    "request_goodput", "slo_attainment",
    *(f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "p90", "p99")),
)
OPTIONAL_FIGURES = ("mean_server_ttft_ms", "median_server_ttft_ms")  # only targets that report their own TTFT
SWEEP_FIGURES = ("request_throughput", "output_throughput", "request_goodput", "slo_attainment",
                 "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")


def command(
    files: Annotated[list[Path], typer.Argument(help="Result JSON files; ratios are to the first.", show_default=False)],
) -> None:
    """pdserve bench compare: benchmark JSON files side by side, with ratios to the first."""
    docs = [load(p) for p in files]
    print(compare_table([label(p, d) for p, d in zip(files, docs)], [flatten(d) for d in docs]))


def load(path: Path) -> dict[str, Any]:
    """A result document; UserError if the file is missing or not a benchmark result."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(doc, dict) or not ("completed" in doc or "runs" in doc):
        raise UserError(f"{path}: not a benchmark result (no 'completed' or 'runs' field)")
    return doc


def label(path: Path, doc: dict[str, Any]) -> str:
    return f"{path.stem} ({doc.get('backend', '?')})"


def flatten(doc: dict[str, Any]) -> dict[str, Any]:
    """Figure name -> value, in display order; sweep figures are keyed ``name@rate``."""
    if "runs" not in doc:
        return {k: doc.get(k) for k in RUN_FIGURES} | {k: doc[k] for k in OPTIONAL_FIGURES if k in doc}
    out: dict[str, Any] = {"goodput_rate": doc.get("goodput_rate")}
    for run in doc["runs"]:
        rate = run["request_rate"]
        out.update({f"{k}@{rate:g}" if isinstance(rate, (int, float)) else f"{k}@{rate}": run.get(k)
                    for k in SWEEP_FIGURES})
    return out


def ratio(value: Any, base: Any) -> str:
    if not isinstance(value, (int, float)) or not isinstance(base, (int, float)) or base == 0:
        return "-"
    return f"{value / base:.2f}x"


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def compare_table(labels: Sequence[str], flats: Sequence[dict[str, Any]]) -> str:
    """Rows: every figure any file has (the first file's order first); columns: each file's value
    and, after the first, its ratio to the first."""
    keys = list(dict.fromkeys(k for f in flats for k in f))
    name_w = max(len("figure"), *(len(k) for k in keys))
    col_w = max(12, *(len(lb) for lb in labels))
    head = [f"{'figure':<{name_w}}", f"{labels[0]:>{col_w}}"]
    for lb in labels[1:]:
        head += [f"{lb:>{col_w}}", f"{'ratio':>7}"]
    lines = ["  ".join(head), "-" * len("  ".join(head))]
    for k in keys:
        base = flats[0].get(k)
        cells = [f"{k:<{name_w}}", f"{_cell(base):>{col_w}}"]
        for f in flats[1:]:
            cells += [f"{_cell(f.get(k)):>{col_w}}", f"{ratio(f.get(k), base):>7}"]
        lines.append("  ".join(cells))
    return "\n".join(lines)
