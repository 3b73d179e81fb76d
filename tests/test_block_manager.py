"""Block manager: exact block ids, refcounts, LRU eviction order, prefix hits. No model."""

from __future__ import annotations

import pytest

from engine.block_manager import NO_HIT, BlockManager
from proto.block_hash import hash_block, hash_blocks


def test_hash_is_chained_deterministic_and_full_blocks_only():
    tokens = list(range(10))
    hs = hash_blocks(tokens, 4)
    assert len(hs) == 2  # the trailing partial block has no hash
    assert hs[0] == hash_block(None, [0, 1, 2, 3])
    assert hs[1] == hash_block(hs[0], [4, 5, 6, 7])
    assert hash_block(None, [4, 5, 6, 7]) != hs[1]  # the parent matters
    assert hs[0] == hash_block(None, (0, 1, 2, 3))  # any sequence type
    assert 0 <= hs[0] < 2**64


def test_allocate_grows_table_and_free_returns_blocks():
    bm = BlockManager(8, 4)
    assert bm.allocate("a", 5) == [0, 1]
    assert bm.allocate("a", 8) == []
    assert bm.allocate("a", 9) == [2]
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.num_used_blocks == 3 and bm.usage == 3 / 8
    assert bm.free("a") == [0, 1, 2]
    assert bm.free("a") == []  # idempotent
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_allocation_that_does_not_fit_changes_nothing():
    bm = BlockManager(4, 4)
    bm.allocate("a", 12)
    before = (bm.num_free_blocks, list(bm.block_table("a")))
    assert bm.allocate("b", 8) is None
    assert bm.allocate("a", 20) is None
    assert (bm.num_free_blocks, bm.block_table("a")) == before
    assert bm.block_table("b") == []
    bm.check_invariants()


def test_watermark_applies_only_when_asked():
    bm = BlockManager(100, 1, watermark=0.05)
    assert bm.allocate("a", 96, use_watermark=True) is None
    assert bm.allocate("a", 95, use_watermark=True) is not None
    assert bm.allocate("b", 5) is not None  # running requests may use the reserve


def test_prefix_hit_reuses_full_computed_blocks_and_counts_tokens():
    bm = BlockManager(16, 4)
    prompt = list(range(100, 111))  # 11 tokens: 2 full blocks + 3
    bm.allocate("a", len(prompt))
    bm.cache_full_blocks("a", prompt, 6)  # only the first block is full and computed
    assert bm.find_cached_prefix(prompt).num_tokens == 4
    bm.cache_full_blocks("a", prompt, 11)
    hit = bm.find_cached_prefix(prompt + [7])
    assert hit.block_ids == tuple(bm.block_table("a")[:2]) and hit.num_tokens == 8
    added = bm.allocate("b", 12, hit)
    assert added[:2] == list(hit.block_ids)
    assert bm.blocks[hit.block_ids[0]].ref_count == 2
    assert bm.prefix_hit_tokens == 8
    bm.check_invariants()


def test_prefix_hit_leaves_last_token_to_compute():
    bm = BlockManager(8, 4)
    prompt = list(range(8))
    bm.allocate("a", 8)
    bm.cache_full_blocks("a", prompt, 8)
    assert bm.find_cached_prefix(prompt).num_tokens == 4  # not 8: the last token needs logits


def test_freed_hashed_blocks_stay_cached_until_evicted_in_lru_order():
    bm = BlockManager(4, 2)
    for rid, base in (("a", 0), ("b", 10)):
        toks = [base, base + 1, base + 2]
        bm.allocate(rid, 3)
        bm.cache_full_blocks(rid, toks, 3)
    bm.free("a")  # a's partial tail block (unhashed) goes to the front, its full block to the back
    bm.free("b")
    assert bm.find_cached_prefix([0, 1, 2]).num_tokens == 2
    assert bm.find_cached_prefix([10, 11, 12]).num_tokens == 2
    assert bm.allocate("c", 4) is not None  # takes the two unhashed blocks first
    assert bm.num_evictions == 0
    bm.allocate("c", 6)  # evicts the least recently freed hashed block: a's
    assert bm.num_evictions == 1
    assert bm.find_cached_prefix([0, 1, 2]) is NO_HIT
    assert bm.find_cached_prefix([10, 11, 12]).num_tokens == 2
    bm.check_invariants()


def test_hit_on_free_block_revives_it_and_needs_capacity():
    bm = BlockManager(3, 2)
    bm.allocate("a", 3)
    bm.cache_full_blocks("a", [1, 2, 3], 3)
    bm.free("a")
    hit = bm.find_cached_prefix([1, 2, 9])
    assert bm.num_blocks_to_allocate("b", 3, hit) == 2  # revived block + one new
    assert bm.allocate("b", 3, hit) is not None
    assert bm.num_free_blocks == 1
    bm.check_invariants()


def test_hit_checks_stored_tokens_not_just_hash():
    bm = BlockManager(4, 2)
    bm.allocate("a", 3)
    bm.cache_full_blocks("a", [1, 2, 3], 3)
    bm.blocks[bm.block_table("a")[0]].token_ids = (9, 9)  # simulate a hash collision
    assert bm.find_cached_prefix([1, 2, 3]) is NO_HIT


def test_duplicate_block_content_keeps_first_cache_entry():
    bm = BlockManager(8, 2)
    for rid in ("a", "b"):
        bm.allocate(rid, 3)
    for rid in ("a", "b"):
        bm.cache_full_blocks(rid, [1, 2, 3], 3)
    assert bm.num_cached_blocks == 1
    bm.free("a"); bm.free("b")
    bm.check_invariants()


def test_prefix_caching_off():
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    bm.allocate("a", 3)
    bm.cache_full_blocks("a", [1, 2, 3], 3)
    assert bm.find_cached_prefix([1, 2, 3]) is NO_HIT


def test_bad_sizes_rejected():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
