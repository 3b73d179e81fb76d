"""Scheduler: plans under the token budget, decode first, chunked prefill, FCFS, preemption,
hold_kv, remote KV, static batching. No model: tokens are fed back by hand."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.plan import StepResult
from engine.request import IllegalTransition, Request, RequestState
from proto.sampling import InvalidRequest, SamplingParams
from engine.scheduler import CapacityError, Scheduler

EOS = 2


def make(num_blocks=64, block_size=4, **cfg) -> Scheduler:
    cfg.setdefault("max_num_batched_tokens", 16)
    cfg.setdefault("max_num_seqs", 4)
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size, watermark=0.0),
                     max_model_len=1024, eos_token_ids=(EOS,))


def req(rid, n, max_tokens=4, base=100, **kw) -> Request:
    return Request(rid, list(range(base, base + n)), SamplingParams(temperature=0, max_tokens=max_tokens, **kw))


def step(s: Scheduler, token=7):
    plan = s.schedule()
    sampled = {c.request_id: token for c in plan.chunks if c.num_logits}
    return plan, s.update(plan, StepResult(sampled))


def test_transitions_table_refuses_illegal_moves():
    r = req("a", 3)
    with pytest.raises(IllegalTransition):
        r.move_to(RequestState.PREEMPTED)
    r.move_to(RequestState.RUNNING)
    r.move_to(RequestState.FINISHED_LENGTH)
    with pytest.raises(IllegalTransition):
        r.move_to(RequestState.RUNNING)
    assert RequestState.FINISHED_STOPPED.is_finished and not RequestState.PREEMPTED.is_finished


def test_chunked_prefill_then_decode_first():
    s = make()
    s.add(req("a", 20))
    plan, _ = step(s)
    assert [(c.request_id, c.start_pos, c.num_tokens, c.num_logits) for c in plan.chunks] == [("a", 0, 16, 0)]
    s.add(req("b", 10, base=500))
    plan, out = step(s)
    # a's remaining 4 tokens, then b's first 12 (the budget)
    assert [(c.request_id, c.start_pos, c.num_tokens) for c in plan.chunks] == [("a", 16, 4), ("b", 0, 10)]
    assert [r.request_id for r in out] == ["a", "b"]
    plan, _ = step(s)
    assert [(c.request_id, c.num_tokens, c.num_logits) for c in plan.chunks] == [("a", 1, 1), ("b", 1, 1)]


def test_decode_tokens_are_scheduled_before_prefill_chunks():
    s = make(max_num_batched_tokens=8)
    s.add(req("a", 3))
    step(s)  # a prefilled, now decoding
    s.add(req("b", 30, base=300))
    step(s)  # b partially prefilled (7 tokens), a decoded
    plan, _ = step(s)
    assert plan.chunks[0].request_id == "a" and plan.chunks[0].num_tokens == 1
    assert plan.chunks[1].request_id == "b" and plan.chunks[1].num_tokens == 7


def test_a_step_without_decode_rows_takes_the_idle_budget():
    s = make(idle_max_num_batched_tokens=40)
    for rid in "abc":
        s.add(req(rid, 12))
    plan, _ = step(s)  # a burst at an idle engine: nothing decodes, all three prompts in one step
    assert [(c.request_id, c.num_tokens, c.num_logits) for c in plan.chunks] == [("a", 12, 1), ("b", 12, 1),
                                                                                 ("c", 12, 1)]
    s.add(req("d", 20, base=500))
    plan, _ = step(s)  # three decode rows to protect: the normal budget of 16
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("a", 1), ("b", 1), ("c", 1), ("d", 13)]
    with pytest.raises(ValueError, match="idle_max_num_batched_tokens"):
        SchedulerConfig(idle_max_num_batched_tokens=0)


def test_a_burst_while_few_rows_decode_takes_the_prefill_first_budget():
    s = make(idle_max_num_batched_tokens=40, prefill_first_ratio=1.0, max_num_seqs=8)
    s.add(req("a", 4))
    step(s)  # a alone at an idle engine, now decoding
    for rid in "bcd":
        s.add(req(rid, 12, base=200 + ord(rid)))
    plan, _ = step(s)  # 3 waiting >= 1 x 1 decode row: a burst, one big step (40 - a's token)
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("a", 1), ("b", 12), ("c", 12), ("d", 12)]
    s.add(req("e", 30, base=600))
    s.add(req("f", 30, base=700))
    plan, _ = step(s)  # 2 waiting < 4 decode rows: the normal budget of 16 protects them
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("a", 1), ("b", 1), ("c", 1), ("d", 1),
                                                                    ("e", 12)]
    plan, _ = step(s)  # e still in prefill + f waiting = 2 < 4: still the normal budget
    assert [(c.request_id, c.num_tokens) for c in plan.chunks][4:] == [("e", 12)]


def test_prefill_first_ratio_scales_the_threshold_and_zero_turns_it_off():
    def second_step(ratio):
        s = make(idle_max_num_batched_tokens=40, prefill_first_ratio=ratio, max_num_seqs=8)
        for rid in "ab":
            s.add(req(rid, 4, base=100 + 10 * ord(rid)))
        step(s)  # a and b decoding
        for rid in "cdef":
            s.add(req(rid, 10, base=300 + 20 * ord(rid)))
        plan, _ = step(s)
        return sum(c.num_tokens for c in plan.chunks if c.num_tokens > 1)
    assert second_step(2.0) == 40 - 2   # 4 waiting >= 2 x 2 decode rows: prefill-first
    assert second_step(3.0) == 16 - 2   # 4 < 3 x 2: the normal budget
    assert second_step(0.0) == 16 - 2   # off: only a step with no decode row is prefill-first
    with pytest.raises(ValueError, match="prefill_first_ratio"):
        SchedulerConfig(prefill_first_ratio=-1.0)


def test_max_num_seqs_and_fcfs():
    s = make(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(3):
        s.add(req(f"r{i}", 4, base=100 * i + 100))
    plan, _ = step(s)
    assert [c.request_id for c in plan.chunks] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_finish_by_length_eos_and_stop_token_ids_frees_blocks():
    s = make()
    s.add(req("len", 3, max_tokens=2))
    s.add(req("eos", 3, base=200))
    s.add(req("stop", 3, base=300, stop_token_ids=(9,)))
    plan = s.schedule()
    s.update(plan, StepResult({"len": 5, "eos": EOS, "stop": 9}))
    assert s.requests.keys() == {"len"}
    plan, out = step(s)
    assert out[0].state == RequestState.FINISHED_LENGTH and out[0].output_token_ids == [5, 7]
    assert s.bm.num_used_blocks == 0 and not s.has_work()


def test_ignore_eos_keeps_going():
    s = make()
    s.add(req("a", 3, max_tokens=3, ignore_eos=True))
    for _ in range(3):
        step(s, token=EOS)
    assert not s.has_work() and s.bm.num_used_blocks == 0


def test_preemption_by_recompute_of_newest():
    s = make(num_blocks=4, block_size=4, max_num_batched_tokens=32)
    s.add(req("old", 7, max_tokens=6))
    s.add(req("new", 7, max_tokens=6, base=300))
    step(s)  # both prefilled: 2 blocks each, all 4 blocks used
    step(s)  # 8 tokens each now computed -> next decode needs a 3rd block
    plan, _ = step(s)
    assert plan.preempted == ("new",)
    assert [c.request_id for c in plan.chunks] == ["old"]
    new = s.requests["new"]
    assert new.state == RequestState.PREEMPTED and new.num_computed_tokens == 0 and s.waiting[0] is new
    assert s.num_preemptions == 1
    assert len(new.output_token_ids) == 2  # generated tokens are kept and recomputed
    while s.has_work():
        step(s)
    assert s.bm.num_used_blocks == 0


def test_abort_at_every_state_frees_blocks():
    s = make(max_num_batched_tokens=4)
    s.add(req("w", 3))
    assert s.abort("w").state == RequestState.FINISHED_ABORTED
    s.add(req("run", 10))
    step(s)  # partial prefill
    assert s.bm.num_used_blocks > 0
    s.abort("run")
    assert s.bm.num_used_blocks == 0 and not s.has_work()
    assert s.abort("run") is None and s.abort("nobody") is None


def test_hold_kv_keeps_blocks_until_release():
    s = make()
    r = req("p", 9, max_tokens=1)
    r.hold_kv = True
    s.add(r)
    _, out = step(s)
    assert out[0].state == RequestState.FINISHED_LENGTH
    assert s.bm.block_table("p") == [0, 1, 2] and s.bm.num_used_blocks == 3
    s.release_kv("p")
    assert s.bm.num_used_blocks == 0 and "p" not in s.requests
    assert s.bm.num_cached_blocks == 2  # the full blocks stay in the prefix cache


def test_remote_reservation_then_decode():
    s = make(num_blocks=4, block_size=4)
    blocks = s.add_remote(req("d", 9, max_tokens=3))
    assert blocks == [0, 1, 2] and s.requests["d"].state == RequestState.WAITING_FOR_REMOTE_KV
    with pytest.raises(CapacityError):
        s.add_remote(req("x", 9, base=400))
    assert s.bm.num_used_blocks == 3  # the refused reservation left nothing behind
    assert s.schedule().is_empty
    r = s.remote_kv_ready("d", 42)
    assert r.output_token_ids == [42] and r.num_computed_tokens == 9
    plan, _ = step(s)
    assert [(c.start_pos, c.token_ids) for c in plan.chunks] == [(9, (42,))]
    step(s)
    assert not s.has_work() and s.bm.num_used_blocks == 0


def test_remote_reservation_reuses_the_cached_prefix():
    """A decode worker that caches part of the prompt reserves those blocks shared (they are not
    written again) and new blocks only for the rest; the last token's block is always new."""
    s = make(num_blocks=8, block_size=4)
    s.add_remote(req("a", 9))
    s.remote_kv_ready("a", 42)  # its 2 full blocks enter the prefix cache
    shared = s.bm.block_table("a")[:2]
    blocks = s.add_remote(req("b", 10))  # the same first 9 tokens, one more
    b = s.requests["b"]
    assert blocks[:2] == shared and b.num_cached_tokens == 8 and len(blocks) == 3
    assert s.bm.blocks[shared[0]].ref_count == 2
    s.abort("a")
    s.abort("b")
    assert s.bm.num_used_blocks == 0 and s.bm.num_cached_blocks == 2


