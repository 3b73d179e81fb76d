"""pdserve bench int8-prefill: the prefill INT8 kernel (kernels/csrc/int8_gemm_prefill.cpp,
``w8a8_vnni_large``) against the decode one (kernels/csrc/int8_gemm.cpp, ``w8a8_vnni``) and bf16
``F.linear``, interleaved in one process.

Two tables:

- linear: the bundled model's four projection shapes (fused qkv 960x576, o 576x576, fused
  gate/up 3072x576, down 576x1536, each with the activation group the model uses,
  engine/quantization/apply.py) at ``--rows`` rows; the three kernels called round-robin in
  ``--repeats`` rounds over all shapes and row counts, on weights in cache (prefill reuses each weight across its rows), best time
  each, in GOP/s (2 M N K / t; int8 ops for the int8 kernels, bf16 FLOPs for F.linear), and
  whether the two int8 kernels' outputs are equal bit for bit;
- prefill: one ``--tokens``-token prefill forward of the model under ``--quantization int8`` (bf16,
  the fused decoder loop), every int8 linear's prefill bucket switched between the two kernels
  forward by forward, best of ``--forwards`` each, in ms and tokens/s, and whether the logits are equal.

Prints the tables and writes JSON (``--json``) with ``uptime``'s load before and after. Run as
``pdserve bench int8-prefill`` or ``python -m bench.int8_prefill``. Speed is measured here, never in tests.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import typer

from bench.options import int_list

SHAPES = ((960, 576, "self_attn.qkv_proj"), (576, 576, "self_attn.o_proj"), (3072, 576, "mlp.gate_up_proj"),
          (576, 1536, "mlp.down_proj"))   # (out, in, projection)
KERNELS = ("w8a8_vnni_large", "w8a8_vnni")


def command(
    json_out: Path = typer.Option(Path("out/bench_int8_prefill.json"), "--json", help="Where to write the results."),
    model: str = typer.Option("smollm2-135m-instruct", "--model", "-m"),
    rows: str = typer.Option("512,2048", "--rows", help="Comma-separated row counts of the linear table."),
    tokens: int = typer.Option(2048, "--tokens", help="Prompt tokens of the prefill forward (0: skip it)."),
    repeats: int = typer.Option(20, "--repeats", help="Timed calls per kernel and shape in the linear table."),
    forwards: int = typer.Option(3, "--forwards", help="Timed prefill forwards per kernel."),
    threads: int = typer.Option(0, "--threads", help="torch threads (0 = the cores this process may use)."),
) -> None:
    """The prefill INT8 kernel against the decode one and bf16, per shape and in a prefill forward."""
    import torch

    from engine.errors import UserError

    row_counts = int_list(rows, "--rows", example="512,2048")
    if repeats < 1 or forwards < 1 or tokens < 0:
        raise UserError("--repeats and --forwards must be >= 1, --tokens >= 0")
    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
    result = {"threads": torch.get_num_threads(), "load_before": os.getloadavg(),
              "linear": _linear_rows(row_counts, repeats), "prefill": _prefill(model, tokens, forwards) if tokens else None}
    result["load_after"] = os.getloadavg()
    _print(result)
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {json_out}")


def _linear_rows(row_counts: list[int], repeats: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from engine.quantization.apply import int8_act_group
    from kernels.linear import Int8Linear, act_group

    cases = []
    with torch.inference_mode():
        for n, k, projection in SHAPES:
            w = torch.randn(n, k).bfloat16()
            group = int8_act_group(f"model.layers.0.{projection}", k) or act_group(k)
            lin = Int8Linear(w, None, group=group)
            if not lin.tiled:
                raise typer.BadParameter("the int8 kernels need a CPU with AVX512-BF16 and AVX512-VNNI")
            for m in row_counts:
                x = torch.randn(m, k).bfloat16()
                calls = {name: (lambda lin=lin, name=name, x=x: lin.run_kernel(name, x)) for name in KERNELS}
                calls["bf16 F.linear"] = lambda x=x, w=w: F.linear(x, w)
                cases.append((n, k, m, group, lin, x, calls, {name: float("inf") for name in calls}))
        for *_, calls, _best in cases:
            for call in calls.values():
                call()
        # round-robin over every shape, row count and kernel: a burst of load on a shared host hits all alike
        for _ in range(repeats):
            for *_, calls, best in cases:
                for name, call in calls.items():
                    t0 = time.perf_counter()
                    call()
                    best[name] = min(best[name], time.perf_counter() - t0)
        out = []
        for n, k, m, group, lin, x, calls, best in cases:
            ops = 2 * m * n * k / 1e9
            out.append({"out": n, "in": k, "rows": m, "act_group": group,
                        **{f"{name} GOP/s": round(ops / t, 1) for name, t in best.items()},
                        "large vs vnni": round(best["w8a8_vnni"] / best["w8a8_vnni_large"], 3),
                        "equal": bool(torch.equal(lin.run_kernel(KERNELS[0], x), lin.run_kernel(KERNELS[1], x)))})
    return out


def _prefill(model: str, tokens: int, repeats: int) -> dict:
    import torch

    from engine.batch import SeqChunk
    from engine.model_loader import resolve_model
    from engine.model_runner import ModelRunner
    from kernels.decoder_loop import build_decoder_loop
    from kernels.linear import Int8Linear

    block = 16
    runner = ModelRunner(resolve_model(model), dtype=torch.bfloat16, block_size=block, num_blocks=-(-tokens // block) + 1,
                         quantization="int8")
    linears = [m for m in runner.model.modules() if isinstance(m, Int8Linear) and m.kernel_names[2] in KERNELS]

    def use(name: str) -> None:   # every int8 linear's prefill bucket on kernel `name`, the fused loop rebuilt
        for lin in linears:
            kernel = lin._kernels.get(name) or lin._candidates()[name]
            lin.kernel_names = lin.kernel_names[:2] + (name,)
            lin._kernels[name] = kernel
            lin._chosen = lin._chosen[:2] + (kernel,)
        runner.model.decoder_loop = build_decoder_loop(runner.model)[0]

    ids = [(i * 7919) % 40000 + 10 for i in range(tokens)]
    chunk = [SeqChunk(ids, 0, list(range(-(-tokens // block))), 1)]
    best, logits, path = {name: float("inf") for name in KERNELS}, {}, {}
    with torch.inference_mode():
        for _ in range(repeats):
            for name in KERNELS:
                use(name)
                t0 = time.perf_counter()
                logits[name] = runner.forward(chunk)
                best[name] = min(best[name], time.perf_counter() - t0)
                path[name] = runner.model.decoder_path
    return {"tokens": tokens, **{f"{name} ms": round(t * 1e3, 1) for name, t in best.items()},
            "large vs vnni": round(best["w8a8_vnni"] / best["w8a8_vnni_large"], 3), "decoder_path": path,
            "equal_logits": bool(torch.equal(logits[KERNELS[0]], logits[KERNELS[1]]))}


def _print(result: dict) -> None:
    print(f"int8 linears on weights in cache, bf16 in/out, {result['threads']} threads, best of the repeats, "
          f"interleaved; load {result['load_before'][0]:.2f} -> {result['load_after'][0]:.2f}")
    print(f"{'shape':>11} {'rows':>5} {'grp':>4} {'large GOP/s':>11} {'vnni GOP/s':>10} {'bf16 GF/s':>9} "
          f"{'large/vnni':>10} {'equal':>6}")
    for r in result["linear"]:
        print(f"{r['out']:>5} x {r['in']:<4} {r['rows']:>5} {r['act_group']:>4} {r['w8a8_vnni_large GOP/s']:>11.0f} "
              f"{r['w8a8_vnni GOP/s']:>10.0f} {r['bf16 F.linear GOP/s']:>9.0f} {r['large vs vnni']:>9.2f}x {str(r['equal']):>6}")
    p = result["prefill"]
    if p:
        tok = p["tokens"]
        print(f"prefill forward, {tok} tokens, int8, bf16 (loop {p['decoder_path']['w8a8_vnni_large']}): "
              f"w8a8_vnni_large {p['w8a8_vnni_large ms']:.0f} ms ({tok / p['w8a8_vnni_large ms'] * 1e3:.0f} tok/s), "
              f"w8a8_vnni {p['w8a8_vnni ms']:.0f} ms ({tok / p['w8a8_vnni ms'] * 1e3:.0f} tok/s), "
              f"{p['large vs vnni']:.2f}x; logits equal: {p['equal_logits']}")


if __name__ == "__main__":
    typer.run(command)
