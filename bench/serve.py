"""pdserve bench serve: serving benchmark against pdserve or any OpenAI-compatible server.

The figures carry ``vllm bench serve``'s names (bench/metrics.py) so results compare across tools.
Flow: load the workload -> connect to the target -> for each request rate (one, or a sweep):
warm up, send on the arrival schedule, aggregate -> print the table, write JSON and plots.

Examples::

    pdserve bench serve --backend openai --url http://127.0.0.1:8000 --request-rate 2 \
        --slo ttft:500,tpot:100 --json pdserve.json --plot plots/
    pdserve bench serve --backend openai --url http://127.0.0.1:8080 --json llamacpp.json   # a peer
    pdserve bench serve --backend pdserve-grpc --url 127.0.0.1:50051 --dataset random \
        --input-len 512 --output-len 64 --sweep-rates 0.5,1,2,4 --slo ttft:1000,tpot:200
    pdserve bench compare pdserve.json llamacpp.json

On a cold CPU server the first requests are slow (first prefills of each shape): raise
``--num-warmups`` so they do not count.
"""

from __future__ import annotations

import asyncio
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Optional

import typer

from engine.errors import UserError

if TYPE_CHECKING:
    from bench.datasets import DatasetConfig
    from bench.load import LoadConfig, RunResult
    from bench.metrics import SLO, RequestRecord

_WORKLOAD = "Workload"
_LOAD = "Load"
_OUT = "Output"


