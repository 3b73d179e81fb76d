"""pdserve bench peers: several servers measured one at a time on the same workload, in one run.

For each server (a name and a command line): start it in its own process group, wait until
its OpenAI API answers ``/v1/models``, run the ``bench serve`` client against it (same prompts,
same flags for every server), sample the resident memory of its whole process tree (Ray's and
vLLM's child processes included) every 0.25 s and the CPU seconds of its processes, of the
client and of the rest of the host while it is measured (bench/cpu_usage.py), stop it (SIGINT, then SIGKILL after a grace
period), then the next. Before the first server starts, the machine's GEMM peak and memcpy
bandwidth are measured (bench/floors.py); each server's row gives its throughput as a ratio of
the first server's (the reference) and as a fraction of the workload's floor on this machine
(prefill FLOPs / GEMM peak + decode steps x weight bytes / bandwidth). Prints one side-by-side
table and writes JSON. With ``--rounds N`` the whole sequence runs N times (a table per round),
then a table of each server's median over rounds and its ratio to the reference within each round
(``rounds_summary``).

A command is a shell line with ``{port}`` where the server's HTTP port goes, e.g.::

    pdserve bench peers --num-prompts 32 --max-tokens 64 --max-concurrency 16 --ignore-eos \
      --server 'vllm=VLLM_CPU_OMP_THREADS_BIND=0-1 /venv/bin/python -m vllm.entrypoints.openai.api_server \
                --model DIR --dtype bfloat16 --no-enable-prefix-caching --port {port}' \
      --server 'pdserve-agg=pdserve serve --mode agg --decode 1 --http-port {port}' \
      --json peers.json

Run it inside the loopback-only namespace when a server starts Ray (pdserve serve).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from bench.cpu_usage import CpuWindow, usage_line
from bench.process_tree import label_totals, process_label, process_tree
from engine.errors import UserError

READY_TIMEOUT_S = 900.0   # vLLM's first start compiles for minutes on a CPU
STOP_GRACE_S = 60.0


@dataclass(frozen=True)
class ServerSpec:
    """name: the row label; command: a shell line with ``{port}`` for the HTTP port."""

    name: str
    command: str

    @classmethod
    def parse(cls, text: str) -> "ServerSpec":
        """``NAME=COMMAND`` -> ServerSpec; UserError naming --server otherwise."""
        name, sep, command = text.partition("=")
        if not sep or not name.strip() or "{port}" not in command:
            raise UserError(f"--server {text!r}: expected NAME=COMMAND with {{port}} in the command")
        return cls(name.strip(), command.strip())


def command(
    server: Annotated[list[str], typer.Option(help="NAME=COMMAND (with {port}); repeat; the first is the reference.")],
    port: Annotated[int, typer.Option(help="HTTP port every server is started on (one at a time).")] = 8011,
    num_prompts: Annotated[int, typer.Option(help="Measured ShareGPT requests per server.")] = 32,
    max_tokens: Annotated[int, typer.Option(help="Output tokens per request.")] = 64,
    max_concurrency: Annotated[int, typer.Option(help="Requests in flight.")] = 16,
    ignore_eos: Annotated[bool, typer.Option(help="Ask each server to ignore EOS.")] = True,
    num_warmups: Annotated[int, typer.Option(help="Requests sent first and excluded.")] = 2,
    dataset_path: Annotated[Optional[Path], typer.Option(help="ShareGPT JSONL (default: ../shared/data).")] = None,
    log_dir: Annotated[Optional[Path], typer.Option(help="Write each server's stdout/stderr here.")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write every figure here.")] = None,
    model: Annotated[str, typer.Option(help="The served model (its config sizes the floor).")] = "smollm2-135m-instruct",
    floors: Annotated[bool, typer.Option(help="Measure GEMM peak and bandwidth first; report each "
                                              "server's fraction of the workload's floor.")] = True,
    rounds: Annotated[int, typer.Option(help="Times the whole sequence of servers runs (each round starts "
                                              "every server once, in order); above 1, also each server's "
                                              "median over rounds and its per-round ratio to the reference.")] = 1,
    engine_row: Annotated[bool, typer.Option(help="Last, a row 'engine-only': the same prompts closed loop on "
                                                  "one LLMEngine with serve's defaults, no server "
                                                  "(bench/closed_loop.py): what serving adds.")] = False,
) -> None:
    """Servers side by side, one at a time, same workload: throughput, latency, peak memory."""
    specs = [ServerSpec.parse(s) for s in server]
    if len({s.name for s in specs}) != len(specs):
        raise UserError("--server: names must be distinct")
    if num_prompts < 1 or max_tokens < 1 or max_concurrency < 1 or rounds < 1:
        raise UserError("--num-prompts, --max-tokens, --max-concurrency and --rounds must be >= 1")
    machine = _measure_machine() if floors else None
    model_cfg = _model_config(model) if floors else None
    all_rounds = []
    for r in range(rounds):
        tag = f" (round {r + 1} of {rounds})" if rounds > 1 else ""
        results = []
        for spec in specs:
            print(f"pdserve bench peers: {spec.name}: starting{tag}", file=sys.stderr, flush=True)
            out = run_one(spec, port, num_prompts, max_tokens, max_concurrency, ignore_eos, num_warmups,
                          dataset_path, log_dir)
            if machine is not None:
                add_floor(out, model_cfg, max_tokens, max_concurrency, machine)
            results.append(out)
        if engine_row:
            print(f"pdserve bench peers: engine-only: starting{tag}", file=sys.stderr, flush=True)
            out = run_engine_row(model, num_prompts, max_tokens, max_concurrency, ignore_eos, num_warmups,
                                 dataset_path)
            if machine is not None and "result" in out:
                add_floor(out, model_cfg, max_tokens, max_concurrency, machine)
            results.append(out)
        all_rounds.append(results)
        if machine is not None and r == 0:
            print(floors_line(machine, results))
        if tag:
            print(f"round {r + 1} of {rounds}:")
        print(peers_table(results))
        print(rss_breakdown(results))
        print(cpu_breakdown(results))
    doc = {"machine": machine_info(), "workload": {"dataset": "sharegpt", "num_prompts": num_prompts,
                                                   "max_tokens": max_tokens, "max_concurrency": max_concurrency,
                                                   "ignore_eos": ignore_eos}, "servers": all_rounds[0]}
    if machine is not None:
        doc["machine"]["floors"] = asdict(machine)
    if rounds > 1:
        doc["rounds"] = all_rounds
        doc["summary"] = rounds_summary(all_rounds)
        print(rounds_table(doc["summary"], rounds))
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(doc, indent=2))
        print(f"wrote {json_out}", file=sys.stderr)


def run_one(spec: ServerSpec, port: int, num_prompts: int, max_tokens: int, max_concurrency: int,
            ignore_eos: bool, num_warmups: int, dataset_path: Path | None, log_dir: Path | None) -> dict[str, Any]:
    """Start, measure and stop one server; a server that fails to start or serve is reported, not raised."""
    from bench.datasets import DatasetConfig
    from bench.load import LoadConfig
    from bench.serve import BenchSpec, run_benchmark

    url = f"http://127.0.0.1:{port}"
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    log = open(log_dir / f"{spec.name}.log", "w") if log_dir else subprocess.DEVNULL
    proc = subprocess.Popen(spec.command.format(port=port), shell=True, start_new_session=True,
                            stdout=log, stderr=subprocess.STDOUT)
    sampler = RssSampler(proc.pid)
    out: dict[str, Any] = {"name": spec.name, "command": spec.command}
    try:
        started = time.monotonic()
        asyncio.run(wait_ready(url, proc, sampler))
        out["startup_s"] = time.monotonic() - started
        bench = BenchSpec(backend="openai", url=url, model=None, tokenizer=None,
                          dataset=DatasetConfig("sharegpt", dataset_path, num_prompts, max_tokens),
                          loads=[LoadConfig(math.inf, 1.0, max_concurrency, num_warmups, 0, False)], slo=None,
                          sweep=False, attainment_target=0.9, ignore_eos=ignore_eos, include_usage=True,
                          timeout_s=600.0)
        sampler.reset_peak()  # the peak while serving, at its configured cache size
        cpu = CpuWindow(proc.pid, process_label)
        outcome = asyncio.run(_sampled(run_benchmark(bench), sampler, cpu))
        out["cpu"] = cpu.finish().as_dict()
        out["result"] = {k: v for k, v in outcome.doc.items() if k != "requests"}
        out["prompt_lens"] = [r["prompt_len"] for r in outcome.doc.get("requests", ()) if r.get("success")]
    except Exception as e:  # a peer that cannot start is a row with its error, not a crash of the whole run
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        out["peak_rss_mib"] = sampler.peak / 2**20
        out["peak_rss_by_process"] = [{"process": k, "count": n, "rss_mib": b / 2**20}
                                      for k, n, b in sampler.peak_by_process]
        stop(proc)
        if log_dir:
            log.close()
    return out


def engine_row_command(model: str, num_prompts: int, max_tokens: int, max_concurrency: int, ignore_eos: bool,
                       num_warmups: int, dataset_path: Path | None) -> list[str]:
    """The argv of the engine-only row's process (bench/closed_loop.py)."""
    argv = [sys.executable, "-m", "bench.closed_loop", "--model", model, "--num-prompts", str(num_prompts),
            "--max-tokens", str(max_tokens), "--max-concurrency", str(max_concurrency),
            "--num-warmups", str(num_warmups)]
    if not ignore_eos:
        argv.append("--no-ignore-eos")
    if dataset_path is not None:
        argv += ["--dataset-path", str(dataset_path)]
    return argv


