"""`pdserve bench ablate`'s outputs from its JSON document: the stdout table, the PNG plots and
the Markdown report. Pure formatting: every number printed is a field of the document
(bench/ablate_analysis.py computed the conclusions), so the report's claims can be checked
against the JSON.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

TABLE_COLUMNS = (("config", "name", None), ("conc", "concurrency", 0), ("out tok/s", "output_throughput", 1),
                 ("goodput", "request_goodput", 2), ("failed", "failed", 0), ("TTFT p50", "median_ttft_ms", 0), ("TTFT p99", "p99_ttft_ms", 0),
                 ("TPOT p50", "median_tpot_ms", 1), ("TPOT p99", "p99_tpot_ms", 1), ("ITL p50", "median_itl_ms", 1),
                 ("ITL p99", "p99_itl_ms", 1), ("KV peak %", "kv_cache_usage_peak", 2), ("preempt", "num_preemptions", 0),
                 ("ppl", "perplexity", 3), ("ppl Δ%", "perplexity_delta", 2), ("greedy", "greedy_agreement", 2),
                 ("quality", "quality_ok", None))


def cell(row: dict[str, Any], key: str, digits: int | None) -> str:
    """One table cell as the report and the table print it (the test reads these back)."""
    v = row.get(key)
    if key == "quality_ok":
        return "-" if v is None else ("ok" if v else "FAIL")
    if v is None:
        return "-"
    if key == "kv_cache_usage_peak":
        v = 100 * v
    if key == "perplexity_delta":
        v = 100 * v
        return f"{v:+.{digits}f}" if abs(v) < 1e4 else f"{v:+.3g}"
    if isinstance(v, float):
        return f"{v:.{digits}f}" if abs(v) < 1e5 else f"{v:.3g}"
    return str(v)


def ordered_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    order = {p["name"]: i for i, p in enumerate(doc["plan"])}
    return sorted(doc["configs"], key=lambda r: (order.get(r["name"], 1e9), r["concurrency"]))


def ablation_table(doc: dict[str, Any]) -> str:
    """Every configuration x tier, the plan's order; errors on their own line."""
    rows = ordered_rows(doc)
    width = max([len("config")] + [len(r["name"]) for r in rows]) + 2
    head = f"{'config':<{width}}" + "".join(f"{t:>11}" for t, _, _ in TABLE_COLUMNS[1:])
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.get("error"):
            lines.append(f"{r['name']:<{width}}{r['concurrency']:>11}  error: {r['error']}")
            continue
        lines.append(f"{r['name']:<{width}}" + "".join(f"{cell(r, k, d):>11}" for _, k, d in TABLE_COLUMNS[1:]))
    return "\n".join(lines)


# -- plots ----------------------------------------------------------------------------------------
def _pyplot():
    from bench.plots import _pyplot as plots_pyplot

    return plots_pyplot()


def _save(fig, path: Path) -> Path:
    from bench.plots import _save as plots_save

    return plots_save(fig, path)


def _value(doc, name: str, c: int, key: str) -> float:
    for r in doc["configs"]:
        if r["name"] == name and r["concurrency"] == c and r.get(key) is not None:
            return float(r[key])
    return float("nan")


