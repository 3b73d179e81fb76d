"""KV-aware routing without a cluster: block-manager events, the router's prefix index and
resync rules, the pure cost function, and the one shared block hash (property-tested)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from proto.block_hash import hash_blocks
from proto.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KvEventRecord, KvSnapshot, decode_record,
                             encode_record)
from router.kv_router import Candidate, choose_headroom, choose_kv, choose_round_robin, kv_cost, sample
from router.prefix_index import PrefixIndex, prompt_block_hashes

BS = 4


def _manager_with_events(num_blocks: int = 8) -> tuple[BlockManager, list]:
    bm = BlockManager(num_blocks, BS)
    events: list = []
    bm.on_event = events.append
    return bm, events


def _compute(bm: BlockManager, rid: str, tokens: list[int]) -> None:
    prefix = bm.find_cached_prefix(tokens)
    assert bm.allocate(rid, len(tokens), prefix) is not None
    bm.cache_full_blocks(rid, tokens, len(tokens))


# -- the shared hash ---------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 49151), min_size=1, max_size=40), st.sampled_from([1, 2, 4, 16]))
def test_router_hash_equals_the_engine_hash_for_the_same_tokens(tokens, bs):
    bm = BlockManager(64, bs)
    stored: list[int] = []
    bm.on_event = lambda ev: stored.extend(ev.block_hashes) if isinstance(ev, BlockStored) else None
    assert bm.allocate("r", len(tokens)) is not None
    bm.cache_full_blocks("r", tokens, len(tokens))
    # what the engine made findable is exactly the router's hashes of every full block
    assert stored == hash_blocks(tokens, bs) == sorted(bm.cached_hashes(), key=stored.index)
    # and what the router looks up for a new prompt with these tokens is what the engine would hit
    hit = bm.find_cached_prefix(tokens)
    index = PrefixIndex()
    index.load_snapshot(KvSnapshot("w", "e", 0, bm.cached_hashes()))
    assert index.overlap_blocks("w", prompt_block_hashes(tokens, bs)) * bs == hit.num_tokens


# -- block-manager events ----------------------------------------------------------------------
def test_computed_full_blocks_are_stored_once_with_their_parent():
    bm, events = _manager_with_events()
    tokens = list(range(10))  # two full blocks and a partial one
    _compute(bm, "a", tokens)
    h = hash_blocks(tokens, BS)
    assert events == [BlockStored((h[0], h[1]), None, 8)]
    bm.cache_full_blocks("a", tokens, len(tokens))  # again: nothing new
    assert len(events) == 1
    bm.free("a")
    _compute(bm, "b", tokens[:8] + [99, 98, 97, 96, 95])  # hits two, stores the third with its parent
    h2 = hash_blocks(tokens[:8] + [99, 98, 97, 96], BS)
    assert events[1:] == [BlockStored((h2[2],), h2[1], 4)]


def test_eviction_removes_and_reset_clears():
    bm, events = _manager_with_events(num_blocks=3)
    _compute(bm, "a", list(range(8)))
    bm.free("a")
    _compute(bm, "b", list(range(100, 112)))  # needs all 3 blocks: evicts both cached ones
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(hash_blocks(list(range(8)), BS))
    bm.free("b")
    bm.reset_prefix_cache()
    assert events[-1] == AllBlocksCleared() and bm.num_cached_blocks == 0
    bm.check_invariants()


def test_replaying_the_events_rebuilds_the_cache_contents():
    """Random workload: the index fed only by events equals the manager's findable set."""
    rng = random.Random(7)
    bm = BlockManager(12, BS)
    index = PrefixIndex()
    seq = iter(range(1, 10**6))
    bm.on_event = lambda ev: index.apply(KvEventRecord("w", "e1", next(seq), ev))
    live: list[str] = []
    for i in range(200):
        if live and (rng.random() < 0.5 or len(live) > 3):
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            prefix = rng.choice([[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 12], []])
            tokens = prefix + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            hit = bm.find_cached_prefix(tokens)
            if bm.allocate(f"r{i}", len(tokens), hit) is not None:
                bm.cache_full_blocks(f"r{i}", tokens, len(tokens))
                live.append(f"r{i}")
        if rng.random() < 0.02:
            bm.reset_prefix_cache()
        assert index.hashes("w") == bm.cached_hashes()
    bm.check_invariants()


# -- the index's sequence rules ----------------------------------------------------------------
def _rec(seq: int, ev, epoch: str = "e1") -> KvEventRecord:
    return KvEventRecord("w", epoch, seq, ev)


def test_gap_and_restart_ask_for_a_resync_and_a_snapshot_repairs():
    idx = PrefixIndex()
    assert idx.apply(_rec(1, BlockStored((1, 2), None, 8)))
    assert idx.apply(_rec(2, BlockStored((3,), 2, 4)))
    assert not idx.apply(_rec(4, BlockRemoved((1,))))  # seq 3 lost
    assert idx.hashes("w") == {1, 2, 3} and idx.resyncs == 1
    idx.load_snapshot(KvSnapshot("w", "e1", 4, frozenset({2, 3})))
    assert idx.apply(_rec(4, BlockRemoved((1,))))  # covered by the snapshot: skipped
    assert idx.apply(_rec(5, AllBlocksCleared())) and idx.hashes("w") == set()
    # a restarted worker starts a new epoch at seq 1: its old entries go
    idx.apply(_rec(6, BlockStored((9,), None, 4)))
    assert idx.apply(_rec(1, BlockStored((7,), None, 4), epoch="e2")) and idx.hashes("w") == {7}
    # a new epoch that does not start at 1 (events lost across the restart): resync
    assert not idx.apply(_rec(3, BlockStored((8,), None, 4), epoch="e3"))
    assert idx.position("w") == ("e2", 1)


