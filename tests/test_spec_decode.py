"""Speculative decoding without a model: the n-gram proposer, the adaptive-k choice, the
rejection sampler's output distribution (chi-square over 10^5 seeded samples per position),
and the scheduler's lookahead slots, rollback, stops inside an accepted run and abort."""

from __future__ import annotations

import pytest
import torch

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.plan import StepResult
from engine.request import Request, RequestState
from engine.sampler import Sampler
from proto.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.spec_decode.adaptive import AcceptanceRate, Candidate, StepTimeModel, choose_k
from engine.spec_decode.config import SpeculativeConfig, compat_descriptor
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.rejection import rejection_sample, verify_one_hot
from engine.spec_decode.speculator import Speculator, can_speculate

EOS = 2
VOCAB = 10
NUM_SAMPLES = 100_000
CHI2_CRIT_P001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88}
CHI2_CRIT_9DOF_P001 = CHI2_CRIT_P001[VOCAB - 1]  # chi-square 0.1% upper tail, by degrees of freedom


# ---- n-gram proposer ---------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_longest_match():
    p = NgramProposer(1, 3)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 6, 7]
    # suffix (6, 7): the 2-gram's latest earlier occurrence ends at 7 -> propose tokens[8:]
    assert p.propose("a", tokens, 3) == (3, 4, 6)
    # the longer match (1, 6, 7) at 0..2 wins over the later (6, 7) at 6..7
    assert p.propose("b", [1, 6, 7, 0, 0, 9, 6, 7, 2, 1, 6, 7], 2) == (0, 0)
    assert p.propose("c", [1, 2, 3, 4], 3) == ()  # no earlier occurrence
    assert p.propose("a", tokens, 0) == ()


def test_ngram_index_is_incremental_and_forgets():
    p = NgramProposer(2, 2)
    tokens = [1, 2, 3, 1]
    assert p.propose("a", tokens, 4) == ()
    tokens.append(2)  # suffix (1, 2) now repeats
    assert p.propose("a", tokens, 4) == (3, 1, 2)
    p.forget({"b"})
    assert p.num_tracked == 0


# ---- adaptive k --------------------------------------------------------------------------------
def test_step_time_model_fits_a_line():
    m = StepTimeModel()
    for b in (1, 8, 32, 64):
        for _ in range(3):
            m.observe(b, 0.010 + 0.002 * b)
    assert m.a == pytest.approx(0.010, rel=1e-6) and m.b == pytest.approx(0.002, rel=1e-6)


def test_choose_k_speculates_at_low_load_and_not_at_high_load():
    flat = StepTimeModel(prior_a=0.020, prior_b=0.0002)  # drafts nearly free (memory-bound)
    steep = StepTimeModel(prior_a=0.005, prior_b=0.002)  # each token costs 2 ms (compute-bound)
    one = [Candidate("a", 4, 0.8)]
    assert choose_k(one, 1, 1, flat) == {"a": 4}
    many = [Candidate(f"r{i}", 4, 0.5) for i in range(32)]
    assert set(choose_k(many, 32, 32, steep).values()) == {0}
    # a request that accepts more gets its drafts first
    mixed = [Candidate("good", 4, 0.9), Candidate("bad", 4, 0.1)]
    ks = choose_k(mixed, 2, 2, StepTimeModel(prior_a=0.02, prior_b=0.002))
    assert ks["good"] > ks["bad"] == 0


def test_choose_k_hysteresis_keeps_the_previous_choice_near_the_break_even():
    # 20 decode rows, alpha 0.5: one draft gains 0.5 / 20 = 2.5%; t(21) / t(20) - 1 = 2.5% too
    m = StepTimeModel(prior_a=0.020, prior_b=0.001)
    cands = lambda prev, a=0.5: [Candidate("x", 1, a, prev)] + [Candidate(f"o{i}", 0, a) for i in range(19)]  # noqa: E731
    assert m.predict(21) / m.predict(20) - 1 == pytest.approx(0.5 / 20)
    assert choose_k(cands(1), 20, 20, m)["x"] == 1  # kept
    assert choose_k(cands(0), 20, 20, m)["x"] == 0  # not started
    # the margin is on the draft's own gain, not on the batch's throughput: a draft that had been
    # running is dropped once it gains clearly less than it costs (here 0.35 of a 0.5-token cost)
    assert choose_k(cands(1, 0.35), 20, 20, m)["x"] == 0