def test_remote_abort_while_waiting_for_kv():
    s = make()
    s.add_remote(req("d", 9))
    s.abort("d")
    assert s.bm.num_used_blocks == 0 and not s.remote


def test_validation_errors():
    s = make(num_blocks=2, block_size=4)
    with pytest.raises(InvalidRequest, match="max_tokens"):
        s.add(req("a", 5, max_tokens=10))
    s2 = make()
    s2.add(req("a", 3))
    with pytest.raises(KeyError):
        s2.add(req("a", 3))
    with pytest.raises(CapacityError):
        s3 = make(max_waiting=1)
        s3.add(req("a", 3)); s3.add(req("b", 3))


def test_prefix_hit_at_admission_sets_cached_tokens():
    s = make(max_num_batched_tokens=64)
    s.add(req("a", 12))
    step(s)
    s.add(req("b", 14))  # same first 12 tokens
    plan, _ = step(s)
    b = s.requests["b"]
    assert b.num_cached_tokens == 12
    assert [c.start_pos for c in plan.chunks if c.request_id == "b"] == [12]


def test_static_batching_pads_finished_until_batch_ends():
    s = make(max_num_seqs=2, max_num_batched_tokens=64, batching="static")
    s.add(req("short", 3, max_tokens=1))
    s.add(req("long", 3, max_tokens=4, base=300))
    s.add(req("next", 3, max_tokens=1, base=500))
    plan, _ = step(s)
    assert {c.request_id for c in plan.chunks} == {"short", "long"}
    assert s.requests["short"].is_finished  # done, but its slot is kept
    plan, _ = step(s)
    pads = [c for c in plan.chunks if c.is_padding]
    assert [c.request_id for c in pads] == ["short"] and pads[0].num_logits == 0
    assert "next" in [r.request_id for r in s.waiting]  # not admitted until the batch ends
    step(s); step(s)
    assert "short" not in s.requests and s.bm.num_used_blocks == 0
    plan, _ = step(s)
    assert [c.request_id for c in plan.chunks] == ["next"]


