"""pdserve bench engine: the runtime's prefill and decode speed beside this machine's floors,
all measured in one run.

For each thread count (``--threads``, default 1 and all available cores) it measures:

- the machine: GEMM peak FLOP/s per dtype (``torch.mm`` on --gemm-size cubes) and memory
  bandwidth (a --memcpy-mib tensor copied with ``Tensor.copy_``; bytes read + written per
  second, the STREAM "copy" convention);
- the runtime, per configuration: each dtype (``--dtypes``, default float32 and bfloat16) with
  each ``--quantization`` method (default none) and each ``--kv-cache-dtype`` (default auto),
  e.g. ``--dtypes bfloat16 --quantization none,int8,fp8 --kv-cache-dtype auto,fp8_e4m3`` for six
  rows: prefill tok/s of one --prompt-tokens prompt, and decode ms/step (forward + argmax) at
  each --batch-sizes with --context tokens of context per sequence;
- the floors, and the fraction of the floor reached (floor time / measured time):
  prefill floor = FLOPs / GEMM peak (FLOPs = 2 x non-embedding params x tokens + causal
  attention); decode floor = roofline max((weight bytes + KV bytes read) / bandwidth,
  FLOPs / GEMM peak): a decode step streams every weight once and every sequence's K/V
  (--context tokens each, all layers) once, so the memory term counts both; the GEMM term
  takes over once a batch makes the step compute-bound. The JSON keeps the weights-only
  figure beside it (``weights_floor_ms``) and both byte counts. A quantized configuration's
  memory floor counts the bytes it reads (int8/E4M3 weights, an E4M3 cache); its compute floor
  is the GEMM peak of what its linears multiply in: ``torch._int_mm``'s int8 peak for int8
  (bench/floors.py measure_int8_gemm_peak, probed when an int8 row runs, on CPUs where oneDNN's
  VNNI kernel runs it; elsewhere its dtype's), bf16's for fp8 where bf16 was probed (CPUs
  multiply FP8 weights as bf16, whatever the model dtype), its dtype's for the rest. The int8
  peak counts the prefill's attention FLOPs too (they run in the dtype): a floor a few percent
  too fast, never one the measurement beats for that reason.

Timing is wall clock, the configurations alternating repeat by repeat (a shared machine's load then
lands on both alike). Decode is timed in its steady state: DECODE_WARMUP steps per dtype first,
then each repeat runs DECODE_RUN consecutive steps of one dtype (the first step after another
dtype's finds its caches and allocator state evicted), best (and median) over all timed steps;
prefill is best of --repeats / 2 after one warm-up; ``uptime``'s load is printed before
and after. ``--vs-transformers`` adds transformers' fp32 forward on the same weights.
Prints a table and writes JSON (``--json``). Speed is measured here, never in tests.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable, Optional

import typer

from bench.floors import best_time, decode_flops, prefill_flops, probe_floors
from bench.options import int_list, name_list
from engine.errors import UserError

DECODE_WARMUP = 3   # untimed decode steps per dtype and batch size before the timed ones
DECODE_RUN = 3      # consecutive timed steps of one dtype per repeat
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"  # ../shared/data beside the repo
_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def command(
    json_out: Path = typer.Option(Path("out/bench_engine.json"), "--json", help="Where to write the results."),
    model: str = typer.Option("smollm2-135m-instruct", "--model", "-m"),
    dtypes: str = typer.Option("float32,bfloat16", "--dtypes", "--dtype",
                               help="Comma-separated dtypes to measure (auto resolves for this CPU)."),
    threads: Optional[str] = typer.Option(None, "--threads",
                                          help="Comma-separated thread counts (default: 1 and all available cores)."),
    prompt_tokens: int = typer.Option(512, "--prompt-tokens", min=1, help="Prefill prompt length."),
    context: int = typer.Option(128, "--context", min=1, help="Context of each sequence before the timed steps."),
    repeats: int = typer.Option(8, "--repeats", min=1, help="Timed decode steps (prefill: half) per measure."),
    batch_sizes: str = typer.Option("1,16,32", "--batch-sizes", help="Comma-separated decode batch sizes."),
    gemm_size: int = typer.Option(1536, "--gemm-size", min=64, help="M = N = K of the GEMM-peak probe."),
    memcpy_mib: int = typer.Option(512, "--memcpy-mib", min=1, help="Size of the bandwidth probe's tensor."),
    vs_transformers: bool = typer.Option(False, "--vs-transformers", help="Also time transformers (fp32)."),
    quantization: str = typer.Option("none", "--quantization",
                                     help="Comma-separated linear methods (none, int8, fp8): a row each, per dtype."),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype",
                                       help="Comma-separated KV-cache dtypes (auto, fp8_e4m3): a row each, per dtype."),
) -> None:
    """Prefill tok/s and decode ms/step per dtype, beside GEMM-peak and bandwidth floors."""
    dtype_names = _parse_dtypes(dtypes)
    configs = _configs(dtype_names, quantization, kv_cache_dtype)
    names = list(configs)
    counts = _parse_threads(threads)
    sizes = int_list(batch_sizes, "--batch-sizes")
    import torch

    from engine import platform

    load_before = _load()
    print(f"machine: {platform.machine_summary()}; torch {torch.__version__} kernels "
          f"{platform.torch_cpu_capability()}; load {load_before}", flush=True)
    runners, tokens = _load_runners(model, configs, prompt_tokens, context, max(sizes), repeats)
    hf = _load_transformers(runners) if vs_transformers else None
    from kernels.linear import kernel_summary

    for n, r in runners.items():   # chosen at load, by timing (kernels.linear); per bucket of 1/16/512 rows
        print(f"linear kernels ({_short(n)}; 1/16/512 rows): {kernel_summary(r.model)}", flush=True)
    first = next(iter(runners.values()))
    cfg = first.model_config
    result = {
        "model": cfg.name, "machine": _machine(), "load_before": load_before,
        "attention_backend": getattr(first.ops, "name", type(first.ops).__name__),
        "configs": {n: dict(zip(("dtype", "quantization", "kv_cache_dtype"), c)) for n, c in configs.items()},
        "weight_bytes": {n: _weight_bytes(r) for n, r in runners.items()},
        "linear_kernels": {n: kernel_summary(r.model) for n, r in runners.items()},
        "timing": f"wall clock, dtypes alternating; decode: {DECODE_WARMUP} warm-up steps, then best (and median) "
                  f"of repeats x {DECODE_RUN} consecutive steps per dtype",
        "runs": [],
    }
    for t in counts:
        torch.set_num_threads(t)
        floors = probe_floors(dtype_names, gemm_size, memcpy_mib,
                              int8=any(getattr(r, "quantization", "none") == "int8" for r in runners.values()))
        run = {"threads": t, "floors": floors,
               "prefill": _prefill(runners, tokens[:prompt_tokens], floors, max(2, repeats // 2), hf),
               "decode": [_decode(runners, tokens, context, b, repeats, floors, hf) for b in sizes]}
        result["runs"].append(run)
        _print_run(run, names)
        result["load_after"] = _load()
        _write(json_out, result)  # after every thread count: a long run interrupted keeps what it measured
    print(f"load after: {result['load_after']}")
    print(f"wrote {json_out}")


def _write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


# ---- arguments -------------------------------------------------------------------------------

def _parse_dtypes(text: str) -> list[str]:
    from engine.platform import resolve_dtype_name

    names = []
    for name in (x.strip() for x in text.split(",") if x.strip()):
        resolved = resolve_dtype_name(name, "cpu")  # UserError naming --dtype
        if resolved not in names:
            names.append(resolved)
    if not names:
        raise UserError(f"--dtypes {text!r}: give at least one of auto, float32, bfloat16, float16")
    return names


def _configs(dtypes: list[str], quantization: str, kv_cache_dtype: str) -> dict[str, tuple[str, str, str]]:
    """Every (dtype, quantization, kv_cache_dtype), by row name: the dtype alone for none/auto (the
    JSON keys of unquantized runs stay the dtype), else e.g. ``bfloat16+int8``, ``bfloat16+kv:fp8_e4m3``."""
    from engine.quantization import KV_CACHE_DTYPES, QUANTIZATION_METHODS

    methods = name_list(quantization, "--quantization", QUANTIZATION_METHODS, what="method")
    kvs = name_list(kv_cache_dtype, "--kv-cache-dtype", KV_CACHE_DTYPES, what="dtype")
    out = {}
    for d in dtypes:
        for m in methods:
            for k in kvs:
                name = d + ("" if m == "none" else f"+{m}") + ("" if k == "auto" else f"+kv:{k}")
                out[name] = (d, m, k)
    return out


def _short(name: str) -> str:
    """A row name as the table prints it: bf16+int8, fp32+kv:fp8."""
    dtype, _, rest = name.partition("+")
    return _SHORT.get(dtype, dtype[:12]) + ("+" + rest.replace("fp8_e4m3", "fp8") if rest else "")


def _dtype_of(runner) -> str:
    return str(runner.dtype).removeprefix("torch.")


def _gemm_peak(floors: dict, runner) -> float:
    """The GEMM peak a runner's linears can reach: the int8 probe's for int8 weights and bf16's for
    fp8 ones (CPUs multiply them as bf16) where those were measured, else its dtype's (or fp32's,
    for a runner of a dtype not probed: the transformers row)."""
    peaks = floors["gemm_flops"]
    method = getattr(runner, "quantization", "none") if runner is not None else "none"
    if method == "int8" and "int8" in peaks:
        return peaks["int8"]
    if method == "fp8" and "bfloat16" in peaks:
        return peaks["bfloat16"]
    return peaks.get(_dtype_of(runner) if runner is not None else "float32", peaks.get("float32"))


def _parse_threads(text: str | None) -> list[int]:
    from engine.platform import available_cores, check_threads

    n = len(available_cores())
    if text is None:
        return sorted({1, n})
    return [check_threads(t, option="--threads") for t in int_list(text, "--threads")]


# ---- the machine -----------------------------------------------------------------------------

def _load() -> str:
    """uptime's 1/5/15-minute load averages and the core count, e.g. "2.31 1.90 1.20 (2 cores)"."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f} ({os.cpu_count()} cores)"