def test_deeper_drafts_have_a_narrow_margin():
    """Near the int8 self-draft at c1 (measured: acceptance 0.95, a draft forward 0.59 of a target
    step, k = 1 on 98% of rows): at acceptance 0.94 the second draft gains 1.19x its cost; the
    first draft's wide start margin (1.2x) refused it for good, the deeper drafts' narrow one
    (1.05x) takes it."""
    m = StepTimeModel(prior_a=0.0117, prior_b=0.0004)
    draft_s = 0.59 * m.predict(1)
    row = [Candidate("a", 3, 0.94, previous_k=1)]
    assert choose_k(row, 1, 1, m, draft_forward_s=draft_s, deep_hysteresis=0.2) == {"a": 1}
    assert choose_k(row, 1, 1, m, draft_forward_s=draft_s)["a"] >= 2
    # the first draft keeps its wide margin: a row not drafting yet needs 1.2x
    assert choose_k([Candidate("b", 3, 0.5, previous_k=0)], 1, 1, m, draft_forward_s=draft_s) == {"b": 0}


def test_a_speculating_batch_drops_its_drafts_when_load_rises():
    """32 rows that all verified 4 drafts last step (alpha 0.5) at a cost where even the first
    draft loses: every k falls to 0 (the old whole-batch margin kept all 128 drafts)."""
    m = StepTimeModel(prior_a=0.014, prior_b=0.0012)  # bf16, one thread, measured 2026-12-01
    many = [Candidate(f"r{i}", 4, 0.5, previous_k=4) for i in range(32)]
    assert set(choose_k(many, 32, 32, m).values()) == {0}
    assert choose_k([Candidate("a", 4, 0.8, 4)], 1, 1, m) == {"a": 4}  # alone, drafts pay


def test_a_draft_model_pays_for_its_forwards():
    """A draft forward costing 0.75 of a target step (the int8 self-draft at batch 1): even a
    0.85-acceptance row does not draft; at 0.2 it does, several tokens deep; at 32 rows no row
    pays the first draft forward alone."""
    from engine.spec_decode.adaptive import DraftCost

    m = StepTimeModel(prior_a=0.014, prior_b=0.0012)
    one = [Candidate("a", 4, 0.85)]
    assert choose_k(one, 1, 1, m, draft_forward_s=0.75 * m.predict(1)) == {"a": 0}
    assert choose_k(one, 1, 1, m, draft_forward_s=0.2 * m.predict(1))["a"] >= 2
    assert choose_k(one, 1, 1, m) == {"a": 4}  # n-gram: proposals are free
    many = [Candidate(f"r{i}", 4, 0.85) for i in range(32)]
    assert set(choose_k(many, 32, 32, m, draft_forward_s=0.2 * m.predict(32)).values()) == {0}
    cost = DraftCost(prior_ratio=0.5)
    cost.observe(0.75 * m.predict(8), 8, m)
    assert cost.ratio == pytest.approx(0.75) and cost.predict(8, m) == pytest.approx(0.75 * m.predict(8))


def test_acceptance_rate_counts_the_first_rejection_only():
    r = AcceptanceRate(prior=0.5, prior_weight=2.0, decay=1.0)
    r.observe(4, 4)
    assert r.value == pytest.approx(5 / 6)
    r.observe(4, 0)
    assert r.value == pytest.approx(5 / 7)


def test_config_validation_and_compat_descriptor():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="ngram"):
        SpeculativeConfig(ngram_min=3, ngram_max=2)
    with pytest.raises(ValueError, match="speculative model"):
        SpeculativeConfig(method="draft")
    assert compat_descriptor(None) == "none"
    assert compat_descriptor(SpeculativeConfig(num_speculative_tokens=3)) != compat_descriptor(SpeculativeConfig())


def test_requests_with_logprobs_are_not_speculated():
    assert can_speculate(SamplingParams(frequency_penalty=1.0, min_tokens=2, max_tokens=4))
    assert not can_speculate(SamplingParams(logprobs=0))


