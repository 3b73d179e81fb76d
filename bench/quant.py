"""Quantized linears and the decode step they make, measured (``python -m bench.quant``).

Two tables, every row timed in one run so ratios are comparable on a busy machine (the load
averages are printed beside them):

- linear: each kernel of each method (kernels/linear.py) on the bundled model's four projection
  shapes at 1, 16 and 512 rows (int8 with the activation group the model uses for that projection,
  engine/quantization/apply.py INT8_ACT_GROUPS), best of a few rounds, with the weight bytes read per call and the
  GB/s that makes;
- linears of a step: every linear of the loaded model (30 layers' qkv, o, gate/up, down and the
  LM head) called on B rows, each with the kernel the model chose at load, per method; each
  weight is read once per pass (the model's 135-270 MB), so every call finds its weight out of the
  core's caches as a decode step does. Per call the least time over --steps passes (methods
  round-robin), summed per projection and in all, with the GB/s of weight that makes: the GEMM
  share of the decode step, in hardware terms, without attention and the small ops;
- decode step: one ModelRunner forward of B decode tokens (B = ``--batch-sizes``, default 1, 16,
  32; ``--context`` tokens of context each) per --quantization method at --dtype, best of
  --steps, and its speed-up over ``none``; also the median step and the median of each round's
  ratio to ``none`` (the spread a busy host puts between single runs shows there). Methods are timed
  round-robin, so a burst of load hits them alike: each round runs every method's step once
  (after another method's step: the caches hold that model's weights, not this one's) and then
  ``--consecutive`` more of its steps, timed apart (the previous step was the same model's, as in
  a server). The two differ where the last-level cache holds much of a model: on a 300 MiB L3 the
  INT8 model's 135 MB can stay there from one step to the next, bf16's 270 MB mostly cannot; on a
  32 MB L3 they agree. Beside it: the step's linears (the table above), the rest of the step, the
  linears' floor (their weight bytes at the run's best streaming read, or their operations at the
  method's GEMM peak, whichever is longer: bench/floors.py) and the speed-up those floors allow
  (``add_floor``);
- with ``--isolated N``: the decode step of each method alone in its own process, N rounds,
  methods alternating (bench/isolated_step.py): what a server's steps see, where the tables above
  hold every method's model in one process.

Writes JSON (``--json``). Speed is measured here, never in tests.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import typer

from bench.isolated_step import decode_chunks, decode_runner, isolated_rows, print_rows, run_process
from bench.options import int_list, name_list

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))   # (out, in): fused qkv, o, fused gate/up, down
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")   # of SHAPES
ROWS = (1, 16, 512)


def command(
    model: str = typer.Option("smollm2-135m-instruct", "--model", "-m"),
    dtype: str = typer.Option("bfloat16", "--dtype"),
    methods: str = typer.Option("none,int8,fp8", "--methods", help="Comma-separated --quantization methods."),
    context: int = typer.Option(128, "--context", help="Context of each sequence in the decode step."),
    steps: int = typer.Option(10, "--steps", min=1, help="Rounds of timed decode steps per method and batch size."),
    consecutive: int = typer.Option(3, "--consecutive", min=0,
                                    help="Steps a method runs in a row after each round's first (timed apart)."),
    batch_sizes: str = typer.Option("1,16,32", "--batch-sizes", help="Comma-separated decode batch sizes."),
    threads: int = typer.Option(0, "--threads", help="torch threads (0 = the cores this process may use)."),
    skip_linear: bool = typer.Option(False, "--skip-linear",
                                     help="Skip the per-kernel table (the step's linears and the decode step remain)."),
    isolated: int = typer.Option(0, "--isolated", min=0,
                                 help="Rounds of each method's decode steps alone in its own process (as served; "
                                      "bench/isolated_step.py); 0: none."),
    isolated_steps: int = typer.Option(200, "--isolated-steps", min=1,
                                       help="Consecutive decode steps a process times per batch size (--isolated)."),
    json_out: Path = typer.Option(Path("out/bench_quant.json"), "--json"),
) -> None:
    """Linear kernels and decode step per quantization method."""
    import torch

    from engine.quantization import QUANTIZATION_METHODS

    names = name_list(methods, "--methods", QUANTIZATION_METHODS, what="method")
    batches = _batch_sizes(batch_sizes)
    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
    dt = getattr(torch, dtype)
    from bench.floors import measure_read_bandwidth

    result = {"dtype": dtype, "threads": torch.get_num_threads(), "load_before": _load(),
              "read_GBps_before": round(measure_read_bandwidth() / 1e9, 1), "gemm_peak_GOPS": gemm_peaks(dtype, names)}
    if not skip_linear:
        result["linear"] = linear_rows(names, dt)
        _print_linear(result["linear"])
    runners = build_runners(model, names, dt, context, batches)
    result["linears"] = linears_rows(runners, steps, batches)
    _print_linears(result["linears"], result)
    result["decode"] = decode_rows(runners, context, steps, batches, consecutive)
    result["load_after"] = _load()
    result["read_GBps_after"] = round(measure_read_bandwidth() / 1e9, 1)
    add_floor(result["decode"], result["linears"], max(result["read_GBps_before"], result["read_GBps_after"]),
              result["gemm_peak_GOPS"])
    _print_decode(result["decode"], result)
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(result, indent=2) + "\n")   # (kept should a process below fail)
    if isolated:
        del runners   # (their memory back before the processes start)
        rounds = [{m: run_process(model, m, dtype, context, list(batches), isolated_steps, torch.get_num_threads())
                   for m in names} for _ in range(isolated)]
        result["isolated"] = isolated_rows(rounds)
        print_rows(result["isolated"])
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
                                     "act_group": _group_label(getattr(mod, "group", None)),
                                     "us": round(t * 1e6, 1), "weight_GBps": round(wbytes / t / 1e9, 1),
                                     "chosen": name == mod.kernel_names[min(ROWS.index(m_rows), 2)]})
    return rows


def _batch_sizes(text: str) -> tuple[int, ...]:
    return tuple(int_list(text, "--batch-sizes"))


def build_runners(model: str, methods: list[str], dtype, context: int, batches: tuple[int, ...]) -> dict:
    """One ModelRunner per --quantization method, with cache blocks for max(batches) sequences."""
    return {m: decode_runner(model, m, dtype, context, max(batches)) for m in methods}


def model_linears(runner) -> list[tuple[str, object]]:
    """(projection, module) for every linear of the runner's model: the decoder's (module order),
    then the LM head's method."""
    from kernels.linear import MeasuredLinear

    out = [(name.rsplit(".", 1)[-1], mod) for name, mod in runner.model.named_modules()
           if isinstance(mod, MeasuredLinear) and name.startswith("model.layers.")]
    head = getattr(runner.model, "head_method", None)
    return out + ([("lm_head", head)] if head is not None else [])