def write_plots(doc: dict[str, Any], out_dir: Path) -> list[Path]:
    """ladder_throughput.png, ladder_p99_latency.png, quality_vs_speed.png, isolation_vs_loo.png."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return [_ladder_throughput(doc, out_dir / "ladder_throughput.png"),
            _ladder_latency(doc, out_dir / "ladder_p99_latency.png"),
            _quality_speed(doc, out_dir / "quality_vs_speed.png"),
            _isolation_vs_loo(doc, out_dir / "isolation_vs_loo.png")]


def _grouped(ax, names: Sequence[str], tiers: Sequence[int], value) -> None:
    import numpy as np

    x = np.arange(len(names))
    width = 0.8 / max(len(tiers), 1)
    for i, c in enumerate(tiers):
        ax.bar(x + (i - (len(tiers) - 1) / 2) * width, [value(n, c) for n in names], width, label=f"concurrency {c}")
    ax.set_xticks(x, [n.split("+")[-1] if n != "baseline" else "baseline" for n in names], rotation=30, ha="right")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize="small")


def _ladder_throughput(doc, path: Path) -> Path:
    plt = _pyplot()
    names, tiers = doc["analysis"]["ladder_names"], doc["workload"]["concurrency"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    _grouped(ax, names, tiers, lambda n, c: _value(doc, n, c, "output_throughput"))
    ax.set(title="Output throughput per ladder rung (each adds the technique named)", ylabel="output tokens/s")
    return _save(fig, path)


def _ladder_latency(doc, path: Path) -> Path:
    plt = _pyplot()
    names, tiers = doc["analysis"]["ladder_names"], doc["workload"]["concurrency"]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    _grouped(ax1, names, tiers, lambda n, c: _value(doc, n, c, "p99_ttft_ms"))
    ax1.set(title="p99 TTFT per ladder rung", ylabel="ms")
    _grouped(ax2, names, tiers, lambda n, c: _value(doc, n, c, "p99_itl_ms"))
    ax2.set(title="p99 ITL per ladder rung", ylabel="ms")
    return _save(fig, path)


def _quality_speed(doc, path: Path) -> Path:
    """Per technique measured alone: its perplexity delta against its isolated throughput gain
    at the highest tier (the analysis' ``isolated_gain``); failing ones as red crosses."""
    plt = _pyplot()
    top = max(doc["workload"]["concurrency"])
    a = doc["analysis"]
    gains = {i["technique"]: i["isolated_gain"] for i in a["interactions"] if i["concurrency"] == top}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for t, names in a["roles"].items():
        q = a["quality"].get(names.get("isolation", ""), {})
        if q.get("perplexity_delta") is None or gains.get(t) is None:
            continue
        x, y = 100 * q["perplexity_delta"], 100 * gains[t]
        bad = q.get("quality_ok") is False
        ax.scatter([x], [y], color="tab:red" if bad else "tab:blue", marker="x" if bad else "o")
        ax.annotate(t, (x, y), fontsize=8, xytext=(3, 3), textcoords="offset points")
    ax.axvline(0, color="grey", lw=0.8)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set(title=f"Quality vs speed per technique, alone (concurrency {top}; red: fails its gate)",
           xlabel="perplexity change vs baseline (%)", ylabel="output tok/s gain alone (%)")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _isolation_vs_loo(doc, path: Path) -> Path:
    import numpy as np

    plt = _pyplot()
    inter = doc["analysis"]["interactions"]
    techs = sorted({i["technique"] for i in inter}, key=[i["technique"] for i in inter].index)
    tiers = doc["workload"]["concurrency"]
    fig, axes = plt.subplots(1, max(len(tiers), 1), figsize=(4 * max(len(tiers), 1), 4), squeeze=False)
    for ax, c in zip(axes[0], tiers):
        x = np.arange(len(techs))
        get = {(i["technique"], i["concurrency"]): i for i in inter}
        iso = [100 * (get[(t, c)]["isolated_gain"] if get[(t, c)]["isolated_gain"] is not None else np.nan) for t in techs]
        loo = [100 * (get[(t, c)]["loo_gain"] if get[(t, c)]["loo_gain"] is not None else np.nan) for t in techs]
        ax.bar(x - 0.2, iso, 0.4, label="alone on the baseline")
        ax.bar(x + 0.2, loo, 0.4, label="last, on the full stack")
        ax.set_xticks(x, techs, rotation=30, ha="right")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set(title=f"concurrency {c}", ylabel="output tok/s gain (%)")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize="x-small")
    return _save(fig, path)