def test_verification_applies_penalties_and_min_tokens_per_position():
    """Each position sees the drafts before it as output: a frequency penalty on the accepted
    draft changes the next position's argmax; min_tokens = 2 with one output token masks EOS at
    the first position only."""
    logits = torch.zeros(3, VOCAB)
    logits[:, 4] = 1.0  # 4 is the argmax everywhere without penalties
    logits[:, 5] = 0.5
    greedy_pen = SamplingParams(temperature=0, frequency_penalty=2.0)
    (out,) = verify_one_hot(Sampler(), logits, [0], [(4, 4)], [greedy_pen], [None], [([1], [])])
    assert out == (4, 5)  # position 1 penalises the accepted 4
    logits[:, EOS] = 3.0
    min_tok = SamplingParams(temperature=0, min_tokens=2, max_tokens=8)
    sampler = Sampler(eos_token_ids=(EOS,))
    assert verify_one_hot(sampler, logits, [0], [(EOS,)], [min_tok], [None], [([1], [7])]) == [(4,)]
    assert verify_one_hot(sampler, logits, [0], [(4, EOS)], [min_tok], [None], [([1], [7])]) == [(4, EOS, EOS)]


# ---- rejection sampling: the output distribution is the target's ------------------------------
def _chi2(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _fixed_p_q(k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(k + 1, VOCAB, generator=g) ** 2 + 0.02
    q = torch.rand(k, VOCAB, generator=g) ** 2 + 0.02
    return p / p.sum(1, keepdim=True), q / q.sum(1, keepdim=True)


def _run_rejection(p: torch.Tensor, q: torch.Tensor, seed: int, sampler=rejection_sample):
    k = q.shape[0]
    g = torch.Generator().manual_seed(seed)
    drafts = torch.stack([torch.multinomial(q[j], NUM_SAMPLES, replacement=True, generator=g) for j in range(k)], 1)
    return sampler(p.expand(NUM_SAMPLES, -1, -1), q.expand(NUM_SAMPLES, -1, -1), drafts, g)


def _position_counts(num_accepted: torch.Tensor, tokens: torch.Tensor, j: int) -> torch.Tensor:
    """Tokens emitted at output position j by the samples that reached it."""
    reached = num_accepted >= j
    return torch.bincount(tokens[reached, j], minlength=VOCAB).float()


def _wrong_sampler(target, draft, ids, generator):
    """Accepts like the right rule but resamples from p (not the residual) after a rejection."""
    num_rows, k = ids.shape
    ratio = target[:, :k].gather(2, ids.unsqueeze(2)).squeeze(2) / draft.gather(2, ids.unsqueeze(2)).squeeze(2)
    accept = torch.rand(num_rows, k, generator=generator) < ratio
    num_accepted = accept.long().cumprod(1).sum(1)
    rows = torch.arange(num_rows)
    final = torch.multinomial(target[rows, num_accepted], 1, generator=generator).squeeze(1)
    tokens = torch.where(torch.arange(k + 1) < num_accepted.unsqueeze(1), torch.cat([ids, ids[:, :1]], 1), -1)
    tokens[rows, num_accepted] = final
    return num_accepted, tokens


@pytest.mark.parametrize("k", [2, 3])
def test_rejection_sampler_preserves_the_target_distribution(k):
    p, q = _fixed_p_q(k)
    num_accepted, tokens = _run_rejection(p, q, seed=1)
    for j in range(k + 1):
        counts = _position_counts(num_accepted, tokens, j)
        assert counts.sum() > 5000
        assert _chi2(counts, p[j]) < CHI2_CRIT_9DOF_P001, f"position {j}"
    wrong_acc, wrong_tokens = _run_rejection(p, q, seed=1, sampler=_wrong_sampler)
    assert _chi2(_position_counts(wrong_acc, wrong_tokens, 0), p[0]) > 10 * CHI2_CRIT_9DOF_P001
    # seeded runs are reproducible
    again = _run_rejection(p, q, seed=1)
    assert torch.equal(again[1], tokens)


def test_rejection_sampler_is_exact_with_a_draft_over_part_of_the_vocabulary():
    """A reduced-vocabulary draft (engine/spec_decode/draft_vocab.py): q is zero outside token
    ids < 4, where p still has mass; the residual max(0, p - q) supplies those tokens and every
    position still follows p (a sampler that resamples from p after a rejection does not)."""
    k = 2
    p, q = _fixed_p_q(k)
    q[:, 4:] = 0
    q = q / q.sum(-1, keepdim=True)
    num_accepted, tokens = _run_rejection(p, q, seed=4)
    for j in range(k + 1):
        counts = _position_counts(num_accepted, tokens, j)
        assert counts.sum() > 5000 and counts[4:].sum() > 0
        assert _chi2(counts, p[j]) < CHI2_CRIT_9DOF_P001, f"position {j}"
    assert (tokens[num_accepted > 0, 0] < 4).all()  # accepted drafts come from q's support
    wrong_acc, wrong_tokens = _run_rejection(p, q, seed=4, sampler=_wrong_sampler)
    assert _chi2(_position_counts(wrong_acc, wrong_tokens, 0), p[0]) > 10 * CHI2_CRIT_9DOF_P001


def test_rejection_sampler_accepts_everything_when_draft_equals_target():
    p, _ = _fixed_p_q(2)
    num_accepted, _ = _run_rejection(p, p[:2].clone(), seed=2)
    assert int(num_accepted.min()) == 2


def test_one_hot_verification_preserves_the_target_distribution():
    """The n-gram path: fixed drafts (one-hot q), the engine's Sampler at temperature 0.7 and
    top-p 0.9 applied to the target; each emitted position follows the transformed p."""
    k, n = 2, 30_000  # the per-row Sampler path is slower than rejection_sample's
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(k + 1, VOCAB, generator=g) * 2
    drafts = [int(logits[j].argmax()) for j in range(k)]  # likely tokens: many accepted
    params = SamplingParams(temperature=0.7, top_p=0.9)
    big = logits.repeat(n, 1)
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    out = verify_one_hot(Sampler(), big, [i * (k + 1) for i in range(n)], [drafts] * n, [params] * n, gens)
    from engine.sampler import apply_top_k_top_p
    target = apply_top_k_top_p(logits / 0.7, torch.full((k + 1,), VOCAB), torch.full((k + 1,), 0.9)).softmax(-1)
    for j in range(k + 1):
        counts = torch.bincount(torch.tensor([t[j] for t in out if len(t) > j]), minlength=VOCAB).float()
        support = target[j] > 0
        assert counts[~support].sum() == 0
        crit = CHI2_CRIT_P001[int(support.sum()) - 1]
        assert _chi2(counts[support], target[j][support]) < crit, f"position {j}"
    assert sum(len(t) - 1 for t in out) > n // 2  # drafts really were accepted


# ---- scheduler: lookahead slots, rollback, stops, abort ---------------------------------------
def make(num_blocks=64, block_size=4, **cfg) -> Scheduler:
    cfg.setdefault("max_num_batched_tokens", 32)
    cfg.setdefault("max_num_seqs", 4)
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size, watermark=0.0),
                     max_model_len=1024, eos_token_ids=(EOS,))