def linears_rows(runners: dict, steps: int, batches: tuple[int, ...]) -> list[dict]:
    """Per method and batch: the least time of each linear call over ``steps`` passes through
    all of them (methods round-robin; one warm-up pass each), summed per projection and in all."""
    import time as _time

    import torch

    seqs = {m: model_linears(r) for m, r in runners.items()}
    out = []
    for batch in batches:
        xs = {m: {mod.in_features: torch.randn(batch, mod.in_features).to(mod.dtype) for _, mod in seq}
              for m, seq in seqs.items()}
        best = {m: [float("inf")] * len(seq) for m, seq in seqs.items()}
        with torch.inference_mode():
            for step in range(steps + 1):
                for m, seq in seqs.items():
                    for i, (_, mod) in enumerate(seq):
                        x = xs[m][mod.in_features]
                        t0 = _time.perf_counter()
                        mod(x)
                        if step:
                            best[m][i] = min(best[m][i], _time.perf_counter() - t0)
        for m, seq in seqs.items():
            per: dict[str, float] = {}
            for (proj, _), t in zip(seq, best[m]):
                per[proj] = per.get(proj, 0.0) + t
            total, wbytes = sum(best[m]), sum(mod.weight_bytes() for _, mod in seq)
            params = sum(mod.in_features * mod.out_features for _, mod in seq)
            out.append({"batch": batch, "method": m, "ms": round(total * 1e3, 3), "params": params,
                        "weight_MB": round(wbytes / 1e6, 1), "weight_GBps": round(wbytes / total / 1e9, 1),
                        "per_projection_ms": {k: round(v * 1e3, 3) for k, v in per.items()}})
    ms = {(r["batch"], r["method"]): r["ms"] for r in out}
    for r in out:
        base = ms.get((r["batch"], "none"))
        r["speedup_vs_none"] = round(base / r["ms"], 2) if base else None
    return out


