"""pdserve bench soak: a long mixed ShareGPT load with random cancels while a worker is SIGKILLed
periodically; RSS per process, KV blocks used and request outcomes over time, with plots.

    /work/bin/heavy pdserve bench soak --duration 1800 --kill-interval 300 --output-dir soak/

It starts its own cluster (Ray, `--prefill` + `--decode` workers, the router in this process:
deploy/local_cluster.py), then for `--duration` seconds keeps `--concurrency` gRPC clients busy:
each sends a ShareGPT prompt (greedy, up to `--max-tokens` tokens) and, with probability
`--cancel-fraction`, cancels it after a random 0-2 s (queued, prefilling or decoding). Every
`--kill-interval` seconds the next worker in turn (prefill-0, decode-0, decode-1, ...) is SIGKILLed;
Ray restarts it. Every `--sample-interval` seconds it records each worker's pid and RSS
(/proc/PID/status VmRSS; the router's is this process's, clients included), each worker's KV blocks
used (the router's last Stats) and the outcomes so far. At the end the load stops, in-flight
requests finish, and every worker must come back to idle (no block used or held, no lease).

Goals (issue 14), each reported with its figure:
  lost == 0             a request neither completed nor cancelled by its client (any error code)
  leaked blocks == 0    used + held blocks and leases on every worker after the load, once idle
  RSS flat within 10%   per process instance, its last sample vs its first after its own warm-up
                        (which starts when the instance is first seen: restarted workers load
                        first; instances that lived half the run or a kill interval after it)
  p99 TTFT during a kill <= 3x steady   TTFT of requests sent within KILL_WINDOW_S after a kill
                        vs all other requests sent after warm-up
Writes soak.json (config, events, samples, per-request records, goals) and rss.png, kv_blocks.png,
outcomes.png, ttft.png to --output-dir; prints the goals table.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from engine.errors import UserError

KILL_WINDOW_S = 30.0  # requests sent this long after a kill count as "during a kill"
MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 1800.0
    kill_interval_s: float = 300.0
    concurrency: int = 8
    cancel_fraction: float = 0.2
    max_tokens: int = 64
    prompt_chars: int = 2000
    sample_interval_s: float = 5.0
    warmup_s: float = 60.0
    mode: str = "disagg"
    num_prefill: int = 1
    num_decode: int = 2
    num_blocks: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        checks = {"--duration": self.duration_s > 0, "--kill-interval": self.kill_interval_s > 0,
                  "--concurrency": self.concurrency >= 1, "--cancel-fraction": 0 <= self.cancel_fraction <= 1,
                  "--max-tokens": self.max_tokens >= 1, "--sample-interval": self.sample_interval_s > 0,
                  "--warmup": 0 <= self.warmup_s < self.duration_s, "--mode": self.mode in ("disagg", "agg"),
                  "--decode": self.num_decode >= 1,
                  "--prefill": self.num_prefill >= (1 if self.mode == "disagg" else 0)}
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise UserError(f"{bad[0]}: out of range (duration > 0, warmup < duration, concurrency >= 1, "
                            f"0 <= cancel-fraction <= 1, mode disagg|agg, at least one worker per role)")


@dataclass
class RequestRecord:
    sent_s: float             # since the start of the load
    outcome: str              # "ok" | "cancelled" | a gRPC status name
    ttft_s: float | None
    tokens: int
    seconds: float


@dataclass
class Sample:
    t_s: float
    rss_mib: dict[str, float]       # "worker-id:pid" -> RSS; "router:pid" for this process
    kv_blocks_used: dict[str, int]  # worker id -> blocks used (router's last Stats)
    outcomes: dict[str, int]


@dataclass
class SoakRun:
    config: SoakConfig
    requests: list[RequestRecord] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    kills: list[tuple[float, str, int]] = field(default_factory=list)  # (t, worker id, pid)
    idle_after_s: float | None = None
    leaked: dict[str, int] = field(default_factory=dict)  # worker id -> used + held blocks + leases at the end


# -- analysis (pure) -------------------------------------------------------------------------------
def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(0.99 * len(v)))]


def goals(run: SoakRun) -> dict[str, Any]:
    """The issue's four goals, each with its figure and whether it was met."""
    c = run.config
    lost = [r for r in run.requests if r.outcome not in ("ok", "cancelled")]
    during = [r.ttft_s for r in run.requests if r.ttft_s is not None and r.outcome == "ok"
              and any(0 <= r.sent_s - t < KILL_WINDOW_S for t, _, _ in run.kills)]
    steady = [r.ttft_s for r in run.requests if r.ttft_s is not None and r.outcome == "ok" and r.sent_s >= c.warmup_s
              and not any(0 <= r.sent_s - t < KILL_WINDOW_S for t, _, _ in run.kills)]
    p99_kill, p99_steady = _p99(during), _p99(steady)
    drift = rss_drift(run)
    worst = max(drift.values(), key=abs) if drift else None
    leaked = sum(run.leaked.values())
    return {
        "requests": len(run.requests),
        "outcomes": _count(r.outcome for r in run.requests),
        "lost": {"value": len(lost), "by_code": _count(r.outcome for r in lost), "met": not lost},
        "leaked_blocks": {"value": leaked, "per_worker": run.leaked, "idle_after_s": run.idle_after_s,
                          "met": leaked == 0 and run.idle_after_s is not None},
        "rss_drift_pct": {"value": worst, "per_process": drift,
                          "met": worst is not None and abs(worst) <= 10.0},
        "p99_ttft_kill_vs_steady": {"kill_s": p99_kill, "steady_s": p99_steady,
                                    "ratio": p99_kill / p99_steady if p99_kill and p99_steady else None,
                                    "met": bool(p99_kill and p99_steady and p99_kill <= 3 * p99_steady)},
    }


