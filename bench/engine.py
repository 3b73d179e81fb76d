"""pdserve bench engine: our runtime vs transformers on the same weights, in one run.

- prefill: tokens/s for one prompt of --prompt-tokens tokens (one forward, logits of the last token);
- decode: ms per step (forward + argmax) at each batch size, every sequence holding --context
  tokens of context when timing starts.

Both sides are timed alternately (median of the repeats) and compared by CPU time, which other
processes on a shared machine do not inflate; wall times are in the JSON too.

Prints a table and writes JSON (``--json``). Run as ``pdserve bench engine`` or ``python -m bench.engine``.
Speed is measured here, never in tests.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import typer

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"  # ../shared/data beside the repo


def command(
    json_out: Path = typer.Option(Path("out/bench_engine.json"), "--json", help="Where to write the results."),
    model: str = typer.Option("smollm2-135m-instruct", "--model", "-m"),
    prompt_tokens: int = typer.Option(512, "--prompt-tokens", help="Prefill prompt length."),
    context: int = typer.Option(128, "--context", help="Context of each sequence before the timed decode steps."),
    steps: int = typer.Option(16, "--steps", help="Timed decode steps per batch size."),
    batch_sizes: str = typer.Option("1,8,32", "--batch-sizes", help="Comma-separated decode batch sizes."),
    threads: int = typer.Option(0, "--threads", help="torch threads (0 = the cores this process may use)."),
) -> None:
    """Prefill tokens/s and decode ms/step, ours vs transformers."""
    import torch

    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
    sizes = [int(b) for b in batch_sizes.split(",") if b.strip()]
    ours, hf, tokens, cfg = _load(model, prompt_tokens, context)
    result = {
        "model": cfg.name, "dtype": "float32", "threads": torch.get_num_threads(),
        "prefill": _prefill(ours, hf, tokens[:prompt_tokens]),
        "decode": [_decode(ours, hf, tokens, context, batch, steps) for batch in sizes],
    }
    _print_table(result)
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {json_out}")


def _load(model: str, prompt_tokens: int, context: int):
    import torch
    from transformers import AutoModelForCausalLM

    from engine.model_loader import load_tokenizer
    from engine.model_runner import ModelRunner

    ours = ModelRunner(model, block_size=16, kv_cache_memory_bytes=1 << 30)
    cfg = ours.model_config
    hf = AutoModelForCausalLM.from_pretrained(cfg.path, dtype=torch.float32).eval()
    text = (SHARED_DATA / "wikitext-2-raw-test.txt").read_text()[:40000]
    tokens = load_tokenizer(cfg.path)(text)["input_ids"]
    assert len(tokens) >= max(prompt_tokens, context + 64)
    return ours, hf, tokens, cfg


def _prefill(ours, hf, prompt: list[int], repeats: int = 3) -> dict:
    import torch

    from engine.batch import SeqChunk

    table = list(range(-(-len(prompt) // ours.block_size)))
    x = torch.tensor([prompt])

    def hf_prefill() -> None:
        with torch.inference_mode():
            hf(x, attention_mask=torch.ones_like(x), use_cache=True, logits_to_keep=1)

    ours_t, hf_t = _interleaved(lambda: ours.forward([SeqChunk(prompt, 0, table)]), hf_prefill, repeats)
    n = len(prompt)
    return {"prompt_tokens": n,
            "ours_tok_s": n / ours_t["cpu"], "transformers_tok_s": n / hf_t["cpu"],
            "ours_tok_s_wall": n / ours_t["wall"], "transformers_tok_s_wall": n / hf_t["wall"],
            "ours_over_transformers": hf_t["cpu"] / ours_t["cpu"]}


def _decode(ours, hf, tokens: list[int], context: int, batch: int, steps: int) -> dict:
    import torch

    from engine.batch import SeqChunk

    blocks_per_seq = -(-(context + steps + 2) // ours.block_size)
    tables = [list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq)) for b in range(batch)]
    prompts = [tokens[b: b + context] for b in range(batch)]  # different contents, same length
    ours.forward([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)])
    state = {"pos": context, "next": [p[-1] for p in prompts]}

    def ours_step() -> None:
        logits = ours.forward([SeqChunk([n], state["pos"], t) for n, t in zip(state["next"], tables)])
        state["next"] = logits.argmax(-1).tolist()
        state["pos"] += 1

    x = torch.tensor(prompts)
    with torch.inference_mode():
        out = hf(x, attention_mask=torch.ones_like(x), use_cache=True, logits_to_keep=1)
    hf_state = {"past": out.past_key_values, "next": out.logits[:, -1].argmax(-1, keepdim=True),
                "mask": torch.ones_like(x)}

    def hf_step() -> None:
        with torch.inference_mode():
            hf_state["mask"] = torch.cat([hf_state["mask"], torch.ones(batch, 1, dtype=torch.long)], dim=1)
            o = hf(hf_state["next"], attention_mask=hf_state["mask"], past_key_values=hf_state["past"],
                   use_cache=True, logits_to_keep=1)
            hf_state["past"], hf_state["next"] = o.past_key_values, o.logits[:, -1].argmax(-1, keepdim=True)

    ours_t, hf_t = _interleaved(ours_step, hf_step, steps)
    return {"batch": batch, "context": context,
            "ours_ms_per_step": 1000 * ours_t["cpu"], "transformers_ms_per_step": 1000 * hf_t["cpu"],
            "ours_ms_per_step_wall": 1000 * ours_t["wall"], "transformers_ms_per_step_wall": 1000 * hf_t["wall"],
            "ours_over_transformers": hf_t["cpu"] / ours_t["cpu"]}


def _interleaved(ours: Callable[[], object], theirs: Callable[[], object], repeats: int) -> tuple[dict, dict]:
    """Median wall and CPU seconds of each, timed alternately after one warm-up each.

    On a shared machine other processes' load lands on both alike; the CPU time (process time,
    all threads) does not count time spent waiting for a core, so the comparison uses it.
    """
    ours(), theirs()
    samples: dict[str, dict[str, list[float]]] = {"ours": {"wall": [], "cpu": []}, "theirs": {"wall": [], "cpu": []}}
    for _ in range(repeats):
        for name, fn in (("ours", ours), ("theirs", theirs)):
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            samples[name]["cpu"].append(time.process_time() - cpu)
            samples[name]["wall"].append(time.perf_counter() - wall)
    med = {name: {k: statistics.median(v) for k, v in d.items()} for name, d in samples.items()}
    return med["ours"], med["theirs"]


def _print_table(r: dict) -> None:
    p = r["prefill"]
    print(f"model {r['model']}  {r['dtype']}  threads {r['threads']}   CPU time (wall in JSON); "
          "speedup = transformers / ours")
    print(f"{'measure':<28}{'ours':>12}{'transformers':>14}{'speedup':>9}")
    print(f"{'prefill %d tok (tok/s)' % p['prompt_tokens']:<28}{p['ours_tok_s']:>12.0f}"
          f"{p['transformers_tok_s']:>14.0f}{p['ours_over_transformers']:>8.2f}x")
    for d in r["decode"]:
        print(f"{'decode batch %d (ms/step)' % d['batch']:<28}{d['ours_ms_per_step']:>12.1f}"
              f"{d['transformers_ms_per_step']:>14.1f}{d['ours_over_transformers']:>8.2f}x")


if __name__ == "__main__":
    typer.run(command)
