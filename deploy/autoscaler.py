"""The planner's actuation on a running cluster: scrape metrics, ask the planner, scale on Ray.

Every ``load_interval_s`` the load loop reads the workers' Prometheus endpoints (decode KV usage,
waiting prefill requests per prefill worker); every ``interval_s`` the SLA loop reads the router's
(requests, prompt and generated tokens, TTFT and ITL sums and counts) as deltas over the
interval. Both go to ``planner.sla.SlaPlanner`` (pure); the targets it returns go to
``ClusterController.scale``, which starts workers or drains them (a drain never fails a
request). Inputs are scraped over HTTP, as any Prometheus would: nothing is read from the
router's or workers' internals. The last decision and its reason are kept for
``pdserve scale`` / the admin endpoint, and exported as planner metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from planner.sla import IntervalMetrics, LoadSample, SlaPlanner

log = logging.getLogger(__name__)

# Metric sample names, newest spelling first (names follow vLLM's; older pdserve names kept so a
# mixed-version cluster still scales).
REQUESTS = ("pdserve:request_success_total",)
PROMPT_TOKENS = ("pdserve:prompt_tokens_total",)
GENERATION_TOKENS = ("pdserve:generation_tokens_total",)
TTFT = ("pdserve:time_to_first_token_seconds",)
ITL = ("pdserve:inter_token_latency_seconds",)
KV_USED = ("pdserve:kv_blocks_used",)
KV_TOTAL = ("pdserve:kv_blocks_total",)
WAITING = ("pdserve:num_requests_waiting",)
RUNNING = ("pdserve:num_requests_running",)


def parse_samples(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value summed over its labels}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


def pick(samples: dict[str, float], names: tuple[str, ...], suffix: str = "") -> float:
    for n in names:
        if n + suffix in samples:
            return samples[n + suffix]
    return 0.0


def interval_metrics(before: dict[str, float], after: dict[str, float], duration_s: float,
                     decode_batch: float | None) -> IntervalMetrics:
    """The SLA loop's input from two scrapes of the router ``duration_s`` apart."""
    d = lambda names, suffix="": pick(after, names, suffix) - pick(before, names, suffix)  # noqa: E731
    n = d(REQUESTS)
    ttft_n, itl_n = d(TTFT, "_count"), d(ITL, "_count")
    return IntervalMetrics(
        duration_s=duration_s, num_requests=int(round(n)),
        mean_isl=d(PROMPT_TOKENS) / n if n else 1.0, mean_osl=d(GENERATION_TOKENS) / n if n else 1.0,
        ttft_ms=1000 * d(TTFT, "_sum") / ttft_n if ttft_n else None,
        itl_ms=1000 * d(ITL, "_sum") / itl_n if itl_n else None, decode_batch=decode_batch)


@dataclass
class Autoscaler:
    """Runs the planner against ``controller`` (deploy.cluster.ClusterController)."""

    controller: object
    planner: SlaPlanner
    router_metrics_url: str
    load_interval_s: float = 5.0
    history: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)   # the last failed ticks, for status and tests
    _task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    @property
    def desired(self) -> dict[str, int]:
        return {"prefill": self.planner.prefill.target, "decode": self.planner.decode.target}

    async def adopt_manual(self, prefill: int | None, decode: int | None) -> dict:
        """`pdserve scale`: the operator's sizes become the planner's baseline, then are applied."""
        p = self.planner.prefill.target if prefill is None else prefill
        d = self.planner.decode.target if decode is None else decode
        decision = self.planner.adopt(time.monotonic(), p, d)
        return await self._apply(decision)

    async def _run(self) -> None:
        import httpx

        before, t0, next_sla = None, 0.0, 0.0
        async with httpx.AsyncClient(timeout=5.0) as client:
            while True:
                try:
                    now = time.monotonic()
                    if before is None:
                        before, t0 = parse_samples((await client.get(self.router_metrics_url)).text), now
                        next_sla = now + self.planner.config.interval_s
                    workers = await self._scrape_workers(client)
                    decision = self.planner.decide_load(now, self._load_sample(workers)) if workers else None
                    if now >= next_sla:
                        after = parse_samples((await client.get(self.router_metrics_url)).text)
                        m = interval_metrics(before, after, now - t0, self._decode_batch(workers))
                        decision = self.planner.decide_sla(now, m)
                        before, t0, next_sla = after, now, now + self.planner.config.interval_s
                    if decision is not None:
                        await self._apply(decision)
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - a failed scrape skips one tick, never the loop
                    self.errors = (self.errors + [f"{type(e).__name__}: {e}"])[-20:]
                    log.warning("autoscaler tick failed: %s", e)
                await asyncio.sleep(self.load_interval_s)

    async def _scrape_workers(self, client) -> dict[str, tuple[str, dict[str, float]]]:
        out = {}
        for wid, (role, url) in self.controller.metrics_targets().items():
            try:
                out[wid] = (role, parse_samples((await client.get(url)).text))
            except Exception:  # noqa: BLE001 - a worker that is starting or gone has no metrics yet
                continue
        return out

    @staticmethod
    def _load_sample(workers) -> LoadSample:
        decode = [s for role, s in workers.values() if role in ("decode", "agg")]
        prefill = [s for role, s in workers.values() if role == "prefill"]
        usage = [pick(s, KV_USED) / pick(s, KV_TOTAL) for s in decode if pick(s, KV_TOTAL)]
        queue = [pick(s, WAITING) + pick(s, RUNNING) for s in prefill]
        return LoadSample(sum(usage) / len(usage) if usage else 0.0, sum(queue) / len(queue) if queue else 0.0)

    @staticmethod
    def _decode_batch(workers) -> float | None:
        running = [pick(s, RUNNING) for role, s in workers.values() if role in ("decode", "agg")]
        return sum(running) / len(running) if running else None

    async def _apply(self, decision) -> dict:
        mode_agg = "agg" in self.controller.replicas()
        result = {}
        if mode_agg:
            result["agg"] = await self.controller.scale("agg", decision.decode)
        else:
            result["prefill"] = await self.controller.scale("prefill", decision.prefill)
            result["decode"] = await self.controller.scale("decode", decision.decode)
        entry = {"t": time.time(), "loop": decision.loop, "reason": decision.reason,
                 "desired": {"prefill": decision.prefill, "decode": decision.decode}, "actions": result}
        self.history = (self.history + [entry])[-100:]
        if any(v["started"] or v["draining"] for v in result.values()):
            log.info("planner (%s): %s -> %s", decision.loop, decision.reason, result)
        return entry