def decoding(s: Scheduler, rid: str, n: int = 6, prompt: list[int] | None = None, **params) -> Request:
    """A request whose n-token prompt is computed and that sampled one token (7); the step
    also decodes every request already running."""
    params.setdefault("max_tokens", 16)
    r = Request(rid, prompt or list(range(100, 100 + n)), SamplingParams(temperature=0, **params))
    s.add(r)
    plan = s.schedule()
    s.update(plan, StepResult({c.request_id: 7 for c in plan.chunks if c.num_logits}))
    return r


def test_drafts_become_a_verification_row_with_lookahead_slots():
    s = make()
    r = decoding(s, "a")  # 7 tokens, 6 computed, 2 blocks of 4
    assert len(s.bm.block_table("a")) == 2
    plan = s.schedule({"a": (8, 9, 10, 11)})
    (c,) = plan.chunks
    assert (c.token_ids, c.start_pos, c.num_logits, c.draft_token_ids) == ((7, 8, 9, 10, 11), 6, 5, (8, 9, 10, 11))
    assert len(c.block_ids) == 3  # positions 6..10 need a third block, reserved now
    # two drafts accepted, then the target's own token 42
    s.update(plan, StepResult(verified={"a": (8, 9, 42)}))
    assert r.output_token_ids == [7, 8, 9, 42]
    assert r.num_computed_tokens == 9  # the row's input token and the two accepted drafts
    assert r.num_uncomputed_tokens == 1
    # only full *computed* blocks are hashed: block 1 holds positions 4..7 (104 105 7 8)
    assert len(s.bm._hashes["a"]) == 2
    plan = s.schedule()
    assert [(c.start_pos, c.token_ids) for c in plan.chunks] == [(9, (42,))]  # rewrites the rejected slot 9