def command(
    backend: Annotated[str, typer.Option(help="Target: 'openai' (/v1/completions, streaming) or 'pdserve-grpc'.")] = "openai",
    url: Annotated[Optional[str], typer.Option(help="openai: http://HOST:PORT; pdserve-grpc: HOST:PORT.")] = None,
    model: Annotated[Optional[str], typer.Option(help="Model name sent to the target (default: the first one it lists).")] = None,
    tokenizer: Annotated[Optional[str], typer.Option(help="Tokenizer dir/id for token counts (default: pdserve's model of that name).")] = None,
    dataset: Annotated[str, typer.Option(help="sharegpt | random | prefix | grounded (fix the grammar of a ShareGPT text: the reply repeats the prompt).", rich_help_panel=_WORKLOAD)] = "sharegpt",
    dataset_path: Annotated[Optional[Path], typer.Option(help="ShareGPT JSONL ({'prompt'}) or original JSON list (default: ../shared/data/sharegpt_prompts.jsonl).", rich_help_panel=_WORKLOAD)] = None,
    num_prompts: Annotated[int, typer.Option(help="Measured requests per rate.", rich_help_panel=_WORKLOAD)] = 100,
    max_tokens: Annotated[Optional[int], typer.Option(help="Output tokens per request (overrides the dataset's lengths).", rich_help_panel=_WORKLOAD)] = None,
    input_len: Annotated[int, typer.Option(help="random: prompt tokens; prefix: tokens after the shared prefix.", rich_help_panel=_WORKLOAD)] = 1024,
    output_len: Annotated[int, typer.Option(help="random/prefix: output tokens.", rich_help_panel=_WORKLOAD)] = 128,
    range_ratio: Annotated[float, typer.Option(help="random/prefix: lengths uniform in [L(1-r), L(1+r)].", rich_help_panel=_WORKLOAD)] = 0.0,
    prefix_len: Annotated[int, typer.Option(help="prefix: tokens in each shared system prompt.", rich_help_panel=_WORKLOAD)] = 256,
    num_prefixes: Annotated[int, typer.Option(help="prefix: number of distinct shared prefixes.", rich_help_panel=_WORKLOAD)] = 4,
    ignore_eos: Annotated[bool, typer.Option(help="Ask the target to ignore EOS (vLLM, SGLang, llama.cpp, pdserve).", rich_help_panel=_WORKLOAD)] = False,
    seed: Annotated[int, typer.Option(help="Seeds the workload and the arrival times.", rich_help_panel=_WORKLOAD)] = 0,
    request_rate: Annotated[float, typer.Option(help="Mean requests/s (Poisson when burstiness=1); inf sends all at once.", rich_help_panel=_LOAD)] = math.inf,
    burstiness: Annotated[float, typer.Option(help="Gamma shape of inter-arrival gaps: 1 Poisson, <1 burstier, >1 steadier.", rich_help_panel=_LOAD)] = 1.0,
    max_concurrency: Annotated[Optional[int], typer.Option(help="At most this many requests in flight.", rich_help_panel=_LOAD)] = None,
    num_warmups: Annotated[int, typer.Option(help="Requests sent first and excluded from the figures.", rich_help_panel=_LOAD)] = 1,
    sweep_rates: Annotated[Optional[str], typer.Option(help="Comma list of rates, e.g. 0.5,1,2,4: one run each, then the goodput rate.", rich_help_panel=_LOAD)] = None,
    slo: Annotated[Optional[str], typer.Option(help="SLOs in ms, e.g. ttft:200,tpot:50 (also e2el).", rich_help_panel=_LOAD)] = None,
    attainment_target: Annotated[float, typer.Option(help="Sweep goodput: highest rate with at least this SLO attainment.", rich_help_panel=_LOAD)] = 0.9,
    timeout: Annotated[float, typer.Option(help="Per-request timeout (s); a timed-out request counts as failed.", rich_help_panel=_LOAD)] = 600.0,
    api_key: Annotated[Optional[str], typer.Option("--api-key", help="The target's API key, sent as 'Authorization: Bearer KEY' (default: $PDSERVE_API_KEY).", rich_help_panel=_LOAD)] = None,
    no_stream_usage: Annotated[bool, typer.Option("--no-stream-usage", help="Do not send stream_options.include_usage (for servers that reject it).", rich_help_panel=_LOAD)] = False,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write every figure and per-request record here.", rich_help_panel=_OUT)] = None,
    plot: Annotated[Optional[Path], typer.Option(help="Write PNG plots into this directory.", rich_help_panel=_OUT)] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar on stderr.", rich_help_panel=_OUT)] = True,
) -> None:
    """Serving benchmark against pdserve or any OpenAI-compatible server (TTFT, TPOT, ITL, E2E, goodput)."""
    from bench.datasets import DatasetConfig
    from bench.load import LoadConfig, RunResult
    from bench.metrics import SLO
    from router.auth import resolve_api_key

    rates = parse_rates(sweep_rates) if sweep_rates else [request_rate]
    data_cfg = DatasetConfig(dataset, dataset_path, num_prompts, max_tokens, input_len, output_len, range_ratio,
                             prefix_len, num_prefixes, seed)
    load_cfgs = [LoadConfig(r, burstiness, max_concurrency, num_warmups, seed, progress) for r in rates]
    if not 0.0 < attainment_target <= 1.0:
        raise UserError("--attainment-target must be in (0, 1]")
    spec = BenchSpec(backend=backend, url=url or default_url(backend), model=model, tokenizer=tokenizer,
                     dataset=data_cfg, loads=load_cfgs, slo=SLO.parse(slo), sweep=sweep_rates is not None,
                     attainment_target=attainment_target, ignore_eos=ignore_eos,
                     include_usage=not no_stream_usage, timeout_s=timeout,
                     api_key=resolve_api_key(api_key))
    emit(asyncio.run(run_benchmark(spec)), json_out, plot)


@dataclass(frozen=True)
class BenchSpec:
    """Everything one ``bench serve`` invocation needs: validated configs, no I/O yet."""

    backend: str
    url: str
    model: str | None
    tokenizer: str | None
    dataset: "DatasetConfig"
    loads: list["LoadConfig"]
    slo: "SLO | None"
    sweep: bool
    attainment_target: float
    ignore_eos: bool
    include_usage: bool
    timeout_s: float
    api_key: str | None = field(default=None, repr=False)   # never printed or written to the JSON


@dataclass
class BenchOutcome:
    """The JSON document (one run, or a sweep with ``runs``) and each run's records, for the plots."""

    doc: dict[str, Any]
    records: list[list["RequestRecord"]]


def default_url(backend: str) -> str:
    return "127.0.0.1:50051" if backend == "pdserve-grpc" else "http://127.0.0.1:8000"


