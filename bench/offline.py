"""pdserve bench offline: continuous vs static batching throughput on one engine, no server.

Every request arrives at t=0; output lengths are fixed (--max-tokens) or drawn per request from
a seeded log-normal (--output-len-dist lognormal:MEDIAN:SIGMA:CAP, default 64:1.0:256) and
generated with EOS ignored, so each request produces exactly its length. Reports output and
request throughput, mean/p99 request latency, KV usage peak, KV waste (allocated-but-unfilled
slots over allocated slots, averaged over steps) and preemptions; writes JSON, prints a table.

Static batching pads as HF ``generate`` does by default (prompts left-padded to the batch's
longest, every row attending the longest context, KV reserved for the rectangle; see
engine/static_batching.py); --no-static-padding runs a paged static batch instead, where only
finished rows are padding. Both modes share one runner, its kernels and its KV cache (2 GiB by
default, so a padded batch of 32 ShareGPT rows fits and both modes run 32 rows).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

DEFAULT_DIST = "lognormal:64:1.0:256"


def parse_length_dist(spec: str) -> tuple[float, float, int]:
    """"lognormal:MEDIAN:SIGMA:CAP" -> (median, sigma, cap). Raises UserError naming the format."""
    from engine.errors import UserError

    parts = spec.split(":")
    try:
        if parts[0] != "lognormal" or len(parts) != 4:
            raise ValueError
        median, sigma, cap = float(parts[1]), float(parts[2]), int(parts[3])
        if median <= 0 or sigma < 0 or cap < 1:
            raise ValueError
    except ValueError:
        raise UserError(f"--output-len-dist {spec!r}: expected lognormal:MEDIAN:SIGMA:CAP with MEDIAN > 0, "
                        "SIGMA >= 0, CAP >= 1 (e.g. lognormal:64:1.0:256)") from None
    return median, sigma, cap


def output_lengths(n: int, max_tokens: int | None, dist: str, seed: int) -> list[int]:
    """Per-request output lengths: all max_tokens, or seeded log-normal draws clipped to [1, CAP]."""
    if max_tokens is not None:
        return [max_tokens] * n
    import numpy as np

    median, sigma, cap = parse_length_dist(dist)
    draws = np.random.default_rng(seed).lognormal(np.log(median), sigma, n)
    return [int(x) for x in np.clip(np.rint(draws), 1, cap)]


def load_prompts(dataset: str, path: Path | None, n: int) -> list[str]:
    from engine.errors import UserError

    if dataset != "sharegpt":
        raise UserError(f"--dataset {dataset!r}: only 'sharegpt' is supported")
    path = path or Path(__file__).resolve().parents[2] / "shared" / "data" / "sharegpt_prompts.jsonl"
    if not path.exists():
        raise UserError(f"dataset file {path} not found: pass --dataset-path")
    with path.open(encoding="utf-8") as f:  # not splitlines(): prompts may hold U+2028
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    if len(prompts) < n:
        raise UserError(f"{path} has {len(prompts)} prompts, --num-prompts asks for {n}")
    return prompts[:n]


def run_mode(runner, tokenizer, prompt_ids: list[list[int]], lengths: list[int], batching: str,
             max_num_seqs: int, max_num_batched_tokens: int, num_blocks: int | None,
             static_padding: bool = True) -> dict:
    """Run every request through one engine in ``batching`` mode; return the metrics dict."""
    import numpy as np

    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine
    from proto.sampling import SamplingParams

    cfg = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, batching=batching,
                                                 max_num_batched_tokens=max_num_batched_tokens,
                                                 static_padding=static_padding),
                       cache=CacheConfig(num_blocks=num_blocks, enable_prefix_caching=False))
    eng = LLMEngine(cfg, runner=runner, tokenizer=tokenizer, track_kv_waste=True)
    for i, (ids, n) in enumerate(zip(prompt_ids, lengths)):
        eng.add_request(f"{batching}-{i}", ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    start, latencies, out_tokens = time.perf_counter(), [], 0
    while eng.has_unfinished():
        for out in eng.step():
            out_tokens += len(out.new_token_ids)
            if out.finished:
                latencies.append(time.perf_counter() - start)
    duration = time.perf_counter() - start
    st = eng.stats()
    return {
        "batching": batching, "num_requests": len(prompt_ids), "duration_s": duration,
        "total_prompt_tokens": sum(map(len, prompt_ids)), "total_output_tokens": out_tokens,
        "output_throughput": out_tokens / duration, "request_throughput": len(prompt_ids) / duration,
        "mean_latency_s": float(np.mean(latencies)), "p99_latency_s": float(np.percentile(latencies, 99)),
        "kv_usage_peak": eng.kv_usage_peak, "kv_waste": float(np.mean(eng.kv_waste_samples)),
        "num_preemptions": st.num_preemptions, "num_steps": st.num_steps, "kv_blocks_total": st.kv_blocks_total,
        "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
        **({"static_padding": static_padding} if batching == "static" else {}),
    }


def print_table(results: dict[str, dict]) -> None:
    cols = [("output tok/s", "output_throughput", "{:.1f}"), ("req/s", "request_throughput", "{:.3f}"),
            ("mean lat s", "mean_latency_s", "{:.1f}"), ("p99 lat s", "p99_latency_s", "{:.1f}"),
            ("KV peak", "kv_usage_peak", "{:.1%}"), ("KV waste", "kv_waste", "{:.1%}"),
            ("preempt", "num_preemptions", "{}"), ("steps", "num_steps", "{}")]
    print(f"{'mode':<11}" + "".join(f"{c[0]:>13}" for c in cols))
    for mode, r in results.items():
        print(f"{mode:<11}" + "".join(f"{c[2].format(r[c[1]]):>13}" for c in cols))


def command(
    model: Annotated[str, typer.Option(help="model name or HF directory")] = "smollm2-135m-instruct",
    dataset: Annotated[str, typer.Option(help="prompt dataset")] = "sharegpt",
    dataset_path: Annotated[Optional[Path], typer.Option(help="jsonl with {'prompt': ...} lines")] = None,
    num_prompts: Annotated[int, typer.Option(min=1)] = 200,
    batching: Annotated[str, typer.Option(help="continuous | static | both")] = "both",
    max_num_seqs: Annotated[int, typer.Option(min=1)] = 32,
    max_num_batched_tokens: Annotated[int, typer.Option(min=1)] = 512,
    max_tokens: Annotated[Optional[int], typer.Option(min=1, help="fixed output length")] = None,
    output_len_dist: Annotated[str, typer.Option(help="lognormal:MEDIAN:SIGMA:CAP")] = DEFAULT_DIST,
    num_kv_blocks: Annotated[Optional[int], typer.Option(help="KV blocks (default: 2 GiB of cache)")] = None,
    static_padding: Annotated[bool, typer.Option(help="static: pad prompts to the batch's longest, as HF "
                                                      "generate (--no-static-padding: a paged static batch)")] = True,
    chat: Annotated[bool, typer.Option(help="apply the chat template to prompts")] = True,
    seed: Annotated[int, typer.Option()] = 0,
    threads: Annotated[Optional[int], typer.Option(help="torch threads (default: all cores)")] = None,
    dtype: Annotated[str, typer.Option(help="auto | float32 | bfloat16 | float16 (auto: bf16 where the CPU "
                                            "has native bf16, else fp32)")] = "auto",
    json_out: Annotated[Optional[Path], typer.Option("--json", help="write the results here")] = None,
) -> None:
    """pdserve bench offline: continuous vs static batching throughput."""
    from engine.errors import UserError

    if batching not in ("continuous", "static", "both"):
        raise UserError(f"--batching {batching!r}: use continuous, static or both")
    import torch

    from engine.model_loader import load_tokenizer, resolve_model
    from engine.model_runner import ModelRunner

    from engine.platform import check_threads, resolve_dtype

    torch_dtype = resolve_dtype(dtype, "cpu")  # UserError naming --dtype
    torch.set_num_threads(check_threads(threads))
    lengths = output_lengths(num_prompts, max_tokens, output_len_dist, seed)
    prompts = load_prompts(dataset, dataset_path, num_prompts)
    path = resolve_model(model)
    tokenizer = load_tokenizer(path)
    runner = ModelRunner(path, block_size=16, num_blocks=num_kv_blocks, kv_cache_memory_bytes=2 * 2**30,
                         dtype=torch_dtype)
    template = lambda p: [{"role": "user", "content": p}]  # noqa: E731
    prompt_ids = [list(tokenizer.apply_chat_template(template(p), add_generation_prompt=True, tokenize=True)
                       ["input_ids"]) if chat else tokenizer(p)["input_ids"] for p in prompts]
    modes = ["continuous", "static"] if batching == "both" else [batching]
    results = {}
    for m in modes:
        results[m] = r = run_mode(runner, tokenizer, prompt_ids, lengths, m, max_num_seqs, max_num_batched_tokens,
                                  None, static_padding)
        print(f"{m}: {r['output_throughput']:.1f} output tok/s in {r['duration_s']:.0f} s", flush=True)
    print_table(results)
    report: dict = dict(results)
    if len(modes) == 2:
        ratio = results["continuous"]["output_throughput"] / results["static"]["output_throughput"]
        report["continuous_over_static"] = ratio
        print(f"continuous / static output throughput: {ratio:.2f}x")
    report_meta = {"model": model, "num_prompts": num_prompts, "output_len": max_tokens or output_len_dist,
                   "seed": seed, "mean_output_len": sum(lengths) / len(lengths),
                   "static_padding": static_padding, "kv_blocks": runner.num_blocks,
                   "dtype": str(torch_dtype).removeprefix("torch."), "threads": torch.get_num_threads()}
    report["config"] = report_meta
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=2))
        print(f"wrote {json_out}")
