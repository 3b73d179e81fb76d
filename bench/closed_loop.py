"""The engine alone on ``bench peers``' workload: what the served rows are measured against.

The same ShareGPT prompts (bench serve's sample, tokenized as the router tokenizes them), the same
output length, EOS ignored or not, the same concurrency, closed loop: a request is added to one
LLMEngine in this process as soon as one in flight finishes, and the engine steps while anything is
unfinished. No HTTP, no gRPC, no router, no client, no event loop: the gap between this row and
``pdserve serve``'s is what serving adds to the engine's own speed.

The engine gets ``pdserve serve``'s default scheduler and cache (engine/config.py, measured in deploy/runtime_options.py: token
budget, idle budget, prefill-first ratio, KV cache bytes; 32 sequences; no prefix caching, as
``bench peers`` runs the servers) on every core this process may use. Times are taken when a step
returns (``time.perf_counter``, seconds): TTFT from the request's add to the end of the step that
sampled its first token, ITL between the steps that gave it its next tokens; the figures are
bench serve's (bench/metrics.py ``summarize``), so the rows compare key by key.

Run as ``python -m bench.closed_loop ...`` (``bench peers --engine-row`` does, in a process of its
own, so the benchmark's process holds no model); prints one JSON object (``summarize``'s doc, plus
``prompt_lens``: each prompt's token count, for the workload floor).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import deque
from pathlib import Path
from typing import Any, Sequence

from bench.metrics import RequestRecord, summarize


def serve_default_config(model: str):
    """EngineConfig of one agg worker started by ``pdserve serve`` with its defaults (prefix caching off)."""
    from engine import config as ro
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig

    cores = sorted(os.sched_getaffinity(0))
    return EngineConfig(
        model=model,
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=ro.DEFAULT_MAX_NUM_BATCHED_TOKENS,
                                  idle_max_num_batched_tokens=ro.DEFAULT_IDLE_MAX_NUM_BATCHED_TOKENS,
                                  prefill_first_ratio=ro.DEFAULT_PREFILL_FIRST_RATIO),
        cache=CacheConfig(memory_bytes=ro.DEFAULT_KV_CACHE_BYTES, enable_prefix_caching=False),
        dtype="auto", num_threads=len(cores), cpu_cores=tuple(cores))


def run(engine, prompts: Sequence[Sequence[int]], max_concurrency: int, max_tokens: int,
        ignore_eos: bool = True) -> dict[str, Any]:
    """Closed loop over ``prompts`` (token ids) on ``engine`` (an idle LLMEngine): at most
    ``max_concurrency`` in flight. Returns bench/metrics.py ``summarize``'s doc (ms, tok/s).
    Raises RuntimeError if a request ends with an error or an abort."""
    from proto.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    pending = deque(enumerate(prompts))
    records: dict[str, RequestRecord] = {}
    added: dict[str, float] = {}
    last: dict[str, float] = {}
    t0 = time.perf_counter()

    def admit(now: float) -> None:
        i, ids = pending.popleft()
        rid = f"closed-loop-{i}"
        engine.add_request(rid, list(ids), params)
        added[rid] = now
        records[rid] = RequestRecord(i, False, start_s=now - t0, prompt_len=len(ids))

    for _ in range(min(max_concurrency, len(pending))):
        admit(time.perf_counter())
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            rec = records[out.request_id]
            if out.new_token_ids:
                if rec.ttft_s is None:
                    rec.ttft_s = now - added[out.request_id]
                else:
                    rec.itl_s.append(now - last[out.request_id])
                last[out.request_id] = now
                rec.output_tokens += len(out.new_token_ids)
            if out.finished:
                if out.finish_reason in ("error", "abort"):
                    raise RuntimeError(f"{out.request_id} ended with {out.finish_reason}")
                rec.success, rec.e2el_s = True, now - added[out.request_id]
                if pending:
                    admit(now)
    return summarize(list(records.values()), time.perf_counter() - t0)


def load_prompts(model_dir: Path, num_prompts: int, max_tokens: int, dataset_path: Path | None) -> list[list[int]]:
    """bench serve's ShareGPT sample, tokenized with the model's tokenizer as the router does."""
    from tokenizers import Tokenizer

    from bench.datasets import DatasetConfig, load_requests

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))  # router/tokenizer.py's encode
    reqs = load_requests(DatasetConfig("sharegpt", dataset_path, num_prompts, max_tokens), None)
    return [tok.encode(r.prompt, add_special_tokens=True).ids for r in reqs]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.closed_loop", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--num-warmups", type=int, default=2)
    ap.add_argument("--no-ignore-eos", action="store_true")
    ap.add_argument("--dataset-path", type=Path, default=None)
    a = ap.parse_args(argv)
    from engine.llm_engine import LLMEngine
    from engine.model_loader import resolve_model

    model_dir = resolve_model(a.model)
    engine = LLMEngine(serve_default_config(str(model_dir)))
    prompts = load_prompts(model_dir, a.num_prompts, a.max_tokens, a.dataset_path)
    if a.num_warmups:
        run(engine, prompts[:a.num_warmups], a.max_concurrency, a.max_tokens, not a.no_ignore_eos)
    doc = run(engine, prompts, a.max_concurrency, a.max_tokens, not a.no_ignore_eos)
    print(json.dumps({**doc, "prompt_lens": [len(p) for p in prompts]}))  # bench peers: the row's floor


if __name__ == "__main__":
    main()