def test_overlap_counts_leading_blocks_only():
    idx = PrefixIndex()
    h = hash_blocks(list(range(16)), BS)
    idx.load_snapshot(KvSnapshot("w", "e", 0, frozenset({h[0], h[1], h[3]})))
    assert idx.overlap_blocks("w", h) == 2
    assert idx.overlap_blocks("other", h) == 0
    assert prompt_block_hashes(list(range(16)), BS) == h[:3]  # the last token's block is always computed


def test_event_records_round_trip_and_refuse_other_versions():
    for ev in (BlockStored((2**64 - 1, 5), None, 8), BlockStored((1,), 2**63, 4), BlockRemoved((3,)),
               AllBlocksCleared()):
        r = KvEventRecord("agg-0", "abc", 12, ev)
        assert decode_record(encode_record(r)) == r
    with pytest.raises(ValueError, match="version"):
        decode_record(encode_record(KvEventRecord("w", "e", 1, AllBlocksCleared())).replace('"v":1', '"v":9'))
    with pytest.raises(ValueError, match="malformed"):
        decode_record('{"v":1}')


# -- the cost -----------------------------------------------------------------------------------
def test_cost_is_weighted_uncached_plus_decode_plus_queue():
    c = Candidate("a", prompt_blocks=10, overlap_blocks=6, booked_prefill_blocks=3, decode_blocks=20, queue=2)
    assert kv_cost(c, overlap_weight=2.0) == 2.0 * (4 + 3) + 20 + 2


def test_cached_worker_wins_until_its_load_outweighs_the_hit():
    rng = random.Random(0)
    hot = Candidate("hot", prompt_blocks=32, overlap_blocks=31)
    cold = Candidate("cold", prompt_blocks=32)
    assert choose_kv([hot, cold], 0.0, rng) == "hot"
    loaded = Candidate("hot", prompt_blocks=32, overlap_blocks=31, decode_blocks=40)
    assert choose_kv([loaded, cold], 0.0, rng) == "cold"


def test_burst_spreads_when_bookings_are_counted():
    """16 requests sharing a 12-block prefix cached on one worker, all in flight together: booking
    each one's decode blocks (its whole context) and its place in the queue makes the cached worker
    dearer with every dispatch, so the burst does not collapse onto it."""
    rng = random.Random(1)
    booked = {"hot": 0, "cold": 0}
    queue = {"hot": 0, "cold": 0}
    prefill = {"hot": 0, "cold": 0}
    chosen = []
    for _ in range(16):
        cands = [Candidate(w, prompt_blocks=13, overlap_blocks=12 if w == "hot" else 0, decode_blocks=booked[w],
                           queue=queue[w], booked_prefill_blocks=prefill[w]) for w in booked]
        w = choose_kv(cands, 0.0, rng, overlap_weight=2.0)
        chosen.append(w)
        booked[w] += 13 + 1  # prompt + one output block
        queue[w] += 1
        prefill[w] += 1 if w == "hot" else 13
    assert chosen[0] == "hot" and 4 <= chosen.count("cold") <= 8, chosen


def test_ties_are_broken_at_random_but_seeded():
    ids = [sample({"a": 1.0, "b": 1.0, "c": 2.0}, 0.0, random.Random(s)) for s in range(40)]
    assert set(ids) == {"a", "b"}
    assert ids == [sample({"c": 2.0, "b": 1.0, "a": 1.0}, 0.0, random.Random(s)) for s in range(40)]


def test_temperature_spreads_choices_by_cost():
    rng = random.Random(3)
    picks = [sample({"a": 0.0, "b": 10.0}, 1.0, rng) for _ in range(2000)]
    share_b = picks.count("b") / len(picks)
    assert 0.2 < share_b < 0.32  # 1 / (1 + e) = 0.269
    assert {sample({"a": 0.0, "b": 10.0}, 0.0, rng) for _ in range(50)} == {"a"}


def test_decode_choice_by_headroom_and_dead_workers_never_chosen():
    rng = random.Random(0)
    cands = [Candidate("a", free_blocks=10), Candidate("b", free_blocks=50), Candidate("c", free_blocks=99, alive=False)]
    assert choose_headroom(cands, 0.0, rng) == "b"
    assert choose_headroom(cands, 0.0, rng, exclude=frozenset({"b"})) == "a"
    assert choose_kv([Candidate("c", alive=False)], 0.0, rng) is None


def test_round_robin_cycles_over_live_ids():
    assert [choose_round_robin(["b", "a"], i) for i in range(4)] == ["a", "b", "a", "b"]
    assert choose_round_robin(["a", "b"], 0, exclude=frozenset({"a"})) == "b"
    assert choose_round_robin([], 0) is None
