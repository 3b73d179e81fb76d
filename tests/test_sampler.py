"""The batched sampler: pure logic on small logits, no model."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engine.sampler import Sampler, apply_top_k_top_p, make_generator
from proto.sampling import SamplingParams
from proto.stop import token_stop_reason

PROBS = [0.5, 0.3, 0.15, 0.05]
LOGITS = torch.tensor([[math.log(p) for p in PROBS]])


def draw_many(params: SamplingParams, n: int = 2000, logits: torch.Tensor = LOGITS) -> Counter:
    gen = make_generator(params)
    sampler = Sampler()
    return Counter(sampler.sample(logits, [params], [gen]).token_ids[0] for _ in range(n))


def test_greedy_is_argmax_per_row():
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(0))
    out = Sampler().sample(logits, [SamplingParams(temperature=0)] * 5)
    assert out.token_ids == logits.argmax(-1).tolist() and out.logprobs is None


def test_temperature_one_follows_the_distribution():
    counts = draw_many(SamplingParams(temperature=1.0, seed=7), n=4000)
    for token, p in enumerate(PROBS):
        assert abs(counts[token] / 4000 - p) < 0.03, counts


def test_low_temperature_sharpens():
    counts = draw_many(SamplingParams(temperature=0.2, seed=3), n=1000)
    assert counts[0] / 1000 > 0.9


def test_top_k_keeps_only_the_k_most_likely():
    counts = draw_many(SamplingParams(temperature=1.0, top_k=2, seed=1))
    assert set(counts) == {0, 1}
    assert abs(counts[0] / 2000 - 0.5 / 0.8) < 0.04


@pytest.mark.parametrize("top_p, allowed", [(0.5, {0}), (0.79, {0, 1}), (0.81, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_nucleus(top_p, allowed):
    counts = draw_many(SamplingParams(temperature=1.0, top_p=top_p, seed=2), n=800)
    assert set(counts) == allowed


def test_top_k_1_mask_leaves_only_the_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(5))
    masked = apply_top_k_top_p(logits, torch.ones(4, dtype=torch.int64), torch.ones(4))
    assert torch.isfinite(masked).sum(-1).tolist() == [1] * 4
    assert masked.argmax(-1).tolist() == logits.argmax(-1).tolist()
    out = Sampler().sample(logits, [SamplingParams(temperature=1.5, top_k=1, seed=s) for s in range(4)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_seeded_rows_do_not_depend_on_the_batch():
    """A seeded request draws the same tokens alone and inside batches of any composition."""
    vocab = 1000
    steps = [torch.randn(1, vocab, generator=torch.Generator().manual_seed(100 + i)) for i in range(20)]
    mine = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    alone_gen = make_generator(mine)
    alone = [Sampler().sample(x, [mine], [alone_gen]).token_ids[0] for x in steps]

    other = SamplingParams(temperature=0.7, seed=9)
    unseeded, greedy = SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)
    gens = [None, make_generator(other), make_generator(mine), None]
    params = [unseeded, other, mine, greedy]
    batched = []
    for i, x in enumerate(steps):
        logits = torch.cat([torch.randn(1, vocab), torch.randn(1, vocab), x, torch.randn(1, vocab)])
        batched.append(Sampler().sample(logits, params, gens).token_ids[2])
    assert batched == alone
    again_gen = make_generator(mine)
    assert [Sampler().sample(x, [mine], [again_gen]).token_ids[0] for x in steps] == alone
    other_seed = make_generator(SamplingParams(temperature=1.0, top_p=0.9, seed=43))
    assert [Sampler().sample(x, [mine], [other_seed]).token_ids[0] for x in steps] != alone


def test_top_n_logprobs_are_sorted_and_match_log_softmax():
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(11))
    params = [SamplingParams(temperature=0, logprobs=5), SamplingParams(temperature=0), SamplingParams(
        temperature=1.0, seed=1, logprobs=2)]
    out = Sampler().sample(logits, params, [None, None, make_generator(params[2])])
    ref = logits.log_softmax(-1)
    assert out.logprobs is not None and out.logprobs[1] is None
    first, third = out.logprobs[0], out.logprobs[2]
    assert len(first.top) == 5 and len(third.top) == 2
    assert [t for t, _ in first.top] == ref[0].topk(5).indices.tolist()
    assert all(abs(lp - ref[0, t].item()) < 1e-5 for t, lp in first.top)
    assert first.token_id == out.token_ids[0] and abs(first.logprob - ref[0].max().item()) < 1e-5
    assert abs(third.logprob - ref[2, out.token_ids[2]].item()) < 1e-5


def test_rows_and_params_must_agree():
    with pytest.raises(ValueError, match="2 logits rows but 1 params"):
        Sampler().sample(torch.zeros(2, 4), [SamplingParams()])


# ---- penalties, min_tokens, logprobs modes (vLLM semantics) -------------------------------------

from engine.sampler import RowHistory, apply_min_tokens, apply_penalties  # noqa: E402


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5]])
    apply_penalties(logits, [SamplingParams(repetition_penalty=2.0)], [RowHistory([0], [1])])
    assert logits.tolist() == [[1.0, -2.0, 3.0, 0.5]]  # 0 in the prompt, 1 in the output; 2, 3 unseen


def test_frequency_and_presence_penalties_count_the_output_only():
    logits = torch.zeros(1, 4)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    apply_penalties(logits, [params], [RowHistory([3, 3], [1, 1, 1, 2])])
    assert logits.tolist() == [[0.0, -1.75, -0.75, 0.0]]


def test_penalties_change_a_greedy_choice_and_not_the_logprobs():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    hist = [RowHistory([], [0, 0])]
    plain = Sampler().sample(logits, [SamplingParams(temperature=0, logprobs=1)], histories=hist)
    pen = Sampler().sample(logits, [SamplingParams(temperature=0, frequency_penalty=1.0, logprobs=1)], histories=hist)
    assert plain.token_ids == [0] and pen.token_ids == [1]
    assert pen.logprobs[0].top == plain.logprobs[0].top  # logprobs are the model's raw distribution


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]])  # EOS = 1 is the argmax, stop id 2 the next
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(2,))
    sampler = Sampler(eos_token_ids=(1,))
    assert sampler.sample(logits, [params], histories=[RowHistory([5], [3])]).token_ids == [3]
    assert sampler.sample(logits, [params], histories=[RowHistory([5], [3, 3])]).token_ids == [1]
    kept = logits.clone()
    apply_min_tokens(kept, [SamplingParams(min_tokens=2, ignore_eos=True)], [RowHistory([], [])], (1,))
    assert torch.isfinite(kept).all()  # ignore_eos: EOS is not a stop, so not masked (vLLM)
    assert token_stop_reason(1, 1, params, (1,)) is None and token_stop_reason(1, 2, params, (1,)) == "stop"


def test_logprobs_zero_gives_the_chosen_token_only():
    out = Sampler().sample(LOGITS, [SamplingParams(temperature=0, logprobs=0)])
    assert out.logprobs[0].token_id == 0 and out.logprobs[0].top == ()
    assert math.isclose(out.logprobs[0].logprob, math.log(0.5), rel_tol=1e-5)


def test_greedy_and_top_k_never_sort_the_vocabulary(monkeypatch):
    def no_sort(*args, **kwargs):
        raise AssertionError("sorted the whole vocabulary")

    monkeypatch.setattr(torch.Tensor, "sort", no_sort)
    monkeypatch.setattr(torch, "sort", no_sort)
    monkeypatch.setattr(torch.Tensor, "argsort", no_sort)
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=5, seed=1),
              SamplingParams(temperature=1.0, top_k=3, top_p=0.9, seed=2)]
    out = Sampler().sample(logits, params)
    assert out.token_ids[0] == logits[0].argmax().item()
    assert out.token_ids[1] in logits[1].topk(5).indices.tolist()
    assert out.token_ids[2] in logits[2].topk(3).indices.tolist()


def test_top_k_top_p_match_a_full_sort_reference():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3))
    top_k = torch.tensor([300, 10, 1, 300, 50, 7])
    top_p = torch.tensor([0.9, 1.0, 1.0, 0.3, 0.8, 0.5])
    ref = logits.clone()
    for i in range(6):  # reference: sort descending, keep top-k, then the smallest nucleus reaching top_p
        vals, idx = ref[i].sort(descending=True)
        vals[int(top_k[i]):] = float("-inf")
        p = vals.softmax(-1)
        keep = (p.cumsum(-1) - p) < top_p[i]
        keep[0] = True
        vals[~keep] = float("-inf")
        ref[i] = torch.full_like(vals, float("-inf")).scatter(0, idx, vals)
    assert torch.equal(torch.isfinite(apply_top_k_top_p(logits, top_k, top_p)), torch.isfinite(ref))


def test_advance_skips_the_draw_made_on_another_worker():
    """Disagg: the prefill worker draws token 1; the decode worker's generator skips that draw."""
    params = SamplingParams(temperature=1.0, seed=11)
    steps = [torch.randn(1, 50, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    one = make_generator(params)
    together = [Sampler().sample(x, [params], [one]).token_ids[0] for x in steps]
    decode_gen = make_generator(params)
    Sampler.advance(decode_gen, 50, params)
    assert [Sampler().sample(x, [params], [decode_gen]).token_ids[0] for x in steps[1:]] == together[1:]


@pytest.mark.parametrize("field, kwargs", [("min_tokens", dict(min_tokens=5, max_tokens=4)),
                                           ("presence_penalty", dict(presence_penalty=2.5)),
                                           ("frequency_penalty", dict(frequency_penalty=-3)),
                                           ("repetition_penalty", dict(repetition_penalty=0)),
                                           ("logprobs", dict(logprobs=21))])
def test_bad_penalty_and_min_tokens_values_name_the_field(field, kwargs):
    from proto.sampling import InvalidRequest

    with pytest.raises(InvalidRequest, match=field):
        SamplingParams(**kwargs)
