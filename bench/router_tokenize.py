"""pdserve bench router-tokenize: how long one long prompt's tokenization stops the router's event loop.

The router tokenizes on its asyncio loop thread; while it does, no other request's stream,
/health or worker poll runs. For a prompt of --chars characters (default: the character bound of
the model's context, max_model_len x the longest token's characters, the longest prompt the
router tokenizes at all; seeded random words, so the BPE cache does not shorten it) three ways
are timed, interleaved for --repeats rounds on one loop, best of each kept:

    inline          tokenizers' Tokenizer.encode on the loop (before)
    thread-encode   Tokenizer.encode on the loop's executor (it holds the GIL: no better)
    router          RouterService's path: RouterTokenizer.encode (encode_batch, which releases
                    the GIL) on the executor for texts over INLINE_TOKENIZE_CHARS

Each row: encode time (ms) and the longest gap between turns of a task that sleeps 1 ms on the
same loop (ms): how long everything else on the loop waited. Prints a table (with ``uptime``'s load)
and writes JSON (``--json``). Speed is measured here, never in tests.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from pathlib import Path
from typing import Callable

import typer

MODES = ("inline", "thread-encode", "router")


def prompt_text(chars: int, seed: int = 0) -> str:
    """`chars` characters of seeded random lower-case words (2-9 letters) separated by spaces."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    out, n = [], 0
    while n < chars:
        w = rng.choice(words)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


async def _timed(run: Callable) -> tuple[float, float, int]:
    """(seconds run() took, longest gap between a 1 ms ticker's turns meanwhile, tokens)."""
    stop = asyncio.Event()
    gaps: list[float] = []

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    ids = await run()
    took = time.perf_counter() - t0
    await asyncio.sleep(0.01)
    stop.set()
    await task
    return took, max(gaps), len(ids)


async def measure(files: dict[str, bytes], text: str, repeats: int) -> dict[str, dict]:
    """Best (lowest loop gap) of `repeats` interleaved rounds per mode."""
    import tokenizers

    from router.service import _off_loop
    from router.tokenizer import RouterTokenizer

    tok = RouterTokenizer(files)
    raw = tokenizers.Tokenizer.from_str(files["tokenizer.json"].decode())  # the same tokenizer, called directly
    loop = asyncio.get_running_loop()

    async def inline():
        return raw.encode(text, add_special_tokens=True).ids

    async def thread_encode():
        return await loop.run_in_executor(None, lambda: raw.encode(text, add_special_tokens=True).ids)

    async def router():
        return await _off_loop(len(text), tok.encode, text)

    runs = {"inline": inline, "thread-encode": thread_encode, "router": router}
    best: dict[str, dict] = {}
    for _ in range(repeats):
        for mode in MODES:
            took, gap, n = await _timed(runs[mode])
            if mode not in best or gap < best[mode]["loop_gap_ms"] / 1e3:
                best[mode] = {"encode_ms": took * 1e3, "loop_gap_ms": gap * 1e3, "tokens": n}
    return best


def _model_files(model_dir: Path) -> dict[str, bytes]:
    names = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
    return {n: (model_dir / n).read_bytes() for n in names if (model_dir / n).exists()}


def command(
    model: str = typer.Option("smollm2-135m-instruct", help="Model name or HF directory (its tokenizer files)."),
    chars: int = typer.Option(0, min=0, help="Prompt characters (0: the character bound of the model's context)."),
    repeats: int = typer.Option(3, min=1, help="Interleaved rounds; the best of each mode is kept."),
    json_out: Path = typer.Option(Path("out/bench_router_tokenize.json"), "--json", help="Where to write results."),
) -> None:
    """pdserve bench router-tokenize: the router's event-loop stall while it tokenizes one long prompt."""
    from engine.model_loader import resolve_model
    from router.tokenizer import RouterTokenizer

    model_dir = Path(resolve_model(model))
    files = _model_files(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    max_model_len = int(config.get("max_position_embeddings", 0))
    n = chars or max_model_len * RouterTokenizer(files).max_chars_per_token
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    rows = asyncio.run(measure(files, prompt_text(n), repeats))
    print(f"prompt {n} characters (max_model_len {max_model_len}); load {load}; best of {repeats}")
    print(f"{'mode':<15}{'encode ms':>11}{'loop gap ms':>13}{'tokens':>9}")
    for mode, r in rows.items():
        print(f"{mode:<15}{r['encode_ms']:>11.1f}{r['loop_gap_ms']:>13.1f}{r['tokens']:>9}")
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps({"model": model, "chars": n, "max_model_len": max_model_len, "repeats": repeats,
                                    "load_before": load, "rows": rows}, indent=2) + "\n")
    print(f"wrote {json_out}")
