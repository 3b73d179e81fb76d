"""Speculative decoding with the real SmolLM2 model (n-gram proposer): greedy output is
token-identical to greedy without speculation (16 ShareGPT prompts, alone and as a batch of 16,
near-tie rule), a stop string inside an accepted run ends the request at the right token, and
k = 0 steps run exactly the forwards of a non-speculative engine."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from proto.sampling import SamplingParams
from engine.spec_decode.adaptive import StepTimeModel
from engine.spec_decode.config import SpeculativeConfig
from engine_helpers import first_near_tie, run_to_completion

pytestmark = pytest.mark.model

NUM_PROMPTS, MAX_TOKENS, PROMPT_CHARS = 16, 10, 200
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
ALWAYS = SpeculativeConfig(num_speculative_tokens=4, adaptive=False)  # speculate whenever n-gram matches


@pytest.fixture(scope="module")
def runner(model_path):
    from engine.model_runner import ModelRunner

    torch.set_num_threads(2)
    return ModelRunner(model_path, block_size=16, num_blocks=600)


def chat(tokenizer, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True)["input_ids"])


@pytest.fixture(scope="module")
def prompts(tokenizer):
    from conftest import sharegpt_prompts

    return [chat(tokenizer, p[:PROMPT_CHARS]) for p in sharegpt_prompts(NUM_PROMPTS)]


def engine(runner, tokenizer, spec: SpeculativeConfig | None, **sched) -> LLMEngine:
    cfg = EngineConfig(scheduler=SchedulerConfig(**sched), cache=CacheConfig(num_blocks=600), speculative=spec)
    return LLMEngine(cfg, runner=runner, tokenizer=tokenizer)


def _reference_with_gaps(runner, tokenizer, prompts):
    eng = engine(runner, tokenizer, None)
    ids = [f"ref-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=2))
    tokens = {rid: [] for rid in ids}
    gaps = {rid: [] for rid in ids}
    while eng.has_unfinished():
        for o in eng.step():
            tokens[o.request_id] += o.new_token_ids
            gaps[o.request_id] += [lp.top[0][1] - lp.top[1][1] for lp in o.logprobs or []]
    return [(tokens[r], gaps[r]) for r in ids]


@pytest.fixture(scope="module")
def greedy_reference(runner, tokenizer, prompts):
    return _reference_with_gaps(runner, tokenizer, prompts)


def assert_same_tokens(got: list[list[int]], reference) -> None:
    for i, (tokens, (ref, gaps)) in enumerate(zip(got, reference)):
        cut = first_near_tie(gaps)
        assert tokens[:cut] == ref[:cut], f"prompt {i}: {tokens} != {ref} (first near tie at {cut})"
        if cut == len(ref):
            assert tokens == ref, f"prompt {i}"


def test_greedy_ngram_is_token_identical_in_a_batch(runner, tokenizer, prompts, greedy_reference):
    batch = engine(runner, tokenizer, ALWAYS)
    outs = run_to_completion(batch, prompts, GREEDY)
    assert_same_tokens([o.token_ids for o in outs], greedy_reference)
    st = batch.stats()
    assert st.spec_num_accepted_tokens > 0 and st.spec_num_draft_tokens > st.spec_num_accepted_tokens
    assert st.kv_blocks_used == 0
    batch.block_manager.check_invariants()


def test_greedy_ngram_is_token_identical_alone(runner, tokenizer, prompts, greedy_reference):
    alone = engine(runner, tokenizer, ALWAYS)
    outs = [run_to_completion(alone, [p], GREEDY)[0] for p in prompts]
    assert_same_tokens([o.token_ids for o in outs], greedy_reference)
    assert alone.stats().spec_num_accepted_tokens > 0


def test_stop_string_inside_an_accepted_run(runner, tokenizer):
    """Find a step that emitted >= 3 tokens, make the text of its second token the stop string:
    the request must end right after that token, with the same text as without speculation."""
    text = "The quick brown fox jumps over the lazy dog while the small cat sleeps on the warm mat."
    prompt = chat(tokenizer, f"Repeat this sentence three times:\n\n{text}")
    params = SamplingParams(temperature=0, max_tokens=48)
    eng = engine(runner, tokenizer, ALWAYS)
    eng.add_request("probe", prompt, params)
    runs, tokens = [], []
    while eng.has_unfinished():
        for o in eng.step():
            runs.append((len(tokens), o.new_token_ids))
            tokens += o.new_token_ids
    start, run = next((s, r) for s, r in runs if len(r) >= 3 and s > 0)
    full = tokenizer.decode(tokens, skip_special_tokens=True)
    before = tokenizer.decode(tokens[:start + 1], skip_special_tokens=True)
    stop = tokenizer.decode(tokens[start + 1:start + 2], skip_special_tokens=True)
    assert stop.strip() and full.find(stop) >= len(before) - len(stop), "pick a stop string that is new here"
    stopped = SamplingParams(temperature=0, max_tokens=48, stop=(stop,))
    got = run_to_completion(engine(runner, tokenizer, ALWAYS), [prompt], stopped)[0]
    plain = run_to_completion(engine(runner, tokenizer, None), [prompt], stopped)[0]
    assert got.finish_reason == plain.finish_reason == "stop"
    assert got.token_ids == plain.token_ids == tokens[:start + 2]
    assert got.text == plain.text


class _Recorder:
    """Wraps a runner's forward and records every call's chunks."""

    def __init__(self, runner) -> None:
        self.runner, self.calls = runner, []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def forward(self, chunks, *args, **kwargs):
        self.calls.append([(tuple(c.token_ids), c.start_pos, c.num_logits) for c in chunks])
        return self.runner.forward(chunks, *args, **kwargs)


def test_k_zero_runs_exactly_the_plain_forwards(runner, tokenizer, prompts):
    """Speculation on, but a step-time model where every draft costs more than it gains: every
    step chooses k = 0 and must run the same forwards (tokens, positions, logits) as no speculation."""
    plain_rec, spec_rec = _Recorder(runner), _Recorder(runner)
    plain = engine(plain_rec, tokenizer, None)
    spec = engine(spec_rec, tokenizer, SpeculativeConfig(num_speculative_tokens=4))
    costly = StepTimeModel()
    costly.observe = lambda *a: None
    costly.predict = lambda num_tokens: 10.0 ** num_tokens  # each token costs more than any gain
    spec.speculator.time_model = costly
    a = run_to_completion(plain, prompts[:4], GREEDY)
    b = run_to_completion(spec, prompts[:4], GREEDY)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert spec_rec.calls == plain_rec.calls
    hist = spec.stats().spec_k_histogram
    assert hist[0] > 0 and sum(hist[1:]) == 0 and spec.stats().spec_num_drafts == 0


@pytest.fixture(scope="module")
def draft_runner(model_path):
    """The unquantized model as its own draft, on its own small cache."""
    from engine.model_runner import ModelRunner

    return ModelRunner(model_path, block_size=16, num_blocks=200)


def test_self_draft_accepts_everything_and_abort_frees_draft_blocks(runner, draft_runner, tokenizer, prompts,
                                                                     greedy_reference):
    """The mechanics test of the draft-model path: the target as its own (greedy) draft is
    accepted at every position (up to near ties), the output is the plain greedy output, and
    every draft block is freed at the end and on an abort in the middle of a run."""
    cfg = SpeculativeConfig(method="draft", model="self", num_speculative_tokens=3, adaptive=False)
    eng = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=600), speculative=cfg), runner=runner,
                    tokenizer=tokenizer, draft_runner=draft_runner)
    outs = run_to_completion(eng, prompts[:4], GREEDY)
    assert_same_tokens([o.token_ids for o in outs], greedy_reference[:4])
    st = eng.stats()
    assert st.spec_num_draft_tokens > 0 and st.spec_num_accepted_tokens >= 0.95 * st.spec_num_draft_tokens
    proposer = eng.speculator.proposer
    # each prompt entered the draft cache once, in a prefill forward of its own (the first output
    # token then starts the first draft), and never again
    assert proposer.num_prefill_tokens == sum(len(p) for p, o in zip(prompts[:4], outs) if len(o.token_ids) > 1)
    draft_bm = proposer.bm
    assert draft_bm.num_used_blocks == 0
    eng.add_request("x", prompts[0], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    while not eng.speculator.counters.num_drafts or draft_bm.num_used_blocks == 0:
        eng.step()
    eng.abort("x")
    assert draft_bm.num_used_blocks == 0 and eng.block_manager.num_used_blocks == 0
    draft_bm.check_invariants()


def test_int8_draft_with_a_reduced_vocabulary_keeps_greedy_output(model_path, runner, tokenizer, prompts,
                                                                  greedy_reference):
    """The int8 self-draft with its LM head cut to token ids < 8192 (FR-Spec,
    engine/spec_decode/draft_vocab.py): every draft is below 8192, most are accepted, and greedy
    output is the plain greedy output (the rejected drafts are the target's own tokens past 8192)."""
    from engine.model_runner import ModelRunner

    n = 8192
    small = ModelRunner(model_path, block_size=16, num_blocks=200, quantization="int8")
    cfg = SpeculativeConfig(method="draft", model="self", quantization="int8", num_speculative_tokens=3,
                            adaptive=False, draft_vocab_size=n)
    eng = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=600), speculative=cfg), runner=runner,
                    tokenizer=tokenizer, draft_runner=small)
    assert small.model.head_method.out_features == n
    assert small.model.head_method.group == small.model_config.hidden_size   # the full head's: one scale per token
    proposer, proposed = eng.speculator.proposer, []
    propose = proposer.propose_batch

    def recording(requests, ks):
        drafts = propose(requests, ks)
        proposed.extend(t for d in drafts.values() for t in d)
        return drafts

    proposer.propose_batch = recording
    outs = run_to_completion(eng, prompts[:3], GREEDY)
    assert any(t >= n for ref, _ in greedy_reference[:3] for t in ref)  # the target does emit ids the draft cannot
    assert_same_tokens([o.token_ids for o in outs], greedy_reference[:3])
    st = eng.stats()
    assert proposed and max(proposed) < n and len(proposed) == st.spec_num_draft_tokens
    assert st.spec_num_accepted_tokens > 0.5 * st.spec_num_draft_tokens
