"""The worker registry's records on Redis (version 1), shared by workers and routers.

    pdserve:worker:<id>   JSON ``WorkerRegistration`` with a TTL (default 3 s) that the worker's
                          heartbeat renews every TTL/3; deleted on drain.

Pure Python, no torch, no Redis client (worker/registration.py writes, router/redis_registry.py reads).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

KEY_PREFIX = "pdserve:worker:"
DEFAULT_TTL_S = 3.0


@dataclass(frozen=True)
class WorkerRegistration:
    """What a worker registers: id, role, gRPC address, model, KV format (dtype/layout/block size
    descriptor, "" if unknown) and capacity (KV blocks)."""

    id: str
    role: str
    address: str
    model: str = ""
    kv_format: str = ""
    capacity_blocks: int = 0
    ttl_s: float = DEFAULT_TTL_S  # the key's TTL: how long a re-registration can take after Redis restarts

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "WorkerRegistration":
        return cls(**json.loads(text))


def parse_url(url: str) -> str:
    """Check a --registry URL (redis://HOST:PORT/DB); raises ValueError naming the option."""
    from urllib.parse import urlparse

    u = urlparse(url)
    if u.scheme != "redis" or not u.hostname:
        raise ValueError(f"--registry must look like redis://HOST:PORT/DB, got {url!r}")
    if u.path not in ("", "/") and not u.path[1:].isdigit():
        raise ValueError(f"--registry database must be a number, got {u.path[1:]!r}")
    return url
