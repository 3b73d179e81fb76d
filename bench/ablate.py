"""pdserve bench ablate: every serving technique measured alone and stacked, with its quality cost, in one run.

Flow (bench/ablate_plan.py decides what runs):
1. Plan: the ladder (baseline, then one technique more per rung, in the field's order), each
   --isolation technique alone on the baseline, the full ladder minus each --leave-one-out
   technique; a configuration playing several roles runs once.
2. Perplexity of the held text once per quality key (dtype, weight quantization, KV-cache
   dtype), through the ``pdserve eval ppl`` machinery, in this process, before any server.
3. Per configuration: start ``pdserve serve`` with its flags (a subprocess in its own process
   group, `bench peers`' lifecycle: wait for /v1/models, SIGINT, SIGKILL after a grace period),
   warm it up, then per concurrency tier send the same requests through the ``bench serve``
   client (bench/load.py, bench/metrics.py) while sampling its workers' Prometheus metrics
   (KV usage peak, preemptions) and its process tree's RSS; then the greedy-agreement prompts;
   stop it. The JSON is rewritten after each configuration (``--resume`` skips those done).
4. Quality verdicts, ladder gains, interactions (bench/ablate_analysis.py); table on stdout,
   JSON, PNG plots and a Markdown report (bench/ablate_report.py).

Run it inside the loopback-only namespace (it starts Ray through `pdserve serve`), e.g.::

    /work/bin/heavy env PYTHONPATH=$PWD .venv/bin/python -m deploy.cli bench ablate \
        --concurrency 1,16,64 --json ablate.json --plot ablate_plots --report ablate.md
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any, Optional, Sequence

import typer

from bench import ablate_plan as plan_mod
from bench.ablate_analysis import Gates
from bench.options import int_list
from engine.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[1]
METRICS_POLL_S = 0.25
_W, _L, _Q, _O = "Workload", "Plan", "Quality", "Output"


def command(
    model: Annotated[str, typer.Option(help="Model served by every configuration.", rich_help_panel=_W)] = "smollm2-135m-instruct",
    dataset: Annotated[str, typer.Option(help="sharegpt | grounded | prefix | random (bench serve's datasets).", rich_help_panel=_W)] = "sharegpt",
    dataset_path: Annotated[Optional[Path], typer.Option(help="ShareGPT JSONL (default: ../shared/data).", rich_help_panel=_W)] = None,
    num_prompts: Annotated[int, typer.Option(help="Most requests per tier: tier c sends min(N, max(--min-requests, 2c)) prompts of its own (no prompt is sent twice to a server).", rich_help_panel=_W)] = 64,
    min_requests: Annotated[int, typer.Option(help="Fewest requests a tier sends.", rich_help_panel=_W)] = 8,
    max_tokens: Annotated[int, typer.Option(help="Output tokens per request (EOS ignored, so every config generates as many).", rich_help_panel=_W)] = 32,
    concurrency: Annotated[str, typer.Option(help="Concurrency tiers, e.g. 1,16,64.", rich_help_panel=_W)] = "1,16,64",
    slo: Annotated[str, typer.Option(help="Request goodput's SLOs in ms, e.g. ttft:2000,tpot:200.", rich_help_panel=_W)] = "ttft:2000,tpot:200",
    num_warmups: Annotated[int, typer.Option(help="Requests sent to each server first, excluded.", rich_help_panel=_W)] = 2,
    seed: Annotated[int, typer.Option(help="Seeds the workload.", rich_help_panel=_W)] = 0,
    techniques: Annotated[Optional[str], typer.Option(help="The ladder, in order (default: "
                          + ",".join(plan_mod.DEFAULT_LADDER) + "). Known: continuous, prefix-caching, chunked-prefill, "
                          "int8, fp8, fp8-kv, spec, disagg; fp8-broken (debug: corrupted FP8 scales).", rich_help_panel=_L)] = None,
    isolation: Annotated[Optional[str], typer.Option(help="Techniques measured alone on the baseline (default: "
                         + ",".join(plan_mod.DEFAULT_ISOLATION) + "; 'none').", rich_help_panel=_L)] = None,
    leave_one_out: Annotated[Optional[str], typer.Option(help="Ladder techniques left out of the full stack (default: "
                             + ",".join(plan_mod.DEFAULT_LEAVE_ONE_OUT) + "; 'none').", rich_help_panel=_L)] = None,
    tuned_batched_tokens: Annotated[int, typer.Option(help="chunked-prefill's --max-num-batched-tokens (the baseline's: "
                                    f"{plan_mod.UNTUNED_BATCHED_TOKENS}).", rich_help_panel=_L)] = plan_mod.DEFAULT_TUNED_BATCHED_TOKENS,
    num_speculative_tokens: Annotated[int, typer.Option(help="spec's most draft tokens per step.", rich_help_panel=_L)] = 4,
    dtype: Annotated[str, typer.Option(help="Model dtype of every configuration (auto: the model's on this device).", rich_help_panel=_L)] = "auto",
    serve_args: Annotated[str, typer.Option(help="Extra flags for every `pdserve serve`, e.g. '--num-blocks 256'.", rich_help_panel=_L)] = "",
    ray_address: Annotated[str, typer.Option(help="Join this Ray cluster instead of each server starting its own.", rich_help_panel=_L)] = "",
    interaction_threshold: Annotated[float, typer.Option(help="Flag a technique whose isolated gain and leave-one-out gain differ in sign or by more than this (0.15 = 15 points).", rich_help_panel=_L)] = 0.15,
    quality_text: Annotated[Optional[Path], typer.Option(help="Held text for perplexity (default: ../shared/data/wikitext-2-raw-test.txt).", rich_help_panel=_Q)] = None,
    quality_max_tokens: Annotated[int, typer.Option(help="Tokens of the held text scored.", rich_help_panel=_Q)] = 4096,
    quality_context: Annotated[int, typer.Option(help="Perplexity window (tokens; eval ppl's default).", rich_help_panel=_Q)] = 1024,
    quality_stride: Annotated[int, typer.Option(help="Perplexity stride (tokens; eval ppl's default).", rich_help_panel=_Q)] = 512,
    greedy_prompts: Annotated[int, typer.Option(help="Prompts of the greedy-agreement check (the pool's first).", rich_help_panel=_Q)] = 8,
    greedy_tokens: Annotated[int, typer.Option(help="Greedy tokens per prompt.", rich_help_panel=_Q)] = 32,
    gate_fp8_ppl: Annotated[float, typer.Option(help="FP8 weights: allowed perplexity increase, %.", rich_help_panel=_Q)] = 2.0,
    gate_int8_ppl: Annotated[float, typer.Option(help="INT8 weights: allowed perplexity increase, %.", rich_help_panel=_Q)] = 1.0,
    gate_fp8_kv_ppl: Annotated[float, typer.Option(help="FP8 KV cache: allowed perplexity increase, %.", rich_help_panel=_Q)] = 1.0,
    gate_greedy_agreement: Annotated[float, typer.Option(help="Least greedy agreement of a lossless configuration.", rich_help_panel=_Q)] = 0.75,
    json_out: Annotated[Path, typer.Option("--json", help="Every figure (rewritten after each configuration).", rich_help_panel=_O)] = Path("ablate.json"),
    plot: Annotated[Optional[Path], typer.Option(help="Write PNG plots here.", rich_help_panel=_O)] = None,
    report: Annotated[Optional[Path], typer.Option(help="Write the Markdown report here.", rich_help_panel=_O)] = None,
    log_dir: Annotated[Optional[Path], typer.Option(help="Each server's output (default: beside --json).", rich_help_panel=_O)] = None,
    resume: Annotated[bool, typer.Option(help="Skip configurations already complete in --json.", rich_help_panel=_O)] = False,
    progress: Annotated[bool, typer.Option(help="Progress bars on stderr.", rich_help_panel=_O)] = True,
) -> None:
    """Techniques measured alone and stacked (ladder, isolation, leave-one-out), with quality deltas, in one run."""
    from bench.metrics import SLO

    tiers = parse_tiers(concurrency)
    known = plan_mod.catalog(tuned_batched_tokens, num_speculative_tokens)
    ladder = plan_mod.parse_names(techniques, "--techniques", known, plan_mod.DEFAULT_LADDER)
    iso = plan_mod.parse_names(isolation, "--isolation", known, plan_mod.DEFAULT_ISOLATION)
    loo = plan_mod.parse_names(leave_one_out, "--leave-one-out", known, plan_mod.DEFAULT_LEAVE_ONE_OUT)
    if techniques is not None and isolation is None:
        iso = tuple(t for t in iso if t in ladder)
    if techniques is not None and leave_one_out is None:
        loo = tuple(t for t in loo if t in ladder)
    plans = plan_mod.build_plan(ladder, iso, loo, known, plan_mod.ServeSettings(dtype=dtype))
    checks = [("--num-prompts", num_prompts, 1), ("--min-requests", min_requests, 1), ("--max-tokens", max_tokens, 1),
              ("--greedy-prompts", greedy_prompts, 1), ("--greedy-tokens", greedy_tokens, 1),
              ("--num-warmups", num_warmups, 0), ("--quality-max-tokens", quality_max_tokens, 2)]
    for flag, value, least in checks:
        if value < least:
            raise UserError(f"{flag} must be >= {least}, got {value}")
    if not 1 <= quality_stride <= quality_context:
        raise UserError(f"--quality-stride must be in [1, --quality-context={quality_context}]")
    extra = shlex.split(serve_args)
    gates = Gates(gate_fp8_ppl / 100, gate_int8_ppl / 100, gate_fp8_kv_ppl / 100, gate_greedy_agreement)
    run = AblationRun(
        model=model, plans=plans, ladder=ladder, tiers=tiers, slo=SLO.parse(slo), gates=gates,
        workload={"dataset": dataset, "dataset_path": str(dataset_path) if dataset_path else None,
                  "num_prompts": num_prompts, "min_requests": min_requests, "max_tokens": max_tokens,
                  "ignore_eos": True, "concurrency": list(tiers), "num_warmups": num_warmups, "seed": seed,
                  "slo": slo, "greedy_prompts": greedy_prompts, "greedy_tokens": greedy_tokens,
                  "quality_text": str(quality_text) if quality_text else None, "quality_max_tokens": quality_max_tokens,
                  "quality_context": quality_context, "quality_stride": quality_stride, "dtype": dtype,
                  "serve_args": extra, "model": model},
        extra_args=extra, ray_address=ray_address, interaction_threshold=interaction_threshold,
        json_out=json_out, log_dir=log_dir or json_out.parent / (json_out.stem + "_logs"), progress=progress)
    doc = run.execute(resume)
    from bench.ablate_report import ablation_table, write_plots, write_report

    print(ablation_table(doc))
    if plot is not None:
        paths = write_plots(doc, plot)
        print(f"wrote {len(paths)} plots to {plot}", file=sys.stderr)
    if report is not None:
        write_report(doc, report, plot)
        print(f"wrote {report}", file=sys.stderr)


def parse_tiers(text: str) -> tuple[int, ...]:
    """``"1,16,64"`` -> (1, 16, 64); UserError naming --concurrency otherwise."""
    return tuple(int_list(text, "--concurrency", distinct=True, example="1,16,64"))


def requests_for_tier(c: int, most: int, least: int) -> int:
    """Requests a tier of concurrency c sends: two waves of c, at least ``least``, at most ``most``."""
    return min(most, max(least, 2 * c))


def tier_slices(tiers: Sequence[int], most: int, least: int, warmups: int) -> tuple[slice, list[slice]]:
    """Where the warm-up and each tier take their requests in the pool: disjoint slices, so no
    tier sends a prompt a server has already seen (prefix caching would otherwise be measured on
    repeats); every configuration gets the same slices, so the same requests."""
    warm, start, out = slice(0, warmups), warmups, []
    for c in tiers:
        n = requests_for_tier(c, most, least)
        out.append(slice(start, start + n))
        start += n
    return warm, out


class AblationRun:
    """One ablation: the plan, where its JSON goes, and how to serve each configuration."""

    def __init__(self, *, model, plans, ladder, tiers, slo, gates, workload, extra_args, ray_address,
                 interaction_threshold, json_out: Path, log_dir: Path, progress: bool) -> None:
        self.model, self.plans, self.ladder, self.tiers = model, plans, ladder, tiers
        self.slo, self.gates, self.workload = slo, gates, workload
        self.extra_args, self.ray_address = extra_args, ray_address
        self.interaction_threshold = interaction_threshold
        self.json_out, self.log_dir, self.progress = json_out, log_dir, progress

    # -- the document ------------------------------------------------------------------------------
    def _fresh_doc(self) -> dict[str, Any]:
        from bench.peers import machine_info

        return {"version": 1, "machine": machine_info(), "workload": self.workload,
                "gates": asdict(self.gates), "ladder": list(self.ladder),
                "plan": [{"name": p.name, "techniques": list(p.techniques), "roles": list(p.roles),
                          "serve_args": p.settings.args(), "env": dict(p.settings.env)} for p in self.plans],
                "configs": [], "servers": {}, "quality": {"perplexity": {}, "greedy": {}, "greedy_reference": None}}

    def _load(self, resume: bool) -> dict[str, Any]:
        doc = self._fresh_doc()
        if not resume or not self.json_out.exists():
            return doc
        try:
            old = json.loads(self.json_out.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"--resume: cannot read {self.json_out}: {e}") from None
        if old.get("workload") != self.workload:
            raise UserError(f"--resume: {self.json_out} was measured on another workload or quality setting; "
                            "use another --json or the same flags")
        for key in ("configs", "servers", "quality"):
            doc[key] = old.get(key, doc[key])
        return doc

    def _save(self, doc: dict[str, Any]) -> None:
        self.json_out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.json_out.with_suffix(self.json_out.suffix + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(self.json_out)   # a run killed mid-write leaves the previous JSON whole

    def _done(self, doc: dict[str, Any], name: str) -> bool:
        have = {r["concurrency"] for r in doc["configs"] if r["name"] == name and r.get("error") is None}
        return have >= set(self.tiers) and name in doc["quality"]["greedy"]

    # -- the run -----------------------------------------------------------------------------------
    def execute(self, resume: bool) -> dict[str, Any]:
        from tqdm import tqdm

        from bench.ablate_analysis import ladder_steps  # noqa: F401  (fail before anything starts)

        doc = self._load(resume)
        self._perplexities(doc)
        self._save(doc)
        requests = self._requests()
        todo = [p for p in self.plans if not self._done(doc, p.name)]
        skipped = len(self.plans) - len(todo)
        with tqdm(total=len(self.plans), initial=skipped, desc="configurations", unit="config",
                  disable=not self.progress, file=sys.stderr) as bar:
            for p in todo:
                bar.set_postfix_str(p.name)
                doc["configs"] = [r for r in doc["configs"] if r["name"] != p.name]
                rows, server, greedy = self._measure(p, requests, doc)
                doc["configs"].extend(rows)
                doc["servers"][p.name] = server
                if greedy is not None:
                    doc["quality"]["greedy"][p.name] = greedy
                finalize(doc, self.plans, self.ladder, self.tiers, self.gates, self.interaction_threshold)
                self._save(doc)
                bar.update(1)
        finalize(doc, self.plans, self.ladder, self.tiers, self.gates, self.interaction_threshold)
        doc["machine"]["load_avg_1m_end"] = os.getloadavg()[0]   # figures under load are not final
        self._save(doc)
        return doc

    def _requests(self):
        from bench.datasets import DatasetConfig, load_requests

        w = self.workload
        path = Path(w["dataset_path"]) if w["dataset_path"] else None
        _, slices = tier_slices(self.tiers, w["num_prompts"], w["min_requests"], w["num_warmups"])
        pool = max(slices[-1].stop, w["num_warmups"] + w["greedy_prompts"])
        cfg = DatasetConfig(w["dataset"], path, pool, w["max_tokens"], seed=w["seed"])
        tok = None
        if w["dataset"] != "sharegpt":
            from engine.model_loader import load_tokenizer, resolve_model

            tok = load_tokenizer(resolve_model(self.model))
        return load_requests(cfg, tok)

    def _perplexities(self, doc: dict[str, Any]) -> None:
        """Perplexity once per quality key not yet in the document."""
        from bench.ablate_quality import held_text_tokens, perplexity
        from evals.perplexity import DEFAULT_TEXT

        w = self.workload
        keys = {}
        for p in self.plans:
            keys.setdefault(quality_label(p.settings), p.settings)
        missing = [(label, s) for label, s in keys.items() if label not in doc["quality"]["perplexity"]]
        if not missing:
            return
        text = Path(w["quality_text"]) if w["quality_text"] else DEFAULT_TEXT
        tokens = held_text_tokens(self.model, text, w["quality_max_tokens"])
        for label, s in missing:
            print(f"pdserve bench ablate: perplexity {label}", file=sys.stderr, flush=True)
            doc["quality"]["perplexity"][label] = perplexity(
                self.model, s.dtype, s.quantization, s.kv_cache_dtype, s.env, tokens,
                min(w["quality_context"], len(tokens)), min(w["quality_stride"], len(tokens)))
            doc["quality"]["perplexity"][label]["text"] = str(text)

    def _measure(self, p, requests, doc) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any] | None]:
        """Serve configuration p, measure every tier and its greedy outputs; errors become rows."""
        return asyncio.run(self._measure_async(p, requests, doc))

    async def _measure_async(self, p, requests, doc):
        from bench.peers import RssSampler, stop, wait_ready

        http, grpc_port, metrics = free_ports(3 + 2)   # metrics, then one port per worker
        url = f"http://127.0.0.1:{http}"
        cmd = serve_command(self.model, p.settings, http, grpc_port, metrics, self.extra_args, self.ray_address)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{p.name}.log"
        env = {**os.environ, **dict(p.settings.env)}
        env["PYTHONPATH"] = os.pathsep.join(x for x in (str(REPO_ROOT), env.get("PYTHONPATH")) if x)
        env.setdefault("RAY_AUTH_MODE", "disabled")
        server: dict[str, Any] = {"command": shlex.join(cmd), "env": dict(p.settings.env), "log": str(log_path)}
        rows: list[dict[str, Any]] = []
        greedy = None
        with log_path.open("w") as log:
            proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
            rss = RssSampler(proc.pid)
            try:
                t0 = time.monotonic()
                await wait_ready(url, proc, rss)
                server["startup_s"] = time.monotonic() - t0
                scraper = WorkerMetrics([metrics + 1 + i for i in range(2)])
                greedy = await self._tiers(p, url, requests, rss, scraper, rows, doc)
            except Exception as e:   # a configuration that cannot serve is a row with its error, not a crash
                server["error"] = f"{type(e).__name__}: {e}"
                server["log_tail"] = _tail(log_path)
                print(f"pdserve bench ablate: {p.name}: {server['error']} (log: {log_path})", file=sys.stderr)
            finally:
                server["peak_rss_mib"] = rss.peak / 2**20
                t_stop = time.monotonic()
                stop(proc)
                server["stop_s"] = time.monotonic() - t_stop
        measured = {r["concurrency"] for r in rows}
        rows += [self._row(p, c, None, error=server.get("error", "not measured")) for c in self.tiers
                 if c not in measured]
        return rows, server, greedy

    async def _tiers(self, p, url, requests, rss, scraper, rows, doc) -> dict[str, Any]:
        from bench.ablate_quality import greedy_agreement, greedy_completions
        from bench.backends import create_backend
        from bench.load import LoadConfig
        from bench.peers import _sampled
        from bench.serve import measure_load

        from bench.load import warm_up

        w = self.workload
        warm, slices = tier_slices(self.tiers, w["num_prompts"], w["min_requests"], w["num_warmups"])
        target = await create_backend("openai", url, None, ignore_eos=True, include_usage=True, timeout_s=600.0)
        try:
            await warm_up(target, requests[warm])
            for c, sl in zip(self.tiers, slices):
                load = LoadConfig(math.inf, 1.0, c, 0, w["seed"], self.progress)
                await scraper.start()
                rss.reset_peak()
                figures, _ = await _sampled(measure_load(target, requests[sl], load, self.slo), rss)
                kv = await scraper.stop()
                rows.append(self._row(p, c, figures, kv=kv, peak_rss_mib=rss.peak / 2**20,
                                      num_requests=sl.stop - sl.start, requests=[sl.start, sl.stop]))
        finally:
            await target.close()
        # the greedy prompts come after the warm-up: the pool's first prompts after it
        prompts = [r.prompt for r in requests[warm.stop:warm.stop + w["greedy_prompts"]]]
        is_baseline = not p.techniques
        outs = await greedy_completions(url, prompts, w["greedy_tokens"], with_logprobs=is_baseline)
        if is_baseline:
            doc["quality"]["greedy_reference"] = outs
        ref = doc["quality"]["greedy_reference"]
        if ref is None:
            return {"greedy_agreement": None, "error": "no baseline reference (the baseline did not serve)"}
        return {**greedy_agreement(ref, outs), "outputs": [o.get("text", o.get("error")) for o in outs]}

    def _row(self, p, c: int, figures: dict[str, Any] | None, *, kv: dict[str, Any] | None = None,
             error: str | None = None, **extra) -> dict[str, Any]:
        row: dict[str, Any] = {"name": p.name, "techniques": list(p.techniques), "roles": list(p.roles),
                               "concurrency": c, "error": error}
        keys = ("output_throughput", "request_goodput", "slo_attainment", "request_throughput", "completed", "failed",
                "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms",
                "median_e2el_ms", "p99_e2el_ms", "duration", "total_output_tokens")
        for k in keys:
            row[k] = None if figures is None else figures.get(k)
        row.update(kv or {"kv_cache_usage_peak": None, "kv_blocks_used_peak": None, "num_preemptions": None})
        row.update(extra)
        return row


def quality_label(s: plan_mod.ServeSettings) -> str:
    """The perplexity table's key of a configuration's numerics."""
    label = f"{s.dtype} w={s.quantization} kv={s.kv_cache_dtype}"
    return label + "".join(f" {k}={v}" for k, v in s.env)


def serve_command(model: str, s: plan_mod.ServeSettings, http: int, grpc_port: int, metrics: int,
                  extra: Sequence[str], ray_address: str) -> list[str]:
    """The `pdserve serve` command line of one configuration."""
    cmd = [sys.executable, "-m", "deploy.cli", "serve", model, *s.args(), "--http-port", str(http),
           "--port", str(grpc_port), "--metrics-port", str(metrics), "--admin-port", "-1", *extra]
    return cmd + (["--ray-address", ray_address] if ray_address else [])


def free_ports(n: int) -> list[int]:
    """n ports free on 127.0.0.1 now: the first two alone, then a block of n - 2 consecutive ones
    (the router's metrics port, then its workers' ports after it)."""
    singles = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            singles.append(s.getsockname()[1])
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n - 2 < 65536 and base not in singles and all(_free(base + i) for i in range(1, n - 2)):
            return singles + [base]
    raise RuntimeError("no block of free ports on 127.0.0.1")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class WorkerMetrics:
    """Polls the workers' Prometheus endpoints while a tier runs: the peak of
    ``pdserve:kv_cache_usage_perc`` and ``pdserve:kv_blocks_used`` (the most of any worker) and
    the growth of ``pdserve:num_preemptions`` (summed over workers). A port that never answers
    (e.g. no second worker in agg mode) is ignored."""

    def __init__(self, ports: Sequence[int]) -> None:
        self.urls = [f"http://127.0.0.1:{p}/metrics" for p in ports]
        self._task: asyncio.Task | None = None
        self._first: dict[str, float] = {}
        self._last: dict[str, float] = {}
        self._peak = {"kv_cache_usage_peak": None, "kv_blocks_used_peak": None}

    async def start(self) -> None:
        self._peak = {"kv_cache_usage_peak": None, "kv_blocks_used_peak": None}
        self._first = await self._scrape()
        self._last = dict(self._first)
        self._task = asyncio.ensure_future(self._poll())

    async def stop(self) -> dict[str, Any]:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._last = await self._scrape() or self._last
        pre = [v - self._first.get(k, 0.0) for k, v in self._last.items() if k.startswith("preempt:")]
        return {**self._peak, "num_preemptions": int(sum(pre)) if pre else None}

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(METRICS_POLL_S)
            if sample := await self._scrape():
                self._last = sample

    async def _scrape(self) -> dict[str, float]:
        import httpx

        out: dict[str, float] = {}
        async with httpx.AsyncClient(timeout=2.0) as client:
            for url in self.urls:
                try:
                    text = (await client.get(url)).text
                except httpx.HTTPError:
                    continue
                for name, value in parse_worker_metrics(text).items():
                    out[f"{name}:{url}"] = value
        for field, metric in (("kv_cache_usage_peak", "usage"), ("kv_blocks_used_peak", "blocks")):
            values = [v for k, v in out.items() if k.startswith(metric + ":")]
            if values:
                self._peak[field] = max(values + [self._peak[field] or 0.0])
        return out


def parse_worker_metrics(text: str) -> dict[str, float]:
    """{"usage", "blocks", "preempt"} of one worker's Prometheus text (summed over its series)."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {"pdserve:kv_cache_usage_perc": "usage", "pdserve:kv_blocks_used": "blocks",
              "pdserve:num_preemptions_total": "preempt"}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in wanted:
                out[wanted[s.name]] = out.get(wanted[s.name], 0.0) + s.value
    return out


