"""KV-cache events: what a worker tells routers about the blocks in its prefix cache.

Version 1 (``KV_EVENTS_VERSION``). A worker numbers its events 1, 2, 3, ... (``seq``) within an
``epoch`` (a fresh random id at every start of its engine), so a router that sees a gap in
``seq`` or a new epoch knows its view of that worker is wrong and reloads it from a snapshot.
Block hashes are ``proto.block_hash.hash_block`` chains (unsigned 64-bit), the same the worker's
block manager uses for prefix caching, so the router can look a prompt's blocks up directly.

    BlockStored(block_hashes, parent_hash, token_count): full blocks newly findable, in prompt
        order; parent_hash is the hash of the block before the first one (None at the start).
    BlockRemoved(block_hashes): blocks evicted (no longer findable).
    AllBlocksCleared(): every cached block is gone (a reset).

On the wire (Redis Streams and the worker gRPC API) each event travels as one compact JSON
object, ``encode_record`` / ``decode_record``. Pure Python, no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

KV_EVENTS_VERSION = 1
STREAM_PREFIX = "pdserve:kv:"  # Redis Stream of a worker's records: STREAM_PREFIX + worker id


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_hash: int | None
    token_count: int  # tokens in these blocks (len(block_hashes) * block_size)


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KvEventRecord:
    """One event as published: which worker, which epoch of it, its sequence number (from 1)."""

    worker_id: str
    epoch: str
    seq: int
    event: KvEvent


@dataclass(frozen=True)
class KvSnapshot:
    """Every block hash a worker has findable after event ``seq`` of ``epoch`` (the resync path)."""

    worker_id: str
    epoch: str
    seq: int
    block_hashes: frozenset[int]


def encode_record(r: KvEventRecord) -> str:
    """One record as JSON: {"v", "w", "e", "s", "t": "stored"|"removed"|"cleared", ...}."""
    d: dict = {"v": KV_EVENTS_VERSION, "w": r.worker_id, "e": r.epoch, "s": r.seq}
    ev = r.event
    if isinstance(ev, BlockStored):
        d.update(t="stored", h=list(ev.block_hashes), p=ev.parent_hash, n=ev.token_count)
    elif isinstance(ev, BlockRemoved):
        d.update(t="removed", h=list(ev.block_hashes))
    else:
        d.update(t="cleared")
    return json.dumps(d, separators=(",", ":"))


def decode_record(text: str | bytes) -> KvEventRecord:
    """Inverse of encode_record; raises ValueError on another version or a malformed record."""
    try:
        d = json.loads(text)
        if d["v"] != KV_EVENTS_VERSION:
            raise ValueError(f"KV event version {d['v']}, this build reads {KV_EVENTS_VERSION}")
        kind = d["t"]
        if kind == "stored":
            ev: KvEvent = BlockStored(tuple(d["h"]), d["p"], d["n"])
        elif kind == "removed":
            ev = BlockRemoved(tuple(d["h"]))
        elif kind == "cleared":
            ev = AllBlocksCleared()
        else:
            raise ValueError(f"unknown KV event type {kind!r}")
        return KvEventRecord(d["w"], d["e"], int(d["s"]), ev)
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"malformed KV event record: {e}") from None