def rss_drift(run: SoakRun) -> dict[str, float]:
    """Per process instance: % change from its first sample after its own warm-up to its last
    sample, for instances that lived, after their warm-up, at least half the post-warm-up run or
    one kill interval (with kills in turn every worker instance lives about #workers x the
    interval, never half a 30-minute run: only the router would be judged).
    An instance's warm-up starts when it is first seen: a worker Ray restarted after a kill is
    still loading its model when it first appears (~300 MiB, then ~2 GiB once serving), and
    that growth is start-up, not drift."""
    c = run.config
    first_seen: dict[str, float] = {}
    series: dict[str, list[tuple[float, float]]] = {}
    for s in run.samples:
        for key, mib in s.rss_mib.items():
            start = first_seen.setdefault(key, s.t_s)
            if s.t_s >= max(c.warmup_s, start + c.warmup_s):
                series.setdefault(key, []).append((s.t_s, mib))
    out = {}
    for key, points in series.items():
        min_span = min((c.duration_s - c.warmup_s) / 2, c.kill_interval_s)
        if points[-1][0] - points[0][0] >= min_span and points[0][1] > 0:
            out[key] = 100.0 * (points[-1][1] - points[0][1]) / points[0][1]
    return out


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in items:
        out[i] = out.get(i, 0) + 1
    return out