def run_engine_row(model: str, num_prompts: int, max_tokens: int, max_concurrency: int, ignore_eos: bool,
                   num_warmups: int, dataset_path: Path | None) -> dict[str, Any]:
    """The engine-only row: bench/closed_loop.py in a process of its own (its peak RSS sampled like
    a server's); a failure is reported in the row, not raised."""
    argv = engine_row_command(model, num_prompts, max_tokens, max_concurrency, ignore_eos, num_warmups, dataset_path)
    out: dict[str, Any] = {"name": "engine-only", "command": " ".join(argv)}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    sampler = RssSampler(proc.pid)
    while proc.poll() is None:
        sampler.sample()
        time.sleep(0.25)
    stdout, stderr = proc.communicate()
    lines = stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (stderr.strip().splitlines() or ["no output"])[-1]
        out["error"] = f"exit status {proc.returncode}: {tail}"
    else:
        out.update(engine_row_fields(json.loads(lines[-1])))
    out["peak_rss_mib"] = sampler.peak / 2**20
    out["peak_rss_by_process"] = [{"process": k, "count": n, "rss_mib": b / 2**20} for k, n, b in sampler.peak_by_process]
    return out


def engine_row_fields(doc: dict[str, Any]) -> dict[str, Any]:
    """bench/closed_loop.py's printed doc -> the row's "result" (summarize's figures) and
    "prompt_lens" (each prompt's tokens, for add_floor; absent from an older closed_loop)."""
    doc = dict(doc)
    lens = doc.pop("prompt_lens", None)
    return {"result": doc, **({"prompt_lens": lens} if lens else {})}


