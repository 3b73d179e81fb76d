"""pdserve bench decoder-loop: one decode step through the Python layer loop against the fused C++
loop (kernels/decoder_loop.py), interleaved in one process.

For each ``--quantization`` (the model in ``--dtype``) and each ``--batch-sizes`` B: B sequences
prefilled to ``--context`` tokens over shuffled block tables (as serving leaves them), then one
decode step (one token each) timed ``--repeats`` times per loop, the two loops alternating step
by step so that other processes on a shared machine slow both alike. Reported per row: the
step's wall-clock median and best (ms) for each loop, the fused loop's speedup on the medians,
and whether the two loops' logits are equal bit for bit. Prints a table and writes JSON
(``--json``), with ``uptime``'s load before and after. Run as ``pdserve bench decoder-loop`` or
``python -m bench.decoder_loop``.
Speed is measured here, never in tests.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from pathlib import Path

import typer

from bench.options import int_list


def command(
    json_out: Path = typer.Option(Path("out/bench_decoder_loop.json"), "--json", help="Where to write the results."),
    model: str = typer.Option("smollm2-135m-instruct", "--model", "-m"),
    quantizations: str = typer.Option("none,int8", "--quantization", help="Comma-separated: none, int8, fp8."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="Model dtype: float32 or bfloat16."),
    batch_sizes: str = typer.Option("1,16", "--batch-sizes", help="Comma-separated decode batch sizes."),
    context: int = typer.Option(128, "--context", help="Tokens of context per sequence."),
    repeats: int = typer.Option(40, "--repeats", help="Timed steps per loop (alternating)."),
    threads: int = typer.Option(0, "--threads", help="torch threads (0 = the cores this process may use)."),
) -> None:
    """Decode step ms, Python layer loop vs the fused C++ loop, interleaved."""
    import torch

    from engine.batch import SeqChunk
    from engine.model_runner import ModelRunner

    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
    batches = int_list(batch_sizes, "--batch-sizes")
    result = {"threads": torch.get_num_threads(), "load_before": os.getloadavg(), "dtype": dtype,
              "context": context, "repeats": repeats, "rows": []}
    blocks = -(-(context + 8) // 16)
    for quant in [q.strip() for q in quantizations.split(",") if q.strip()]:
        runner = ModelRunner(model, dtype=getattr(torch, dtype), quantization=quant,
                             num_blocks=max(batches) * blocks + 1)
        loop = runner.model.decoder_loop
        for batch in batches:
            ids = list(range(batch * blocks))
            random.Random(0).shuffle(ids)
            tables = [ids[i * blocks:(i + 1) * blocks] for i in range(batch)]
            for t in tables:
                runner.forward([SeqChunk(list(range(1, context + 1)), 0, t, 1)])
            chunks = [SeqChunk([5], context, t, 1) for t in tables]
            times: dict[str, list[float]] = {"python": [], "fused": []}
            logits: dict[str, torch.Tensor] = {}
            for i in range(repeats + 3):   # 3 warm-up rounds
                for path in ("python", "fused"):
                    runner.model.decoder_loop = loop if path == "fused" else None
                    started = time.perf_counter()
                    logits[path] = runner.forward(chunks)
                    elapsed = time.perf_counter() - started
                    if runner.model.decoder_path != path:
                        raise RuntimeError(f"asked for the {path} loop, ran {runner.model.decoder_path}")
                    if i >= 3:
                        times[path].append(elapsed * 1e3)
            runner.model.decoder_loop = loop
            row = {"quantization": quant, "batch": batch,
                   **{f"{p}_median_ms": statistics.median(t) for p, t in times.items()},
                   **{f"{p}_best_ms": min(t) for p, t in times.items()},
                   "equal_logits": bool(torch.equal(logits["python"], logits["fused"]))}
            row["speedup"] = row["python_median_ms"] / row["fused_median_ms"]
            result["rows"].append(row)
        del runner
    result["load_after"] = os.getloadavg()
    _print(result)
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(result, indent=2))


def _print(result: dict) -> None:
    print(f"decode step, {result['dtype']}, context {result['context']}, {result['threads']} threads, "
          f"{result['repeats']} steps per loop alternating; load {result['load_before'][0]:.2f} -> "
          f"{result['load_after'][0]:.2f}")
    print(f"{'quant':<6} {'B':>3} {'python ms (best)':>17} {'fused ms (best)':>16} {'speedup':>8} {'equal':>6}")
    for r in result["rows"]:
        print(f"{r['quantization']:<6} {r['batch']:>3} {r['python_median_ms']:>8.2f} ({r['python_best_ms']:5.2f})"
              f" {r['fused_median_ms']:>8.2f} ({r['fused_best_ms']:5.2f}) {r['speedup']:>7.2f}x {str(r['equal_logits']):>6}")


if __name__ == "__main__":
    typer.run(command)
