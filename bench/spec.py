"""pdserve bench spec: speculative decoding off vs on, in one run, on one in-process engine.

For each workload (ShareGPT; "grounded": fix the grammar of a ShareGPT text, whose reply repeats
the prompt) and each concurrency (closed loop: a new request as soon as one finishes), the same
requests run without speculation and with n-gram speculation (load-adaptive k) on two engines
on two model runners, *in lockstep*: one step of one engine, then one of the other (who goes
first alternates; both runners are warmed up on the cell's first prompt). Each
engine's clock advances only by the duration of its own steps, so both see the same machine
load (which drifts by 3x within minutes on a shared box) and the ratio is fair.
Per cell: TPOT p50 (ms, per request (last - first token time) / (tokens - 1), on the engine's
clock), TTFT p50 (ms, first token time - the clock when the request was added; with a draft model
it includes the draft's prefill of the prompt, engine/spec_decode/draft.py), output tokens/s (tokens / engine clock), acceptance rate (accepted / draft tokens), mean accepted length
(tokens emitted per verification row = 1 + accepted / rows), and the share of decode rows that
ran with k >= 1. The speculative counters come from the engine itself (EngineStats), which a
serving benchmark over HTTP cannot see. The machine's load average is printed beside the
figures: on a shared machine compare the ratios of one run, not absolute times.

With ``--speculative-method draft --speculative-model M [--speculative-quantization int8]`` the
speculative engine drafts with a model instead (for the bundled model, a quantized copy of
itself); the draft's and the target's decode-step costs are measured alone beforehand (batch 1,
a 256-token context, median of 20 forwards each) and their ratio reported: the ceiling of a
draft's gain is set by it (with acceptance a and k drafts, one verification emits on average
(1 - a^(k+1)) / (1 - a) tokens for the cost of 1 + k x ratio target steps). The draft's one-time
prefill of each prompt (at the end of the step that sampled the prompt's first token, so in
TTFT, not TPOT; in P/D the decode worker recomputes every prompt's draft KV the same way) is
reported per cell: tokens, seconds and share of the run.

Defaults follow ``pdserve serve``: dtype auto, a 128-token step budget (2048 with no decode row).

Run as ``pdserve bench spec`` or ``python -m bench.spec``. Speed is measured here, never in tests.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import typer

from bench.options import int_list

# pdserve serve's step budgets (deploy/runtime_options.py; bench/ may not import deploy/, which imports it)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 128
DEFAULT_IDLE_MAX_NUM_BATCHED_TOKENS = 2048


def command(
    json_out: Path = typer.Option(Path("out/bench_spec.json"), "--json", help="Where to write the results."),
    model: str = typer.Option("smollm2-135m-instruct", "--model", "-m"),
    datasets: str = typer.Option("sharegpt,grounded", help="Comma-separated: sharegpt, grounded."),
    concurrency: str = typer.Option("1,4,16,32", help="Comma-separated closed-loop concurrencies."),
    num_prompts: int = typer.Option(16, help="Requests per cell (at least the concurrency)."),
    max_tokens: int = typer.Option(64, help="Most output tokens per request (greedy, EOS honoured)."),
    input_len: int = typer.Option(256, help="grounded: tokens of ShareGPT text per prompt."),
    num_speculative_tokens: int = typer.Option(4, help="k_max of the speculative run."),
    spec_ngram_max: int = typer.Option(4, "--spec-ngram-max", help="ngram: longest n-gram matched."),
    spec_ngram_min: int = typer.Option(2, "--spec-ngram-min", help="ngram: shortest n-gram matched."),
    max_num_batched_tokens: int = typer.Option(DEFAULT_MAX_NUM_BATCHED_TOKENS, "--max-num-batched-tokens",
                                               help="Token budget of one step (pdserve serve's default)."),
    adaptive: bool = typer.Option(True, "--adaptive/--no-adaptive", help="Load-adaptive k (else always k_max)."),
    threads: int = typer.Option(1, help="torch threads."),
    speculative_method: str = typer.Option("ngram", "--speculative-method", help="ngram or draft."),
    speculative_model: str = typer.Option(None, "--speculative-model", help="draft: the draft model (name or path)."),
    speculative_quantization: str = typer.Option("none", "--speculative-quantization",
                                                 help="draft: its linear method (none, int8, fp8)."),
    speculative_draft_vocab_size: int = typer.Option(None, "--speculative-draft-vocab-size",
                                                     help="draft: its LM head covers token ids < N only "
                                                          "(FR-Spec; default: the whole vocabulary)."),
    dtype: str = typer.Option("auto", "--dtype", help="Target (and draft) dtype: auto (as pdserve serve: bf16 "
                                                      "with native bf16), float32 or bfloat16."),
) -> None:
    """Speculation off vs on: TPOT p50, output tok/s, acceptance rate, mean accepted length."""
    import torch

    from bench.datasets import DatasetConfig, load_requests
    from engine.model_loader import load_tokenizer
    from engine.model_runner import ModelRunner
    from engine.spec_decode.config import SpeculativeConfig

    from engine.errors import UserError
    from engine.platform import resolve_dtype_name
    from engine.spec_decode.config import from_flags

    if dtype not in ("auto", "float32", "bfloat16"):
        raise UserError(f"--dtype must be auto, float32 or bfloat16, got {dtype!r}")
    if max_num_batched_tokens < 1:
        raise UserError(f"--max-num-batched-tokens must be >= 1, got {max_num_batched_tokens}")
    concurrencies = int_list(concurrency, "--concurrency", example="1,4,16")
    dtype = resolve_dtype_name(dtype)
    flags = from_flags(speculative_method, num_speculative_tokens, speculative_model, spec_ngram_max, spec_ngram_min,
                       speculative_quantization, speculative_draft_vocab_size)
    torch.set_num_threads(threads)
    tdtype = getattr(torch, dtype)
    runner, runner_spec = (ModelRunner(model, block_size=16, num_blocks=1024, dtype=tdtype) for _ in range(2))
    tok = load_tokenizer(runner.model_config.path)
    spec = SpeculativeConfig(flags.method, num_speculative_tokens, spec_ngram_max, spec_ngram_min, model=flags.model,
                             quantization=flags.quantization, adaptive=adaptive,
                             draft_vocab_size=speculative_draft_vocab_size)
    draft = None if spec.method != "draft" else ModelRunner(spec.model, block_size=16, num_blocks=1024, dtype=tdtype,
                                                            quantization=spec.quantization)
    if draft is not None and spec.draft_vocab_size is not None:  # before its step is timed (the engine would do it)
        from engine.spec_decode.draft_vocab import restrict_lm_head

        restrict_lm_head(draft.model, spec.draft_vocab_size)
    step_cost = None
    if draft is not None:
        target_ms, draft_ms = _decode_step_ms(runner), _decode_step_ms(draft)
        step_cost = {"target_ms": target_ms, "draft_ms": draft_ms, "draft_target_ratio": draft_ms / target_ms}
        vocab = "" if spec.draft_vocab_size is None else f", head {spec.draft_vocab_size} ids"
        print(f"decode step alone (batch 1, 256-token context): target {target_ms:.2f} ms, draft "
              f"({spec.model}, {spec.quantization}{vocab}) {draft_ms:.2f} ms, ratio {draft_ms / target_ms:.2f}", flush=True)
    budget = max_num_batched_tokens
    cells = []
    for name in [d.strip() for d in datasets.split(",") if d.strip()]:
        for conc in concurrencies:
            n = max(num_prompts, conc)
            reqs = load_requests(DatasetConfig(name, num_prompts=n, max_tokens=max_tokens, input_len=input_len), tok)
            prompts = [_chat(tok, r.prompt) for r in reqs]
            for r in (runner, runner_spec):  # warm-up: first shapes, on both runners
                _Loop(r, tok, prompts[:1], 1, max_tokens, None, budget).run_alone()
            off = _Loop(runner, tok, prompts, conc, max_tokens, None, budget)
            on = _Loop(runner_spec, tok, prompts, conc, max_tokens, spec, budget, draft)
            turn = 0
            while not (off.done and on.done):  # alternate who goes first: neither always runs right after the other
                for arm in ((off, on) if turn % 2 == 0 else (on, off)):
                    arm.step()
                turn += 1
            off, on = off.figures(), on.figures()
            cells.append({"dataset": name, "concurrency": conc, "num_prompts": n, "off": off, "on": on,
                          "tpot_speedup": off["tpot_p50_ms"] / on["tpot_p50_ms"],
                          "throughput_ratio": on["output_tok_s"] / off["output_tok_s"],
                          "load_avg_1m": os.getloadavg()[0]})
            _print_row(cells[-1])
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps({"model": runner.model_config.name, "threads": threads, "max_tokens": max_tokens,
                                    "max_num_batched_tokens": budget, "ngram": [spec.ngram_min, spec.ngram_max],
                                    "num_speculative_tokens": num_speculative_tokens, "adaptive": adaptive,
                                    "dtype": dtype, "speculative_method": spec.method, "speculative_model": spec.model,
                                    "speculative_quantization": spec.quantization,
                                    "speculative_draft_vocab_size": spec.draft_vocab_size, "step_cost": step_cost,
                                    "cells": cells}, indent=1) + "\n")
    print(f"wrote {json_out}")


def _chat(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


class _Loop:
    """One engine in a closed loop at ``conc`` requests in flight, timed on its own step clock."""

    def __init__(self, runner, tok, prompts: list[list[int]], conc: int, max_tokens: int, spec, budget: int,
                 draft_runner=None) -> None:
        from engine.config import CacheConfig, EngineConfig, SchedulerConfig
        from engine.llm_engine import LLMEngine
        from proto.sampling import SamplingParams

        sched = SchedulerConfig(max_num_seqs=max(conc, 1), max_num_batched_tokens=budget,
                                idle_max_num_batched_tokens=max(budget, DEFAULT_IDLE_MAX_NUM_BATCHED_TOKENS))
        self.eng = LLMEngine(EngineConfig(scheduler=sched,
                                          cache=CacheConfig(), speculative=spec),
                             runner=runner, tokenizer=tok, draft_runner=draft_runner)
        self.params = SamplingParams(temperature=0, max_tokens=max_tokens)
        self.pending = list(enumerate(prompts))
        self.conc, self.clock = conc, 0.0
        self.times: dict[str, list[float]] = {}
        self.arrivals: dict[str, float] = {}

    @property
    def done(self) -> bool:
        return not self.pending and not self.eng.has_unfinished()

    def step(self) -> None:
        if self.done:
            return
        s = self.eng.scheduler
        while self.pending and len(s.running) + len(s.waiting) < self.conc:
            i, p = self.pending.pop(0)
            self.eng.add_request(f"r{i}", p, self.params)
            self.times[f"r{i}"], self.arrivals[f"r{i}"] = [], self.clock
        start = time.perf_counter()
        outs = self.eng.step()
        self.clock += time.perf_counter() - start
        for out in outs:
            self.times[out.request_id] += [self.clock] * len(out.new_token_ids)

    def run_alone(self) -> None:
        while not self.done:
            self.step()

    def figures(self) -> dict:
        times, st = self.times, self.eng.stats()
        tpots = [(t[-1] - t[0]) / (len(t) - 1) * 1e3 for t in times.values() if len(t) > 1]
        hist = st.spec_k_histogram
        tokens = sum(len(t) for t in times.values())
        ttfts = [(t[0] - self.arrivals[rid]) * 1e3 for rid, t in times.items() if t]
        return {"tpot_p50_ms": statistics.median(tpots), "ttft_p50_ms": statistics.median(ttfts),
                "output_tok_s": tokens / self.clock,
                "output_tokens": tokens, "steps": self.eng.num_steps, "engine_seconds": self.clock,
                "acceptance_rate": st.spec_num_accepted_tokens / st.spec_num_draft_tokens if st.spec_num_draft_tokens else None,
                "mean_accepted_length": 1 + st.spec_num_accepted_tokens / st.spec_num_drafts if st.spec_num_drafts else None,
                "speculated_row_share": sum(hist[1:]) / sum(hist) if hist and sum(hist) else None,
                "k_histogram": list(hist), **self._draft_figures()}

    def _draft_figures(self) -> dict:
        """A draft model's one-time prefill of each context new to its cache (in P/D: every
        prompt, whose KV the decode worker recomputes for the draft): tokens and seconds."""
        spec = self.eng.speculator
        proposer = getattr(spec, "proposer", None)
        if not hasattr(proposer, "num_prefill_tokens"):
            return {}
        return {"draft_prefill_tokens": proposer.num_prefill_tokens,
                "draft_prefill_s": proposer.prefill_seconds_total, "draft_forwards": proposer.num_forwards}


def _decode_step_ms(runner, context: int = 256, reps: int = 20) -> float:
    """Median ms of one decode forward (batch 1) at position ``context`` after a ``context``-token prefill."""
    from engine.batch import SeqChunk

    blocks = list(range(context // runner.block_size + 1))
    ids = [100 + i % 1000 for i in range(context)]
    runner.forward([SeqChunk(ids, 0, blocks, 1)])
    times = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        runner.forward([SeqChunk([42], context, blocks, 1)])
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) * 1e3


def _fmt(v, digits=2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _print_row(c: dict) -> None:
    off, on = c["off"], c["on"]
    print(f"{c['dataset']:<9} conc {c['concurrency']:>2} | TPOT p50 ms off {_fmt(off['tpot_p50_ms'], 1):>6} "
          f"on {_fmt(on['tpot_p50_ms'], 1):>6} (x{_fmt(c['tpot_speedup'])}) | tok/s off {_fmt(off['output_tok_s'], 1):>6} "
          f"on {_fmt(on['output_tok_s'], 1):>6} (x{_fmt(c['throughput_ratio'])}) | TTFT p50 ms off "
          f"{_fmt(off['ttft_p50_ms'], 0)} on {_fmt(on['ttft_p50_ms'], 0)} | accept {_fmt(on['acceptance_rate'])} "
          f"mean len {_fmt(on['mean_accepted_length'])} spec rows {_fmt(on['speculated_row_share'])} "
          + (f"| draft prefill {on['draft_prefill_tokens']} tok {on['draft_prefill_s']:.2f} s "
             f"({on['draft_prefill_s'] / on['engine_seconds']:.0%} of the run) " if "draft_prefill_s" in on else "")
          + f"| load {c['load_avg_1m']:.1f}", flush=True)


if __name__ == "__main__":
    typer.run(command)