async def wait_ready(url: str, proc: subprocess.Popen, sampler: "RssSampler") -> None:
    """Poll ``/v1/models`` until it answers 200; RuntimeError if the server exits or times out."""
    import httpx

    deadline = time.monotonic() + READY_TIMEOUT_S
    async with httpx.AsyncClient(timeout=5.0) as client:
        while time.monotonic() < deadline:
            sampler.sample()
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with status {proc.returncode} before serving")
            try:
                if (await client.get(f"{url}/v1/models")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(1.0)
    raise RuntimeError(f"server not ready after {READY_TIMEOUT_S:.0f} s")


async def _sampled(coro, sampler: "RssSampler", cpu: CpuWindow | None = None):
    """Run coro while sampling RSS (and the CPU window, if given) every 0.25 s."""
    task = asyncio.ensure_future(coro)
    while not task.done():
        sampler.sample()
        if cpu is not None:
            cpu.sample()
        await asyncio.wait({task}, timeout=0.25)
    return task.result()


class RssSampler:
    """Peak resident memory of a process and all its descendants, in bytes; ``peak_by_process``:
    at the sample of that peak, each process's RSS by label (see ``process_label``), summed over
    processes with the same label, largest first."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.root = psutil.Process(pid)
        self.peak = 0
        self.peak_by_process: list[tuple[str, int, int]] = []  # (label, processes, bytes)

    def sample(self) -> int:
        import psutil

        rss = []
        for p in process_tree(self.root):
            try:
                rss.append((process_label(p.name(), p.cmdline()), p.memory_info().rss))
            except psutil.Error:
                continue
        by_label = label_totals(rss)
        total = sum(b for _, _, b in by_label)
        if total > self.peak:
            self.peak, self.peak_by_process = total, by_label
        return total

    def reset_peak(self) -> None:
        self.peak = 0
        self.peak_by_process = []
        self.sample()


def stop(proc: subprocess.Popen) -> None:
    """SIGINT the server's process group, SIGKILL what is left after STOP_GRACE_S."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=STOP_GRACE_S)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _measure_machine():
    from bench.floors import measure_machine

    m = measure_machine()
    print(f"pdserve bench peers: floors: {m.dtype} GEMM {m.gemm_flops / 1e9:.0f} GFLOP/s, memcpy "
          f"{m.memcpy_bytes_per_s / 1e9:.0f} GB/s ({m.threads} threads)", file=sys.stderr, flush=True)
    return m


def _model_config(model: str):
    from engine.model_config import ModelConfig
    from engine.model_loader import resolve_model

    return ModelConfig.from_pretrained(resolve_model(model))


def add_floor(out: dict[str, Any], model_cfg, max_tokens: int, max_concurrency: int, machine) -> None:
    """Put the workload's floor for the prompts this server was sent, and its fraction of it, in ``out``."""
    from bench.floors import workload_floor

    res, lens = out.get("result"), out.get("prompt_lens")
    if not res or not lens:
        return
    floor = workload_floor(model_cfg, lens, max_tokens, max_concurrency, machine)
    out["floor"] = floor.as_dict()
    out["floor_fraction"] = res["output_throughput"] / floor.output_tok_s


def floors_line(machine, results: list[dict[str, Any]]) -> str:
    """One line: the machine's probes and the workload's floor (from the first server with one)."""
    floor = next((r["floor"] for r in results if "floor" in r), None)
    text = (f"machine floor ({machine.threads} threads, {machine.dtype}): GEMM {machine.gemm_flops / 1e9:.0f} GFLOP/s, "
            f"memcpy {machine.memcpy_bytes_per_s / 1e9:.0f} GB/s")
    if floor:
        text += (f"; workload floor {floor['floor_s']:.2f} s = prefill {floor['prefill_s']:.2f} s "
                 f"({floor['prefill_flops'] / 1e12:.2f} TFLOP) + decode {floor['decode_s']:.2f} s "
                 f"({floor['decode_steps']} steps x {floor['weight_bytes'] / 2**20:.0f} MiB) "
                 f"= {floor['output_tok_s']:.0f} output tok/s")
    return text


def machine_info() -> dict[str, Any]:
    """CPU model, the ISA flags that choose kernels, cores, and the 1-minute load at the start."""
    flags: list[str] = []
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")
    return {"cpu": model, "isa_flags": [f for f in wanted if f in flags], "cores": len(os.sched_getaffinity(0)),
            "load_avg_1m": os.getloadavg()[0]}


def rss_breakdown(results: list[dict[str, Any]]) -> str:
    """Per server, its processes' RSS at its peak (MiB, by label; "xN" when N processes share one)."""
    lines = ["peak RSS by process (MiB):"]
    for r in results:
        parts = []
        for p in r.get("peak_rss_by_process", ()):
            times = f" x{p['count']}" if p["count"] > 1 else ""
            parts.append(f"{p['process']}{times} {p['rss_mib']:.0f}")
        lines.append(f"  {r['name']}: " + ", ".join(parts))
    return "\n".join(lines)


def cpu_breakdown(results: list[dict[str, Any]]) -> str:
    """Per server, the CPU seconds of its processes, of the client and of the rest of the host
    while it was measured (bench/cpu_usage.py): a row with a large 'other' was disturbed."""
    lines = ["CPU during each measurement (s; 'other': the host's busy CPU outside the server and the client):"]
    lines += [usage_line(r["name"], r["cpu"]) for r in results if "cpu" in r]
    return "\n".join(lines)


def rounds_summary(all_rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per server (in the first round's order), over the rounds it served in: its median output
    tok/s, and the median, least and most of its per-round ratio to the round's first server (the
    reference, measured minutes apart rather than a whole run apart). Why: one run of a short
    workload moves with the host (vLLM's own rate moved 394-529 tok/s between five 32-prompt runs
    on one host, 2026-12-07), and a ratio taken within a round sees the same host minutes."""
    def tput(row: dict[str, Any]) -> float | None:
        return (row.get("result") or {}).get("output_throughput")

    out = []
    for i, first in enumerate(all_rounds[0]):
        tputs = [t for rnd in all_rounds if (t := tput(rnd[i])) is not None]
        ratios = [t / ref for rnd in all_rounds
                  if (t := tput(rnd[i])) is not None and (ref := tput(rnd[0]))]
        row: dict[str, Any] = {"name": first["name"], "rounds": len(tputs),
                               "output_throughput_median": statistics.median(tputs) if tputs else None}
        if ratios:
            row.update(ratio_median=statistics.median(ratios), ratio_least=min(ratios), ratio_most=max(ratios))
        out.append(row)
    return out


def rounds_table(summary: list[dict[str, Any]], rounds: int) -> str:
    """rounds_summary as text: a row per server."""
    rows = [f"over {rounds} rounds (each round: every server once, in order): the median output tok/s, and the "
            "median, least and most of the ratio to the first server within a round",
            f"{'server':<20}{'rounds':>7}{'out tok/s':>11}{'ratio':>7}{'least':>7}{'most':>7}"]
    for r in summary:
        tput = r["output_throughput_median"]
        cells = (f"{r['ratio_median']:>7.2f}{r['ratio_least']:>7.2f}{r['ratio_most']:>7.2f}"
                 if "ratio_median" in r else f"{'-':>7}{'-':>7}{'-':>7}")
        rows.append(f"{r['name']:<20}{r['rounds']:>7}{(f'{tput:.1f}' if tput is not None else 'error'):>11}{cells}")
    return "\n".join(rows)


def peers_table(results: list[dict[str, Any]]) -> str:
    """One row per server; ratio = its output tok/s over the first server's; floor % = its output
    tok/s over the workload floor's (when measured)."""
    ref = (results[0].get("result") or {}).get("output_throughput") if results else None
    head = (f"{'server':<16}{'out tok/s':>10}{'ratio':>7}{'TTFT p50/p99 ms':>18}{'TPOT p50':>10}"
            f"{'ITL p99':>9}{'peak RSS MiB':>14}{'floor %':>9}{'failed':>8}")
    rows = [head, "-" * len(head)]
    for r in results:
        res = r.get("result")
        if res is None:
            rows.append(f"{r['name']:<16}  error: {r.get('error')}")
            continue
        tput = res["output_throughput"]
        ratio = f"{tput / ref:.2f}" if ref else "-"
        ttft = f"{res['median_ttft_ms']:.0f} / {res['p99_ttft_ms']:.0f}"
        floor = f"{100 * r['floor_fraction']:.0f}" if "floor_fraction" in r else "-"
        rows.append(f"{r['name']:<16}{tput:>10.1f}{ratio:>7}{ttft:>18}{res['median_tpot_ms']:>10.1f}"
                    f"{res['p99_itl_ms']:>9.0f}{r['peak_rss_mib']:>14.0f}{floor:>9}{res['failed']:>8}")
    return "\n".join(rows)
