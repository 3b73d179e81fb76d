"""pdserve profile: measure one worker's prefill and decode curves for the planner and `pdserve plan`.

On the machine and device it runs on, with the worker's own runtime (ModelRunner, paged KV cache,
the attention backend and linears it would choose):

- **prefill**: for each input length, the prompt run as a prefill worker runs it — chunks of
  ``--max-num-batched-tokens`` one after another — timed end to end (TTFT of a request alone;
  the sampling of the first token is negligible beside it); tokens/s = ISL / TTFT.
- **decode**: for each (batch, context), one decode step of ``batch`` sequences whose contexts
  are ``context`` tokens long, timed as the median of ``--repeats`` steps (ITL); tokens/s =
  batch / ITL. The K/V those steps read is whatever the cache holds (the timing does not
  depend on the values); sequences get their own blocks while the cache has room, and share
  blocks beyond that (noted in the JSON as ``shared_blocks``).

Writes the profile JSON (planner/profile.py's format) and, with ``--plot``, a PNG.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from bench.options import int_list
from engine.errors import UserError


def _ints(text: str, flag: str) -> list[int]:
    return sorted(set(int_list(text, flag)))


def command(
    model: Annotated[str, typer.Option(help="Model name or HF directory / .gguf path.")] = "smollm2-135m-instruct",
    json_out: Annotated[Path, typer.Option("--json", help="Write the profile here.")] = Path("profile.json"),
    isl: Annotated[str, typer.Option(help="Prefill input lengths.")] = "64,256,1024,2048,4096",
    batch: Annotated[str, typer.Option(help="Decode batch sizes.")] = "1,4,16,32,64",
    context: Annotated[str, typer.Option(help="Decode context lengths.")] = "256,1024,4096",
    dtype: Annotated[str, typer.Option(help="auto | float32 | bfloat16 | float16")] = "auto",
    threads: Annotated[Optional[int], typer.Option(help="torch threads (default: the cores available).")] = None,
    max_num_batched_tokens: Annotated[int, typer.Option(help="Prefill chunk size, as the worker's budget.")] = 512,
    repeats: Annotated[int, typer.Option(help="Timed repeats per point (median).")] = 3,
    kv_cache_memory_gib: Annotated[float, typer.Option(help="KV cache to allocate, GiB.")] = 2.0,
    plot: Annotated[Optional[Path], typer.Option(help="Write profile.png into this directory.")] = None,
) -> None:
    """Measure a worker's prefill TTFT/throughput vs ISL and decode ITL/throughput vs batch and context."""
    import os

    import torch
    from tqdm import tqdm

    from engine.model_runner import ModelRunner
    from planner.profile import WorkerProfile

    isls, batches, contexts = _ints(isl, "--isl"), _ints(batch, "--batch"), _ints(context, "--context")
    if repeats < 1 or max_num_batched_tokens < 1:
        raise UserError("--repeats and --max-num-batched-tokens must be >= 1")
    cores = len(os.sched_getaffinity(0))
    if threads is not None and not 1 <= threads <= cores:
        raise UserError(f"--threads must be in [1, {cores}] (the cores available), got {threads}")
    torch.set_num_threads(threads or cores)
    torch_dtype = resolve(dtype)
    runner = ModelRunner(model, kv_cache_memory_bytes=int(kv_cache_memory_gib * 2**30), dtype=torch_dtype)
    limit = runner.model_config.max_model_len
    if max(isls) > limit or max(contexts) + 1 > limit:
        raise UserError(f"--isl/--context: the model's context is {limit} tokens")
    points = [("prefill", n) for n in isls] + [("decode", (b, c)) for c in contexts for b in batches]
    prefill, decode, shared = [], [], False
    _prefill_ms(runner, min(isls), max_num_batched_tokens)   # warm-up: first calls allocate
    for kind, arg in tqdm(points, desc="pdserve profile", file=sys.stderr):
        if kind == "prefill":
            ms = statistics.median(_prefill_ms(runner, arg, max_num_batched_tokens) for _ in range(repeats))
            prefill.append({"isl": arg, "ttft_ms": ms, "tokens_per_s": arg / (ms / 1000)})
        else:
            b, c = arg
            ms, was_shared = _decode_ms(runner, b, c, repeats)
            shared |= was_shared
            decode.append({"batch": b, "context": c, "itl_ms": ms, "tokens_per_s": b / (ms / 1000)})
    meta = {"model": model, "dtype": str(torch_dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
            "device": str(runner.device), "attention_backend": getattr(runner.ops, "name", "?"),
            "max_num_batched_tokens": max_num_batched_tokens, "shared_blocks": shared, "source": "pdserve profile",
            "load_avg_1m": os.getloadavg()[0]}
    prof = WorkerProfile.from_json({"prefill": prefill, "decode": decode, "meta": meta})
    prof.save(json_out)
    print(table(prof))
    print(f"wrote {json_out}", file=sys.stderr)
    if plot:
        plot_profile(prof, plot)


def resolve(name: str):
    """The dtype to run: the runtime's own resolution when present (`auto` by ISA), else by name."""
    import torch

    try:
        from engine.platform import resolve_dtype
    except ImportError:
        resolve_dtype = None
    if resolve_dtype is not None:
        return resolve_dtype(name, "cpu")
    if name == "auto":
        return torch.float32
    if name not in ("float32", "bfloat16", "float16"):
        raise UserError(f"--dtype must be auto, float32, bfloat16 or float16, got {name!r}")
    return getattr(torch, name)


def _prefill_ms(runner, isl: int, chunk: int) -> float:
    from engine.batch import SeqChunk

    bs = runner.block_size
    table = list(range(-(-isl // bs)))
    ids = [(7 * i) % runner.model_config.vocab_size for i in range(isl)]
    start = time.perf_counter()
    for pos in range(0, isl, chunk):
        part = ids[pos:pos + chunk]
        last = pos + len(part) == isl
        runner.forward([SeqChunk(part, pos, table, 1 if last else 0)])
    return 1000 * (time.perf_counter() - start)


def _decode_ms(runner, batch: int, context: int, repeats: int) -> tuple[float, bool]:
    from engine.batch import SeqChunk

    bs = runner.block_size
    per_seq = -(-(context + 1) // bs)
    shared = batch * per_seq > runner.num_blocks
    tables = []
    for b in range(batch):
        first = 0 if shared else b * per_seq
        tables.append(list(range(first, first + per_seq)))
    chunks = [SeqChunk([11 + b], context, tables[b]) for b in range(batch)]
    runner.forward(chunks)  # warm-up at this shape
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.forward(chunks)
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times), shared


def table(prof) -> str:
    lines = [f"{'ISL':>6}{'TTFT ms':>10}{'prefill tok/s':>15}"]
    lines += [f"{p.isl:>6}{p.ttft_ms:>10.1f}{p.tokens_per_s:>15.0f}" for p in prof.prefill]
    lines += ["", f"{'batch':>6}{'context':>9}{'ITL ms':>9}{'decode tok/s':>14}"]
    lines += [f"{d.batch:>6}{d.context:>9}{d.itl_ms:>9.1f}{d.tokens_per_s:>14.0f}" for d in prof.decode]
    return "\n".join(lines)


def plot_profile(prof, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot([p.isl for p in prof.prefill], [p.ttft_ms for p in prof.prefill], "o-")
    a.set(xlabel="input length (tokens)", ylabel="TTFT (ms)", title="prefill", xscale="log")
    for c in prof.contexts:
        row = [d for d in prof.decode if d.context == c]
        b.plot([d.batch for d in row], [d.itl_ms for d in row], "o-", label=f"context {c}")
    b.set(xlabel="batch size", ylabel="ITL (ms)", title="decode")
    b.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "profile.png", dpi=100)
    plt.close(fig)