def test_rejected_drafts_never_enter_the_prefix_cache():
    s = make()
    decoding(s, "a", n=3)  # tokens 100 101 102 7, computed 3
    plan = s.schedule({"a": (50, 51, 52, 53, 54)})  # positions 3..8
    s.update(plan, StepResult(verified={"a": (60,)}))  # the first draft rejected
    assert len(s.bm._hashes["a"]) == 1  # block 0 (100 101 102 7): the input token is real
    cached_tokens = {b.token_ids for b in s.bm.blocks if b.block_hash is not None}
    assert cached_tokens == {(100, 101, 102, 7)}


def test_drafts_do_not_preempt_and_respect_the_budget():
    s = make(num_blocks=5, max_num_batched_tokens=16, max_num_seqs=2)
    decoding(s, "a", n=7, max_tokens=8)  # 2 blocks
    decoding(s, "b", prompt=list(range(200, 207)), max_tokens=8)  # 2 blocks: one block left
    plan = s.schedule({"a": (1, 2, 3), "b": (1, 2, 3)})
    assert [c.draft_token_ids for c in plan.chunks] == [(1, 2, 3), ()]  # b's lookahead does not fit: plain row
    assert s.num_preemptions == 0 and s.bm.num_free_blocks == 0
    s = make(max_num_batched_tokens=6, max_num_seqs=2)
    decoding(s, "a", n=4)
    decoding(s, "b", n=4)
    plan = s.schedule({"a": (1, 2, 3), "b": (1, 2, 3)})
    assert [c.num_tokens for c in plan.chunks] == [4, 2]  # 2 decode rows first, then 4 draft tokens


def test_drafts_get_only_the_budget_prefill_leaves():
    s = make(max_num_batched_tokens=8, max_num_seqs=2)
    decoding(s, "a", n=4)
    s.add(Request("w", list(range(300, 320)), SamplingParams(temperature=0, max_tokens=4)))
    plan = s.schedule({"a": (1, 2, 3)})
    assert [(c.request_id, c.num_tokens, c.draft_token_ids) for c in plan.chunks] == [("a", 1, ()), ("w", 7, ())]
    s = make(max_num_batched_tokens=8, max_num_seqs=2)
    decoding(s, "a", n=4)
    s.add(Request("w", list(range(300, 305)), SamplingParams(temperature=0, max_tokens=4)))
    plan = s.schedule({"a": (1, 2, 3)})  # the 5-token prompt leaves 2 tokens: 2 drafts
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("a", 3), ("w", 5)]


@pytest.mark.parametrize("stop, emitted, expect_out, reason", [
    ({}, (8, EOS, 9), [7, 8, EOS], RequestState.FINISHED_STOPPED),
    ({"stop_token_ids": (8,)}, (8, 9, 10), [7, 8], RequestState.FINISHED_STOPPED),
    ({"max_tokens": 3}, (8, 9, 10), [7, 8, 9], RequestState.FINISHED_LENGTH),
])
def test_stop_inside_an_accepted_run_drops_the_later_tokens(stop, emitted, expect_out, reason):
    s = make()
    r = decoding(s, "a", **stop)
    plan = s.schedule({"a": (8, 9)})
    s.update(plan, StepResult(verified={"a": emitted}))
    assert r.output_token_ids == expect_out and r.state == reason
    assert s.bm.num_used_blocks == 0
    s.bm.check_invariants()


def test_abort_mid_verification_frees_every_block():
    s = make()
    decoding(s, "a")
    decoding(s, "b", prompt=list(range(200, 206)))
    plan = s.schedule({"a": (1, 2, 3, 4, 5, 6), "b": (1, 2)})
    assert s.bm.num_used_blocks == 4 + 3  # a: 7 computed + 1 + 6 drafts; b: 6 + 1 + 2
    s.abort("a")  # while the verification forward runs
    out = s.update(plan, StepResult(verified={"a": (1, 2, 9), "b": (1, 9)}))
    assert [r.request_id for r in out] == ["b"]
    s.abort("b")
    assert s.bm.num_used_blocks == 0 and not s.requests
    s.bm.check_invariants()


