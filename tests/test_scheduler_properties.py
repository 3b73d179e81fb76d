"""Property tests (hypothesis): after any sequence of add / step / finish / abort / preempt /
remote-KV operations the block accounting is exact and the (simulated) KV contents are right.

The model is replaced by a simulated cache that stores, per slot, the token whose K/V would be
written there: every chunk must find its earlier tokens in its block table's slots, so prefix
hits, preemption and eviction are checked against what the real cache would hold.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.plan import StepResult
from engine.request import Request
from proto.sampling import SamplingParams
from engine.scheduler import CapacityError, Scheduler

BS, NUM_BLOCKS, EOS = 4, 10, 0

OPS = st.lists(st.tuples(st.sampled_from(["add", "add", "step", "step", "step", "abort", "release", "remote",
                                          "ready"]),
                         st.integers(0, 10**6)), max_size=80)


class Sim:
    def __init__(self, batching: str, seed: int) -> None:
        prefill_first = batching == "prefill-first"  # continuous, big steps while mostly waiting
        cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12,
                              batching="continuous" if prefill_first else batching.removeprefix("paged-"),
                              static_padding=batching == "static",
                              idle_max_num_batched_tokens=28 if prefill_first else None,
                              prefill_first_ratio=1.0 if prefill_first else None)
        self.s = Scheduler(cfg, BlockManager(NUM_BLOCKS, BS, watermark=0.1), max_model_len=64, eos_token_ids=(EOS,))
        self.slots: list[int | None] = [None] * (NUM_BLOCKS * BS)
        self.n = 0
        self.done: list[Request] = []

    def prompt(self, x: int) -> list[int]:
        # a few shared stems so prefix hits happen
        stem = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9], []][x % 3]
        return stem + [10 + (x >> 2) % 7 + i for i in range(1 + x % 9)]

    def new_request(self, x: int, *, hold: bool = False) -> Request:
        self.n += 1
        r = Request(f"r{self.n}", self.prompt(x), SamplingParams(temperature=0, max_tokens=1 + x % 16))
        r.hold_kv = hold
        return r

    def apply(self, op: str, x: int) -> None:
        s = self.s
        if op == "add":
            s.add(self.new_request(x, hold=x % 5 == 0 and s._static is None))
        elif op == "step":
            self.step(x)
        elif op == "abort" and s.requests:
            rid = sorted(s.requests)[x % len(s.requests)]
            self.done.append(s.requests[rid])
            s.abort(rid)
        elif op == "release" and s.held:
            s.release_kv(sorted(s.held)[x % len(s.held)])
        elif op == "remote" and s._static is None:
            try:
                r = self.new_request(x)
                s.add_remote(r)
                for p in range(r.num_cached_tokens):  # a cached prefix already holds its KV: not sent
                    assert self.slots[r.block_ids[p // BS] * BS + p % BS] == r.all_token_ids[p]
                for p in range(r.num_cached_tokens, r.num_prompt_tokens):  # the rest "lands"
                    self.write(r, p)
            except CapacityError:
                pass
        elif op == "ready" and s.remote:
            s.remote_kv_ready(sorted(s.remote)[x % len(s.remote)], 5 + x % 3)

    def write(self, r: Request, pos: int) -> None:
        self.slots[r.block_ids[pos // BS] * BS + pos % BS] = r.all_token_ids[pos]

    def step(self, x: int) -> None:
        plan = self.s.schedule()
        self.forget_free_blocks()  # preemption inside schedule() may have freed blocks
        for c in plan.chunks:
            assert len(c.block_ids) * BS >= c.start_pos + c.num_tokens
            if c.is_padding:  # static batching: computed, result discarded; it must overwrite nothing live
                for pos in range(c.start_pos, c.start_pos + c.num_tokens):
                    self.slots[c.block_ids[pos // BS] * BS + pos % BS] = -1
                continue
            r = self.s.requests[c.request_id]
            for p in range(c.start_pos):  # everything before the chunk is already in the cache
                assert self.slots[c.block_ids[p // BS] * BS + p % BS] == r.all_token_ids[p], (c, p)
            for i, t in enumerate(c.token_ids):
                assert r.all_token_ids[c.start_pos + i] == t
                self.slots[c.block_ids[(c.start_pos + i) // BS] * BS + (c.start_pos + i) % BS] = t
        sampled = {c.request_id: (x + i) % 23 for i, c in enumerate(plan.chunks) if c.num_logits}
        for r in self.s.update(plan, StepResult(sampled)):
            if r.is_finished:
                self.done.append(r)

    def forget_free_blocks(self) -> None:
        """A free block without a hash holds nothing anyone may rely on: blank it."""
        for b in self.s.bm.blocks:
            if b.ref_count == 0 and b.block_hash is None:
                self.slots[b.block_id * BS:(b.block_id + 1) * BS] = [None] * BS

    def check(self) -> None:
        bm, s = self.s.bm, self.s
        self.forget_free_blocks()
        bm.check_invariants()  # refcount == number of tables holding the block; free list exact
        static_members = {r.request_id for r in s._static.members} if s._static else set()
        for r in self.done:
            if r.request_id not in s.held and r.request_id not in static_members:
                assert bm.block_table(r.request_id) == [], f"{r.request_id} holds blocks after finishing"
        assert set(bm.holders()) <= set(s.requests)
        for x in range(12):  # a prefix hit's blocks store exactly the prompt's tokens
            p = self.prompt(x)
            hit = bm.find_cached_prefix(p)
            for i, b in enumerate(hit.block_ids):
                assert bm.blocks[b].token_ids == tuple(p[i * BS:(i + 1) * BS])
                assert all(self.slots[b * BS + j] == p[i * BS + j] for j in range(BS))

    def drain(self) -> None:
        for rid in list(self.s.remote):
            self.s.remote_kv_ready(rid, 5)
        for i in range(500):
            for rid in list(self.s.held):  # holds would otherwise block admission forever
                self.s.release_kv(rid)
            if not self.s.has_work():
                break
            self.step(i)
        assert not self.s.has_work()
        assert self.s.bm.num_free_blocks == NUM_BLOCKS and self.s.bm.num_used_blocks == 0
        assert not self.s.requests


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, batching=st.sampled_from(["continuous", "continuous", "prefill-first", "static", "paged-static"]))
def test_block_accounting_and_kv_contents_hold_under_random_operations(ops, batching):
    sim = Sim(batching, 0)
    for op, x in ops:
        sim.apply(op, x)
        sim.check()
    sim.drain()
    sim.check()


@pytest.mark.parametrize("prefill_first", [False, True])
@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=4, max_size=12))
def test_small_cache_forces_preemption_and_every_request_completes(prefill_first, lengths):
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16,
                          idle_max_num_batched_tokens=40 if prefill_first else None,
                          prefill_first_ratio=1.0 if prefill_first else None)
    s = Scheduler(cfg, BlockManager(12, BS, watermark=0.0), max_model_len=64)
    reqs = [Request(f"r{i}", list(range(100 + 50 * i, 100 + 50 * i + n)),
                    SamplingParams(temperature=0, max_tokens=16)) for i, n in enumerate(lengths)]
    for r in reqs:
        s.add(r)
    for i in range(2000):
        if not s.has_work():
            break
        plan = s.schedule()
        s.update(plan, StepResult({c.request_id: 7 for c in plan.chunks if c.num_logits}))
        s.bm.check_invariants()
    assert all(len(r.output_token_ids) == 16 for r in reqs)
    assert s.bm.num_used_blocks == 0