@pytest.mark.parametrize("padded", [True, False])
def test_static_batching_pads_prompts_to_the_longest_like_a_contiguous_cache(padded):
    s = make(max_num_seqs=2, max_num_batched_tokens=64, batching="static", static_padding=padded)
    s.add(req("short", 3, max_tokens=2))
    s.add(req("long", 7, max_tokens=4, base=300))
    plan, _ = step(s)
    assert [(c.request_id, c.num_tokens, c.is_padding) for c in plan.chunks] == [("short", 3, False),
                                                                             ("long", 7, False)]
    assert plan.pad_to_longest is padded
    # each row reserves the longest prompt + the largest max_tokens (11 tokens: 3 blocks of 4)
    assert [len(s.bm.block_table(r)) for r in ("short", "long")] == ([3, 3] if padded else [2, 3])
    plan, _ = step(s)
    if padded:  # the short row's 4 padding tokens, after its prompt; nothing decodes yet
        assert [(c.request_id, c.start_pos, c.num_tokens, c.num_logits, c.is_padding) for c in plan.chunks] == [
            ("short", 3, 4, 0, True)]
        assert s.requests["short"].num_computed_tokens == 3  # padding is not the request's
        plan, _ = step(s)
    assert [(c.request_id, c.start_pos, c.num_tokens) for c in plan.chunks] == [("short", 3, 1), ("long", 7, 1)]
    while s.has_work():
        step(s)
    assert s.bm.num_used_blocks == 0


