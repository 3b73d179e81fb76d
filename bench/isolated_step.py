"""The decode step of one --quantization method alone in its process, as a server runs it
(``python -m bench.isolated_step``: one JSON object on stdout). ``pdserve bench quant --isolated N``
starts one such process per method and round, methods alternating, and tabulates them
(``isolated_rows``).

Why a process each: bench quant's other tables hold every method's model in one process (none,
int8 and fp8: ~700 MB of weights), so even a method's consecutive steps share the last-level cache
with the other models' weights and caches, which a server never does; and its first table times
each step after another method's. Alone, a model's step finds in the L3 what its own previous
step left there: on a 300 MiB L3 much of the INT8 model's 135 MB, less of bf16's 270 MB. Two
processes back to back (none, then the method) see about the same host minute, so the ratio is
taken per round, between adjacent processes.

Speed is measured here, never in tests.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import typer

WARMUP = 20
"""Untimed decode steps per batch size before the timed ones (kernel choice, caches, allocator)."""


def _blocks_per_seq(context: int) -> int:
    return -(-(context + 1) // 16)   # the context and the step's token, in blocks of 16


def decode_runner(model: str, method: str, dtype, context: int, max_batch: int):
    """A ModelRunner with --quantization ``method`` (dtype: a torch dtype) and cache blocks for
    ``max_batch`` sequences of decode_chunks(context, ...) (bench quant's runners too)."""
    from engine.model_runner import ModelRunner

    return ModelRunner(model, num_blocks=max_batch * _blocks_per_seq(context), dtype=dtype, quantization=method)


def decode_chunks(context: int, batch: int) -> list:
    """One decode step's chunks: ``batch`` sequences of ``context`` tokens, one new token each,
    sequence b on its own blocks (the same ones every step: a step's timing, not a generation)."""
    from engine.batch import SeqChunk

    n = _blocks_per_seq(context)
    return [SeqChunk([100 + b], context, list(range(b * n, (b + 1) * n)), 1) for b in range(batch)]


def time_steps(model: str, method: str, dtype: str, context: int, batches: list[int],
               steps: int) -> dict[int, list[float]]:
    """Seconds of each of ``steps`` consecutive decode steps per batch size: one decode_runner with
    ``method``, decode_chunks(context, batch) (as bench quant's decode table), after WARMUP untimed
    steps."""
    import time

    import torch

    runner = decode_runner(model, method, getattr(torch, dtype), context, max(batches))
    out: dict[int, list[float]] = {}
    for batch in batches:
        chunks = decode_chunks(context, batch)
        for _ in range(WARMUP):
            runner.forward(chunks)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            runner.forward(chunks)
            times.append(time.perf_counter() - t0)
        out[batch] = times
    return out


def run_process(model: str, method: str, dtype: str, context: int, batches: list[int], steps: int,
                threads: int) -> dict[int, list[float]]:
    """time_steps in a fresh Python process (this module as a script); its JSON parsed.
    Raises RuntimeError with the child's last line of stderr (its error) if it fails."""
    cmd = [sys.executable, "-m", "bench.isolated_step", "--model", model, "--method", method, "--dtype", dtype,
           "--context", str(context), "--batch-sizes", ",".join(map(str, batches)), "--steps", str(steps),
           "--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        reason = ([line for line in proc.stderr.splitlines() if line.strip()] or ["(no stderr)"])[-1]
        raise RuntimeError(f"bench.isolated_step ({method}) exited {proc.returncode}: {reason.strip()}")
    return {int(b): ts for b, ts in json.loads(proc.stdout.strip().splitlines()[-1])["steps"].items()}


def isolated_rows(rounds: list[dict[str, dict[int, list[float]]]]) -> list[dict]:
    """Per batch and method, from rounds of {method: {batch: step seconds}} (one process each):
    the best step, the median over rounds of each process's median step, and, where ``none``
    ran, the median over rounds of none's median step over the method's (adjacent processes),
    with the least and the most of those per-round ratios (the spread between rounds)."""
    methods = list(rounds[0])
    batches = sorted(rounds[0][methods[0]])
    out = []
    for batch in batches:
        med = {m: [statistics.median(r[m][batch]) for r in rounds] for m in methods}
        for m in methods:
            row = {"batch": batch, "method": m, "rounds": len(rounds), "steps": len(rounds[0][m][batch]),
                   "ms": round(min(min(r[m][batch]) for r in rounds) * 1e3, 2),
                   "ms_median": round(statistics.median(med[m]) * 1e3, 2)}
            if "none" in med:
                ratios = [n / t for n, t in zip(med["none"], med[m])]
                row.update(speedup_vs_none_median=round(statistics.median(ratios), 2),
                           speedup_vs_none_least=round(min(ratios), 2), speedup_vs_none_most=round(max(ratios), 2))
            out.append(row)
    return out


def print_rows(rows: list[dict]) -> None:
    if not rows:
        return
    print(f"decode step, each method alone in its own process (as served): {rows[0]['rounds']} rounds of "
          f"{rows[0]['steps']} consecutive steps a process, methods alternating. best: the least step; p50 ms: the "
          "median over rounds of each process's median step; p50 vs: the median over rounds of none's median over "
          "the method's (adjacent processes), then the least and the most round")
    print(f"{'batch':>5} {'method':<6} {'best ms':>8} {'p50 ms':>8} {'p50 vs':>7} {'least':>6} {'most':>6}")
    for r in rows:
        print(f"{r['batch']:>5} {r['method']:<6} {r['ms']:>8.2f} {r['ms_median']:>8.2f} "
              f"{r.get('speedup_vs_none_median', ''):>7} {r.get('speedup_vs_none_least', ''):>6} "
              f"{r.get('speedup_vs_none_most', ''):>6}")


def main(
    model: str = typer.Option("smollm2-135m-instruct", "--model"),
    method: str = typer.Option(..., "--method"),
    dtype: str = typer.Option("bfloat16", "--dtype"),
    context: int = typer.Option(128, "--context", min=1),
    batch_sizes: str = typer.Option("1,16", "--batch-sizes"),
    steps: int = typer.Option(200, "--steps", min=1),
    threads: int = typer.Option(0, "--threads", help="torch threads (0 = the cores this process may use)."),
) -> None:
    import os

    import torch

    from bench.options import int_list

    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
    steps_by_batch = time_steps(model, method, dtype, context, int_list(batch_sizes, "--batch-sizes"), steps)
    print(json.dumps({"method": method, "threads": torch.get_num_threads(), "steps": steps_by_batch}))


if __name__ == "__main__":
    typer.run(main)
