"""Prometheus metrics of a worker process: the engine-side series, named as vLLM names them.

Every series carries ``model_name`` (the served model id), ``worker_id`` and ``role``. These are
the engine's view (what is in this worker's batch and cache); the router exports the client's
view (TTFT, end-to-end latency, finished requests by ``finished_reason``) under names no worker
uses, so a sum over one name never counts a request twice.

Read at scrape time from ``EngineStats`` (gauges and counters) or observed per finished request
(the queue / prefill / decode time histograms):

    pdserve:num_requests_running, pdserve:num_requests_waiting        gauge
    pdserve:kv_cache_usage_perc                                       gauge, fraction in [0, 1]
    pdserve:kv_blocks_used, pdserve:kv_blocks_total, pdserve:kv_blocks_held   gauge
    pdserve:num_preemptions_total                                     counter
    pdserve:prefix_cache_queries_total, pdserve:prefix_cache_hits_total       counter, tokens
    pdserve:request_queue_time_seconds, pdserve:request_prefill_time_seconds,
    pdserve:request_decode_time_seconds                               histogram, per request
    pdserve:spec_decode_<name>_total                                  counter, one per int EngineStats.spec_<name>
                                     (num_drafts, num_draft_tokens, num_accepted_tokens, num_verify_steps)
    pdserve:spec_decode_mean_accepted_length                          gauge, 1 + accepted / drafts (0: none yet)
    pdserve:spec_decode_k                                             histogram, the k each speculable decode
                                                                      row ran with (k = 0 included)
"""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

LABELS = ("model_name", "worker_id", "role")
_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
                 40.0, 80.0, 160.0)

_GAUGES = (("pdserve:num_requests_running", "Requests in this worker's running batch", "running"),
           ("pdserve:num_requests_waiting", "Requests queued on this worker", "waiting"),
           ("pdserve:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)", "kv_usage"),
           ("pdserve:kv_blocks_used", "KV blocks held by requests", "kv_blocks_used"),
           ("pdserve:kv_blocks_total", "KV blocks in the cache", "kv_blocks_total"))
_COUNTERS = (("pdserve:num_preemptions", "Requests preempted (recomputed later)", "num_preemptions"),
             ("pdserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
              "prefix_cache_query_tokens"),
             ("pdserve:prefix_cache_hits", "Prompt tokens found in the prefix cache", "prefix_cache_hit_tokens"))


class WorkerMetrics:
    """One worker's registry: the per-request histograms, and a collector over the engine's stats."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.registry = CollectorRegistry()
        self._values: tuple[str, str, str] | None = None

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=_TIME_BUCKETS, registry=self.registry)

        self.queue_time = hist("pdserve:request_queue_time_seconds", "Arrival to first scheduled, per request")
        self.prefill_time = hist("pdserve:request_prefill_time_seconds", "First scheduled to first token, per request")
        self.decode_time = hist("pdserve:request_decode_time_seconds", "First token to finish, per request")
        self.registry.register(_StatsCollector(self))

    @property
    def label_values(self) -> tuple[str, str, str]:
        if self._values is None:
            c = self.worker.config
            self._values = (self.worker.model_id, c.worker_id, c.role)
        return self._values

    def observe(self, out) -> None:
        """Record a finished RequestOutput's RequestTimes (outputs without times are ignored)."""
        times = getattr(out, "times", None)
        if times is None:
            return
        for hist, value in ((self.queue_time, times.queue_s), (self.prefill_time, times.prefill_s),
                            (self.decode_time, times.decode_s)):
            if value is not None:
                hist.labels(*self.label_values).observe(value)


class _StatsCollector:
    def __init__(self, metrics: WorkerMetrics) -> None:
        self.m = metrics

    def describe(self):
        return []  # collected at scrape time only

    def collect(self):
        w = self.m.worker
        s = w.engine.stats()
        values = list(self.m.label_values)
        for name, doc, field in _GAUGES:
            yield _family(GaugeMetricFamily, name, doc, values, getattr(s, field))
        held = w.worker_stats().kv_blocks_held
        yield _family(GaugeMetricFamily, "pdserve:kv_blocks_held", "Blocks reserved for or held for a peer",
                      values, held)
        for name, doc, field in _COUNTERS:
            yield _family(CounterMetricFamily, name, doc, values, getattr(s, field))
        for f in dataclasses.fields(s):
            value = getattr(s, f.name)
            if f.name.startswith("spec_") and isinstance(value, int):
                name = "pdserve:spec_decode_" + f.name.removeprefix("spec_")
                yield _family(CounterMetricFamily, name, f"EngineStats.{f.name}", values, value)
        mean = 1.0 + s.spec_num_accepted_tokens / s.spec_num_drafts if s.spec_num_drafts else 0.0
        yield _family(GaugeMetricFamily, "pdserve:spec_decode_mean_accepted_length",
                      "Tokens emitted per verification row: 1 + accepted / drafts (0 before the first)", values, mean)
        yield k_histogram(s.spec_k_histogram, values)


def k_histogram(counts: tuple[int, ...], values: list[str]) -> HistogramMetricFamily:
    """counts[k] = decode rows that ran with k drafts -> a histogram with one bucket per k (le="0".."K")."""
    family = HistogramMetricFamily("pdserve:spec_decode_k", "Draft tokens chosen per speculable decode row",
                                   labels=list(LABELS))
    buckets, total = [], 0
    for k, n in enumerate(counts):
        total += n
        buckets.append((str(k), total))
    buckets.append(("+Inf", total))
    family.add_metric(values, buckets, sum_value=sum(k * n for k, n in enumerate(counts)))
    return family


def _family(cls, name: str, doc: str, values: list[str], value: float):
    family = cls(name, doc, labels=list(LABELS))
    family.add_metric(values, value)
    return family


def serve_worker_metrics(worker, port: int, host: str = "127.0.0.1") -> int:
    """Serve the worker's registry on host:port (0: any free one); returns the bound port."""
    server, _ = start_http_server(port, addr=host, registry=worker.metrics.registry)
    return server.server_port
