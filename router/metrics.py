"""Prometheus metrics of the router process, named in the field's style (pdserve:...).

Each process owns a registry and serves it on its own port, bound to 127.0.0.1 unless told
otherwise (prometheus-client's default is 0.0.0.0).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                    10.0, 20.0, 40.0, 80.0)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("pdserve:time_to_first_token_seconds", "Time from arrival to the first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdserve:inter_token_latency_seconds", "Time between consecutive streamed tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pdserve:time_per_output_token_seconds",
                              "Per request: (e2e - TTFT) / (output tokens - 1)", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve:e2e_request_latency_seconds", "Time from arrival to the last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.finished = Counter("pdserve:request_success_total", "Finished requests by finish reason",
                                ["finish_reason"], registry=r)
        self.errors = Counter("pdserve:request_errors_total", "Failed requests by status code", ["code"], registry=r)
        self.running = Gauge("pdserve:num_requests_running", "Requests streaming tokens", registry=r)
        self.waiting = Gauge("pdserve:num_requests_waiting", "Requests admitted, before their first token",
                             registry=r)
        self.prompt_tokens = Counter("pdserve:prompt_tokens_total", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("pdserve:generation_tokens_total", "Generated tokens", registry=r)
        self.kv_bytes = Counter("pdserve:kv_transfer_bytes_total", "KV bytes moved prefill -> decode", registry=r)
        self.kv_seconds = Histogram("pdserve:kv_transfer_seconds", "KV transfer time per request",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.registry_connected = Gauge("pdserve:registry_connected",
                                        "1 while the worker registry is reachable (0: serving from the last view)",
                                        registry=r)
        self.registry_connected.set(1)
        self.prefix_hits = Counter("pdserve:prefix_cache_hit_tokens_total", "Prompt tokens served from a prefix cache",
                                   registry=r)


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> int:
    """Serve /metrics on host:port (port 0: any free one); returns the bound port."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server.server_port