def test_speculator_room_and_counters():
    s = make()
    decoding(s, "a", prompt=[7, 8, 9, 3, 3, 3], max_tokens=4)  # + 7: the 1-gram (7) matches at 0
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4, ngram_min=1, adaptive=False), max_model_len=1024)
    drafts = spec.drafts(s.running)
    assert drafts == {"a": (8, 9)}  # max_tokens 4, one output so far: 2 drafts + the target's token
    plan = s.schedule(drafts)
    result = StepResult(verified={"a": (drafts["a"][0], 42)})
    spec.observe(plan, result, 0.01)
    c = spec.counters
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, c.num_verify_steps) == (1, 2, 1, 1)
    assert c.k_histogram == [0, 0, 1, 0, 0]


# ---- P/D: the speculative config is part of the transfer compatibility key ------------------
def test_pd_pair_with_different_speculative_configs_is_refused_at_handshake():
    from engine.kv_cache import KVCacheSpec
    from kv_transfer.base import CompatKey, IncompatiblePeer, decode_metadata, encode_metadata

    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=4, block_size=4, num_blocks=8, dtype=torch.float32)
    ngram = compat_descriptor(SpeculativeConfig(num_speculative_tokens=4))
    prefill = CompatKey.from_spec(spec, "m", ngram)
    blob = encode_metadata("tcp", prefill, 8)
    assert decode_metadata(blob, "tcp", CompatKey.from_spec(spec, "m", ngram))["num_blocks"] == 8
    for other in (compat_descriptor(None), compat_descriptor(SpeculativeConfig(num_speculative_tokens=2))):
        with pytest.raises(IncompatiblePeer, match=f"speculative: ours='{other}' peer='{ngram}'"):
            decode_metadata(blob, "tcp", CompatKey.from_spec(spec, "m", other))


def test_cli_flags_make_the_config_or_name_the_bad_flag():
    from engine.errors import UserError
    from engine.spec_decode.config import from_flags

    assert from_flags(None, None, None, None, None) is None
    assert from_flags("ngram", None, None, None, None).ngram_max == 4
    cfg = from_flags("ngram", 3, None, 5, 1)
    assert (cfg.num_speculative_tokens, cfg.ngram_max, cfg.ngram_min) == (3, 5, 1)
    assert from_flags("draft", 2, "smollm2-135m-instruct", 4, 2, "int8").quantization == "int8"
    assert from_flags("draft", 2, "m", 4, 2, "int8", 32768).draft_vocab_size == 32768
    for args, flag in [(("eagle", None, None, 4, 2), "--speculative-method"),
                       (("draft", 2, None, 4, 2), "--speculative-model"),
                       (("draft", 2, "m", 4, 2, "int4"), "--speculative-quantization"),
                       (("ngram", 0, None, 4, 2), "--num-speculative-tokens"),
                       (("ngram", 2, None, 2, 3), "--spec-ngram-min"),
                       ((None, 2, None, 4, 2), "--speculative-method"),
                       (("ngram", 2, None, 4, 2, "none", 8192), "--speculative-draft-vocab-size"),
                       (("draft", 2, "m", 4, 2, "int8", 0), "--speculative-draft-vocab-size"),
                       ((None, None, None, 4, 2, "none", 8192), "--speculative-draft-vocab-size"),
                       ((None, None, None, None, None, "int8"), "--speculative-quantization needs"),
                       ((None, None, None, None, 1), "--spec-ngram-min needs")]:
        with pytest.raises(UserError, match=flag):
            from_flags(*args)


def test_rows_whose_first_draft_cannot_pay_are_not_even_proposed():
    s = make()
    decoding(s, "a", prompt=[7, 8, 9, 3, 3, 3])
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4, ngram_min=1), max_model_len=1024)
    spec.time_model = StepTimeModel(prior_a=0.001, prior_b=1.0)  # one more token doubles the step
    assert spec.drafts(s.running) == {} and spec.proposer.num_tracked == 0
    spec.time_model = StepTimeModel(prior_a=0.02, prior_b=0.0001)  # drafts nearly free
    assert spec.drafts(s.running)["a"][:2] == (8, 9)


def test_bench_spec_budgets_are_pdserve_serves():
    """bench/spec.py copies serve's step budgets (bench/ may not import deploy/): keep them equal."""
    import bench.spec
    from deploy import runtime_options

    assert bench.spec.DEFAULT_MAX_NUM_BATCHED_TOKENS == runtime_options.DEFAULT_MAX_NUM_BATCHED_TOKENS
    assert bench.spec.DEFAULT_IDLE_MAX_NUM_BATCHED_TOKENS == runtime_options.DEFAULT_IDLE_MAX_NUM_BATCHED_TOKENS


