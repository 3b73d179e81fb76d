"""The fleet simulator against a real 1P+1D run on this machine, at two request rates.

    python -m deploy.validate_sim [--rates 0.5,1.5] [--num-prompts 24] [--input-len 128]
                                  [--output-len 32] [--profile PROFILE.json] [--json out.json]

1. Profile: `pdserve profile` in a child process with one torch thread (what each worker of a
   two-core 1P+1D cluster gets), at the benchmark's input lengths and decode contexts, prefill
   chunked by the workers' --max-num-batched-tokens (skipped with --profile).
2. Real: a disaggregated cluster of one prefill and one decode worker (a local Ray: run this in a
   loopback-only namespace, `/work/bin/heavy` or `quiet`), and for each rate `pdserve bench
   serve` (random prompts of --input-len tokens, --output-len tokens each, EOS ignored, Poisson
   arrivals) against its router.
3. Simulated: planner/simulator.py with that profile, 1P+1D, fed the very requests the real run
   sent (each one's send time, prompt and output tokens). The handoff's fixed cost per request
   (tokenizing, Reserve on the decode worker, the Prefill RPC, the last layer's KV write and its
   confirmation, the first token's way back) is no engine time, so the profile cannot hold it:
   it is measured once, before the rated runs, from ``--lone`` requests sent one at a time
   (their TTFT p50 minus the profiled TTFT at their ISL), and is the simulator's ``transfer_s``.
   It is not fitted to the rated runs: what the simulator predicts there (queueing for the
   prefill worker, the decode batch's ITL) comes from the profile alone.
4. Compared: TTFT p50 and ITL p50 (per request: the mean gap between its tokens after the first,
   TPOT — the simulator's ITL), simulated against real, as the relative error; the goal is
   within 25% at both rates. The real run's all-gaps ITL median is printed beside it.

"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

GOAL = 0.25


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m deploy.validate_sim", description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="0.5,1.5", help="two (or more) request rates, req/s")
    ap.add_argument("--num-prompts", type=int, default=24, help="measured requests per rate")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=128, help="the workers' prefill chunk")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--profile", default=None, help="a profile JSON to use instead of profiling now")
    ap.add_argument("--lone", type=int, default=4, help="requests sent one at a time to measure the handoff cost")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", dest="json_out", default=None)
    a = ap.parse_args(argv)
    rates = [float(x) for x in a.rates.split(",") if x.strip()]
    if len(rates) < 2 or any(r <= 0 for r in rates) or a.num_prompts < 4 or a.input_len < 1 or a.output_len < 2:
        ap.error("need >= 2 rates > 0, --num-prompts >= 4, --input-len >= 1, --output-len >= 2")
    from engine import platform

    dtype = platform.resolve_dtype_name(a.dtype, "cpu")  # as `pdserve serve` resolves it, once for both workers
    profile_path = Path(a.profile) if a.profile else profile(a, dtype)
    from planner.profile import WorkerProfile

    prof = WorkerProfile.load(profile_path)
    lone, docs = real_runs(a, rates, dtype)
    handoff_ms = handoff_cost_ms(lone, prof)
    rows = [compare(rate, doc, prof, handoff_ms) for rate, doc in zip(rates, docs)]
    print(f"handoff cost (lone requests' TTFT p50 - profiled prefill): {handoff_ms:.1f} ms")
    print(table(rows))
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"settings": vars(a), "dtype": dtype, "profile": prof.to_json(),
                                                "handoff_ms": handoff_ms, "rates": rows}, indent=2))
        print(f"wrote {a.json_out}", file=sys.stderr)


def profile(a, dtype: str) -> Path:
    """Run `pdserve profile` (one thread) for this workload; returns the profile's path."""
    out = Path(tempfile.mkdtemp(prefix="pdserve-validate-")) / "profile.json"
    isl, osl = a.input_len, a.output_len
    isls = sorted({max(1, isl // 2), isl, 2 * isl})
    contexts = sorted({isl, isl + osl, isl + 2 * osl})
    cmd = [sys.executable, "-m", "deploy.cli", "profile", "--threads", "1", "--dtype", dtype, "--json", str(out),
           "--isl", ",".join(map(str, isls)), "--batch", "1,2,4,8,16", "--context", ",".join(map(str, contexts)),
           "--max-num-batched-tokens", str(a.max_num_batched_tokens), "--repeats", "5", "--kv-cache-memory-gib", "0.5"]
    print("profiling:", " ".join(cmd[2:]), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return out


def real_runs(a, rates: list[float], dtype: str) -> tuple[dict, list[dict]]:
    """bench serve against one 1P+1D cluster: ``--lone`` requests one at a time, then each rate;
    the bench JSON documents."""
    from bench.datasets import DatasetConfig
    from bench.load import LoadConfig
    from bench.serve import BenchSpec, run_benchmark
    from deploy.cluster import ClusterSpec
    from deploy.local_cluster import LocalServing
    from engine.platform import assign_cores
    from router.app import RouterConfig

    cores = assign_cores(2, None)  # as `pdserve serve` deals them: each worker its own core
    spec = ClusterSpec(mode="disagg", num_prefill=1, num_decode=1, num_blocks=256, dtype=dtype,
                       threads_per_worker=cores.threads, cpu_cores=cores.cores,
                       max_num_batched_tokens=a.max_num_batched_tokens)
    def bench(url: str, n: int, rate: float, concurrency: int | None, seed: int) -> dict:
        # no warm-up inside a run: bench serve warms up with the run's own first prompts, which
        # would then hit the prefix cache when measured; the cluster is warmed up once instead
        spec = BenchSpec(backend="pdserve-grpc", url=url, model=None, tokenizer=None,
                         dataset=DatasetConfig("random", None, n, None, a.input_len, a.output_len, 0.0, 0, 1, seed),
                         loads=[LoadConfig(rate, 1.0, concurrency, 0, seed, False)], slo=None, sweep=False,
                         attainment_target=0.9, ignore_eos=True, include_usage=True, timeout_s=600.0)
        return asyncio.run(run_benchmark(spec)).doc

    with LocalServing(spec, RouterConfig(port=0, http_port=None, mode="disagg", max_waiting=1024)) as s:
        bench(s.grpc_address, 2, math.inf, 1, a.seed + 200)  # warm-up, discarded (prompts of their own)
        lone = bench(s.grpc_address, a.lone, math.inf, 1, a.seed + 100)
        docs = [bench(s.grpc_address, a.num_prompts, rate, None, a.seed + i) for i, rate in enumerate(rates)]
    return lone, docs


def handoff_cost_ms(lone: dict, prof) -> float:
    """The lone requests' TTFT p50 minus the profiled prefill TTFT at their ISL (>= 0), ms."""
    ok = [r for r in lone["requests"] if r.get("success")]
    if not ok:
        raise RuntimeError("no lone request succeeded: the cluster is not serving")
    raw = _median([1000 * r["ttft_s"] - prof.prefill_ttft_ms(r["prompt_len"]) for r in ok])
    if raw < 0:  # the lone requests were faster than the profile: the machine's load changed between them
        print(f"warning: lone TTFT p50 is {-raw:.1f} ms below the profile's prefill time", file=sys.stderr)
    return max(0.0, raw)


def compare(rate: float, doc: dict, prof, handoff_ms: float) -> dict:
    """The simulator fed the real run's requests; both runs' p50s and the relative errors."""
    from planner.simulator import SimConfig, SimRequest, Simulation

    ok = [r for r in doc["requests"] if r.get("success")]
    reqs = [SimRequest(r["start_s"], int(r["prompt_len"]), int(r["output_tokens"])) for r in ok]
    cfg = SimConfig(num_prefill=1, num_decode=1, max_batch=32, transfer_s=handoff_ms / 1000)
    sim = Simulation(prof, cfg).run(reqs)
    real_ttft = _median([1000 * r["ttft_s"] for r in ok])
    real_tpot = _median([1000 * r["tpot_s"] for r in ok if r["tpot_s"] is not None])
    sim_ttft, sim_itl = sim.percentile(sim.ttft_ms, 50), sim.percentile(sim.itl_ms, 50)
    return {"rate": rate, "completed": len(ok), "failed": len(doc["requests"]) - len(ok),
            "real_ttft_p50_ms": real_ttft, "sim_ttft_p50_ms": sim_ttft,
            "ttft_error": sim_ttft / real_ttft - 1, "real_itl_p50_ms": real_tpot, "sim_itl_p50_ms": sim_itl,
            "itl_error": sim_itl / real_tpot - 1, "real_all_gaps_itl_p50_ms": doc.get("median_itl_ms"),
            "real_output_throughput": doc.get("output_throughput")}


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return (xs[(n - 1) // 2] + xs[n // 2]) / 2 if xs else float("nan")


def table(rows: list[dict]) -> str:
    head = (f"{'rate':>6} {'ok/fail':>8} {'TTFT p50 real':>14} {'sim':>8} {'err':>7} "
            f"{'ITL p50 real':>13} {'sim':>7} {'err':>7}  {'(all-gaps ITL p50)':>18}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['rate']:>6g} {r['completed']:>4}/{r['failed']:<3} {r['real_ttft_p50_ms']:>14.1f} "
                     f"{r['sim_ttft_p50_ms']:>8.1f} {100 * r['ttft_error']:>+6.1f}% {r['real_itl_p50_ms']:>13.1f} "
                     f"{r['sim_itl_p50_ms']:>7.1f} {100 * r['itl_error']:>+6.1f}%  {r['real_all_gaps_itl_p50_ms'] or 0:>18.1f}")
    within = all(abs(r["ttft_error"]) <= GOAL and abs(r["itl_error"]) <= GOAL for r in rows)
    lines.append(f"simulator within {100 * GOAL:.0f}% of the real run at every rate: {'yes' if within else 'no'}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
