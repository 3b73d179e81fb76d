"""pdserve bench spec: speculative decoding off vs on, in one run, on one in-process engine.

For each workload (ShareGPT; "grounded": fix the grammar of a ShareGPT text, whose reply repeats
the prompt) and each concurrency (closed loop: a new request as soon as one finishes), the same
requests run without speculation and with n-gram speculation (load-adaptive k), alternately,
on one shared model runner. Per cell: TPOT p50 (ms, per request (last - first token time) /
(tokens - 1)), output tokens/s, acceptance rate (accepted / draft tokens), mean accepted length
(tokens emitted per verification row = 1 + accepted / rows), and the share of decode rows that
ran with k >= 1. The speculative counters come from the engine itself (EngineStats), which a
serving benchmark over HTTP cannot see. The machine's load average is printed beside the
figures: on a shared machine compare the ratios of one run, not absolute times.

Run as ``pdserve bench spec`` or ``python -m bench.spec``. Speed is measured here, never in tests.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import typer


def command(
    json_out: Path = typer.Option(Path("out/bench_spec.json"), "--json", help="Where to write the results."),
    model: str = typer.Option("smollm2-135m-instruct", "--model", "-m"),
    datasets: str = typer.Option("sharegpt,grounded", help="Comma-separated: sharegpt, grounded."),
    concurrency: str = typer.Option("1,16", help="Comma-separated closed-loop concurrencies."),
    num_prompts: int = typer.Option(16, help="Requests per cell (at least the concurrency)."),
    max_tokens: int = typer.Option(64, help="Most output tokens per request (greedy, EOS honoured)."),
    input_len: int = typer.Option(256, help="grounded: tokens of ShareGPT text per prompt."),
    num_speculative_tokens: int = typer.Option(4, help="k_max of the speculative run."),
    adaptive: bool = typer.Option(True, "--adaptive/--no-adaptive", help="Load-adaptive k (else always k_max)."),
    threads: int = typer.Option(1, help="torch threads."),
) -> None:
    """Speculation off vs on: TPOT p50, output tok/s, acceptance rate, mean accepted length."""
    import torch

    from bench.datasets import DatasetConfig, load_requests
    from engine.model_loader import load_tokenizer
    from engine.model_runner import ModelRunner
    from engine.spec_decode.config import SpeculativeConfig

    torch.set_num_threads(threads)
    runner = ModelRunner(model, block_size=16, num_blocks=2048)
    tok = load_tokenizer(runner.model_config.path)
    spec = SpeculativeConfig(num_speculative_tokens=num_speculative_tokens, adaptive=adaptive)
    cells = []
    for name in [d.strip() for d in datasets.split(",") if d.strip()]:
        for conc in [int(c) for c in concurrency.split(",") if c.strip()]:
            n = max(num_prompts, conc)
            reqs = load_requests(DatasetConfig(name, num_prompts=n, max_tokens=max_tokens, input_len=input_len), tok)
            prompts = [_chat(tok, r.prompt) for r in reqs]
            _run(runner, tok, prompts[:1], 1, max_tokens, None)  # warm-up: first shapes
            off = _run(runner, tok, prompts, conc, max_tokens, None)
            on = _run(runner, tok, prompts, conc, max_tokens, spec)
            cells.append({"dataset": name, "concurrency": conc, "num_prompts": n, "off": off, "on": on,
                          "tpot_speedup": off["tpot_p50_ms"] / on["tpot_p50_ms"],
                          "throughput_ratio": on["output_tok_s"] / off["output_tok_s"],
                          "load_avg_1m": os.getloadavg()[0]})
            _print_row(cells[-1])
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps({"model": runner.model_config.name, "threads": threads, "max_tokens": max_tokens,
                                    "num_speculative_tokens": num_speculative_tokens, "adaptive": adaptive,
                                    "cells": cells}, indent=1) + "\n")
    print(f"wrote {json_out}")


def _chat(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _run(runner, tok, prompts: list[list[int]], conc: int, max_tokens: int, spec) -> dict:
    """Closed loop at ``conc`` requests in flight; per-request token times; engine counters."""
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine
    from proto.sampling import SamplingParams

    eng = LLMEngine(EngineConfig(scheduler=SchedulerConfig(max_num_seqs=max(conc, 1)), cache=CacheConfig(),
                                 speculative=spec), runner=runner, tokenizer=tok)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    times: dict[str, list[float]] = {}
    pending = list(enumerate(prompts))
    start = time.perf_counter()
    while pending or eng.has_unfinished():
        while pending and len(eng.scheduler.running) + len(eng.scheduler.waiting) < conc:
            i, p = pending.pop(0)
            eng.add_request(f"r{i}", p, params)
            times[f"r{i}"] = []
        for out in eng.step():
            times[out.request_id] += [time.perf_counter()] * len(out.new_token_ids)
    wall = time.perf_counter() - start
    tpots = [(t[-1] - t[0]) / (len(t) - 1) * 1e3 for t in times.values() if len(t) > 1]
    st = eng.stats()
    hist = st.spec_k_histogram
    return {"tpot_p50_ms": statistics.median(tpots), "output_tok_s": sum(len(t) for t in times.values()) / wall,
            "output_tokens": sum(len(t) for t in times.values()), "steps": eng.num_steps,
            "acceptance_rate": st.spec_num_accepted_tokens / st.spec_num_draft_tokens if st.spec_num_draft_tokens else None,
            "mean_accepted_length": 1 + st.spec_num_accepted_tokens / st.spec_num_drafts if st.spec_num_drafts else None,
            "speculated_row_share": sum(hist[1:]) / sum(hist) if hist and sum(hist) else None,
            "k_histogram": list(hist)}


def _fmt(v, digits=2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _print_row(c: dict) -> None:
    off, on = c["off"], c["on"]
    print(f"{c['dataset']:<9} conc {c['concurrency']:>2} | TPOT p50 ms off {_fmt(off['tpot_p50_ms'], 1):>6} "
          f"on {_fmt(on['tpot_p50_ms'], 1):>6} (x{_fmt(c['tpot_speedup'])}) | tok/s off {_fmt(off['output_tok_s'], 1):>6} "
          f"on {_fmt(on['output_tok_s'], 1):>6} (x{_fmt(c['throughput_ratio'])}) | accept {_fmt(on['acceptance_rate'])} "
          f"mean len {_fmt(on['mean_accepted_length'])} spec rows {_fmt(on['speculated_row_share'])} "
          f"| load {c['load_avg_1m']:.1f}", flush=True)


if __name__ == "__main__":
    typer.run(command)