class _FakeDraftRunner:
    """A draft 'model' that always proposes token 5; records each forward's chunks."""

    block_size, num_blocks = 4, 64

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.model_config = SimpleNamespace(vocab_size=VOCAB)
        self.calls: list[list[tuple[int, int, int]]] = []

    def forward(self, chunks):
        self.calls.append([(c.start_pos, c.num_tokens, c.num_logits) for c in chunks])
        logits = torch.zeros(sum(c.num_logits for c in chunks), VOCAB)
        logits[:, 5] = 1.0
        return logits


def test_draft_prefills_a_new_context_once_in_its_own_forward():
    from engine.spec_decode.draft import DraftModelProposer

    runner = _FakeDraftRunner()
    proposer = DraftModelProposer(runner, VOCAB)
    r = Request("a", list(range(100, 130)), SamplingParams(temperature=0, max_tokens=16))
    r.output_token_ids = [7]
    assert proposer.propose_batch([r], {"a": 2}) == {"a": (5, 5)}
    # the 30-token prompt in a forward of its own, then the first output token and one draft
    assert runner.calls == [[(0, 30, 1)], [(30, 1, 1)], [(31, 1, 1)]]
    assert proposer.num_prefill_tokens == 30 and proposer.take_prefill_seconds() > 0
    assert proposer.take_prefill_seconds() == 0.0
    r.output_token_ids += [5, 9]  # one draft accepted, then the target's token
    runner.calls.clear()
    proposer.propose_batch([r], {"a": 2})
    assert runner.calls[0] == [(32, 1, 1)]  # steady state: the accepted draft is cached, only the new token
    assert proposer.num_prefill_tokens == 30
    proposer.release("a")
    assert proposer.bm.num_used_blocks == 0


def test_a_prompt_enters_the_draft_cache_when_its_first_token_is_sampled():
    """Speculator.prefill_drafts after the step that sampled a request's first token: the draft
    prefills the prompt then (not in the step-time model's seconds), the first drafted step
    catches up the one new token only; a request already held, or finished, is skipped."""
    from engine.spec_decode.draft import DraftModelProposer

    s = make()
    done = decoding(s, "b", n=8, max_tokens=1)  # finished: no room for a draft
    r = decoding(s, "a", n=30)
    runner = _FakeDraftRunner()
    spec = Speculator(SpeculativeConfig("draft", 2, model="x"), max_model_len=1024,
                      proposer=DraftModelProposer(runner, VOCAB))
    spec.prefill_drafts([r, done])
    assert runner.calls == [[(0, 30, 1)]] and spec.proposer.num_prefill_tokens == 30
    assert spec.proposer.take_prefill_seconds() == 0.0  # nothing for observe() to take out of a step
    spec.prefill_drafts([r])
    assert len(runner.calls) == 1  # once
    runner.calls.clear()
    assert spec.drafts(s.running)["a"][0] == 5
    assert runner.calls[0] == [(30, 1, 1)]  # the first output token only


def test_the_step_time_model_learns_the_target_step_without_the_drafting():
    from engine.spec_decode.draft import DraftModelProposer

    s = make()
    decoding(s, "a", n=30)
    runner = _FakeDraftRunner()
    spec = Speculator(SpeculativeConfig("draft", 2, model="x", adaptive=False), max_model_len=1024,
                      proposer=DraftModelProposer(runner, VOCAB))
    drafts = spec.drafts(s.running)
    assert drafts == {"a": (5, 5)} and len(runner.calls) == 3  # prefill, 2 drafting forwards
    plan = s.schedule(drafts)
    spec.observe(plan, StepResult(verified={"a": (5, 9)}), seconds=1.0)
    (mean, _), = spec.time_model._means.values()
    assert 0.9 < mean < 1.0  # the drafting and the draft's prefill were taken out
    assert spec.draft_cost.observations == 1 and spec.counters.num_accepted_tokens == 1