def decode_rows(runners: dict, context: int, steps: int, batches: tuple[int, ...] = (1, 16, 32),
                consecutive: int = 3) -> list[dict]:
    """Per batch and method: the decode step after another method's step (ms, its median, the
    speed-ups over none) and, with ``consecutive`` > 0, the steps that follow the same method's
    (ms_consecutive and the rest). ``steps`` rounds, methods round-robin within each (with one
    method, a round's first step follows that method's own previous round)."""
    methods = list(runners)
    out = []
    for batch in batches:
        chunks = decode_chunks(context, batch)
        times: dict[str, list[float]] = {m: [] for m in methods}
        runs: dict[str, list[list[float]]] = {m: [] for m in methods}   # per round, the consecutive steps
        for _ in range(2):                                   # warm-up
            for r in runners.values():
                r.forward(chunks)
        for _ in range(steps):                               # round-robin
            for m, r in runners.items():
                run = []
                for i in range(1 + consecutive):
                    t0 = time.perf_counter()
                    r.forward(chunks)
                    (run if i else times[m]).append(time.perf_counter() - t0)
                if run:
                    runs[m].append(run)
        best = {m: min(t) for m, t in times.items()}
        steady = {m: [t for run in rs for t in run] for m, rs in runs.items() if rs}   # each method's consecutive steps
        for m in methods:
            row = {"batch": batch, "method": m, "ms": round(best[m] * 1e3, 2),
                   "ms_median": round(statistics.median(times[m]) * 1e3, 2), "context": context,
                   "speedup_vs_none": round(best["none"] / best[m], 2) if "none" in best else None,
                   "attention_backend": runners[m].attention_backend}
            if "none" in times:   # a round's steps run one after another: their ratio sees the same host minute
                row["speedup_vs_none_median"] = round(statistics.median(
                    n / t for n, t in zip(times["none"], times[m])), 2)
            if m in steady:
                row.update(ms_consecutive=round(min(steady[m]) * 1e3, 2),
                           ms_consecutive_median=round(statistics.median(steady[m]) * 1e3, 2))
                if "none" in steady:   # per round, none's mean consecutive step over the method's
                    row["speedup_vs_none_consecutive"] = round(min(steady["none"]) / min(steady[m]), 2)
                    row["speedup_vs_none_consecutive_median"] = round(statistics.median(
                        statistics.fmean(n) / statistics.fmean(t) for n, t in zip(runs["none"], runs[m])), 2)
            out.append(row)
    return out


def gemm_peaks(dtype: str, methods: list[str]) -> dict[str, float]:
    """GOP/s of the GEMM each method's linears run on: the dtype's torch.mm for none, torch._int_mm
    for int8 (bench engine's probes; int8 only where oneDNN's VNNI kernel runs it). None for fp8:
    CPUs run FP8 weights from a bf16 copy that ``weight_bytes`` does not count, so no floor here
    would be one."""
    from bench.floors import GEMM_SIZE, probe_floors

    peaks = probe_floors([dtype], GEMM_SIZE, 1, int8="int8" in methods)["gemm_flops"]
    return {name: round(peaks[key] / 1e9) for name, key in (("none", dtype), ("int8", "int8")) if key in peaks}


def add_floor(decode: list[dict], linears: list[dict], read_gbps: float, peak_gops: dict[str, float]) -> None:
    """Beside each decode row: its linears timed alone (``linears`` of the same batch and method),
    the rest of the step (step - linears: attention, norms, sampling, overhead), the linears'
    floor, the larger of streaming their weight bytes at ``read_gbps`` (the run's best streaming
    read) and computing their 2 x params x batch operations at the method's GEMM peak
    (``peak_gops``), and the linears' fraction of it; and ``bound_vs_none``, the step speed-up over
    ``none`` were every method's linears at their floor and its rest as measured."""
    lin = {(r["batch"], r["method"]): r for r in linears}
    for r in decode:
        ln = lin.get((r["batch"], r["method"]))
        peak = peak_gops.get(r["method"])
        if ln is None or not peak:
            continue
        read_ms = ln["weight_MB"] / read_gbps                       # MB / (GB/s) = ms
        compute_ms = 2 * ln["params"] * r["batch"] / peak / 1e6    # ops / (GOP/s) in ms
        floor_ms = max(read_ms, compute_ms)
        r.update(linears_ms=ln["ms"], rest_ms=round(r["ms"] - ln["ms"], 2), read_floor_ms=round(read_ms, 2),
                 compute_floor_ms=round(compute_ms, 2), floor_ms=round(floor_ms, 2),
                 linears_pct_of_floor=round(100 * floor_ms / ln["ms"]))
    by = {(r["batch"], r["method"]): r for r in decode}
    for r in decode:
        base = by.get((r["batch"], "none"))
        if base and "floor_ms" in r and "floor_ms" in base and r["floor_ms"] + r["rest_ms"] > 0:
            # (rest is step - linears timed apart: on a noisy host it can come out negative)
            r["bound_vs_none"] = round((base["floor_ms"] + base["rest_ms"]) / (r["floor_ms"] + r["rest_ms"]), 2)