def parse_rates(spec: str) -> list[float]:
    """``"0.5,1,2"`` -> [0.5, 1.0, 2.0], ascending; UserError for anything not a finite positive number."""
    try:
        rates = sorted(float(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise UserError(f"--sweep-rates {spec!r}: expected numbers separated by commas, e.g. 0.5,1,2,4") from None
    if not rates or any(not (0 < r < math.inf) for r in rates):
        raise UserError(f"--sweep-rates {spec!r}: rates must be finite and > 0")
    return rates


async def run_benchmark(spec: BenchSpec) -> BenchOutcome:
    """Run every configured rate against the target, one after another."""
    from bench.backends import create_backend
    from bench.datasets import load_requests
    from bench.metrics import goodput_rate
    from bench.report import run_document
    from bench.tokenizer import LazyTokenizer

    tok = LazyTokenizer(spec.tokenizer, spec.model)
    target = await create_backend(spec.backend, spec.url, spec.model,
                                  ignore_eos=spec.ignore_eos, include_usage=spec.include_usage,
                                  timeout_s=spec.timeout_s, api_key=spec.api_key)
    tok.set_model(target.model)
    docs, records = [], []
    try:
        # ShareGPT prompts need no tokenizer when the target reports usage; random/prefix lengths do.
        needs_tok = spec.dataset.name != "sharegpt" or spec.tokenizer is not None
        requests = load_requests(spec.dataset, tok.get() if needs_tok else None)
        header = run_header(spec, target.model, len(requests))
        for load in spec.loads:
            figures, result = await measure_load(target, requests, load, spec.slo, tok.get)
            docs.append(run_document(header, load.request_rate, figures, result.records))
            records.append(result.records)
    finally:
        await target.close()
    if not spec.sweep:
        return BenchOutcome(docs[0], records)
    points = [(d["request_rate"], d["slo_attainment"]) for d in docs]
    doc = {**header, "sweep_rates": [d["request_rate"] for d in docs], "attainment_target": spec.attainment_target,
           "goodput_rate": goodput_rate(points, spec.attainment_target) if spec.slo else None, "runs": docs}
    return BenchOutcome(doc, records)


async def measure_load(target, requests, load: "LoadConfig", slo: "SLO | None",
                       tokenizer: Callable[[], Any] = lambda: None) -> tuple[dict[str, Any], "RunResult"]:
    """(figures, result) of one load against an open backend: the requests sent as ``load`` says,
    output tokens counted with ``tokenizer()`` where the target reported no usage, then summarized
    (bench/metrics.py) against ``slo``. Used by ``bench serve`` per rate and ``bench ablate`` per tier."""
    from bench.backends import count_output_tokens
    from bench.load import run_load
    from bench.metrics import summarize

    result = await run_load(target, requests, load)
    if any(r.output_tokens_source == "chunks" for r in result.records):  # the target sent no usage
        count_output_tokens(result.records, tokenizer())
        if tokenizer() is None:
            print("pdserve bench: the target reported no usage and no tokenizer is known: output tokens "
                  "are counted as streamed chunks (pass --tokenizer PATH)", file=sys.stderr)
    return summarize(result.records, result.duration_s, slo), result


def run_header(spec: BenchSpec, model_id: str, num_prompts: int) -> dict[str, Any]:
    """The settings every run of this invocation shares, recorded in its JSON."""
    load = spec.loads[0]
    return {"backend": spec.backend, "base_url": spec.url, "model_id": model_id, "tokenizer_id": spec.tokenizer,
            "dataset": spec.dataset.name, "num_prompts": num_prompts, "burstiness": load.burstiness,
            "max_concurrency": load.max_concurrency, "num_warmups": load.num_warmups, "seed": spec.dataset.seed,
            "slo": spec.slo.to_json() if spec.slo else None}


def emit(outcome: BenchOutcome, json_out: Path | None, plot_dir: Path | None) -> None:
    """Print the table; write the JSON and the plots if asked."""
    from bench.report import run_table, sweep_table, write_json

    doc = outcome.doc
    print(sweep_table(doc) if "runs" in doc else run_table(doc))
    if json_out:
        write_json(doc, json_out)
        print(f"wrote {json_out}", file=sys.stderr)
    if plot_dir:
        from bench.plots import plot_run, plot_sweep

        runs = doc.get("runs", [doc])
        for run, recs in zip(runs, outcome.records):
            plot_run(recs, plot_dir, prefix="" if len(runs) == 1 else f"rate_{run['request_rate']:g}_")
        if "runs" in doc:
            plot_sweep(runs, doc["attainment_target"], plot_dir)
        print(f"wrote plots to {plot_dir}", file=sys.stderr)