def test_draft_cost_is_the_same_steps_ratio_and_ignores_a_spike():
    """The draft/target ratio is taken against the same step's target time (a load rise that
    slows both leaves it alone) and is the median of recent observations (one 4x spike, as a
    warm-up forward or a neighbour's burst gave here, does not move it)."""
    from engine.spec_decode.adaptive import DraftCost

    m = StepTimeModel(prior_a=0.014, prior_b=0.001)
    cost = DraftCost(prior_ratio=0.5)
    for load in (1.0, 3.0, 1.0, 2.0):  # the machine slows both models alike
        cost.observe(0.6 * m.predict(1) * load, 1, m, step_seconds=m.predict(3) * load, step_tokens=3)
    assert cost.ratio == pytest.approx(0.6)
    cost.observe(4 * m.predict(1), 1, m, step_seconds=m.predict(3), step_tokens=3)
    assert cost.ratio == pytest.approx(0.6) and cost.observations == 5


def test_a_new_request_starts_at_the_pooled_acceptance():
    """A new request's acceptance estimate starts at what earlier requests' drafts scored, not at
    a fixed prior (with the prior below the break-even a new request was never drafted for)."""
    from engine.spec_decode.draft import DraftModelProposer

    s = make()
    decoding(s, "a", n=30, max_tokens=40)
    spec = Speculator(SpeculativeConfig("draft", 2, model="x", adaptive=False), max_model_len=1024,
                      proposer=DraftModelProposer(_FakeDraftRunner(), VOCAB))
    assert spec._rate("first").value == pytest.approx(0.8)  # the prior, before any verification
    for _ in range(8):  # every draft accepted
        plan = s.schedule(spec.drafts(s.running))
        result = StepResult(verified={"a": (5, 5, 7)})
        spec.observe(plan, result, seconds=0.02)
        s.update(plan, result)
    assert spec.counters.num_accepted_tokens == 16 and spec.pooled_acceptance.value > 0.9
    assert spec._rate("new").value == pytest.approx(spec.pooled_acceptance.value)
    assert spec._previous_k("new") == 2  # and the hysteresis state of the latest row


def test_a_row_without_room_leaves_the_latest_k():
    """A request's last rows (at max_tokens, room 0) run with k = 0 for want of room, not because
    drafts stopped paying: the next request still starts from the k before them."""
    from engine.spec_decode.draft import DraftModelProposer

    s = make()
    decoding(s, "a", n=30, max_tokens=5)  # 1 token out: room 2 -> k = 2, then room 0
    spec = Speculator(SpeculativeConfig("draft", 2, model="x", adaptive=False), max_model_len=1024,
                      proposer=DraftModelProposer(_FakeDraftRunner(), VOCAB))
    plan = s.schedule(spec.drafts(s.running))
    result = StepResult(verified={"a": (5, 5, 7)})
    spec.observe(plan, result, seconds=0.02)
    s.update(plan, result)
    assert spec.latest_k == 2 and spec.room(s.running[0]) == 0
    plan = s.schedule(spec.drafts(s.running))
    assert [len(c.draft_token_ids) for c in plan.chunks] == [0]
    spec.observe(plan, StepResult({"a": 7}), seconds=0.02)
    assert spec.previous_k["a"] == 0 and spec.latest_k == 2 and spec._previous_k("next") == 2


def test_estimates_age_out_when_speculation_stays_off(monkeypatch):
    """A draft cost measured in a load spike keeps an adaptive policy at k = 0, and k = 0 measures
    nothing more: after REARM_STEPS such steps the estimates return to their priors and the next
    row is drafted (and measured) again. Rows without room do not count."""
    import engine.spec_decode.speculator as speculator
    from engine.spec_decode.draft import DraftModelProposer

    monkeypatch.setattr(speculator, "REARM_STEPS", 8)
    s = make()
    decoding(s, "a", n=30, max_tokens=200)
    spec = Speculator(SpeculativeConfig("draft", 2, model="x"), max_model_len=1024,
                      proposer=DraftModelProposer(_FakeDraftRunner(), VOCAB))
    spec.time_model = StepTimeModel(prior_a=0.02, prior_b=0.0001)  # a verified token is nearly free
    spec.draft_cost.ratio = 5.0  # but a draft forward was measured at 5 target steps
    for step in range(8):
        drafts = spec.drafts(s.running)
        assert drafts == {} and spec.counters.num_rearms == 0
        plan = s.schedule(drafts)
        spec.observe(plan, StepResult({"a": 7}), seconds=0.02)
        s.update(plan, StepResult({"a": 7}))
    assert spec.counters.num_rearms == 1 and spec.draft_cost.ratio == pytest.approx(0.5)
    assert spec.drafts(s.running)["a"][:1] == (5,)  # drafted again (k = 1 at the start margin)
