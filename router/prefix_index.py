"""The router's per-worker prefix index, fed by the workers' KV events (proto/kv_events.py).

For each worker: the set of block hashes it has findable, and the (epoch, seq) of the last event
applied. ``apply`` takes events in order; an event from another epoch (the worker restarted) or
with a sequence gap is *not* applied and answers False, and the caller reloads that worker with
``load_snapshot`` (events already covered by a snapshot are skipped). ``overlap_blocks`` is what
the KV-aware cost reads: how many leading blocks of a prompt a worker would hit.

Hashes are ``proto.block_hash.hash_blocks`` of the prompt with the worker's block size: the same
function the worker's block manager uses, so a hit here is a hit there (up to eviction races:
the index is as fresh as the last event). Pure Python, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from proto.block_hash import hash_blocks
from proto.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventRecord, KvSnapshot


@dataclass
class _WorkerEntry:
    epoch: str = ""
    seq: int = 0
    hashes: set[int] = field(default_factory=set)
    synced: bool = False  # a snapshot (or the epoch's first event) has been applied


class PrefixIndex:
    def __init__(self) -> None:
        self._workers: dict[str, _WorkerEntry] = {}
        self.resyncs = 0  # gaps and restarts seen (a metric)

    def workers(self) -> list[str]:
        return list(self._workers)

    def hashes(self, worker_id: str) -> frozenset[int]:
        e = self._workers.get(worker_id)
        return frozenset(e.hashes) if e else frozenset()

    def position(self, worker_id: str) -> tuple[str, int] | None:
        """(epoch, seq) of the last event applied for the worker, or None if never synced."""
        e = self._workers.get(worker_id)
        return (e.epoch, e.seq) if e and e.synced else None

    def apply(self, r: KvEventRecord) -> bool:
        """Apply one event in order. False = gap or new epoch: nothing applied, resync the worker."""
        e = self._workers.setdefault(r.worker_id, _WorkerEntry())
        if e.synced and r.epoch == e.epoch and r.seq <= e.seq:
            return True  # already covered (a snapshot taken after it, or a replay)
        if not e.synced or r.epoch != e.epoch or r.seq != e.seq + 1:
            if not (r.seq == 1 and (not e.synced or r.epoch != e.epoch)):
                self.resyncs += 1
                return False
            # the first event of a fresh epoch: the worker starts empty
            e.epoch, e.seq, e.hashes, e.synced = r.epoch, 0, set(), True
        ev = r.event
        if isinstance(ev, BlockStored):
            e.hashes.update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            e.hashes.difference_update(ev.block_hashes)
        elif isinstance(ev, AllBlocksCleared):
            e.hashes.clear()
        e.seq = r.seq
        return True

    def load_snapshot(self, s: KvSnapshot) -> None:
        """Replace the worker's entries with the snapshot (events up to s.seq of s.epoch)."""
        self._workers[s.worker_id] = _WorkerEntry(s.epoch, s.seq, set(s.block_hashes), True)

    def drop(self, worker_id: str) -> None:
        """Forget a worker (it left the registry or restarted)."""
        self._workers.pop(worker_id, None)

    def overlap_blocks(self, worker_id: str, block_hashes: Sequence[int]) -> int:
        """Leading blocks of the prompt (given as its chained hashes) the worker has cached."""
        e = self._workers.get(worker_id)
        if e is None:
            return 0
        n = 0
        for h in block_hashes:
            if h not in e.hashes:
                break
            n += 1
        return n


def prompt_block_hashes(prompt_ids: Sequence[int], block_size: int) -> list[int]:
    """Hashes of the blocks a worker could serve from its cache: full blocks, and never the block
    holding the last prompt token (it is always computed, for the first output token's logits),
    exactly as engine.block_manager.BlockManager.find_cached_prefix looks them up."""
    usable = (len(prompt_ids) - 1) // block_size * block_size
    return hash_blocks(list(prompt_ids[:max(usable, 0)]), block_size)
