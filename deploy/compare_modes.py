"""Disaggregated vs aggregated serving, in one run: the same ShareGPT workload through both.

    unshare -n bash -c 'ip link set lo up && exec .venv/bin/python -m deploy.compare_modes \
        --num-prompts 100 --concurrency 8 --max-tokens 32 --out /tmp/modes'

Starts a cluster per mode on one local Ray (disagg: 1 prefill + 1 decode worker over the chosen
KV transport; agg: 1 worker doing both), drives it with the benchmark client (`pdserve bench serve
--backend pdserve-grpc`), and prints completed/failed, TTFT and ITL p50/p99 and output tokens/s.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROWS = (("completed", "completed"), ("failed", "failed"), ("ttft p50 ms", "median_ttft_ms"),
        ("ttft p99 ms", "p99_ttft_ms"), ("itl p50 ms", "median_itl_ms"), ("itl p99 ms", "p99_itl_ms"),
        ("output tok/s", "output_throughput"))


def run_mode(mode: str, args) -> dict:
    from deploy.cluster import ClusterSpec
    from deploy.local_cluster import LocalServing
    from router.app import RouterConfig

    spec = ClusterSpec(mode=mode, kv_transport=args.kv_transport, num_prefill=1, num_decode=1,
                       num_blocks=args.num_blocks, max_num_seqs=args.concurrency * 2)
    out = Path(args.out) / f"{mode}.json"
    with LocalServing(spec, RouterConfig(port=0, http_port=None, mode=mode)) as s:
        cmd = [str(Path(sys.executable).parent / "pdserve"), "bench", "serve", "--backend", "pdserve-grpc",
               "--url", s.grpc_address, "--num-prompts", str(args.num_prompts), "--max-concurrency",
               str(args.concurrency), "--max-tokens", str(args.max_tokens), "--json", str(out), "--no-progress"]
        subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kv-transport", default="tcp")
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--out", default="bench-results/modes")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    from deploy.cluster import init_ray

    init_ray(num_cpus=8)
    docs = {mode: run_mode(mode, args) for mode in ("disagg", "agg")}
    print(f"\n{args.num_prompts} ShareGPT prompts, concurrency {args.concurrency}, max_tokens {args.max_tokens}, "
          f"kv transport {args.kv_transport}")
    print(f"{'':<14}{'disagg':>12}{'agg':>12}")
    for label, key in ROWS:
        vals = [docs[m].get(key) for m in ("disagg", "agg")]
        print(f"{label:<14}" + "".join(f"{v:>12.1f}" if isinstance(v, float) else f"{v!s:>12}" for v in vals))
    (Path(args.out) / "summary.json").write_text(json.dumps(
        {m: {key: docs[m].get(key) for _, key in ROWS} for m in docs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
