"""pdserve bench attention: paged attention, the torch reference against the in-place CPU kernel.

Two parts, in one run:

- **op**: one layer's decode attention (``--query-lens``: 1 query per sequence, or a short
  verification run of n) at each batch size x context x dtype, the model's shapes (9 query heads,
  3 KV heads, head dim 64, block size 16), block tables shuffled over the cache (as serving leaves
  them). Each repeat visits enough separate layer caches (at least 64 MiB in all, more than the
  L3) that every call finds its K/V in DRAM, as it does inside a decode step. Reported: ms per
  layer (CPU time, median), and the K/V bytes the kernel reads per second; interleaved with the
  default in the same run, the kernel with ``PDSERVE_ATTN_WHOLE_MIN_ROWS=0`` (its earlier work
  items: one over all KV heads once a batch has two tiles per thread), with
  ``PDSERVE_ATTN_AMX_DECODE=0`` (on CPUs with AMX-BF16: the decode rows off the AMX tiles, through
  the vdpbf16ps path) and, for bf16, with ``PDSERVE_ATTN_DECODE=fp32`` (its earlier fp32 P V loop,
  kept as a fallback).
- **prefill**: one layer's attention of one prefill chunk of each ``--prefill-lens`` length, from
  position 0 and continued after as many cached tokens (causal; the same shapes, scattered
  tables). Reported: ms per layer and GFLOP/s of the causal work (4 x head_dim FLOPs per query
  head and visible (query, key) pair; the CPU's bf16 GEMM peak is ~470 GFLOP/s a core).
- **step**: a whole decode step of the bundled model (batch 16, ~250-token contexts by default)
  per dtype and backend: ms per step, the part of it spent in attention, and the metadata build
  (``AttentionMetadata.build``) per step; also the cpu backend with ``PDSERVE_ATTN_WHOLE_MIN_ROWS=0``
  (all-heads step) and with ``PDSERVE_ATTN_AMX_DECODE=0``, interleaved; ``--profile`` adds
  torch.profiler's top operators.

Times are CPU time (process time, all threads), which other processes on a shared machine do
not inflate; wall times are in the JSON too, beside ``uptime``'s load. Prints a table and writes
JSON (``--json``). Run as ``pdserve bench attention`` or ``python -m bench.attention``. Speed is
measured here, never in tests.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Callable

import typer

from bench.options import int_list

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
COLD_BYTES = 64 * 2**20


def command(
    json_out: Path = typer.Option(Path("out/bench_attention.json"), "--json", help="Where to write the results."),
    model: str = typer.Option("smollm2-135m-instruct", "--model", "-m"),
    batch_sizes: str = typer.Option("1,16,32", "--batch-sizes", help="Comma-separated batch sizes (op part)."),
    contexts: str = typer.Option("256,1024", "--contexts", help="Comma-separated context lengths (op part)."),
    query_lens: str = typer.Option("1", "--query-lens",
                                   help="Comma-separated queries per sequence (op part: 1 = decode, 2-5 = verification)."),
    dtypes: str = typer.Option("float32,bfloat16", "--dtypes", help="Comma-separated dtypes."),
    prefill_lens: str = typer.Option("512", "--prefill-lens",
                                     help="Comma-separated prefill chunk lengths (prefill part; empty = skip it)."),
    step_batch: int = typer.Option(16, "--step-batch", help="Decode batch of the step part (0 = skip it)."),
    step_context: int = typer.Option(250, "--step-context", help="Context of each sequence in the step part."),
    repeats: int = typer.Option(9, "--repeats", help="Timed repeats (median)."),
    threads: int = typer.Option(0, "--threads", help="torch threads (0 = the cores this process may use)."),
    profile: bool = typer.Option(False, "--profile", help="Also print torch.profiler's top ops of one step."),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype",
                                       help="KV cache of the step part: auto (= dtype) or fp8_e4m3 (calibrated scales)."),
) -> None:
    """Attention ms per layer (reference vs kernel) and decode step ms per backend."""
    import torch

    from engine.quantization import check_kv_cache_dtype

    kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype)
    batches, ctxs, qlens = (int_list(batch_sizes, "--batch-sizes"), int_list(contexts, "--contexts"),
                            int_list(query_lens, "--query-lens"))
    lengths = int_list(prefill_lens, "--prefill-lens")
    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
    names = [d.strip() for d in dtypes.split(",") if d.strip()]
    result = {"threads": torch.get_num_threads(), "load_before": os.getloadavg(),
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "op": [], "prefill": [], "step": []}
    for dtype in names:
        for batch in batches:
            for context in ctxs:
                for qlen in qlens:
                    result["op"].append(_op(getattr(torch, dtype), batch, context, repeats, qlen))
    for dtype in names:
        for length in lengths:
            for start in (0, length):
                result["prefill"].append(_prefill(getattr(torch, dtype), start, length, repeats))
    if step_batch:
        for dtype in names:
            result["step"].append(_step(model, getattr(torch, dtype), step_batch, step_context, repeats, profile,
                                        kv_cache_dtype))
    result["load_after"] = os.getloadavg()
    _print_table(result)
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {json_out}")


def _op(dtype, batch: int, context: int, repeats: int, qlen: int = 1) -> dict:
    """One layer's attention of ``qlen`` queries per sequence ending at position ``context``."""
    import torch

    from kernels.attention import AttentionMetadata, get_attention_backend

    blocks_per_seq = -(-context // BLOCK)
    num_blocks = batch * blocks_per_seq + 1
    layer_bytes = 2 * num_blocks * BLOCK * KV_HEADS * HEAD_DIM * torch.empty((), dtype=dtype).element_size()
    layers = max(2, min(30, -(-COLD_BYTES // layer_bytes)))
    caches = [(torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM).to(dtype),
               torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)) for _ in range(layers)]
    order = list(range(num_blocks))
    random.Random(0).shuffle(order)
    tables = [order[b * blocks_per_seq:(b + 1) * blocks_per_seq] for b in range(batch)]
    args = ([context - qlen] * batch, [qlen] * batch, tables, BLOCK)
    query = torch.randn(batch * qlen, HEADS, HEAD_DIM).to(dtype)
    ref, cpu = get_attention_backend("torch"), get_attention_backend("cpu")
    full = AttentionMetadata.build(*args, dtype=dtype)
    lean = AttentionMetadata.build(*args, dtype=dtype, groups=cpu.metadata_groups)

    def over_layers(ops, meta) -> Callable[[], None]:
        return lambda: [ops.paged_attention(query, k, v, meta, HEAD_DIM ** -0.5) for k, v in caches]

    fns = {"torch": over_layers(ref, full), "cpu": over_layers(cpu, lean)}
    if dtype == torch.bfloat16:   # the fp32 P V fallback, for the A/B
        fns["cpu_fp32_pv"] = _with_env("PDSERVE_ATTN_DECODE", "fp32", over_layers(cpu, lean))
    # the earlier work items (one item over all KV heads once there are enough tiles), for the A/B
    fns["cpu_all_heads"] = _with_env("PDSERVE_ATTN_WHOLE_MIN_ROWS", "0", over_layers(cpu, lean))
    # decode rows off the AMX tiles (the same kernel elsewhere), for the A/B
    fns["cpu_no_amx_decode"] = _with_env("PDSERVE_ATTN_AMX_DECODE", "0", over_layers(cpu, lean))
    times = _interleaved(fns, repeats)
    per_layer = {name: {k: 1000 * v / layers for k, v in t.items()} for name, t in times.items()}
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * torch.empty((), dtype=dtype).element_size()
    out = {"dtype": str(dtype).removeprefix("torch."), "batch": batch, "context": context, "query_len": qlen,
           "layers_cycled": layers, "speedup": per_layer["torch"]["cpu"] / per_layer["cpu"]["cpu"]}
    for name in fns:
        out[f"{name}_ms_per_layer"] = per_layer[name]["cpu"]
        out[f"{name}_ms_per_layer_wall"] = per_layer[name]["wall"]
    out["cpu_kv_read_gb_s"] = kv_bytes / (per_layer["cpu"]["cpu"] / 1000) / 1e9
    out["speedup_vs_all_heads"] = per_layer["cpu_all_heads"]["cpu"] / per_layer["cpu"]["cpu"]
    out["speedup_vs_no_amx_decode"] = per_layer["cpu_no_amx_decode"]["cpu"] / per_layer["cpu"]["cpu"]
    if "cpu_fp32_pv" in fns:
        out["cpu_fp32_pv_kv_read_gb_s"] = kv_bytes / (per_layer["cpu_fp32_pv"]["cpu"] / 1000) / 1e9
        out["speedup_vs_fp32_pv"] = per_layer["cpu_fp32_pv"]["cpu"] / per_layer["cpu"]["cpu"]
    return out


def _with_env(name: str, value: str, fn: Callable[[], object]) -> Callable[[], object]:
    """fn run with os.environ[name] = value (the kernel reads it at each call), restored after."""
    def run() -> object:
        old = os.environ.get(name)
        os.environ[name] = value
        try:
            return fn()
        finally:
            if old is None:
                del os.environ[name]
            else:
                os.environ[name] = old
    return run


def _prefill(dtype, start: int, length: int, repeats: int) -> dict:
    """One layer's attention of a chunk of ``length`` tokens after ``start`` cached ones."""
    import torch

    from kernels.attention import AttentionMetadata, get_attention_backend

    blocks = -(-(start + length) // BLOCK)
    order = list(range(blocks + 1))
    random.Random(0).shuffle(order)
    key_cache, value_cache = (torch.randn(blocks + 1, BLOCK, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(2))
    args = ([start], [length], [order[:blocks]], BLOCK)
    query = torch.randn(length, HEADS, HEAD_DIM).to(dtype)
    ref, cpu = get_attention_backend("torch"), get_attention_backend("cpu")
    full = AttentionMetadata.build(*args, dtype=dtype)
    lean = AttentionMetadata.build(*args, dtype=dtype, groups=cpu.metadata_groups)
    times = _interleaved({"torch": lambda: ref.paged_attention(query, key_cache, value_cache, full, HEAD_DIM ** -0.5),
                          "cpu": lambda: cpu.paged_attention(query, key_cache, value_cache, lean, HEAD_DIM ** -0.5)},
                         repeats)
    flops = 4 * HEAD_DIM * HEADS * (length * start + length * (length + 1) // 2)
    out = {"dtype": str(dtype).removeprefix("torch."), "start": start, "length": length, "gflop": flops / 1e9}
    for name in times:
        out[f"{name}_ms_per_layer"] = 1000 * times[name]["cpu"]
        out[f"{name}_ms_per_layer_wall"] = 1000 * times[name]["wall"]
        out[f"{name}_gflop_s"] = flops / times[name]["cpu"] / 1e9
        out[f"{name}_gflop_s_wall"] = flops / times[name]["wall"] / 1e9
    return out


def _step(model: str, dtype, batch: int, context: int, repeats: int, profile: bool, kv_cache_dtype: str = "auto") -> dict:
    import torch

    from engine.batch import SeqChunk
    from engine.model_runner import ModelRunner
    from kernels.attention import AttentionMetadata, get_attention_backend

    blocks_per_seq = -(-(context + 9) // BLOCK)
    runner = ModelRunner(model, block_size=BLOCK, num_blocks=batch * blocks_per_seq + 1, dtype=dtype,
                         attention_backend="torch", kv_cache_dtype=kv_cache_dtype)
    tables = [list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq)) for b in range(batch)]
    chunks = [SeqChunk([b + 1], context + b % 8, tables[b]) for b in range(batch)]   # K/V values do not matter
    backends = {"torch": get_attention_backend("torch"), "cpu": get_attention_backend("cpu")}
    attention_s = {name: [0.0] for name in backends}
    for name, ops in backends.items():
        ops.paged_attention = _timed(ops.paged_attention, attention_s[name])

    def step(name: str) -> Callable[[], None]:
        def run() -> None:
            runner.ops = backends[name]
            runner.forward(chunks)
        return run

    fns = {name: step(name) for name in backends}
    # the cpu kernel with its earlier work items (one over all KV heads), interleaved: the A/B of 893f332
    fns["cpu_all_heads"] = _with_env("PDSERVE_ATTN_WHOLE_MIN_ROWS", "0", step("cpu"))
    fns["cpu_no_amx_decode"] = _with_env("PDSERVE_ATTN_AMX_DECODE", "0", step("cpu"))
    times = _interleaved(fns, repeats)
    out = {"dtype": str(dtype).removeprefix("torch."), "kv_cache_dtype": kv_cache_dtype, "batch": batch,
           "context": context}
    out["cpu_all_heads_ms_per_step"] = 1000 * times["cpu_all_heads"]["cpu"]
    out["cpu_all_heads_ms_per_step_wall"] = 1000 * times["cpu_all_heads"]["wall"]
    out["cpu_no_amx_decode_ms_per_step"] = 1000 * times["cpu_no_amx_decode"]["cpu"]
    out["cpu_no_amx_decode_ms_per_step_wall"] = 1000 * times["cpu_no_amx_decode"]["wall"]
    for name in backends:
        # warm-up included in the attention total; the cpu backend's also covers the steps of its two A/B variants
        calls = (repeats + 1) * (3 if name == "cpu" else 1)
        out[f"{name}_ms_per_step"] = 1000 * times[name]["cpu"]
        out[f"{name}_ms_per_step_wall"] = 1000 * times[name]["wall"]
        # None: the backend's attention ran inside the fused C++ decoder loop (kernels/decoder_loop.py),
        # which calls the operator from C++, out of this Python-level timer's sight
        out[f"{name}_attention_ms_per_step"] = 1000 * attention_s[name][0] / calls if attention_s[name][0] else None
        groups = getattr(backends[name], "metadata_groups", "all")
        out[f"{name}_metadata_ms_per_step"] = 1000 * _median_cpu(lambda: AttentionMetadata.build(
            [c.start_pos for c in chunks], [1] * batch, tables, BLOCK, dtype=dtype, groups=groups), 50)
    out["step_speedup"] = out["torch_ms_per_step"] / out["cpu_ms_per_step"]
    if profile:
        out["profile"] = {name: _profile(step(name)) for name in backends}
    return out


def _timed(fn, total: list[float]):
    import torch

    def wrapper(*args, **kwargs):
        start = time.process_time()
        with torch.profiler.record_function("paged_attention"):
            result = fn(*args, **kwargs)
        total[0] += time.process_time() - start
        return result
    return wrapper


def _profile(step: Callable[[], None], steps: int = 3) -> list[dict]:
    """Top operators of ``steps`` steps by self time, per step (the profiler's clock is wall
    time: on a busy machine read the shares, not the milliseconds)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    return [{"op": e.key, "self_wall_ms_per_step": e.self_cpu_time_total / 1000 / steps,
             "share": e.self_cpu_time_total / total} for e in rows]


def _median_cpu(fn: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        samples.append(time.process_time() - start)
    return statistics.median(samples)


def _interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, dict[str, float]]:
    """Median wall and CPU seconds of each function, timed alternately after one warm-up each."""
    for fn in fns.values():
        fn()
    samples = {name: {"wall": [], "cpu": []} for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            samples[name]["cpu"].append(time.process_time() - cpu)
            samples[name]["wall"].append(time.perf_counter() - wall)
    return {name: {k: statistics.median(v) for k, v in d.items()} for name, d in samples.items()}


def _ms(value: float | None) -> str:
    """A 6-wide ms cell; '-' for a figure not measured."""
    return f"{value:6.1f}" if value is not None else f"{'-':>6}"


def _print_table(result: dict) -> None:
    print(f"threads {result['threads']}, CPU {result['cpu_capability']}, load before "
          f"{' '.join(f'{x:.2f}' for x in result['load_before'])}, after "
          f"{' '.join(f'{x:.2f}' for x in result['load_after'])}")
    print("\nattention, one layer of decode / verification (q = queries per sequence; ms, CPU time; K/V cold in DRAM;"
          " fp32-PV: the kernel with PDSERVE_ATTN_DECODE=fp32, same run)")
    print("all-heads: the kernel with PDSERVE_ATTN_WHOLE_MIN_ROWS=0 (one work item over all KV heads at b >= 2 x threads,"
          " as before 2026-12-02), same run")
    print("no-AMX: the kernel with PDSERVE_ATTN_AMX_DECODE=0 (decode rows through vdpbf16ps where the CPU has AMX-BF16;"
          " elsewhere the same kernel), same run")
    print(f"{'dtype':9} {'batch':>5} {'ctx':>5} {'q':>2} {'torch ms':>9} {'cpu ms':>8} {'speedup':>8} {'cpu KV GB/s':>11} "
          f"{'all-heads ms':>12} {'vs all-heads':>12} {'no-AMX ms':>9} {'vs no-AMX':>9} {'fp32-PV ms':>10} {'fp32-PV GB/s':>12} "
          f"{'vs fp32-PV':>10}")
    for r in result["op"]:
        line = (f"{r['dtype']:9} {r['batch']:5d} {r['context']:5d} {r.get('query_len', 1):2d} {r['torch_ms_per_layer']:9.3f} "
                f"{r['cpu_ms_per_layer']:8.3f} {r['speedup']:7.2f}x {r['cpu_kv_read_gb_s']:11.1f}"
                f" {r['cpu_all_heads_ms_per_layer']:12.3f} {r['speedup_vs_all_heads']:11.2f}x"
                f" {r['cpu_no_amx_decode_ms_per_layer']:9.3f} {r['speedup_vs_no_amx_decode']:8.2f}x")
        if "cpu_fp32_pv_ms_per_layer" in r:
            line += (f" {r['cpu_fp32_pv_ms_per_layer']:10.3f} {r['cpu_fp32_pv_kv_read_gb_s']:12.1f}"
                     f" {r['speedup_vs_fp32_pv']:9.2f}x")
        print(line)
    if result["prefill"]:
        print("\nattention, one layer of one prefill chunk (ms and GFLOP/s; CPU time, and wall GFLOP/s)")
        print(f"{'dtype':9} {'start':>5} {'len':>5} {'torch ms':>9} {'cpu ms':>8} {'torch GF/s':>10} {'cpu GF/s':>9} "
              f"{'cpu wall GF/s':>13}")
        for r in result["prefill"]:
            print(f"{r['dtype']:9} {r['start']:5d} {r['length']:5d} {r['torch_ms_per_layer']:9.3f} {r['cpu_ms_per_layer']:8.3f} "
                  f"{r['torch_gflop_s']:10.1f} {r['cpu_gflop_s']:9.1f} {r['cpu_gflop_s_wall']:13.1f}")
    if result["step"]:
        print("\ndecode step (ms, CPU time): whole step / attention in it / metadata build"
              " ('-': attention inside the fused C++ decoder loop, not timed from Python; see --profile)")
        print(f"{'dtype':9} {'kv':>8} {'batch':>5} {'ctx':>5} {'torch step':>10} {'attn':>6} {'meta':>6} "
              f"{'cpu step':>9} {'attn':>6} {'meta':>6} {'speedup':>8} {'all-heads step':>14} {'no-AMX step':>11}")
        for r in result["step"]:
            print(f"{r['dtype']:9} {r.get('kv_cache_dtype', 'auto'):>8} {r['batch']:5d} {r['context']:5d} {r['torch_ms_per_step']:10.1f} "
                  f"{_ms(r['torch_attention_ms_per_step'])} {r['torch_metadata_ms_per_step']:6.2f} "
                  f"{r['cpu_ms_per_step']:9.1f} {_ms(r['cpu_attention_ms_per_step'])} "
                  f"{r['cpu_metadata_ms_per_step']:6.2f} {r['step_speedup']:7.2f}x {r['cpu_all_heads_ms_per_step']:14.1f}"
                  f" {r['cpu_no_amx_decode_ms_per_step']:11.1f}")
        for r in result["step"]:
            for name, rows in r.get("profile", {}).items():
                print(f"\nprofile, {r['dtype']} {name}: top ops by self time (profiler wall ms per step, share)")
                for row in rows:
                    print(f"  {row['op'][:40]:40} {row['self_wall_ms_per_step']:7.2f} {100 * row['share']:5.1f}%")


if __name__ == "__main__":
    typer.run(command)
