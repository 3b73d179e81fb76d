"""Which worker gets a request: pure functions over load snapshots, no I/O.

Decode: most free KV blocks (it must hold the whole prompt and its output), then fewest running
requests, then the id (deterministic). Prefill: shortest queue (waiting + running), then most free
blocks, then the id. Workers marked dead or excluded (a retry after a failure) are never chosen.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerLoad:
    """One worker's load as the router last saw it (its Stats plus requests the router has in flight)."""

    id: str
    kv_blocks_total: int
    kv_blocks_used: int
    running: int
    waiting: int
    alive: bool = True

    @property
    def kv_blocks_free(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_used


def choose_decode(loads: list[WorkerLoad], exclude: frozenset[str] = frozenset()) -> str | None:
    """The decode worker with the most free KV blocks, then the fewest running; None if none is alive."""
    live = [w for w in loads if w.alive and w.id not in exclude]
    if not live:
        return None
    return min(live, key=lambda w: (-w.kv_blocks_free, w.running, w.id)).id


def choose_prefill(loads: list[WorkerLoad], exclude: frozenset[str] = frozenset()) -> str | None:
    """The prefill worker with the shortest queue, then the most free blocks; None if none is alive."""
    live = [w for w in loads if w.alive and w.id not in exclude]
    if not live:
        return None
    return min(live, key=lambda w: (w.waiting + w.running, -w.kv_blocks_free, w.id)).id


def use_local_prefill(prompt_len: int, threshold: int) -> bool:
    """Conditional disaggregation: prompts shorter than the threshold are prefilled on the decode worker."""
    return prompt_len < threshold