def _machine() -> dict:
    from engine import platform

    flags = platform.cpu_flags()
    return {"summary": platform.machine_summary(), "isa": platform.cpu_isa(),
            "torch_capability": platform.torch_cpu_capability(),
            "flags": sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")) or f == "bf16"),
            "cores": platform.available_cores()}


# ---- the runtime -----------------------------------------------------------------------------

def _load_runners(model: str, configs: dict[str, tuple[str, str, str]], prompt_tokens: int, context: int,
                  max_batch: int, steps: int):
    import torch

    from engine.model_loader import load_tokenizer
    from engine.model_runner import ModelRunner

    per_seq = -(-(context + _decode_steps(steps) + 4) // 16)
    blocks = max_batch * per_seq + -(-prompt_tokens // 16) + 1
    runners = {n: ModelRunner(model, block_size=16, num_blocks=blocks, dtype=getattr(torch, d), quantization=q,
                              kv_cache_dtype=k) for n, (d, q, k) in configs.items()}
    cfg = next(iter(runners.values())).model_config
    text = (SHARED_DATA / "wikitext-2-raw-test.txt").read_text()[:60000]
    tokens = load_tokenizer(cfg.path)(text)["input_ids"]
    if len(tokens) < max(prompt_tokens, context + max_batch):
        raise UserError(f"--prompt-tokens {prompt_tokens} / --context {context}: the text has only {len(tokens)} tokens")
    return runners, tokens


def _load_transformers(runners):
    import torch
    from transformers import AutoModelForCausalLM

    path = next(iter(runners.values())).model_config.path
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _weight_bytes(runner) -> int:
    """Bytes of the weights one decode step reads: the decoder layers' tensors, the final norm and
    the LM head, each counted once; a linear method counts the weight it reads in its stored
    format (``MeasuredLinear.weight_bytes``: N x K values, not the packed copies its kernels keep);
    the embedding table only as a tied head without a method."""
    from kernels.linear import MeasuredLinear

    m = runner.model
    mods = [m.model.layers, m.model.norm] + ([m.head_method] if m.head_method is not None else [])
    linears = [mod for root in mods for mod in root.modules() if isinstance(mod, MeasuredLinear)]
    inside = {id(t) for lin in linears for t in (*lin.parameters(), *lin.buffers())}
    tensors = [t for mod in mods for t in (*mod.parameters(), *mod.buffers()) if id(t) not in inside]
    if m.head_method is None:
        tensors.append(m.model.embed_tokens.weight if m.lm_head is None else m.lm_head.weight)
    seen: dict[int, int] = {}
    for t in tensors:
        seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.numel() * t.element_size())
    return sum(seen.values()) + sum(lin.weight_bytes() for lin in linears)


def _kv_bytes_read(runner, batch: int, context: int) -> int:
    """K and V bytes of ``context`` tokens per sequence over every layer: what a decode step at
    that context reads of the cache (the timed steps read up to _decode_steps(--repeats) tokens
    more, so a floor from this never flatters the measurement)."""
    cfg = runner.model_config
    elt = runner.kv_cache.data.element_size()
    return batch * context * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elt


def _prefill(runners: dict, prompt: list[int], floors: dict, repeats: int, hf) -> dict:
    import torch

    from engine.batch import SeqChunk

    table = list(range(-(-len(prompt) // 16)))
    fns = {n: (lambda r=r: r.forward([SeqChunk(prompt, 0, table)])) for n, r in runners.items()}
    if hf is not None:
        x = torch.tensor([prompt])

        def hf_prefill() -> None:
            with torch.inference_mode():
                hf(x, attention_mask=torch.ones_like(x), use_cache=True, logits_to_keep=1)

        fns["transformers_fp32"] = hf_prefill
    best, _ = _alternating(fns, repeats)
    cfg = next(iter(runners.values())).model_config
    flops = prefill_flops(cfg, len(prompt))
    out = {"prompt_tokens": len(prompt), "flops": flops}
    for name, t in best.items():
        peak = _gemm_peak(floors, runners.get(name))
        floor_s = flops / peak
        out[name] = {"tok_s": len(prompt) / t, "seconds": t, "floor_tok_s": len(prompt) / floor_s,
                     "fraction_of_floor": floor_s / t}
    return out


def _decode(runners: dict, tokens: list[int], context: int, batch: int, steps: int, floors: dict, hf) -> dict:
    fns = {n: _decode_step(r, tokens, context, batch, steps) for n, r in runners.items()}
    if hf is not None:
        fns["transformers_fp32"] = _hf_decode_step(hf, tokens, context, batch)
    best, median = _alternating(fns, steps, warmup=DECODE_WARMUP, run=DECODE_RUN)
    first = next(iter(runners.values()))
    cfg = first.model_config
    flops = decode_flops(cfg, batch, context)
    out = {"batch": batch, "context": context, "flops": flops}
    for name, t in best.items():
        runner = runners.get(name, runners.get("float32", first))
        weight = _weight_bytes(runner)
        peak = _gemm_peak(floors, runner if name in runners else None)
        kv = _kv_bytes_read(runner, batch, context)
        floor = decode_floor(weight, kv, flops, floors["memcpy_bytes_per_s"], peak)
        out[name] = {"ms_per_step": 1000 * t, "ms_per_step_median": 1000 * median[name],
                     "floor_ms": 1000 * floor["floor_s"], "bound": floor["bound"],
                     "fraction_of_floor": floor["floor_s"] / t, "weights_floor_ms": 1000 * floor["weights_s"],
                     "weight_bytes": weight, "kv_bytes_read": kv}
    return out


def decode_floor(weight_bytes: int, kv_bytes: int, flops: float, bytes_per_s: float, flops_per_s: float) -> dict:
    """The roofline floor of one decode step, in seconds.

    A step reads every weight once and every sequence's cached K/V once, so its memory time is
    (weight_bytes + kv_bytes) / bytes_per_s; its compute time flops / flops_per_s; the floor is
    the larger (``bound``: which). ``weights_s``: the weights-only memory time (the floor this
    bench printed before it counted the KV cache), kept for comparison.
    """
    mem_s, gemm_s = (weight_bytes + kv_bytes) / bytes_per_s, flops / flops_per_s
    return {"floor_s": max(mem_s, gemm_s), "bound": "memory" if mem_s >= gemm_s else "compute",
            "memory_s": mem_s, "compute_s": gemm_s, "weights_s": weight_bytes / bytes_per_s}


def _decode_step(runner, tokens: list[int], context: int, batch: int, steps: int) -> Callable[[], None]:
    """A decode step over ``batch`` sequences of ``context`` tokens (filled by one prefill now);
    each call appends one token to every sequence (the blocks cover warm-up + steps)."""
    from engine.batch import SeqChunk
    from kernels.layer_ops import greedy_argmax

    per_seq = -(-(context + _decode_steps(steps) + 4) // runner.block_size)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    prompts = [tokens[b: b + context] for b in range(batch)]  # different contents, same length
    runner.forward([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)])
    state = {"pos": context, "next": [p[-1] for p in prompts]}

    def step() -> None:
        logits = runner.forward([SeqChunk([n], state["pos"], t) for n, t in zip(state["next"], tables)])
        state["next"] = greedy_argmax(logits).tolist()   # as the engine's greedy sampler picks
        state["pos"] += 1

    return step


def _hf_decode_step(hf, tokens: list[int], context: int, batch: int) -> Callable[[], None]:
    import torch

    x = torch.tensor([tokens[b: b + context] for b in range(batch)])
    with torch.inference_mode():
        out = hf(x, attention_mask=torch.ones_like(x), use_cache=True, logits_to_keep=1)
    state = {"past": out.past_key_values, "next": out.logits[:, -1].argmax(-1, keepdim=True), "mask": torch.ones_like(x)}

    def step() -> None:
        with torch.inference_mode():
            state["mask"] = torch.cat([state["mask"], torch.ones(batch, 1, dtype=torch.long)], dim=1)
            o = hf(state["next"], attention_mask=state["mask"], past_key_values=state["past"], use_cache=True,
                   logits_to_keep=1)
            state["past"], state["next"] = o.past_key_values, o.logits[:, -1].argmax(-1, keepdim=True)

    return step


def _decode_steps(repeats: int) -> int:
    """Decode steps each runner takes at one batch size: the warm-up, then repeats x DECODE_RUN."""
    return DECODE_WARMUP + repeats * DECODE_RUN


def _alternating(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1,
                 run: int = 1) -> tuple[dict[str, float], dict[str, float]]:
    """Best and median wall seconds of each function: ``warmup`` untimed calls each, then
    ``repeats`` rounds in which the functions take turns, each timed over ``run`` consecutive calls."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            for _ in range(run):
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
    best = {name: min(ts) for name, ts in times.items()}
    median = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
    return best, median


# ---- the table -------------------------------------------------------------------------------

def _print_run(run: dict, dtypes: list[str]) -> None:
    f = run["floors"]
    peaks = ", ".join(f"{_short(n)} {v / 1e9:.0f}" for n, v in f["gemm_flops"].items())
    print(f"\nthreads {run['threads']}: GEMM peak (GFLOP/s) {peaks}; memcpy {f['memcpy_bytes_per_s'] / 1e9:.0f} GB/s "
          "(read + write)")
    names = dtypes + (["transformers_fp32"] if "transformers_fp32" in run["prefill"] else [])
    width = max([10] + [len(_short(n)) + 1 for n in names])
    head = f"{'measure':<26}" + "".join(f"{_short(n):>{width}}{'floor':>9}{'of floor':>9}" for n in names)
    print(head)
    p = run["prefill"]
    row = f"{'prefill %d tok (tok/s)' % p['prompt_tokens']:<26}"
    for n in names:
        row += f"{p[n]['tok_s']:>{width}.0f}{p[n]['floor_tok_s']:>9.0f}{p[n]['fraction_of_floor']:>9.0%}"
    print(row)
    for d in run["decode"]:
        row = f"{'decode b%d (ms/step)' % d['batch']:<26}"
        for n in names:
            x = d[n]
            row += f"{x['ms_per_step']:>{width}.1f}{x['floor_ms']:>8.1f}{x['bound'][0]}{x['fraction_of_floor']:>9.0%}"
        print(row)
    print("floor: prefill FLOPs / GEMM peak; decode roofline max((weight + KV bytes read) / bandwidth (m), "
          "FLOPs / GEMM peak (c)); the weights-only floor is in the JSON (weights_floor_ms)")


if __name__ == "__main__":
    typer.run(command)