def goals_table(g: dict[str, Any]) -> str:
    def fmt(v, unit=""):
        return "-" if v is None else (f"{v:.3g}{unit}" if isinstance(v, float) else f"{v}{unit}")

    t = g["p99_ttft_kill_vs_steady"]
    rows = [("requests", fmt(g["requests"]), json.dumps(g["outcomes"]), ""),
            ("lost requests", fmt(g["lost"]["value"]), json.dumps(g["lost"]["by_code"]), "0"),
            ("leaked blocks", fmt(g["leaked_blocks"]["value"]),
             f"idle after {fmt(g['leaked_blocks']['idle_after_s'], ' s')}", "0"),
            ("RSS drift (worst)", fmt(g["rss_drift_pct"]["value"], " %"),
             f"{len(g['rss_drift_pct']['per_process'])} processes", "<= 10 %"),
            ("p99 TTFT kill / steady", fmt(t["ratio"], "x"), f"{fmt(t['kill_s'], ' s')} / {fmt(t['steady_s'], ' s')}",
             "<= 3x")]
    met = {"lost requests": g["lost"]["met"], "leaked blocks": g["leaked_blocks"]["met"],
           "RSS drift (worst)": g["rss_drift_pct"]["met"], "p99 TTFT kill / steady": t["met"]}
    lines = [f"{'goal':<24} {'value':>10}  {'goal':>8}  {'met':<4} detail"]
    for name, value, detail, goal in rows:
        ok = "" if name not in met else ("yes" if met[name] else "NO")
        lines.append(f"{name:<24} {value:>10}  {goal:>8}  {ok:<4} {detail}")
    return "\n".join(lines)


