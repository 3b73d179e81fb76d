"""Prometheus metrics of the router process: the client's view of every request, vLLM-named.

Every series carries ``model_name``. The router exports what only it sees (time to first
token, inter-token latency, time per output token, end-to-end latency, finished requests by
``finished_reason``, prompt / generation tokens, KV transfer bytes and time per request); what
it shares a concept with the workers gets a ``router_`` name (its own queue: admitted requests
before / after their first token), so no name is exported by both and a sum never double counts.
Failover, by ``reason`` (router/failover_events.py; every known reason exported from the start,
at 0): ``pdserve:request_migrations_total`` (requests moved to another decode-capable worker),
``pdserve:prefill_failovers_total`` (prefill legs given up on their worker) and
``pdserve:worker_suspect_total`` (workers that became suspect, also by ``role``).
The workers' engine-side series are in worker/metrics.py.

Each process owns a registry and serves it on its own port, bound to 127.0.0.1 unless told
otherwise (prometheus-client's default is 0.0.0.0); the HTTP API also serves it at /metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from router.failover_events import MIGRATION_REASONS, PREFILL_FAILOVER_REASONS, SUSPECT_REASONS, FailoverEvents

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                    10.0, 20.0, 40.0, 80.0)
M = ("model_name",)


@dataclass(frozen=True)
class ModelSeries:
    """One model's children of every labelled family (what the service records into)."""

    ttft: object
    itl: object
    tpot: object
    e2e: object
    running: object
    waiting: object
    prompt_tokens: object
    generation_tokens: object
    kv_bytes: object
    kv_seconds: object
    cached_tokens: object
    finished: object   # .labels(finished_reason=...) still to give
    errors: object     # .labels(code=...) still to give


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, M, buckets=_LATENCY_BUCKETS, registry=r)

        self._ttft = hist("pdserve:time_to_first_token_seconds", "Time from arrival to the first token")
        self._itl = hist("pdserve:inter_token_latency_seconds", "Time between consecutive streamed tokens")
        self._tpot = hist("pdserve:time_per_output_token_seconds", "Per request: (e2e - TTFT) / (output tokens - 1)")
        self._e2e = hist("pdserve:e2e_request_latency_seconds", "Time from arrival to the last token")
        self._kv_seconds = hist("pdserve:kv_transfer_time_seconds", "KV transfer time prefill -> decode, per request")
        self._finished = Counter("pdserve:request_success", "Finished requests by finished_reason",
                                 M + ("finished_reason",), registry=r)
        self._errors = Counter("pdserve:request_errors", "Failed requests by status code", M + ("code",), registry=r)
        self._running = Gauge("pdserve:router_num_requests_running", "Requests streaming tokens through the router",
                              M, registry=r)
        self._waiting = Gauge("pdserve:router_num_requests_waiting",
                              "Requests admitted by the router, before their first token", M, registry=r)
        self._prompt = Counter("pdserve:prompt_tokens", "Prompt tokens of finished requests", M, registry=r)
        self._generation = Counter("pdserve:generation_tokens", "Generated tokens of finished requests", M,
                                   registry=r)
        self._kv_bytes = Counter("pdserve:kv_transfer_bytes", "KV bytes moved prefill -> decode", M, registry=r)
        self._cached = Counter("pdserve:router_cached_prompt_tokens",
                               "Prompt tokens of finished requests served from a worker's prefix cache", M, registry=r)
        self.registry_connected = Gauge("pdserve:registry_connected",
                                        "1 while the worker registry is reachable (0: serving from the last view)",
                                        registry=r)
        self.registry_connected.set(1)
        self._migrations = Counter("pdserve:request_migrations",
                                   "Requests moved to another decode-capable worker mid-stream, by reason",
                                   M + ("reason",), registry=r)
        self._prefill_failovers = Counter("pdserve:prefill_failovers",
                                          "Prefill legs given up on their worker (retried elsewhere, or prefilled "
                                          "on the decode worker: reason no_prefill_worker), by reason",
                                          M + ("reason",), registry=r)
        self._suspects = Counter("pdserve:worker_suspect",
                                 "Workers that became suspect (no new requests until they answer or progress again), "
                                 "by role and reason", M + ("role", "reason"), registry=r)
        self._series: dict[str, ModelSeries] = {}

    def model(self, name: str) -> ModelSeries:
        """The series of one served model (created on first use)."""
        if name not in self._series:
            self._series[name] = ModelSeries(
                self._ttft.labels(name), self._itl.labels(name), self._tpot.labels(name), self._e2e.labels(name),
                self._running.labels(name), self._waiting.labels(name), self._prompt.labels(name),
                self._generation.labels(name), self._kv_bytes.labels(name), self._kv_seconds.labels(name),
                self._cached.labels(name), self._finished, self._errors)
            for reason in MIGRATION_REASONS:  # every known reason exported at 0 from the start
                self._migrations.labels(name, reason)
            for reason in PREFILL_FAILOVER_REASONS:
                self._prefill_failovers.labels(name, reason)
            for role in ("prefill", "decode", "agg"):
                for reason in SUSPECT_REASONS:
                    self._suspects.labels(name, role, reason)
        return self._series[name]

    def failover_events(self, model_name: Callable[[], str]) -> FailoverEvents:
        """Hooks for the pool and orchestrator that count into this registry; model_name() is
        asked at each event (the served id, learned from the workers)."""
        return _CountedEvents(self, model_name)

    def finished(self, model_name: str, finished_reason: str):
        return self._finished.labels(model_name=model_name, finished_reason=finished_reason)

    def errors(self, model_name: str, code: str):
        return self._errors.labels(model_name=model_name, code=code)


class _CountedEvents(FailoverEvents):
    def __init__(self, metrics: RouterMetrics, model_name: Callable[[], str]) -> None:
        self._m, self._name = metrics, model_name

    def _model(self) -> str:
        name = self._name()
        self._m.model(name)  # its series (and the zeros of every reason) exist
        return name

    def migration(self, reason: str) -> None:
        self._m._migrations.labels(self._model(), reason).inc()

    def prefill_failover(self, reason: str) -> None:
        self._m._prefill_failovers.labels(self._model(), reason).inc()

    def worker_suspect(self, role: str, reason: str) -> None:
        self._m._suspects.labels(self._model(), role, reason).inc()


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> int:
    """Serve /metrics on host:port (port 0: any free one); returns the bound port."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server.server_port