def finalize(doc: dict[str, Any], plans, ladder, tiers, gates: Gates, threshold: float) -> None:
    """Attach each row's quality (perplexity delta, greedy agreement, verdict) and the analysis."""
    from bench.ablate_analysis import best_rungs, interactions, ladder_steps, quality_verdict, role_names

    known = plan_mod.catalog()
    by_name = {p.name: p for p in plans}
    ppl = doc["quality"]["perplexity"]
    base = ppl.get(quality_label(by_name["baseline"].settings), {}).get("perplexity")
    verdicts = {}
    for p in plans:
        mine = ppl.get(quality_label(p.settings), {}).get("perplexity")
        delta = None if mine is None or base is None else mine / base - 1.0
        g = doc["quality"]["greedy"].get(p.name, {})
        agreement = 1.0 if p.name == "baseline" and g else g.get("greedy_agreement")
        gate_keys = [known[t].gate for t in p.techniques if t in known and known[t].gate]
        ok, reasons = quality_verdict(delta, agreement, gate_keys, gates)
        verdicts[p.name] = {"perplexity": mine, "perplexity_delta": delta, "greedy_agreement": agreement,
                            "quality_ok": ok, "quality_failures": reasons,
                            "quality_allowance": gates.allowance(gate_keys)}
    for row in doc["configs"]:
        row.update(verdicts.get(row["name"], {}))
    names, per = role_names(plans)
    steps = ladder_steps(doc["configs"], names, list(ladder), list(tiers))
    doc["analysis"] = {"ladder_names": names, "ladder_steps": steps, "best_rungs": best_rungs(steps, list(tiers)),
                       "interactions": interactions(doc["configs"], per, list(tiers), threshold),
                       "interaction_threshold": threshold, "roles": per, "quality": verdicts}