# -- the run ---------------------------------------------------------------------------------------
def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class _Soak:
    def __init__(self, config: SoakConfig, serving, prompts: list[str]) -> None:
        self.c = config
        self.s = serving
        self.prompts = prompts
        self.run = SoakRun(config)
        self.rng = random.Random(config.seed)
        self.t0 = 0.0
        self.stop = asyncio.Event()

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def on_serving_loop(self, coro, timeout_s: float):
        fut = asyncio.run_coroutine_threadsafe(coro, self.s._loop)
        return await asyncio.wait_for(asyncio.wrap_future(fut), timeout_s)

    async def main(self) -> SoakRun:
        import grpc

        self.t0 = time.monotonic()
        async with grpc.aio.insecure_channel(self.s.grpc_address) as ch:
            from proto.pdserve.v1 import api_pb2_grpc

            stub = api_pb2_grpc.GenerationStub(ch)
            tasks = [asyncio.create_task(self.client(stub, i)) for i in range(self.c.concurrency)]
            tasks += [asyncio.create_task(self.killer()), asyncio.create_task(self.sampler())]
            await asyncio.sleep(self.c.duration_s)
            self.stop.set()
            await asyncio.gather(*tasks)
        await self.settle()
        return self.run

    async def client(self, stub, i: int) -> None:
        import grpc

        from proto.pdserve.v1 import api_pb2

        rng = random.Random(self.c.seed * 1000 + i)
        while not self.stop.is_set():
            prompt = self.prompts[rng.randrange(len(self.prompts))][:self.c.prompt_chars]
            req = api_pb2.GenerateRequest(model=MODEL, prompt=prompt, sampling=api_pb2.SamplingOptions(
                temperature=0, max_tokens=rng.randint(max(1, self.c.max_tokens // 4), self.c.max_tokens)))
            cancel_after = rng.uniform(0, 2.0) if rng.random() < self.c.cancel_fraction else None
            sent, ttft, tokens = self.now(), None, 0
            call = stub.Generate(req, timeout=600)

            async def consume():
                nonlocal ttft, tokens
                async for m in call:
                    if ttft is None and m.token_ids:
                        ttft = self.now() - sent
                    tokens += len(m.token_ids)

            try:
                if cancel_after is None:
                    await consume()
                    outcome = "ok"
                else:
                    try:
                        await asyncio.wait_for(consume(), cancel_after)
                        outcome = "ok"
                    except TimeoutError:
                        call.cancel()
                        outcome = "cancelled"
            except grpc.RpcError as e:
                outcome = e.code().name
            self.run.requests.append(RequestRecord(sent, outcome, ttft, tokens, self.now() - sent))

    async def killer(self) -> None:
        order = [c.worker_id for c in self.s.spec.worker_configs()]
        n = 0
        while not await self._sleep(self.c.kill_interval_s):
            wid = order[n % len(order)]
            n += 1
            try:
                pid = await self.on_serving_loop(self.s.controller.worker_pid(wid), 30)
            except Exception as e:  # noqa: BLE001 - still restarting from the last kill: skip this turn
                print(f"soak: {wid} not reachable for a kill ({type(e).__name__}); skipped", file=sys.stderr)
                continue
            os.kill(pid, signal.SIGKILL)
            self.run.kills.append((self.now(), wid, pid))
            print(f"soak: t={self.now():.0f}s SIGKILL {wid} (pid {pid})", file=sys.stderr, flush=True)

    async def sampler(self) -> None:
        while True:
            rss = {f"router:{os.getpid()}": _rss_mib(os.getpid()) or 0.0}
            for c in self.s.spec.worker_configs():
                try:
                    pid = await self.on_serving_loop(self.s.controller.worker_pid(c.worker_id), 1.0)
                except Exception:  # noqa: BLE001 - restarting
                    continue
                if (mib := _rss_mib(pid)) is not None:
                    rss[f"{c.worker_id}:{pid}"] = mib
            kv = {w.id: w.stats.kv_blocks_used for w in self.s.router.pool.workers()}
            self.run.samples.append(Sample(self.now(), rss, kv, _count(r.outcome for r in self.run.requests)))
            if await self._sleep(self.c.sample_interval_s):
                return

    async def _sleep(self, seconds: float) -> bool:
        """Sleep unless stopped first; True when stopped."""
        try:
            await asyncio.wait_for(self.stop.wait(), seconds)
            return True
        except TimeoutError:
            return False

    async def settle(self, timeout_s: float = 180.0) -> None:
        """After the load: background aborts done, every worker back (restarted ones included), idle."""
        await self.on_serving_loop(self.s.router.orchestrator.drain(), timeout_s)
        start = time.monotonic()
        expected = len(self.s.spec.worker_configs())
        while time.monotonic() - start < timeout_s:
            stats = await asyncio.to_thread(self.s.worker_stats)
            self.run.leaked = {wid: st.kv_blocks_used + st.kv_blocks_held + st.leases + st.running + st.waiting
                               for wid, st in stats.items()}
            if len(stats) == expected and not any(self.run.leaked.values()):
                self.run.idle_after_s = time.monotonic() - start
                return
            await asyncio.sleep(0.5)


def plots(run: SoakRun, out_dir: Path) -> list[Path]:
    """rss.png, kv_blocks.png, outcomes.png, ttft.png: each over the soak's time, the SIGKILLs dashed."""
    from bench.plots import _pyplot, _save

    plt = _pyplot()
    kills = [t for t, _, _ in run.kills]
    paths = []

    def figure(name: str, draw, **labels) -> None:
        fig, ax = plt.subplots(figsize=(8, 4))
        draw(ax)
        for t in kills:
            ax.axvline(t, color="red", alpha=0.3, linestyle="--")
        ax.set(**labels)
        paths.append(_save(fig, out_dir / name))

    def per_key(attr: str, fontsize: int):
        """One line per key of each sample's dict `attr` (a process's RSS, a worker's KV blocks)."""
        def draw(ax) -> None:
            for key in sorted({k for s in run.samples for k in getattr(s, attr)}):
                pts = [(s.t_s, getattr(s, attr)[key]) for s in run.samples if key in getattr(s, attr)]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=key)
            ax.legend(fontsize=fontsize)
        return draw

    def outcomes(ax) -> None:
        for outcome in sorted({r.outcome for r in run.requests}):
            ends = sorted(r.sent_s + r.seconds for r in run.requests if r.outcome == outcome)
            ax.step(ends, range(1, len(ends) + 1), where="post", label=outcome)
        ax.legend(fontsize=7)

    def ttft(ax) -> None:
        ok = [r for r in run.requests if r.ttft_s is not None]
        ax.scatter([r.sent_s for r in ok], [r.ttft_s for r in ok], s=4)

    figure("rss.png", per_key("rss_mib", 6), xlabel="time (s); dashed: SIGKILL", ylabel="RSS (MiB)",
           title="RSS per process")
    figure("kv_blocks.png", per_key("kv_blocks_used", 7), xlabel="time (s)", ylabel="KV blocks used",
           title="KV blocks used per worker")
    figure("outcomes.png", outcomes, xlabel="time (s)", ylabel="requests (cumulative)", title="Request outcomes")
    figure("ttft.png", ttft, xlabel="send time (s)", ylabel="TTFT (s)", title="TTFT per request")
    return paths


def run_soak(config: SoakConfig, out_dir: Path, dataset_path: Path | None = None) -> dict[str, Any]:
    """Start the cluster, run the soak, write soak.json and the plots; returns the goals."""
    from bench.datasets import default_sharegpt_path, read_sharegpt
    from deploy.cluster import ClusterSpec
    from deploy.local_cluster import LocalServing
    from router.app import RouterConfig

    prompts = [p for p, _ in read_sharegpt(dataset_path or default_sharegpt_path())]
    spec = ClusterSpec(mode=config.mode, num_prefill=config.num_prefill if config.mode == "disagg" else 0,
                       num_decode=config.num_decode, kv_transport="tcp", num_blocks=config.num_blocks)
    out_dir.mkdir(parents=True, exist_ok=True)
    with LocalServing(spec, RouterConfig(port=0, http_port=None, mode=config.mode, max_waiting=4 * config.concurrency)) \
            as s:
        run = asyncio.run(_Soak(config, s, prompts).main())
    g = goals(run)
    doc = {"config": asdict(config), "goals": g, "kills": run.kills, "samples": [asdict(x) for x in run.samples],
           "requests": [asdict(r) for r in run.requests]}
    (out_dir / "soak.json").write_text(json.dumps(doc, indent=1))
    plots(run, out_dir)
    return g


def command(
    duration: Annotated[float, typer.Option(help="Seconds of load (the issue's soak: 1800).")] = 1800.0,
    kill_interval: Annotated[float, typer.Option(help="Seconds between SIGKILLs (workers in turn).")] = 300.0,
    concurrency: Annotated[int, typer.Option(help="Clients, each with one request in flight.")] = 8,
    cancel_fraction: Annotated[float, typer.Option(help="Share of requests cancelled after a random 0-2 s.")] = 0.2,
    max_tokens: Annotated[int, typer.Option(help="Most output tokens per request (each draws max/4..max).")] = 64,
    prompt_chars: Annotated[int, typer.Option(help="ShareGPT prompts cut to this many characters.")] = 2000,
    sample_interval: Annotated[float, typer.Option(help="Seconds between RSS / KV samples.")] = 5.0,
    warmup: Annotated[float, typer.Option(help="Seconds excluded from the RSS and steady-TTFT figures.")] = 60.0,
    mode: Annotated[str, typer.Option(help="disagg | agg")] = "disagg",
    prefill: Annotated[int, typer.Option(help="Prefill workers (disagg).")] = 1,
    decode: Annotated[int, typer.Option(help="Decode (or agg) workers.")] = 2,
    num_blocks: Annotated[int, typer.Option(help="KV blocks per worker.")] = 512,
    seed: Annotated[int, typer.Option(help="Seed of the prompts, lengths and cancels.")] = 0,
    dataset_path: Annotated[Optional[Path], typer.Option(help="ShareGPT JSONL (default: ../shared/data).")] = None,
    output_dir: Annotated[Path, typer.Option(help="Where soak.json and the plots go.")] = Path("soak-results"),
) -> None:
    """A soak under faults: mixed ShareGPT load, random cancels, a worker SIGKILLed periodically."""
    config = SoakConfig(duration, kill_interval, concurrency, cancel_fraction, max_tokens, prompt_chars,
                        sample_interval, warmup, mode, prefill, decode, num_blocks, seed)
    g = run_soak(config, output_dir, dataset_path)
    print(goals_table(g))
    print(f"wrote {output_dir / 'soak.json'} and plots", file=sys.stderr)
