"""Quantized linears and the decode step they make, measured (``python -m bench.quant``).

Two tables, every row timed in one run so ratios are comparable on a busy machine (the load
averages are printed beside them):

- linear: each kernel of each method (kernels/linear.py) on the bundled model's four projection
  shapes at 1, 16 and 512 rows (int8 with the activation group the model uses for that projection,
  engine/quantization/apply.py INT8_ACT_GROUPS), best of a few rounds, with the weight bytes read per call and the
  GB/s that makes;
- decode step: one ModelRunner forward of B decode tokens (B = ``--batch-sizes``, default 1, 16,
  32; ``--context`` tokens of
  context each) per --quantization method at --dtype, best of --steps, and its speed-up over
  ``none``. Methods are timed round-robin, so a burst of load hits them alike.

Writes JSON (``--json``). Speed is measured here, never in tests.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import typer

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))   # (out, in): fused qkv, o, fused gate/up, down
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")   # of SHAPES
ROWS = (1, 16, 512)


def command(
    model: str = typer.Option("smollm2-135m-instruct", "--model", "-m"),
    dtype: str = typer.Option("bfloat16", "--dtype"),
    methods: str = typer.Option("none,int8,fp8", "--methods", help="Comma-separated --quantization methods."),
    context: int = typer.Option(128, "--context", help="Context of each sequence in the decode step."),
    steps: int = typer.Option(10, "--steps", help="Timed decode steps per method and batch size."),
    batch_sizes: str = typer.Option("1,16,32", "--batch-sizes", help="Comma-separated decode batch sizes."),
    threads: int = typer.Option(0, "--threads", help="torch threads (0 = the cores this process may use)."),
    skip_linear: bool = typer.Option(False, "--skip-linear", help="Only the decode-step table."),
    json_out: Path = typer.Option(Path("out/bench_quant.json"), "--json"),
) -> None:
    """Linear kernels and decode step per quantization method."""
    import torch

    from engine.quantization import check_quantization

    names = [check_quantization(m.strip()) for m in methods.split(",") if m.strip()]
    batches = _batch_sizes(batch_sizes)
    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
    dt = getattr(torch, dtype)
    result = {"dtype": dtype, "threads": torch.get_num_threads(), "load_before": _load()}
    if not skip_linear:
        result["linear"] = linear_rows(names, dt)
        _print_linear(result["linear"])
    result["decode"] = decode_rows(model, names, dt, context, steps, batches)
    result["load_after"] = _load()
    _print_decode(result["decode"], result)
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {json_out}")


def linear_rows(methods: list[str], dtype) -> list[dict]:
    import torch

    from engine.quantization.apply import int8_act_group, make_linear

    rows = []
    for (n, k), projection in zip(SHAPES, PROJECTIONS):
        lin = torch.nn.Linear(k, n, bias=False).to(dtype)
        group = int8_act_group(f"model.layers.0.{projection}", k)   # the model's int8 activation group
        mods = {m: make_linear(lin, m, group=group if m == "int8" else None) for m in methods}
        for m_rows in ROWS:
            x = torch.randn(m_rows, k).to(dtype)
            with torch.inference_mode():
                for method, mod in mods.items():
                    for name in mod.kernel_choices:
                        t = _best(lambda: mod.run_kernel(name, x), reps=2 if m_rows >= 256 else 10)
                        wbytes = n * k * {"none": dtype.itemsize, "int8": 1, "fp8": 1}[method]
                        rows.append({"out": n, "in": k, "rows": m_rows, "method": method, "kernel": name,
                                     "act_group": getattr(mod, "group", None),
                                     "us": round(t * 1e6, 1), "weight_GBps": round(wbytes / t / 1e9, 1),
                                     "chosen": name == mod.kernel_names[min(ROWS.index(m_rows), 2)]})
    return rows


def _batch_sizes(text: str) -> tuple[int, ...]:
    from engine.errors import UserError

    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise UserError(f"--batch-sizes: {text!r} is not a comma-separated list of positive integers")
    return sizes


def decode_rows(model: str, methods: list[str], dtype, context: int, steps: int,
                batches: tuple[int, ...] = (1, 16, 32)) -> list[dict]:
    import torch

    from engine.batch import SeqChunk
    from engine.model_runner import ModelRunner

    blocks_per_seq = -(-(context + 1) // 16)
    runners = {m: ModelRunner(model, num_blocks=max(batches) * blocks_per_seq, dtype=dtype, quantization=m)
               for m in methods}
    out = []
    for batch in batches:
        chunks = [SeqChunk([100 + b], context, list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq)), 1)
                  for b in range(batch)]
        best = {m: float("inf") for m in methods}
        for _ in range(2):                                   # warm-up
            for r in runners.values():
                r.forward(chunks)
        for _ in range(steps):                               # round-robin
            for m, r in runners.items():
                t0 = time.perf_counter()
                r.forward(chunks)
                best[m] = min(best[m], time.perf_counter() - t0)
        for m in methods:
            out.append({"batch": batch, "method": m, "ms": round(best[m] * 1e3, 2), "context": context,
                        "speedup_vs_none": round(best["none"] / best[m], 2) if "none" in best else None,
                        "attention_backend": runners[m].attention_backend})
    return out


def _best(fn, reps: int, rounds: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def _print_linear(rows: list[dict]) -> None:
    print(f"{'out x in':>11} {'rows':>5} {'method':<6} {'kernel':<16} {'group':>5} {'us':>9} {'weight GB/s':>11}")
    for r in rows:
        mark = " *" if r["chosen"] else ""
        print(f"{r['out']:>5} x {r['in']:<4} {r['rows']:>5} {r['method']:<6} {r['kernel']:<16} {r['act_group'] or '':>5} {r['us']:>9.1f} "
              f"{r['weight_GBps']:>11.1f}{mark}")
    print("(* = the kernel the method chose at load for that row count)")


def _print_decode(rows: list[dict], result: dict) -> None:
    print(f"decode step, {result['dtype']}, {result['threads']} threads "
          f"(load {result['load_before']} before, {result['load_after']} after)")
    print(f"{'batch':>5} {'method':<6} {'ms/step':>8} {'vs none':>8}")
    for r in rows:
        print(f"{r['batch']:>5} {r['method']:<6} {r['ms']:>8.2f} {r['speedup_vs_none'] or '':>8}")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    typer.run(command)
