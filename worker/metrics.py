"""Prometheus metrics of a worker process (pdserve:...), read from the worker at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class WorkerCollector:
    def __init__(self, worker) -> None:
        self.worker = worker

    def collect(self):
        s = self.worker.worker_stats()
        labels = ["worker_id", "role"]
        values = [self.worker.config.worker_id, self.worker.config.role]
        for name, doc, v in (("pdserve:kv_blocks_used", "KV blocks held by requests", s.kv_blocks_used),
                             ("pdserve:kv_blocks_total", "KV blocks in the cache", s.kv_blocks_total),
                             ("pdserve:kv_blocks_held", "Blocks reserved for or held for a peer", s.kv_blocks_held),
                             ("pdserve:num_requests_running", "Requests in the running batch", s.running),
                             ("pdserve:num_requests_waiting", "Requests queued", s.waiting)):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, v)
            yield g
        c = CounterMetricFamily("pdserve:prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                labels=labels)
        c.add_metric(values, s.prefix_cache_hit_tokens)
        yield c
        pusher = getattr(self.worker, "pusher", None)
        if pusher is not None:
            b = CounterMetricFamily("pdserve:kv_transfer_bytes", "KV bytes written to decode workers", labels=labels)
            b.add_metric(values, pusher.total_bytes)
            yield b


def serve_worker_metrics(worker, port: int, host: str = "127.0.0.1") -> int:
    registry = CollectorRegistry()
    registry.register(WorkerCollector(worker))
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server.server_port
