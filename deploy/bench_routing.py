"""Routing policies compared on one cluster: `pdserve bench serve --dataset prefix` per policy.

    python -m deploy.bench_routing [--workers 2] [--num-prompts 48] [--json out.json]

Starts ``--workers`` agg workers (a local Ray; run it in a loopback-only namespace) and one router,
then for each of round-robin, load and kv runs the serving benchmark (shared system prompts,
distinct questions; more distinct prefixes than one worker's KV cache holds, so where a request
goes decides whether it hits) against the router's gRPC API, switching the router's policy in
place. Each policy gets its own prefixes (seed + its index), so no policy inherits another's warm
cache (the previous policy's blocks are evicted as the new ones arrive). Prints one table (TTFT
p50/p99, output tok/s, prefix-cache hit rate and share of requests per worker) and the machine's
load beside it; writes the JSON with every figure. Not a test: absolute times on a shared machine
are noisy, the ratios within one run are what count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys

POLICIES = ("round-robin", "load", "kv")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m deploy.bench_routing", description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--num-blocks", type=int, default=96, help="KV blocks per worker (16 tokens each)")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--prefix-len", type=int, default=320)
    ap.add_argument("--num-prefixes", type=int, default=7, help="odd, so round-robin over 2 workers cannot pin prefixes by accident")
    ap.add_argument("--input-len", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--max-concurrency", type=int, default=4)
    ap.add_argument("--request-rate", type=float, default=math.inf)
    ap.add_argument("--registry", default="", help="redis://HOST:PORT/DB (default: in-process)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", dest="json_out", default=None)
    a = ap.parse_args(argv)
    rows = run(a)
    print(table(rows))
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"settings": vars(a), "policies": rows}, f, indent=2)
        print(f"wrote {a.json_out}", file=sys.stderr)


def run(a) -> list[dict]:
    from bench.datasets import DatasetConfig
    from bench.load import LoadConfig
    from bench.serve import BenchSpec, run_benchmark
    from deploy.cluster import ClusterSpec
    from deploy.local_cluster import LocalServing
    from router.app import RouterConfig
    from router.routing import RoutingConfig

    spec = ClusterSpec(mode="agg", num_prefill=0, num_decode=a.workers, num_blocks=a.num_blocks,
                       registry_url=a.registry or None)
    rows = []
    with LocalServing(spec, RouterConfig(port=0, http_port=None, mode="agg", max_waiting=1024)) as s:
        router = s.router
        for i, policy in enumerate(POLICIES):
            router.selector.config = RoutingConfig(policy=policy, seed=a.seed)
            before = _snapshot(s)
            bench = BenchSpec(backend="pdserve-grpc", url=s.grpc_address, model=None, tokenizer=None,
                              dataset=DatasetConfig("prefix", None, a.num_prompts, None, a.input_len, a.output_len,
                                                    0.0, a.prefix_len, a.num_prefixes, a.seed + i),
                              loads=[LoadConfig(a.request_rate, 1.0, a.max_concurrency, 1, a.seed + i, False)],
                              slo=None, sweep=False, attainment_target=0.9, ignore_eos=True, include_usage=True,
                              timeout_s=600.0)
            doc = asyncio.run(run_benchmark(bench)).doc
            after = _snapshot(s)
            rows.append(_row(policy, doc, before, after))
    return rows


def _snapshot(s) -> dict:
    stats = s.worker_stats()
    sel = s.router.selector
    return {wid: (st.prefix_cache_hit_tokens, sel.decisions.get(wid, 0), sel.prompt_tokens.get(wid, 0))
            for wid, st in sorted(stats.items())}


def _row(policy: str, doc: dict, before: dict, after: dict) -> dict:
    per_worker = {}
    total_req = sum(after[w][1] - before[w][1] for w in after) or 1
    for w in after:
        hits, reqs, toks = (after[w][k] - before[w][k] for k in range(3))
        per_worker[w] = {"requests": reqs, "share": reqs / total_req, "prompt_tokens": toks, "hit_tokens": hits,
                         "hit_rate": hits / toks if toks else None}
    keys = ("completed", "failed", "median_ttft_ms", "p99_ttft_ms", "mean_ttft_ms", "output_throughput",
            "median_tpot_ms")
    return {"policy": policy, **{k: doc.get(k) for k in keys}, "workers": per_worker}


def table(rows: list[dict]) -> str:
    head = f"{'policy':<12} {'ok/fail':>8} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'out tok/s':>10}  per worker: share / hit rate"
    lines = [head, "-" * len(head)]
    for r in rows:
        ws = "  ".join(f"{w} {v['share']:.0%}/{(v['hit_rate'] or 0):.0%}" for w, v in r["workers"].items())
        lines.append(f"{r['policy']:<12} {r['completed']:>4}/{r['failed']:<3} {r['median_ttft_ms']:>12.0f} "
                     f"{r['p99_ttft_ms']:>12.0f} {r['output_throughput']:>10.1f}  {ws}")
    base = next(r for r in rows if r["policy"] == "round-robin")
    kv = next(r for r in rows if r["policy"] == "kv")
    lines.append(f"kv vs round-robin: TTFT p50 {base['median_ttft_ms'] / kv['median_ttft_ms']:.2f}x lower, "
                 f"output tok/s {kv['output_throughput'] / base['output_throughput']:.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
