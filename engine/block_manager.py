"""KV block manager: integer block ids, reference counts, an LRU free list, prefix caching.

Pure Python, no torch: the cache tensor lives in engine/kv_cache.py; this module only decides
which block ids a request's tokens go to.

Prefix caching (after vLLM's automatic prefix caching and nano-vllm): each *full, computed*
block gets a chained hash (proto/block_hash.py: a block's hash covers its parent's hash and its
own tokens), written once. Freed blocks keep their hash and stay findable until evicted, so a
later request whose prompt starts with the same blocks reuses them. A hit is also checked
token by token against the tokens stored with the block.

Free list: an OrderedDict used as an O(1) queue in eviction order. Blocks without a hash go to
the front (evicted first); hashed blocks go to the back in least-recently-freed order; a prefix
hit removes a free block from the middle in O(1).

KV events (proto/kv_events.py): ``on_event``, if set, is called with a BlockStored when full
blocks become findable, a BlockRemoved when cached blocks are evicted or forgotten, and an
AllBlocksCleared when a reset leaves nothing cached; the worker's publisher numbers and sends
them to routers. The hook is called synchronously in the engine thread, so it must be cheap.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

from proto.block_hash import hash_block
from proto.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()  # stored with the hash, to verify a hit


@dataclass(frozen=True)
class PrefixHit:
    """Cached blocks that cover the first ``num_tokens`` tokens of a prompt (a block multiple)."""

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0


NO_HIT = PrefixHit()


class BlockManager:
    """Owns every block's refcount and every request's block table.

    num_blocks: blocks in the cache (ids 0 .. num_blocks-1); block_size: tokens per block.
    watermark: fraction of blocks kept free when admitting *new* work, so running requests can
        still grow by a block without preempting right after an admission (thrashing).
    """

    def __init__(self, num_blocks: int, block_size: int, *, watermark: float = 0.01,
                 enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[int]] = {}  # chained hashes of each request's full computed blocks
        # counters
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_evictions = 0
        self.on_event: Callable[[KvEvent], None] | None = None

    # ---- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (including cached-but-free ones)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def cached_hashes(self) -> frozenset[int]:
        """Every findable block hash (what a KV-event snapshot holds)."""
        return frozenset(self._cached)

    def block_table(self, request_id: str) -> list[int]:
        """The live block table of a request (empty if it holds none). Do not mutate."""
        return self._tables.get(request_id, [])

    def holders(self) -> list[str]:
        return list(self._tables)

    # ---- prefix cache ----------------------------------------------------------------------
    def find_cached_prefix(self, token_ids: Sequence[int]) -> PrefixHit:
        """Longest run of cached full blocks that starts the prompt. No side effects.

        Leaves at least one token uncached, because the last prompt token must be computed to
        produce the logits of the first output token.
        """
        if not self.enable_prefix_caching:
            return NO_HIT
        bs, parent, hit = self.block_size, None, []
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            parent = hash_block(parent, tokens)
            block_id = self._cached.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hit.append(block_id)
        return PrefixHit(tuple(hit), len(hit) * bs) if hit else NO_HIT

    # ---- allocation ------------------------------------------------------------------------
    def num_blocks_to_allocate(self, request_id: str, num_tokens: int, prefix: PrefixHit = NO_HIT) -> int:
        """New blocks needed so the table covers ``num_tokens`` tokens (free prefix blocks count)."""
        have = len(self._tables.get(request_id, ())) + len(prefix.block_ids)
        revived = sum(1 for b in prefix.block_ids if self.blocks[b].ref_count == 0)
        return max(0, cdiv(num_tokens, self.block_size) - have) + revived

    def allocate(self, request_id: str, num_tokens: int, prefix: PrefixHit = NO_HIT, *,
                 use_watermark: bool = False) -> list[int] | None:
        """Grow the request's table to cover ``num_tokens`` tokens, first taking ``prefix``'s
        cached blocks (only for a request that holds none yet).

        Returns the newly added block ids (prefix blocks included), or None — with nothing
        changed — if they do not fit (above the watermark when ``use_watermark``).
        """
        table = self._tables.get(request_id)
        if prefix.block_ids and table:
            raise ValueError(f"request {request_id} already holds blocks; a prefix hit applies only at admission")
        needed = self.num_blocks_to_allocate(request_id, num_tokens, prefix)
        reserve = self.watermark_blocks if use_watermark else 0
        if needed > len(self._free) - reserve:
            return None
        table = self._tables.setdefault(request_id, [])
        added = [self._take(b) for b in prefix.block_ids]
        if prefix.block_ids:
            self._hashes[request_id] = [self.blocks[b].block_hash for b in prefix.block_ids]
            self.prefix_hit_tokens += prefix.num_tokens
        added += [self._take_free() for _ in range(cdiv(num_tokens, self.block_size) - len(table) - len(added))]
        table.extend(added)
        return added

    def note_prefix_query(self, num_prompt_tokens: int) -> None:
        self.prefix_query_tokens += num_prompt_tokens

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Give every full block among the first ``num_computed_tokens`` tokens its hash (once).

        A block whose hash is already cached elsewhere (two equal prompts computed together)
        stays unhashed: the first block keeps the entry.
        """
        if not self.enable_prefix_caching:
            return
        table, bs = self._tables.get(request_id, []), self.block_size
        hashes = self._hashes.setdefault(request_id, [])
        stored: list[int] = []
        parent: int | None = None
        for i in range(len(hashes), min(num_computed_tokens // bs, len(table))):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = hash_block(hashes[-1] if hashes else None, tokens)
            block = self.blocks[table[i]]
            if block.block_hash is None and h not in self._cached:
                block.block_hash, block.token_ids = h, tokens
                self._cached[h] = block.block_id
                if not stored:
                    parent = hashes[-1] if hashes else None
                stored.append(h)
            elif stored:  # a run of new blocks ends: one event per contiguous run
                self._emit(BlockStored(tuple(stored), parent, len(stored) * bs))
                stored = []
            hashes.append(h)
        if stored:
            self._emit(BlockStored(tuple(stored), parent, len(stored) * bs))

    def free(self, request_id: str) -> list[int]:
        """Drop the request's hold on every block of its table; returns the table. Idempotent."""
        table = self._tables.pop(request_id, [])
        self._hashes.pop(request_id, None)
        for block_id in reversed(table):  # tail blocks first: they are the least likely to be shared
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)
        return table

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash of a free block (e.g. after the cache contents changed)."""
        removed = [h for b in self._free if (h := self._uncache(self.blocks[b])) is not None]
        if not self._cached and removed:
            self._emit(AllBlocksCleared())
        elif removed:
            self._emit(BlockRemoved(tuple(removed)))

    # ---- internals -------------------------------------------------------------------------
    def _take(self, block_id: int) -> int:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1
        return block_id

    def _take_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if (h := self._uncache(block)) is not None:
                self._emit(BlockRemoved((h,)))
            self.num_evictions += 1
        block.ref_count = 1
        return block_id

    def _uncache(self, block: Block) -> int | None:
        """Drop the block's hash; returns it if it was findable (indexed to this block)."""
        h = block.block_hash
        gone = h is not None and self._cached.get(h) == block.block_id
        if gone:
            del self._cached[h]
        block.block_hash, block.token_ids = None, ()
        return h if gone else None

    def _emit(self, event: KvEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)

    # ---- integrity -------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if refcounts, the free list or the hash index are inconsistent."""
        refs = [0] * self.num_blocks
        for table in self._tables.values():
            for block_id in table:
                refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], f"block {block.block_id}: ref {block.ref_count} != {refs[block.block_id]}"
            assert (block.ref_count == 0) == (block.block_id in self._free), f"block {block.block_id} free-list mismatch"
        for h, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == h, f"hash index points at block {block_id} with another hash"
        assert self.num_free_blocks + sum(1 for r in refs if r) == self.num_blocks