def _best(fn, reps: int, rounds: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def _group_label(group: int | None) -> int | str | None:
    """An INT8 linear's activation group as the table prints it: channels a scale, or "mx"."""
    from kernels.linear import MX_GROUP

    return "mx" if group == MX_GROUP else group


def _print_linear(rows: list[dict]) -> None:
    print(f"{'out x in':>11} {'rows':>5} {'method':<6} {'kernel':<16} {'group':>5} {'us':>9} {'weight GB/s':>11}")
    for r in rows:
        mark = " *" if r["chosen"] else ""
        print(f"{r['out']:>5} x {r['in']:<4} {r['rows']:>5} {r['method']:<6} {r['kernel']:<16} {r['act_group'] or '':>5} {r['us']:>9.1f} "
              f"{r['weight_GBps']:>11.1f}{mark}")
    print("(* = the kernel the method chose at load for that row count)")


def _print_linears(rows: list[dict], result: dict) -> None:
    print(f"linears of a decode step (every weight once, cold), {result['dtype']}, {result['threads']} threads "
          f"(load {_load()})")
    projs = list(rows[0]["per_projection_ms"]) if rows else []
    print(f"{'batch':>5} {'method':<6} {'ms':>7} {'weight MB':>9} {'GB/s':>6} {'vs none':>8}  " +
          " ".join(f"{p:>9}" for p in projs))
    for r in rows:
        print(f"{r['batch']:>5} {r['method']:<6} {r['ms']:>7.2f} {r['weight_MB']:>9.1f} {r['weight_GBps']:>6.1f} "
              f"{r['speedup_vs_none'] or '':>8}  " + " ".join(f"{r['per_projection_ms'].get(p, 0):>9.2f}" for p in projs))


def _print_decode(rows: list[dict], result: dict) -> None:
    print(f"decode step, {result['dtype']}, {result['threads']} threads "
          f"(load {result['load_before']} before, {result['load_after']} after)")
    before, after = result.get("read_GBps_before"), result.get("read_GBps_after")
    print(f"(linears: the step's linears timed alone, above; rest = step - linears; floor = the larger of their weight "
          f"bytes at {before}/{after} GB/s (the run's streaming read, before/after) and their ops at the method's GEMM "
          f"peak, GOP/s {result.get('gemm_peak_GOPS')}; bound = the speed-up over none with every method's linears at "
          f"their floor)")
    if before and after and abs(before - after) > 0.15 * min(before, after):
        print(f"(the two reads differ by {abs(before - after) / min(before, after):.0%}: the host's memory was busier at one "
              "of them; the floors take the faster)")
    print("(ms/step and vs none: the best step of each method; p50: the median step, and the median over rounds of "
          "none's step over the method's in the same round)")
    print(f"{'batch':>5} {'method':<6} {'ms/step':>8} {'vs none':>8} {'p50 ms':>8} {'p50 vs':>7} {'linears':>8} {'rest':>6} "
          f"{'read':>6} {'compute':>7} {'% floor':>7} {'bound':>6}")
    for r in rows:
        print(f"{r['batch']:>5} {r['method']:<6} {r['ms']:>8.2f} {r['speedup_vs_none'] or '':>8} {r['ms_median']:>8.2f} "
              f"{r.get('speedup_vs_none_median', ''):>7} {r.get('linears_ms', ''):>8} "
              f"{r.get('rest_ms', ''):>6} {r.get('read_floor_ms', ''):>6} {r.get('compute_floor_ms', ''):>7} "
              f"{r.get('linears_pct_of_floor', ''):>7} {r.get('bound_vs_none', ''):>6}")
    if any("ms_consecutive" in r for r in rows):
        print("decode step, consecutive steps of one method (the previous step was the same model's, as in a server; "
              "above: after another method's step). ms/step and vs none: the best; p50 ms: the median step; p50 vs: "
              "the median over rounds of none's mean step over the method's")
        print(f"{'batch':>5} {'method':<6} {'ms/step':>8} {'vs none':>8} {'p50 ms':>8} {'p50 vs':>7}")
        for r in rows:
            if "ms_consecutive" in r:
                print(f"{r['batch']:>5} {r['method']:<6} {r['ms_consecutive']:>8.2f} "
                      f"{r.get('speedup_vs_none_consecutive') or '':>8} {r['ms_consecutive_median']:>8.2f} "
                      f"{r.get('speedup_vs_none_consecutive_median', ''):>7}")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    typer.run(command)