# -- the Markdown report --------------------------------------------------------------------------
def _pct(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{100 * x:+.1f}%" if abs(x) < 100 else f"{100 * x:+.3g}%"


def write_report(doc: dict[str, Any], path: Path, plot_dir: Path | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report_markdown(doc, plot_dir, path.parent))


def report_markdown(doc: dict[str, Any], plot_dir: Path | None = None, relative_to: Path | None = None) -> str:
    """The report, top to bottom: setup, findings per tier, the ladder, isolation vs leave-one-out,
    quality, every row (the "All figures" table repeats the JSON's rows, cell for cell)."""
    a, w, m = doc["analysis"], doc["workload"], doc["machine"]
    out = ["# pdserve bench ablate", "",
           f"Model `{w['model']}` on {m.get('cpu') or 'this CPU'} ({m.get('cores')} cores, ISA "
           f"{', '.join(m.get('isa_flags') or []) or '-'}, 1-minute load {m.get('load_avg_1m', 0):.1f} at the start, "
           f"{m.get('load_avg_1m_end', float('nan')):.1f} at the end); "
           f"dataset {w['dataset']}, {w['max_tokens']} output tokens per request (EOS ignored), concurrency "
           f"{', '.join(map(str, w['concurrency']))}; request goodput under SLO {w['slo']}. "
           "Each configuration is a `pdserve serve` measured through the `bench serve` client on the same requests.",
           "", "## Findings", ""]
    out += _findings(doc)
    out += ["", "## The ladder", "", "Each rung adds one technique to the one above it.", ""]
    out += _ladder_table(doc)
    if plot_dir is not None:
        rel = _rel(plot_dir, relative_to)
        out += ["", f"![throughput per rung]({rel}/ladder_throughput.png)", "",
                f"![p99 latency per rung]({rel}/ladder_p99_latency.png)"]
    out += ["", "## Isolation and leave-one-out", "",
            "Isolated gain: the technique alone on the baseline (plus what it needs), against that reference. "
            "Leave-one-out gain: the full stack against the full stack without it. "
            f"Flagged where they differ in sign or by more than {100 * a['interaction_threshold']:.0f} points.", ""]
    out += _interaction_table(doc)
    if plot_dir is not None:
        out += ["", f"![isolation vs leave-one-out]({_rel(plot_dir, relative_to)}/isolation_vs_loo.png)"]
    out += ["", "## Quality", "", _gates_text(doc), ""]
    out += _quality_table(doc)
    if plot_dir is not None:
        out += ["", f"![quality vs speed]({_rel(plot_dir, relative_to)}/quality_vs_speed.png)"]
    out += ["", "## All figures", "", "One row per configuration and concurrency, as in the JSON's `configs`.", ""]
    out += markdown_rows(doc)
    out += ["", "## Serve commands", ""]
    for p in doc["plan"]:
        env = "".join(f"{k}={v} " for k, v in p["env"].items())
        out.append(f"- `{p['name']}` ({', '.join(p['roles'])}): `{env}pdserve serve {' '.join(p['serve_args'])}`")
    return "\n".join(out) + "\n"


def _rel(plot_dir: Path, base: Path | None) -> str:
    import os

    return os.path.relpath(plot_dir, base) if base is not None else str(plot_dir)


def _findings(doc) -> list[str]:
    a, out = doc["analysis"], []
    for b in a["best_rungs"]:
        c, best, worst = b["concurrency"], b["best"], b["worst"]
        if best is None:
            out.append(f"- Concurrency {c}: no two consecutive rungs were measured.")
            continue
        lead = (f"the largest gain was **{best['technique']}** (rung {best['rung']})" if best["gain"] > 0 else
                f"no rung raised output tok/s; the smallest loss was **{best['technique']}** (rung {best['rung']})")
        out.append(f"- Concurrency {c}: {lead}, {_pct(best['gain'])} output tok/s ({best['previous_output_throughput']:.1f}"
                   f" → {best['output_throughput']:.1f}); the worst rung was {worst['technique']}, {_pct(worst['gain'])}.")
    flagged = sorted({(i["technique"], i["concurrency"]) for i in a["interactions"] if i["interacts"]})
    if flagged:
        by: dict[str, list[int]] = {}
        for t, c in flagged:
            by.setdefault(t, []).append(c)
        for t, cs in by.items():
            rows = [i for i in a["interactions"] if i["technique"] == t and i["concurrency"] in cs]
            figs = "; ".join(f"concurrency {i['concurrency']}: alone {_pct(i['isolated_gain'])}, "
                             f"last {_pct(i['loo_gain'])}" for i in rows)
            out.append(f"- **{t}** interacts with the rest of the stack ({figs}).")
    else:
        out.append("- No technique's isolated gain differs from its leave-one-out gain beyond the threshold "
                   "(or none had both measured).")
    for r in ordered_rows(doc):
        if not r.get("error") and r.get("failed"):
            out.append(f"- **{r['name']}** at concurrency {r['concurrency']}: {r['failed']} of "
                       f"{r.get('num_requests', '?')} requests failed; its figures count the completed ones only.")
    for name, q in a["quality"].items():
        if q["quality_ok"] is False:
            out.append(f"- **{name}** fails its quality gate: {'; '.join(q['quality_failures'])}.")
    costly = [(n, q) for n, q in a["quality"].items() if q["perplexity_delta"] is not None and q["perplexity_delta"] > 0]
    for n, q in sorted(costly, key=lambda x: -x[1]["perplexity_delta"]):
        if q["quality_ok"] is not False:
            out.append(f"- {n} costs {_pct(q['perplexity_delta'])} perplexity (allowed {_pct(q['quality_allowance'])}), "
                       f"greedy agreement {q['greedy_agreement'] if q['greedy_agreement'] is None else round(q['greedy_agreement'], 2)}.")
    return out


def _ladder_table(doc) -> list[str]:
    tiers = doc["workload"]["concurrency"]
    head = "| rung | added | " + " | ".join(f"tok/s @{c} | gain @{c}" for c in tiers) + " |"
    out = [head, "|" + "---|" * (2 + 2 * len(tiers))]
    steps = {(s["rung"], s["concurrency"]): s for s in doc["analysis"]["ladder_steps"]}
    for i, name in enumerate(doc["analysis"]["ladder_names"]):
        cells = []
        for c in tiers:
            v = _value(doc, name, c, "output_throughput")
            cells += ["-" if v != v else f"{v:.1f}", _pct(steps[(i, c)]["gain"]) if i else "-"]
        added = "baseline" if i == 0 else doc["ladder"][i - 1]
        out.append(f"| {i} | {added} | " + " | ".join(cells) + " |")
    return out


def _interaction_table(doc) -> list[str]:
    inter = doc["analysis"]["interactions"]
    if not inter:
        return ["(no isolation or leave-one-out configuration in this run)"]
    out = ["| technique | concurrency | alone | last | interacts |", "|---|---|---|---|---|"]
    for i in inter:
        flag = "-" if i["interacts"] is None else ("**yes**" if i["interacts"] else "no")
        out.append(f"| {i['technique']} | {i['concurrency']} | {_pct(i['isolated_gain'])} | {_pct(i['loo_gain'])} | {flag} |")
    return out


def _gates_text(doc) -> str:
    g = doc["gates"]
    return (f"Gates: perplexity may rise by at most the sum of the configuration's lossy techniques' allowances "
            f"(FP8 weights {100 * g['fp8']:.1f}%, INT8 {100 * g['int8']:.1f}%, FP8 KV {100 * g['fp8_kv']:.1f}%; "
            f"lossless techniques 0); a configuration without a lossy technique must also repeat the baseline's "
            f"greedy continuation up to its first near-tie on at least {100 * g['greedy_agreement']:.0f}% of "
            f"{doc['workload']['greedy_prompts']} prompts ({doc['workload']['greedy_tokens']} tokens).")


def _quality_table(doc) -> list[str]:
    out = ["| config | perplexity | Δ vs baseline | allowed | greedy agreement | verdict |", "|---|---|---|---|---|---|"]
    for name, q in doc["analysis"]["quality"].items():
        ppl = "-" if q["perplexity"] is None else f"{q['perplexity']:.3f}"
        agr = "-" if q["greedy_agreement"] is None else f"{q['greedy_agreement']:.2f}"
        verdict = "-" if q["quality_ok"] is None else ("ok" if q["quality_ok"] else "FAIL: " + "; ".join(q["quality_failures"]))
        ppl = ppl if q["perplexity"] is None or q["perplexity"] < 1e5 else f"{q['perplexity']:.3g}"
        out.append(f"| {name} | {ppl} | {_pct(q['perplexity_delta'])} | {_pct(q['quality_allowance'])} | {agr} | {verdict} |")
    return out


def markdown_rows(doc: dict[str, Any]) -> list[str]:
    """The "All figures" table: TABLE_COLUMNS' cells of every row of ``configs``."""
    out = ["| " + " | ".join(t for t, _, _ in TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    for r in ordered_rows(doc):
        if r.get("error"):
            out.append(f"| {r['name']} | {r['concurrency']} | error: {r['error']} |" + " |" * (len(TABLE_COLUMNS) - 3))
            continue
        out.append("| " + " | ".join(cell(r, k, d) for _, k, d in TABLE_COLUMNS) + " |")
    return out