@pytest.mark.parametrize("padded", [True, False])
def test_static_padding_never_runs_past_max_model_len(padded):
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, batching="static", static_padding=padded),
                  BlockManager(16, 4, watermark=0.0), max_model_len=10, eos_token_ids=(EOS,))
    s.add(req("a", 8, max_tokens=1))  # finishes at prefill, then pads while "b" decodes
    s.add(req("b", 2, max_tokens=7, base=300))
    ends = []
    while s.has_work():
        plan, _ = step(s)
        ends += [c.start_pos + c.num_tokens for c in plan.chunks]
    assert max(ends) == 10 and s.bm.num_used_blocks == 0


def test_static_batching_is_a_policy_the_scheduler_takes_and_it_never_edits_the_queues():
    import ast
    import inspect

    from engine import static_batching
    from engine.static_batching import StaticBatching

    policy = StaticBatching()
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), BlockManager(64, 4, watermark=0.0),
                  max_model_len=1024, eos_token_ids=(EOS,), policy=policy)
    s.add(req("a", 3, max_tokens=1))
    s.add(req("b", 3, max_tokens=2, base=300))
    s.add(req("c", 3, max_tokens=1, base=500))
    plan, _ = step(s)
    assert policy.members and {c.request_id for c in plan.chunks} == {"a", "b"}  # the policy planned it
    while s.has_work():
        step(s)
    assert s.bm.num_used_blocks == 0 and not s.requests
    # the policy reaches the queues only through the scheduler's methods, never by mutating them
    tree = ast.parse(inspect.getsource(static_batching))
    touched = {node.value.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
               and isinstance(node.value, ast.Attribute) and node.value.attr in ("waiting", "running", "remote")}
    assert not touched, f"static batching edits the scheduler's {touched}"
